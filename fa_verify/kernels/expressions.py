"""Arithmetic over a problem's names, for kernel specs: `"cdiv(Nq, 64)"`, `"(64 + 2 * 32) * D * 2"`.

A spec gives its grid, block, shared memory and scalar arguments as expressions of the problem
(B, H, Nq, D, ...). They are parsed with Python's `ast` and evaluated by walking the tree with a
whitelist — numbers, the names given, + - * / // % **, comparisons, `and`/`or`/`not`,
`a if c else b` and the functions in FUNCTIONS — never with eval, so a spec cannot run code.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping

from fa_verify.errors import InvalidArgumentError

#: Functions an expression may call.
FUNCTIONS = {
    "cdiv": lambda a, b: -(-a // b),
    "round_up": lambda a, m: -(-a // m) * m,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "log2": math.log2,
    "int": int,
    "float": float,
}
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.LShift: operator.lshift, ast.RShift: operator.rshift,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_COMPARE = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne,
}


def parse(text, where: str, names) -> ast.expr:
    """The syntax tree of `text` (a string, or an int/float constant), checked against the
    whitelist and the `names` it may use; InvalidArgumentError naming `where` otherwise.
    A tree already parsed is returned as it is."""
    if isinstance(text, ast.expr):
        return text
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise InvalidArgumentError(f"{where}={text!r} must be a number or an expression string such as 'cdiv(Nq, 64)'")
    try:
        tree = ast.parse(str(text).strip(), mode="eval").body
    except SyntaxError as exc:
        raise InvalidArgumentError(f"{where}={text!r} is not an expression ({exc.msg})") from None
    for node in ast.walk(tree):
        _allowed(node, text, where, names)
    return tree


def evaluate(tree: ast.expr, values: Mapping[str, object], where: str):
    """The value of a parsed expression with the names bound to `values`."""
    try:
        return _value(tree, values)
    except (ArithmeticError, ValueError, TypeError) as exc:
        shown = ", ".join(f"{k}={v}" for k, v in values.items() if isinstance(v, (int, float)))
        raise InvalidArgumentError(f"{where}={ast.unparse(tree)!r} cannot be evaluated ({exc}) for {shown}") from None


def _is_number(value) -> bool:
    """int or float, not bool (True and False are ints to Python, not numbers to a spec)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _allowed(node, text, where, names) -> None:
    if isinstance(node, ast.Constant):
        if _is_number(node.value):
            return
        raise InvalidArgumentError(f"{where}={text!r}: constant {node.value!r} ({type(node.value).__name__}) is "
                                   "not allowed; only int and float numbers are constants of a spec expression")
    if isinstance(node, ast.Name):
        if node.id in names or node.id in FUNCTIONS:
            return
        raise InvalidArgumentError(f"{where}={text!r} uses {node.id!r}; names: {', '.join(sorted(names))}")
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS and not node.keywords:
            return
        raise InvalidArgumentError(f"{where}={text!r}: only {', '.join(FUNCTIONS)} may be called")
    if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.IfExp, ast.Load,
                         ast.And, ast.Or, *_BINARY, *_UNARY, *_COMPARE)):
        if isinstance(node, ast.BinOp) and type(node.op) not in _BINARY:
            raise InvalidArgumentError(f"{where}={text!r}: operator {type(node.op).__name__} is not allowed")
        return
    raise InvalidArgumentError(f"{where}={text!r}: {type(node).__name__} is not allowed in a spec expression "
                               "(numbers, names, arithmetic, comparisons, 'a if c else b', function calls)")


def _value(node, values):
    if isinstance(node, ast.Constant):
        if not _is_number(node.value):  # a tree built by hand skips parse's check
            raise ValueError(f"constant {node.value!r} is not a number")
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id] if node.id in values else FUNCTIONS[node.id]
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, values), _value(node.right, values)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent above 64")  # no 10**10**10 from a spec
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_value(node.operand, values))
    if isinstance(node, ast.Compare):
        left = _value(node.left, values)
        for op, comparator in zip(node.ops, node.comparators):
            right = _value(comparator, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        results = [_value(v, values) for v in node.values]
        return all(results) if isinstance(node.op, ast.And) else any(results)
    if isinstance(node, ast.IfExp):
        return _value(node.body, values) if _value(node.test, values) else _value(node.orelse, values)
    if isinstance(node, ast.Call):
        return FUNCTIONS[node.func.id](*(_value(a, values) for a in node.args))
    raise ValueError(f"{type(node).__name__} is not allowed")
