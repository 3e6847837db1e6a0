"""One-line shell commands that rebuild a failing example and check the property again."""

from __future__ import annotations

from fa_verify.backends import Backend, CallableBackend
from fa_verify.backends.registry import builtin_backends
from fa_verify.problem import AttentionProblem
from fa_verify.properties.registry import Property

#: Python that imports fa_verify.backends inside a one-line reproducer.
BACKENDS_MODULE = "__import__('fa_verify.backends', fromlist=['get_backend'])"


def backend_expression(backend: Backend, dtype: str) -> str:
    """Python that rebuilds `backend` (for reproducers), or a placeholder for custom ones."""
    if isinstance(backend, CallableBackend):
        m = backend.precision(dtype)
        spec = f"score={m.score_accumulation},p={m.p_rounding},pv={m.pv_accumulation},out={m.output}"
        return (f"{BACKENDS_MODULE}.CallableBackend({BACKENDS_MODULE}.load_callable({backend.name!r}), "
                f"layout={backend.layout!r}, array={backend.array!r}, "
                f"causal_alignment={backend.causal_alignment!r}, precision={spec!r})")
    if backend.name in {b.name for b in builtin_backends()}:
        return f"{BACKENDS_MODULE}.get_backend({backend.name!r})"
    return "YOUR_BACKEND"


def reproducer(backend: str, prop: Property, problem: AttentionProblem, seed: int) -> str:
    """A one-line shell command that rebuilds `problem` from its tags and checks `prop` again on
    the target the Python expression `backend` builds (see `backend_expression`)."""
    tags = dict(problem.tags)
    shape = (problem.batch, problem.heads, problem.kv_heads, problem.nq, problem.nk, problem.head_dim)
    make = (f"make_problem({tags.get('distribution')!r}, {shape}, {problem.dtype!r}, {tags.get('seed')}, "
            f"causal={problem.causal}, causal_alignment={problem.causal_alignment!r}, scale={problem.scale!r})")
    seed_arg = f", seed={seed}" if prop.seeded else ""
    return (f"python -c \"import sys; sys.path.insert(0, ''); from fa_verify.strategies import make_problem; "
            f"from fa_verify.properties import get_property; "
            f"print(get_property({prop.name!r})({backend}, {make}"
            f"{seed_arg}).message())\"")
