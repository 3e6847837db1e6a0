"""FlashAttention-3's Table 3 from the records of its setup: RMSE of the output per result.

Rows: the exactly rounded reference and naive same-precision attention (from the records'
comparisons, counted once per problem), then every backend that ran the setup; the paper's
figures stand beside them. "× rounded" divides by the exactly rounded RMSE (as the overview's
headline does, `aggregate.vs_rounded`), which makes the figures comparable across shapes (the paper's absolute ones depend on a shape it does not give).
"""

from __future__ import annotations

from dataclasses import dataclass

from fa_verify.dtypes import DTYPE_NAMES
from fa_verify.report.aggregate import pooled_rmse, ratio
from fa_verify.results import EXACTLY_ROUNDED, NAIVE_SAME_PRECISION
from fa_verify.sweeps import FA3_DISTRIBUTION, FA3_PAPER_RMSE, FA3_SHAPE


@dataclass
class Fa3Row:
    name: str
    #: what it is: "backend" or "comparison"
    kind: str
    #: dtype -> pooled RMSE of the absolute output error
    rmse: dict
    #: dtype -> rmse / the exactly rounded reference's (1 is the best a kernel can do)
    vs_rounded: dict
    runs: int


@dataclass
class Fa3Table:
    shape: str
    dtypes: list
    rows: list
    #: the paper's figures (fp16), by name
    paper: dict
    seeds: int


_COMPARISON_LABELS = {EXACTLY_ROUNDED: "exactly rounded reference",
                      NAIVE_SAME_PRECISION: "standard attention, same precision (naive)"}


def is_fa3_problem(p) -> bool:
    return p.distribution == FA3_DISTRIBUTION and p.shape == FA3_SHAPE and not p.causal


def fa3_table(records) -> Fa3Table | None:
    """FlashAttention-3 Table 3 from the records of the fa3 setup; None if there are none."""
    runs = [r for r in records if is_fa3_problem(r.problem) and r.out_errors is not None]
    if not runs:
        return None
    dtypes = sorted({r.problem.dtype for r in runs}, key=DTYPE_NAMES.index)
    # The comparisons are the same in every backend's record of a problem: count each once.
    per_problem = {r.problem.key(): (r.problem.dtype, r.comparisons) for r in runs if r.comparisons}
    rmse = {label: {d: pooled_rmse(c[name]["abs"] for dtype, c in per_problem.values() if dtype == d)
                    for d in dtypes}
            for name, label in _COMPARISON_LABELS.items()}
    runs_of = {label: len(per_problem) for label in rmse}
    backends = sorted({r.backend for r in runs})
    for backend in backends:
        mine = [r for r in runs if r.backend == backend]
        rmse[backend] = {d: pooled_rmse(r.out_errors["abs"] for r in mine if r.problem.dtype == d)
                         for d in dtypes}
        runs_of[backend] = len(mine)
    rounded = rmse[_COMPARISON_LABELS[EXACTLY_ROUNDED]]
    rows = [Fa3Row(name, "backend" if name in backends else "comparison", values,
                   {d: ratio(values[d], rounded[d]) for d in dtypes}, runs_of[name])
            for name, values in rmse.items()]
    return Fa3Table(shape=f"B={FA3_SHAPE.batch} H={FA3_SHAPE.heads} N={FA3_SHAPE.nq} "
                          f"D={FA3_SHAPE.head_dim}, non-causal",
                    dtypes=dtypes, rows=rows, paper=dict(FA3_PAPER_RMSE),
                    seeds=len({r.problem.seed for r in runs}))
