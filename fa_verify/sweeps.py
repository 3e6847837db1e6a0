"""The sweeps `fa_verify report` runs: which problems, and how much time each backend may take.

A sweep is a list of points — (shape, dtype, causal, distribution, seed) — that every
selected backend runs. Shapes are chosen so that each lands in its own row of the report's
summary table (shape buckets by N, D and head grouping) and so that one family (Nq = Nk,
D = 64, MHA) runs through several N, which gives the error-vs-sequence-length curves.

Slow backends (the CUDA-on-CPU runner emulates every GPU thread) cannot run large shapes in a
few minutes, so each sweep gives every backend a time budget: the runner runs points from the
cheapest up, predicts each run's time from the backend's largest run so far, and skips (and
lists) points that would exceed the budget. The smallest shapes come first for every dtype
and causal mode, so a slow backend still covers every column of the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from fa_verify.errors import InvalidArgumentError
from fa_verify.strategies import Shape

DTYPES = ("fp16", "bf16", "fp32")
CAUSAL = (False, True)


@dataclass(frozen=True)
class SweepPoint:
    shape: Shape
    dtype: str
    causal: bool
    distribution: str
    seed: int

    @property
    def work(self) -> int:
        """B·H·Nq·Nk·D: the run time of an attention kernel grows with it."""
        return self.shape.work


@dataclass(frozen=True)
class Sweep:
    name: str
    description: str
    points: tuple
    #: seconds each backend may spend on this sweep's runs (predicted before each run)
    budget_s: float
    #: published results reproduced after the sweep (`fa_verify.report.published.EXPERIMENTS`;
    #: fixed experiments, cached by their inputs, not per backend)
    published: tuple = ()

    def ordered(self) -> list[SweepPoint]:
        """Cheapest first, so that a budget cut leaves the largest shapes out, never a column."""
        return sorted(self.points, key=lambda p: (p.work, p.shape.nq, DTYPES.index(p.dtype),
                                                  p.causal, p.distribution, p.seed))


def grid(shapes, *, dtypes=DTYPES, causal=CAUSAL, distributions=("normal",), seeds=(0,)) -> tuple:
    """Every combination of the given shapes (6-tuples), dtypes, causal modes, distributions, seeds."""
    return tuple(SweepPoint(Shape.coerce(s), d, c, dist, seed)
                 for s, d, c, dist, seed in product(shapes, dtypes, causal, distributions, seeds))


#: The quick sweep's error-vs-N lengths: half octaves up to 256, where runs are cheap, then
#: octaves (each doubling of N quadruples a run's work); nine lengths, 1024 the largest.
QUICK_LENGTHS = (16, 32, 64, 96, 128, 192, 256, 512, 1024)


def _seq_curve(lengths, head_dim=64, heads=4) -> list[tuple]:
    """The error-vs-N family: MHA, Nq = Nk."""
    return [(1, heads, heads, n, n, head_dim) for n in lengths]


#: FlashAttention-3 Table 3's setup, at a shape of ours (the paper does not state its shape).
FA3_SHAPE = Shape(batch=1, heads=4, kv_heads=4, nq=1024, nk=1024, head_dim=128)
FA3_DISTRIBUTION = "fa3_outliers"
#: The paper's RMSE of the fp16 output against an fp64 reference (Table 3).
FA3_PAPER_RMSE = {
    "standard attention (fp16)": 3.2e-4,
    "FlashAttention-2 (fp16)": 1.9e-4,
    "FlashAttention-3 (fp16)": 1.9e-4,
}

SWEEPS = {
    "quick": Sweep(
        "quick", f"every dtype and causal mode at {len(QUICK_LENGTHS)} sequence lengths N = "
        f"{', '.join(map(str, QUICK_LENGTHS))} (D = 64, MHA), GQA at D = 128 and MQA with Nq > Nk "
        "(fully masked rows when causal); normal inputs, one seed",
        grid(_seq_curve(QUICK_LENGTHS) + [(1, 8, 2, 256, 256, 128), (1, 4, 1, 100, 64, 96)]),
        budget_s=25.0,
        published=("fa3", "golden")),
    "default": Sweep(
        "default", "N = 16 ... 2048 (D = 64, MHA), D = 128 with GQA and MQA, Nq != Nk both ways; "
        "normal and FA3-outlier inputs, two seeds",
        grid(_seq_curve((16, 64, 256, 1024, 2048))
             + [(1, 8, 2, 512, 512, 128), (1, 8, 1, 256, 256, 128),
                (1, 4, 1, 100, 64, 96), (2, 4, 2, 64, 300, 32)],
             distributions=("normal", "fa3_outliers"), seeds=(0, 1)),
        budget_s=120.0,
        published=("fa3", "golden")),
    "fa3": Sweep(
        "fa3", f"FlashAttention-3 Table 3: inputs N(0,1) + N(0,100)·Bernoulli(0.001), "
        f"B={FA3_SHAPE.batch} H={FA3_SHAPE.heads} N={FA3_SHAPE.nq} D={FA3_SHAPE.head_dim}, "
        "non-causal, fp16 and bf16, four seeds",
        grid([(FA3_SHAPE.batch, FA3_SHAPE.heads, FA3_SHAPE.kv_heads, FA3_SHAPE.nq, FA3_SHAPE.nk,
               FA3_SHAPE.head_dim)], dtypes=("fp16", "bf16"), causal=(False,),
             distributions=(FA3_DISTRIBUTION,), seeds=(0, 1, 2, 3)),
        budget_s=300.0,
        published=("golden",)),
    "thorough": Sweep(
        "thorough", "N = 16 ... 4096 at D = 64 and 128, D = 32 ... 256, GQA and MQA, Nq != Nk; "
        "normal, FA3-outlier, large-logit and uniform inputs, three seeds",
        grid(_seq_curve((16, 64, 256, 1024, 2048, 4096)) + _seq_curve((256, 1024, 4096), 128)
             + [(1, 4, 4, 512, 512, d) for d in (32, 96, 256)]
             + [(1, 8, 2, 512, 512, 128), (1, 8, 1, 1024, 1024, 128),
                (1, 4, 1, 100, 64, 96), (2, 4, 2, 64, 300, 32), (1, 4, 4, 1, 257, 64)],
             distributions=("normal", "fa3_outliers", "large_logits", "uniform"), seeds=(0, 1, 2)),
        budget_s=900.0,
        published=("fa3", "golden")),
}


def get_sweep(name: str) -> Sweep:
    if name not in SWEEPS:
        raise InvalidArgumentError(f"sweep={name!r} is unknown; use one of {', '.join(SWEEPS)}")
    return SWEEPS[name]
