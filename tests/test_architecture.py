"""The package's architecture, as docs/architecture.md states it: no import cycle between its
modules (lazy imports inside functions count too: they are arrows all the same), and no branch
on the kind of problem outside the modules that define a kind."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "fa_verify"
#: The modules that define a kind of problem (its problem type, oracle, strategies, properties,
#: and the registry of kinds): only they may ask which kind a problem is.
KIND_MODULES = {"fa_verify.problem", "fa_verify.ragged", "fa_verify.oracle.ragged", "fa_verify.strategies._ragged",
                "fa_verify.properties.ragged", "fa_verify.properties.draw_ragged", "fa_verify.properties.kinds",
                "fa_verify.backends.numpy_ragged"}
#: Names that tell kinds apart.
KIND_NAMES = {"RaggedProblem", "AttentionProblem"}


def _modules() -> dict:
    """Module name -> its parsed source, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _imports(name: str, tree, modules) -> set:
    """The package's modules `name` imports (at any depth of its code)."""
    package = name if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists() else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from a.b import c`: the module a.b.c if it is one, else a.b
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != name}


def _cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(name, tree, modules) for name, tree in modules.items()}


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 400  # the walk found the package's imports
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each a set of modules reaching each other):\n" + "\n".join(map(str, cycles))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_branch_on_the_kind_of_problem_outside_the_kinds():
    """isinstance(x, RaggedProblem) (or AttentionProblem) is a branch on the kind: the pipeline asks
    the problem instead (problem.parts(), problem.kind, ...)."""
    branches = []
    for name, tree in _modules().items():
        if name in KIND_MODULES:
            continue
        validations = {id(node.test) for node in ast.walk(tree)  # `if not isinstance(...): raise`: a type check
                       if isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Raise)}
        for node in ast.walk(tree):
            if isinstance(node, ast.UnaryOp) and id(node) in validations:
                validations.add(id(node.operand))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                    and len(node.args) == 2 and id(node) not in validations
                    and KIND_NAMES & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}):
                branches.append(f"{name}:{node.lineno}")
    assert not branches, f"branches on the kind of problem: {branches}"
