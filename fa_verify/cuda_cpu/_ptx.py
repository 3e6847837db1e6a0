"""Inline PTX on the CPU: each ``asm(...)`` statement of the kernel author's code becomes a call of
the shim's emulation (include/fa_cuda_cpu_ptx.h), or a build error naming the instruction.

g++ on x86 cannot assemble PTX, and a macro cannot look inside the template string, so the builder
parses every asm statement of the preprocessed source (GNU extended asm: a template, outputs,
inputs, clobbers), substitutes the operands, and emits C++ for each instruction it knows:

* ``mma.sync.aligned.m16n8k16`` / ``m16n8k8`` ``.row.col.f32.{f16,bf16}.{f16,bf16}.f32``;
* ``ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}{.shared{::cta}}.b16``;
* ``cp.async.{ca,cg}.shared{::cta}.global{.L2::*B}`` with ``commit_group``, ``wait_group N``,
  ``wait_all``;
* ``ld.global{.nc}{.v2,.v4}.{b32,u32,s32,f32}`` (caching hints ignored);
* ``ex2.approx{.ftz}.f32``; ``tanh.approx.f32`` (within, and near, its documented error);
  ``cvt.rn.{f16x2,bf16x2}.f32``; ``shfl.sync.{up,down,bfly,idx}.b32``
  (without a predicate output).

Every input register is read into a temporary before any output is written, as the hardware's
register file would; outputs are written back through the operands' own lvalues. The generated
code replaces the statement on its own line(s), so diagnostics keep pointing at the user's file.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import Path

from fa_verify.cuda_cpu._rewrite import STRING_OR_CHAR, user_lines
from fa_verify.errors import KernelUnsupportedError

_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b")
_QUALIFIERS = re.compile(r"\s*(?:volatile|__volatile__|__volatile|inline|__inline)\b")
_OPERAND = re.compile(r'^\s*"([^"]*)"\s*\((.*)\)\s*$', re.S)
_REFERENCE = re.compile(r"%%|%(\d+)")
_MARK = re.compile(r"\x01(\d+)\x02")
_WORD_BEFORE = re.compile(r"(\w+)\s*$")
_INT_LITERAL = re.compile(r"^-?(?:0[xX][0-9a-fA-F]+|\d+)[uU]?$")
_FLOAT_LITERAL = re.compile(r"^0[fF]([0-9a-fA-F]{8})$")
_ADDRESS = re.compile(r"^\[\s*(\x01\d+\x02)\s*(?:\+\s*(-?(?:0[xX][0-9a-fA-F]+|\d+)))?\s*\]$")

_NS = "::fa_cpu::ptx::"


@dataclass(frozen=True)
class Operand:
    constraint: str  # without the '=', '+' or '&' modifiers
    expression: str
    output: bool
    read: bool  # an input, or a '+' output


class _Statement:
    """One asm statement: its operands and where it is, for messages."""

    def __init__(self, operands: list[Operand], where: str):
        self.operands = operands
        self.where = where

    def fail(self, instruction: str, why: str) -> KernelUnsupportedError:
        return KernelUnsupportedError(f"{self.where}: inline assembly `{instruction}`: {why}")

    def operand(self, token: str, instruction: str) -> Operand:
        mark = _MARK.fullmatch(token.strip())
        if mark is None:
            raise self.fail(instruction, f"expected an operand (%N) where `{token.strip()}` is")
        if int(mark.group(1)) >= len(self.operands):
            raise self.fail(instruction, f"operand %{mark.group(1)} does not exist ({len(self.operands)} operands)")
        return self.operands[int(mark.group(1))]

    def read32(self, token: str, instruction: str) -> str:
        """C++ for the 32 bits a register operand or an immediate holds."""
        token = token.strip()
        if _INT_LITERAL.match(token):
            return f"static_cast<::std::uint32_t>({token.rstrip('uU')}ll)"
        literal = _FLOAT_LITERAL.match(token)
        if literal:
            return f"0x{literal.group(1)}u"
        op = self.operand(token, instruction)
        if not op.read:
            raise self.fail(instruction,
                            f"operand `{op.expression}` is written-only (\"={op.constraint}\") but read here")
        if "f" in op.constraint:
            return f"::fa_cpu::fp::float_bits({_NS}f32({op.expression}))"
        if "r" in op.constraint:
            return f"{_NS}b32({op.expression})"
        if op.constraint in ("n", "i"):
            return f"static_cast<::std::uint32_t>({op.expression})"
        raise self.fail(instruction,
                        f"a 32-bit operand with constraint \"{op.constraint}\" (use \"r\", \"f\" or \"n\")")

    def write32(self, token: str, bits: str, instruction: str) -> str:
        op = self.operand(token, instruction)
        if not op.output:
            raise self.fail(instruction, f"operand `{op.expression}` is an input but is written here")
        if "f" in op.constraint:
            return f"{_NS}set_f32({op.expression}, ::fa_cpu::fp::bits_float({bits}));"
        if "r" in op.constraint:
            return f"{_NS}set_b32({op.expression}, {bits});"
        raise self.fail(instruction, f"a 32-bit output with constraint \"{op.constraint}\" (use \"=r\" or \"=f\")")

    def immediate(self, token: str, instruction: str) -> str:
        token = token.strip()
        if _INT_LITERAL.match(token):
            return f"{token.rstrip('uU')}ll"
        op = self.operand(token, instruction)
        return f"static_cast<long long>({op.expression})"

    def address(self, token: str, instruction: str) -> str:
        """C++ for an address operand `[%N]` or `[%N+imm]`: the operand itself (pointer or integer)."""
        found = _ADDRESS.match(token.strip())
        if found is None:
            raise self.fail(instruction, f"expected an address `[%N]` or `[%N+imm]` where `{token.strip()}` is")
        op = self.operand(found.group(1), instruction)
        if found.group(2):
            return f"{_NS}byte_offset({op.expression}, {found.group(2)})"
        return f"({op.expression})"


def rewrite_inline_asm(text: str, shim_dir: Path) -> str:
    """Replace every asm statement in the user's code by C++ (see the module docstring)."""
    masked = STRING_OR_CHAR.sub(lambda m: m.group(0)[0] + "x" * (len(m.group(0)) - 2) + m.group(0)[-1], text)
    pieces: list[str] = []
    done = 0
    for start, path, line, raw in user_lines(text, shim_dir):
        for found in _ASM.finditer(masked, start, start + len(raw)):
            if found.start() < done:
                continue
            end, code = _rewrite_statement(text, masked, found, f"{path}:{line}")
            pieces += [text[done : found.start()], code, "\n" * text.count("\n", found.start(), end)]
            done = end
    pieces.append(text[done:])
    return "".join(pieces)


def _not_a_statement(where: str) -> KernelUnsupportedError:
    return KernelUnsupportedError(
        f"{where}: inline assembly outside a statement (an asm label or an asm expression) cannot run on the "
        "CPU; the CUDA-on-CPU runner emulates asm statements with the PTX instructions it knows")


def _rewrite_statement(text: str, masked: str, found: re.Match, where: str) -> tuple[int, str]:
    before = _WORD_BEFORE.search(masked, max(0, found.start() - 64), found.start())
    if before is not None and before.group(1) not in ("else", "do"):  # `int r asm("r1");`: a label
        raise _not_a_statement(where)
    pos = found.end()
    while (qualifier := _QUALIFIERS.match(masked, pos)) is not None:
        pos = qualifier.end()
    while pos < len(masked) and masked[pos].isspace():
        pos += 1
    if pos >= len(masked) or masked[pos] != "(":
        raise KernelUnsupportedError(f"{where}: `{found.group(0)}` is not an asm statement the CPU runner can read")
    close = _matching_paren(masked, pos, where)
    after = close + 1
    while after < len(masked) and masked[after] in " \t":
        after += 1
    if masked[after : after + 1] != ";":
        raise _not_a_statement(where)
    if "\n#" in masked[pos:close]:
        raise KernelUnsupportedError(f"{where}: an asm statement spans an #include or a line marker")
    sections = _split_top_level(masked, pos + 1, close, ":")
    template = "".join(codecs.decode(literal[1:-1], "unicode_escape")
                       for literal in STRING_OR_CHAR.findall(text[slice(*sections[0])]))
    parsed = []
    for index, output in ((1, True), (2, False)):
        if index < len(sections):
            parsed += [_parse_operand(text[a:b], output, where)
                       for a, b in _split_top_level(masked, *sections[index], ",") if text[a:b].strip()]
    statement = _Statement(parsed, where)
    code = [_emit(statement, opcode, args) for opcode, args in _instructions(template, where)]
    return close + 1, "do { " + " ".join(code) + " } while (0)"


def _matching_paren(masked: str, open_at: int, where: str) -> int:
    depth = 0
    for i in range(open_at, len(masked)):
        if masked[i] == "(":
            depth += 1
        elif masked[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise KernelUnsupportedError(f"{where}: an asm statement has no closing parenthesis")


def _split_top_level(masked: str, lo: int, hi: int, separator: str) -> list[tuple[int, int]]:
    """Spans of masked[lo:hi] between separators outside brackets (``::`` is two separators)."""
    spans, depth, start = [], 0, lo
    for i in range(lo, hi):
        ch = masked[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == separator and depth == 0:
            spans.append((start, i))
            start = i + 1
    spans.append((start, hi))
    return spans


def _parse_operand(text: str, output: bool, where: str) -> Operand:
    found = _OPERAND.match(text)
    if found is None:
        raise KernelUnsupportedError(f"{where}: cannot read the asm operand `{' '.join(text.split())}`")
    constraint, expression = found.groups()
    modifiers = set(constraint) & set("=+&")
    letters = "".join(c for c in constraint if c not in "=+&")
    if output != bool(modifiers & {"=", "+"}):
        raise KernelUnsupportedError(
            f"{where}: asm operand \"{constraint}\" ({expression.strip()}) is in the wrong section")
    return Operand(letters, f"({expression.strip()})", output, not output or "+" in modifiers)


def _instructions(template: str, where: str) -> list[tuple[str, list[str]]]:
    """The template's instructions as (opcode, operand tokens), operands marked \x01N\x02."""
    body = _REFERENCE.sub(lambda found: "%" if found.group(0) == "%%" else f"\x01{found.group(1)}\x02", template)
    out = []
    for instruction in re.split(r"[;\n]", body):
        instruction = instruction.strip()
        if not instruction:
            continue
        if instruction[0] in "{}@." or instruction.split()[0].endswith(":"):
            raise KernelUnsupportedError(
                f"{where}: inline assembly `{_unmark(instruction)}` cannot run on the CPU: the CUDA-on-CPU runner "
                "emulates single PTX instructions (mma.sync, ldmatrix, cp.async, ex2.approx, tanh.approx, cvt, "
                "shfl.sync), "
                "not scopes, labels, predicates or directives")
        opcode, _, rest = instruction.partition(" ")
        out.append((opcode, _split_operands(rest)))
    return out


def _unmark(text: str) -> str:
    return _MARK.sub(lambda m: "%" + m.group(1), text)


def _split_operands(text: str) -> list[str]:
    tokens, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            tokens.append(text[start:i].strip())
            start = i + 1
    if text.strip():
        tokens.append(text[start:].strip())
    return tokens


def _vector(token: str, count: int, statement: _Statement, opcode: str) -> list[str]:
    token = token.strip()
    if not (token.startswith("{") and token.endswith("}")):
        raise statement.fail(opcode, f"expected a vector of {count} registers where `{token}` is")
    items = [t.strip() for t in token[1:-1].split(",")]
    if len(items) != count:
        raise statement.fail(opcode, f"expected {count} registers in `{token}`")
    return items


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _emit(statement: _Statement, opcode: str, args: list[str]) -> str:
    parts = opcode.split(".")
    label = _c_string(f"{opcode} ({statement.where})")
    head = parts[0]
    if head == "mma":
        return _emit_mma(statement, opcode, parts, args, label)
    if head == "ldmatrix":
        return _emit_ldmatrix(statement, opcode, parts, args, label)
    if head == "cp" and parts[1:2] == ["async"]:
        return _emit_cp_async(statement, opcode, parts, args, label)
    if head == "ld" and parts[1:2] == ["global"]:
        return _emit_ld_global(statement, opcode, parts, args, label)
    if head == "ex2" and parts[1:] in (["approx", "f32"], ["approx", "ftz", "f32"]) and len(args) == 2:
        ftz = "true" if "ftz" in parts else "false"
        return statement.write32(args[0], f"::fa_cpu::fp::float_bits({_NS}ex2(::fa_cpu::fp::bits_float("
                                           f"{statement.read32(args[1], opcode)}), {ftz}))", opcode)
    if head == "tanh" and parts[1:] == ["approx", "f32"] and len(args) == 2:
        return statement.write32(args[0], f"::fa_cpu::fp::float_bits({_NS}tanh_approx(::fa_cpu::fp::bits_float("
                                           f"{statement.read32(args[1], opcode)})))", opcode)
    if head == "cvt" and parts[1:] in (["rn", "f16x2", "f32"], ["rn", "bf16x2", "f32"]) and len(args) == 3:
        bf16 = "true" if parts[2] == "bf16x2" else "false"
        a, b = (f"::fa_cpu::fp::bits_float({statement.read32(t, opcode)})" for t in args[1:])
        return statement.write32(args[0], f"{_NS}cvt_pack({bf16}, {a}, {b})", opcode)
    if head == "shfl" and len(parts) == 4 and parts[1] == "sync" and parts[3] == "b32" and len(args) == 5:
        modes = {"idx": 0, "up": 1, "down": 2, "bfly": 3}  # fa_cpu::WarpOp
        if "|" in args[0]:
            raise statement.fail(opcode, "the predicate output (d|p) of shfl.sync is not emulated")
        if parts[2] in modes:
            reads = ", ".join(statement.read32(a, opcode) for a in args[1:])
            return statement.write32(args[0], f"{_NS}shfl({modes[parts[2]]}, {reads})", opcode)
    raise statement.fail(opcode, "this PTX instruction is not emulated by the CUDA-on-CPU runner (it emulates "
                                 "mma.sync.aligned.m16n8k16/m16n8k8 .row.col.f32 with f16/bf16 inputs, "
                                 "ldmatrix.sync.aligned.m8n8 .b16, cp.async.ca/.cg with commit_group/wait_group/"
                                 "wait_all, ld.global{.v2,.v4} of 32-bit elements, ex2.approx.f32, tanh.approx.f32, "
                                 "cvt.rn.f16x2/bf16x2.f32 and shfl.sync .b32); use the CUDA C intrinsic instead")


def _emit_mma(statement, opcode, parts, args, label) -> str:
    shapes = {"m16n8k16": 16, "m16n8k8": 8}
    if (len(parts) != 10 or parts[1:3] != ["sync", "aligned"] or parts[3] not in shapes
            or parts[4:6] != ["row", "col"] or parts[6] != "f32" or parts[9] != "f32"
            or parts[7] != parts[8] or parts[7] not in ("f16", "bf16") or len(args) != 4):
        raise statement.fail(opcode, "only mma.sync.aligned.m16n8k16/m16n8k8.row.col.f32.{f16,bf16}.{f16,bf16}.f32 "
                                     "is emulated (fp32 accumulators, A row-major, B column-major)")
    k = shapes[parts[3]]
    d = _vector(args[0], 4, statement, opcode)
    a = [statement.read32(t, opcode) for t in _vector(args[1], k // 4, statement, opcode)]
    b = [statement.read32(t, opcode) for t in _vector(args[2], k // 8, statement, opcode)]
    c = [statement.read32(t, opcode) for t in _vector(args[3], 4, statement, opcode)]
    bf16 = "true" if parts[7] == "bf16" else "false"
    writes = " ".join(statement.write32(t, f"__fa_ptx_d[{i}]", opcode) for i, t in enumerate(d))
    return ("{ const ::std::uint32_t __fa_ptx_a[] = {" + ", ".join(a) + "}; "
            "const ::std::uint32_t __fa_ptx_b[] = {" + ", ".join(b) + "}; "
            "const ::std::uint32_t __fa_ptx_c[] = {" + ", ".join(c) + "}; ::std::uint32_t __fa_ptx_d[4]; "
            f"{_NS}mma<{k}>({bf16}, __fa_ptx_d, __fa_ptx_a, __fa_ptx_b, __fa_ptx_c, {label}); {writes} }}")


def _emit_ldmatrix(statement, opcode, parts, args, label) -> str:
    counts = {"x1": 1, "x2": 2, "x4": 4}
    quals = parts[1:]
    num = [q for q in quals if q in counts]
    rest = [q for q in quals if q not in counts and q not in ("trans", "shared", "shared::cta")]
    if len(num) != 1 or rest != ["sync", "aligned", "m8n8", "b16"] or len(args) != 2:
        raise statement.fail(opcode, "only ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}{.shared}.b16 is emulated")
    n = counts[num[0]]
    regs = _vector(args[0], n, statement, opcode)  # ptxas wants braces for .x1 too
    shared = "true" if ("shared" in quals or "shared::cta" in quals) else "false"
    trans = "true" if "trans" in quals else "false"
    writes = " ".join(statement.write32(t, f"__fa_ptx_r[{i}]", opcode) for i, t in enumerate(regs))
    return (f"{{ ::std::uint32_t __fa_ptx_r[{n}]; {_NS}ldmatrix({n}, {trans}, {_NS}address<{shared}>("
            f"{statement.address(args[1], opcode)}), __fa_ptx_r, {label}); {writes} }}")


def _emit_cp_async(statement, opcode, parts, args, label) -> str:
    if parts == ["cp", "async", "commit_group"] and not args:
        return f"{_NS}cp_async_commit_group();"
    if parts == ["cp", "async", "wait_all"] and not args:
        return f"{_NS}cp_async_wait_all();"
    if parts == ["cp", "async", "wait_group"] and len(args) == 1:
        return f"{_NS}cp_async_wait_group({statement.immediate(args[0], opcode)});"
    quals = [q for q in parts[2:] if not q.startswith("L2::")]
    if (len(quals) == 3 and quals[0] in ("ca", "cg") and quals[1] in ("shared", "shared::cta")
            and quals[2] == "global" and len(args) in (3, 4)):
        size = statement.immediate(args[2], opcode)
        src_size = statement.immediate(args[3], opcode) if len(args) == 4 else size
        cg = "true" if quals[0] == "cg" else "false"
        return (f"{_NS}cp_async({cg}, {statement.address(args[0], opcode)}, {statement.address(args[1], opcode)}, "
                f"{size}, {src_size}, {label});")
    raise statement.fail(opcode, "only cp.async.{ca,cg}.shared.global [dst], [src], cp-size{, src-size}, "
                                 "cp.async.commit_group, cp.async.wait_group N and cp.async.wait_all are emulated")


#: ld.global's qualifiers that change only caching or ordering hints, not the value loaded.
_LOAD_HINTS = re.compile(r"^(?:nc|ca|cg|cs|lu|cv|weak|relaxed|L1::\w+|L2::\w+)$")


def _emit_ld_global(statement, opcode, parts, args, label) -> str:
    quals = [q for q in parts[2:] if not _LOAD_HINTS.match(q)]
    count = {"v2": 2, "v4": 4}.get(quals[0], 1) if quals else 1
    element = quals[-1] if quals else ""
    if len(quals) != (1 if count == 1 else 2) or element not in ("b32", "u32", "s32", "f32") or len(args) != 2:
        raise statement.fail(opcode, "only ld.global{.nc}{.v2,.v4}.{b32,u32,s32,f32} [%N{+imm}] is emulated")
    regs = _vector(args[0], count, statement, opcode) if count > 1 else [args[0]]
    writes = " ".join(statement.write32(t, f"__fa_ptx_r[{i}]", opcode) for i, t in enumerate(regs))
    return (f"{{ ::std::uint32_t __fa_ptx_r[{count}]; {_NS}ld_global({count}, {_NS}address<false>("
            f"{statement.address(args[1], opcode)}), __fa_ptx_r, {label}); {writes} }}")
