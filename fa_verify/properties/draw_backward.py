"""What to draw for a property on a backward target: the forward problems a dense property would
draw (probed through tiny backward problems, as `draw.capabilities` probes), each paired with an
upstream gradient by `strategies.backward_problems`; and fixed edge cases where backward bugs
live, run first: rows whose logits are all near -100 (very negative LSE) at key lengths on
either side of every tile edge, near-uniform rows under an all-positive dout, a loss-scaled
dout, head dims past powers of two and GQA groups of 3.
"""

from __future__ import annotations

import numpy as np

from fa_verify import strategies as fst
from fa_verify.backward import BackwardProblem
from fa_verify.properties import draw
from fa_verify.strategies._backward import DOUT_DISTRIBUTIONS, anti_aligned, fitting

#: (B, H, Hkv, Nq, Nk, D), the forward's distribution, dout's distribution, anti-aligned rows.
EDGE_CASES = (
    # every row anti-aligned; Nk at 64 - 1, 64 + 1, 128 (the tails of 64- and 128-key tiles)
    ((1, 2, 1, 3, 63, 16), "normal", "normal", (0, 1, 2)),
    ((1, 2, 1, 3, 65, 16), "normal", "normal", (0, 1, 2)),
    ((1, 2, 1, 5, 128, 16), "normal", "normal", (1, 3)),
    # near-uniform rows (q = 0 in constant rows) under an all-positive dout: dS cancels
    ((2, 3, 1, 7, 40, 40), "constant_rows", "uniform-positive", ()),
    # GQA 5, D = 72, a loss-scaled dout
    ((1, 5, 1, 9, 33, 72), "normal", "loss-scaled", ()),
)


def as_backward(problem, backend=None) -> BackwardProblem:
    """A probe: `problem` as a backward problem with dout = 1 (out and lse zero: a probe only
    asks `supports` and runs once, so it needs no oracle)."""
    zeros = np.zeros(problem.out_shape, problem.q.dtype)
    return BackwardProblem(problem, np.ones(problem.out_shape, problem.q.dtype), zeros,
                           np.zeros(problem.lse_shape, np.float32))


def backward_strategy(prop, backend, selection):
    forwards = draw.problem_strategy(prop, draw.capabilities(backend, as_backward), selection)
    if isinstance(forwards, str):
        return forwards
    return fst.backward_problems(forwards, with_dlse=backend.takes_dlse)


def edge_problems(prop, backend, selection) -> tuple[list, tuple]:
    cases = [(shape, forward) for shape, forward, _, _ in EDGE_CASES]
    problems, notes = draw.edge_problems(prop, backend, selection, cases, as_backward)
    gradients = {(tuple(shape), forward): (dout, rows) for shape, forward, dout, rows in EDGE_CASES}
    found = []
    for i, forward in enumerate(problems):
        shape = (forward.batch, forward.heads, forward.kv_heads, forward.nq, forward.nk, forward.head_dim)
        dout, rows = gradients.get((shape, dict(forward.tags)["distribution"]), ("normal", ()))
        rows = [r for r in rows if r < forward.nq]
        if rows:
            forward = anti_aligned(forward, rows)
        values = DOUT_DISTRIBUTIONS[dout](np.random.default_rng(i), forward.out_shape)
        found.append(BackwardProblem.of(forward, *fitting(forward, values, None), tags=(("dout", dout),)))
    return found, notes
