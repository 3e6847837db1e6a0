"""FlashAttention-3's Table 3 from the records of its setup: RMSE of the output per result.

Rows: the exactly rounded reference and naive same-precision attention (from the records'
comparisons, counted once per problem), then every backend that ran the setup; the paper's
figures stand beside them. "× rounded" divides by the exactly rounded RMSE (as the overview's
headline does, `aggregate.vs_rounded`), which makes the figures comparable across shapes (the paper's absolute ones depend on a shape it does not give).

`measure_table3` / `table3` are the default report's small version of the same table, which
needs no fa3 sweep: our own implementations (the exactly rounded reference, standard attention
in numpy and as the naive16 kernel, the fa2 kernel on the CUDA-on-CPU runner) on one problem
per dtype and seed at the FA3 shape with one head, each problem's figures cached by its inputs
(`measurements`); the paper's figure stands beside each row it corresponds to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fa_verify.backends.cuda_kernels import CpuKernelBackend, cpu_runner_availability
from fa_verify.backends.naive import naive_attention
from fa_verify.dtypes import DTYPE_NAMES, round_to
from fa_verify.kernels.catalogue import FA2, NAIVE16
from fa_verify.oracle import reference
from fa_verify.precision import PrecisionModel
from fa_verify.report.aggregate import pooled_rmse, ratio
from fa_verify.report.measurements import code_fingerprint, deviation, measure_problems, seeds_text
from fa_verify.results import EXACTLY_ROUNDED, NAIVE_SAME_PRECISION
from fa_verify.strategies import make_problem
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
    # (a check or pytest record compares with the rounded reference only)
    per_problem = {r.problem.key(): (r.problem.dtype, r.comparisons) for r in runs
                   if r.comparisons and set(_COMPARISON_LABELS) <= set(r.comparisons)}
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


# --- the default report's small version, measured (and cached) outside the sweep -------------------

_ROUNDED, _NAIVE = _COMPARISON_LABELS[EXACTLY_ROUNDED], _COMPARISON_LABELS[NAIVE_SAME_PRECISION]
_NAIVE16_KERNEL, _FA2_KERNEL = (CpuKernelBackend(f).name for f in (NAIVE16, FA2))
#: Our row -> the paper's row it corresponds to (FA3_PAPER_RMSE's names).
PAPER_ROW = {_NAIVE: "standard attention (fp16)", _NAIVE16_KERNEL: "standard attention (fp16)",
             _FA2_KERNEL: "FlashAttention-2 (fp16)"}
#: The paper's rows we have no implementation of, and why.
NOT_REPRODUCED = {
    "FlashAttention-3 (fp16)": "no FA3 kernel here (it needs Hopper's wgmma and TMA); our fa2 and "
                               "wmma kernels are FA2-style",
    "FP8 rows (FlashAttention-3 FP8 with block quantization and incoherent processing, baseline "
    "FP8)": "our FP8 kernel (fa3_fp8.cu) has FlashAttention-3's per-(batch, kv head) descales but neither "
            "block quantization nor incoherent processing, and the paper's inputs (outliers, its FP8 "
            "baseline) are not given exactly; its abstract reports FP8 FlashAttention-3's error 2.6× below a "
            "baseline FP8 attention's",
}
TABLE3_CODE = (("fa_verify.report.fa3", "fa_verify.oracle", "fa_verify.backends.naive",
                "fa_verify.backends.cuda_kernels", "fa_verify.cuda_cpu", "fa_verify.strategies",
                "fa_verify.dtypes"),
               ("fa_common.cuh", "fa2.cu", "naive.cu"))


@dataclass(frozen=True)
class Table3Setup:
    """The fa3 sweep's shape with one head (a quarter of its cost; RMSE does not grow with H)."""

    dtypes: tuple = ("fp16", "bf16")
    seeds: tuple = (0,)
    batch: int = FA3_SHAPE.batch
    heads: int = 1
    seq_len: int = FA3_SHAPE.nq
    head_dim: int = FA3_SHAPE.head_dim

    def describe(self) -> str:
        return (f"B={self.batch} H={self.heads} N={self.seq_len} D={self.head_dim}, non-causal, "
                f"inputs N(0,1) + N(0,100)·Bernoulli(0.001) (the {FA3_DISTRIBUTION} distribution), "
                f"{seeds_text(self.seeds)}")


def measure_table3(setup: Table3Setup, cache, progress=None) -> dict:
    """Every (dtype, seed) problem's deviations, through `cache`; plain JSON for published.json."""
    return measure_problems(cache, "FlashAttention-3 Table 3", setup, code_fingerprint(*TABLE3_CODE),
                            "dtype", setup.dtypes, setup.seeds,
                            lambda dtype, seed: _measure_table3_problem(setup, dtype, seed), progress,
                            {"cpu_runner": cpu_runner_availability().available})


def _measure_table3_problem(setup: Table3Setup, dtype: str, seed: int) -> dict:
    shape = (setup.batch, setup.heads, setup.heads, setup.seq_len, setup.seq_len, setup.head_dim)
    problem = make_problem(FA3_DISTRIBUTION, shape, dtype, seed)
    ref = reference(problem)
    outputs = {_ROUNDED: round_to(ref.out, dtype),
               _NAIVE: naive_attention(problem, PrecisionModel.same_precision(dtype))[0]}
    runner = cpu_runner_availability()
    if runner.available:
        for family in (NAIVE16, FA2):
            backend = CpuKernelBackend(family)
            outputs[backend.name] = backend.run(problem)[0]
    return {"unavailable": None if runner.available else runner.reason,
            "deviation": {name: deviation(out, ref.out) for name, out in outputs.items()}}


@dataclass
class Table3Row:
    name: str
    #: dtype -> RMSE of |O - O_ref| over every element of the dtype's problems
    rmse: dict
    #: dtype -> rmse / the rounded reference's
    vs_rounded: dict
    #: the paper's row this one corresponds to, and its fp16 RMSE (None: no counterpart)
    paper_row: str | None
    paper_rmse: float | None


@dataclass
class Table3:
    setup: Table3Setup
    rows: list
    #: the paper's rows without a counterpart here: name -> (fp16 RMSE or None, why)
    not_reproduced: dict
    unavailable: str | None

    def standard_over_fa2(self, dtype: str = "fp16") -> float | None:
        """Our standard attention's RMSE over the fa2 kernel's: the paper's is 3.2e-4 / 1.9e-4."""
        by_name = {row.name: row.rmse.get(dtype) for row in self.rows}
        return ratio(by_name.get(_NAIVE), by_name.get(_FA2_KERNEL))

    @property
    def paper_standard_over_fa2(self) -> float:
        return FA3_PAPER_RMSE["standard attention (fp16)"] / FA3_PAPER_RMSE["FlashAttention-2 (fp16)"]


def table3(data: dict) -> Table3:
    """The page's view of `measure_table3`'s JSON: RMSE pooled over seeds (equal-sized problems)."""
    setup = Table3Setup(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["setup"].items()})
    names = list(dict.fromkeys(name for p in data["problems"] for name in p["deviation"]))
    rmse = {name: {d: _pooled([p["deviation"][name]["rmse"] for p in data["problems"]
                               if p["dtype"] == d and name in p["deviation"]])
                   for d in setup.dtypes} for name in names}
    rows = [Table3Row(name, rmse[name], {d: ratio(rmse[name][d], rmse[_ROUNDED][d]) for d in setup.dtypes},
                      PAPER_ROW.get(name), FA3_PAPER_RMSE.get(PAPER_ROW.get(name)))
            for name in names]
    not_reproduced = {name: (FA3_PAPER_RMSE.get(name), why) for name, why in NOT_REPRODUCED.items()}
    unavailable = next((p["unavailable"] for p in data["problems"] if p["unavailable"]), None)
    return Table3(setup, rows, not_reproduced, unavailable)


def _pooled(rmses) -> float | None:
    return math.sqrt(sum(r * r for r in rmses) / len(rmses)) if rmses else None
