"""The sweeps `fa_verify report` runs: which problems, and how much time each backend may take.

A sweep is a list of points — (shape, dtype, causal, distribution, seed, variant) — that
every selected backend runs (a backend that does not implement a point's variant skips it, listed
as unsupported). Shapes are chosen so that each lands in its own row of the report's
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

import numpy as np

from fa_verify.dtypes import FP8_DTYPES
from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import NO_WINDOW, used_features
from fa_verify.strategies import Shape, make_backward_problem, make_descaled_problem, make_problem

#: The kind of problem a sweep is made of unless it says otherwise (`fa_verify.properties.kinds`).
PROBLEM_KIND = "dense"
#: The kinds a sweep can be made of: a dense point is a forward problem, a backward point the
#: same problem with an upstream gradient (`SweepPoint.dout`), an FP8 point the problem's values
#: stored in an FP8 format under descales drawn from a range (`SweepPoint.descales`).
KINDS = ("dense", "backward", "fp8")

DTYPES = ("fp16", "bf16", "fp32")
#: Every dtype a point can have, in the order points and columns sort by.
ALL_DTYPES = DTYPES + FP8_DTYPES
CAUSAL = (False, True)


@dataclass(frozen=True)
class Variant:
    """The variants a sweep point switches on (fa_verify.problem's conventions); the default is
    a dense problem. Slopes and sinks are recipes, made for the point's heads by `apply`."""

    window_size: tuple = NO_WINDOW
    softcap: float = 0.0
    #: None, "heads": the ALiBi recipe 2^(-8 h / H), h = 1..H, as [H]; "batch": [B, H], batch
    #: entry b the recipe rotated by b heads (each entry's slopes differ, as do each head's)
    alibi: str | None = None
    #: None, or head 0's sink logit; head h's is this + h / 2 (heads differ, to catch a wrong
    #: head index)
    sinks: float | None = None

    def apply(self, problem):
        heads = problem.heads
        recipe = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
        slopes = {None: None, "heads": recipe,
                  "batch": np.stack([np.roll(recipe, b) for b in range(problem.batch)])}[self.alibi]
        sinks = None if self.sinks is None else self.sinks + np.arange(heads) / 2
        return problem.replace(window_size=self.window_size, softcap=self.softcap,
                               alibi_slopes=slopes, sinks=sinks)

    @property
    def label(self) -> str:
        """What the progress line shows; "" when dense."""
        parts = {"window": f"window={self.window_size}", "softcap": f"softcap={self.softcap}",
                 "alibi": f"alibi={self.alibi}", "sinks": f"sinks={self.sinks}+h/2"}
        return " ".join(parts[name] for name in self.features)

    @property
    def features(self) -> tuple:
        return used_features(self.window_size, self.softcap, self.alibi, self.sinks)


DENSE = Variant()


@dataclass(frozen=True)
class SweepPoint:
    shape: Shape
    dtype: str
    causal: bool
    distribution: str
    seed: int
    variant: Variant = DENSE
    #: a backward point's upstream gradient (a name of `DOUT_DISTRIBUTIONS`, drawn from `seed`);
    #: None for a forward point
    dout: str | None = None
    #: an FP8 point's descale range (low, high): its q, k and v descales are drawn from U(low,
    #: high) (`make_descaled_problem`); None for a point of fp16/bf16/fp32 inputs
    descales: tuple | None = None

    @property
    def kind(self) -> str:
        return "fp8" if self.descales is not None else PROBLEM_KIND if self.dout is None else "backward"

    @property
    def work(self) -> int:
        """B·H·Nq·Nk·D: the run time of an attention kernel grows with it."""
        return self.shape.work

    @property
    def label(self) -> str:
        """What the progress line shows after the shape: the variants, a backward's dout."""
        return " ".join(x for x in (self.variant.label, self.dout and f"dout={self.dout}",
                                     self.descales and f"descales {self.descales[0]:g}-{self.descales[1]:g}") if x)

    def problem(self):
        """The AttentionProblem the point runs (BackwardProblem for a backward point, FP8Problem
        for an FP8 one)."""
        if self.descales is not None:
            return make_descaled_problem(self.distribution, self.shape, self.dtype, self.seed, self.descales,
                                         causal=self.causal)
        forward = self.variant.apply(make_problem(self.distribution, self.shape, self.dtype, self.seed,
                                                  causal=self.causal))
        return forward if self.dout is None else make_backward_problem(forward, self.dout, self.seed)


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
    #: the kind of problem its points are (KINDS); the report runs the backends of that kind
    kind: str = PROBLEM_KIND

    def __post_init__(self):
        wrong = [p for p in self.points if p.kind != self.kind]
        if self.kind not in KINDS or wrong:
            raise InvalidArgumentError(f"sweep {self.name!r} of kind={self.kind!r} has points of kind "
                                       f"{wrong[0].kind if wrong else '?'}; kinds: {', '.join(KINDS)}")

    def ordered(self) -> list[SweepPoint]:
        """Cheapest first, so that a budget cut leaves the largest shapes out, never a column."""
        return sorted(self.points, key=lambda p: (p.work, p.shape.nq, ALL_DTYPES.index(p.dtype),
                                                  p.causal, p.distribution, p.seed, p.label))


def grid(shapes, *, dtypes=DTYPES, causal=CAUSAL, distributions=("normal",), seeds=(0,),
         variants=(DENSE,), douts=(None,), descales=(None,)) -> tuple:
    """Every combination of the given shapes (6-tuples), dtypes, causal modes, distributions,
    seeds, variants, upstream gradients (None: forward points) and descale ranges (FP8 points)."""
    return tuple(SweepPoint(Shape.coerce(s), d, c, dist, seed, variant, dout, ranges)
                 for s, d, c, dist, seed, variant, dout, ranges in product(shapes, dtypes, causal, distributions,
                                                                           seeds, variants, douts, descales))


#: The quick sweep's error-vs-N lengths: half octaves up to 256, where runs are cheap, then
#: octaves (each doubling of N quadruples a run's work); nine lengths, 1024 the largest.
QUICK_LENGTHS = (16, 32, 64, 96, 128, 192, 256, 512, 1024)


def _seq_curve(lengths, head_dim=64, heads=4) -> list[tuple]:
    """The error-vs-N family: MHA, Nq = Nk."""
    return [(1, heads, heads, n, n, head_dim) for n in lengths]


#: D_v != D_qk (DeepSeek's 192/128: q and k of D = 192, v and the output of 128), for the backends
#: whose Limits declare the pair (`head_dims_v`); the others list the point as unsupported.
DV_SHAPE = (1, 4, 4, 64, 64, 192, 128)

#: The decode family: the error-vs-N family with one query (Nq = 1), over the quick lengths as Nk.
DECODE_SHAPES = [(1, 4, 4, 1, n, 64) for n in QUICK_LENGTHS]

#: A kernel's usual key tile: the variants sweep puts window edges on either side of it.
TILE = 64
#: The variants sweep's error-vs-N lengths, each feature at one parameter; its other
#: parameters run at VARIANT_SHAPE.
VARIANT_LENGTHS = (16, 32, 64, 128)
VARIANT_SHAPE = (1, 4, 4, 128, 128, 64)


def _feature_points(along_n: Variant, at_128: tuple, extra: tuple = ()) -> tuple:
    """A feature's points: `along_n` at every VARIANT_LENGTHS (its error-vs-N curve), the
    `at_128` variants at VARIANT_SHAPE, and `extra` (shape, variant) pairs; every dtype and
    causal mode (causal sets a window's right side to 0, as flash-attn 2 does)."""
    return (grid(_seq_curve(VARIANT_LENGTHS), variants=(along_n,))
            + grid([VARIANT_SHAPE], variants=at_128)
            + sum((grid([shape], variants=(v,)) for shape, v in extra), ()))


#: Per feature, the parameters where kernels differ or break (issue 15's bug classes).
#: Scores q.k/sqrt(D) of normal inputs are ~N(0, 1), so a row's largest is below 6 and above
#: -6 (tests/test_report.py checks it on the sweep's own problems): sinks of 8 lie above every
#: row's max, of -8 below every one, of 0 among the scores.
VARIANT_POINTS = {
    "window": _feature_points(
        Variant(window_size=(8, 8)),  # small: a few keys either side of the diagonal
        (Variant(window_size=(0, 0)),  # the diagonal alone
         Variant(window_size=(TILE - 1, TILE + 1)),  # edges on either side of a tile boundary
         Variant(window_size=(300, 300))),  # wider than N: masks nothing beyond causal
        # Nq < Nk: the window is around the diagonal i + Nk - Nq
        (((1, 4, 4, 96, 128, 64), Variant(window_size=(TILE - 1, TILE + 1))),)),
    "softcap": _feature_points(Variant(softcap=1.0),  # binds: scores reach ~4 = tanh's flat part
                               (Variant(softcap=30.0),)),  # Gemma-2's: near-identity on N(0, 1) scores
    "alibi": _feature_points(
        Variant(alibi="heads"), (),
        (((2, 4, 4, 128, 128, 64), Variant(alibi="batch")),  # [B, H] slopes
         ((1, 8, 2, 128, 128, 64), Variant(alibi="heads")))),  # GQA: the query head picks the slope
    "sinks": _feature_points(Variant(sinks=8.0), (Variant(sinks=0.0), Variant(sinks=-8.0))),
    "combined": _feature_points(
        Variant(window_size=(TILE - 1, TILE + 1), softcap=5.0, alibi="heads", sinks=0.0), (),
        (((1, 4, 4, 96, 128, 64), Variant(window_size=(TILE - 1, TILE + 1), softcap=5.0,
                                         alibi="heads", sinks=0.0)),)),
}

#: FlashAttention-3 Table 3's setup, at a shape of ours (the paper does not state its shape).
FA3_SHAPE = Shape(batch=1, heads=4, kv_heads=4, nq=1024, nk=1024, head_dim=128)
FA3_DISTRIBUTION = "fa3_outliers"
#: The paper's RMSE of the fp16 output against an fp64 reference (Table 3).
FA3_PAPER_RMSE = {
    "standard attention (fp16)": 3.2e-4,
    "FlashAttention-2 (fp16)": 1.9e-4,
    "FlashAttention-3 (fp16)": 1.9e-4,
}

#: The backward sweep's error-vs-N lengths (a backward run costs ~2.5 forward ones).
BACKWARD_LENGTHS = (16, 32, 64, 128, 256)
#: Upstream gradients of the backward sweep at BACKWARD_SHAPE besides "normal": torch.rand's
#: all-positive dO (dS = P (dP - D) cancels), a few rows only, a mixed-precision loss scale.
BACKWARD_DOUTS = ("uniform-positive", "sparse", "loss-scaled")
BACKWARD_SHAPE = (1, 2, 2, 128, 128, 64)

#: The FP8 sweep's error-vs-N lengths, and its descale ranges: small descales put the stored
#: values near e4m3's top (448), unit ones around 1, large ones down among its subnormals.
FP8_LENGTHS = (16, 32, 64, 128, 256, 512)
FP8_DESCALE_RANGES = ((1 / 64, 1 / 16), (0.5, 2.0), (16.0, 64.0))

SWEEPS = {
    "quick": Sweep(
        "quick", f"every dtype and causal mode at {len(QUICK_LENGTHS)} sequence lengths N = "
        f"{', '.join(map(str, QUICK_LENGTHS))} (D = 64, MHA), GQA at D = 128 and MQA with Nq > Nk "
        "(fully masked rows when causal), D = 192 with D_v = 128 at N = 64; normal inputs, one seed",
        grid(_seq_curve(QUICK_LENGTHS) + [(1, 8, 2, 256, 256, 128), (1, 4, 1, 100, 64, 96), DV_SHAPE]),
        budget_s=25.0,
        published=("fa3", "golden")),
    "default": Sweep(
        "default", "N = 16 ... 2048 (D = 64, MHA), D = 128 with GQA and MQA, Nq != Nk both ways, "
        "D = 192 with D_v = 128; normal and FA3-outlier inputs, two seeds",
        grid(_seq_curve((16, 64, 256, 1024, 2048))
             + [(1, 8, 2, 512, 512, 128), (1, 8, 1, 256, 256, 128),
                (1, 4, 1, 100, 64, 96), (2, 4, 2, 64, 300, 32), DV_SHAPE],
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
    "variants": Sweep(
        "variants", "per feature (sliding window, softcap, ALiBi, sinks, all four combined): "
        "window edges across a 64-key tile, small, diagonal-only and wider-than-N windows, Nq < Nk; "
        "binding (1) and non-binding (30) softcaps; ALiBi recipe slopes [H], [B, H] and under GQA; "
        "sinks above, among and below the scores; each feature also at N = "
        f"{', '.join(map(str, VARIANT_LENGTHS))} (D = 64, MHA); every dtype and causal mode, normal "
        "inputs, one seed; backends that do not implement a feature are listed as not applicable",
        sum(VARIANT_POINTS.values(), ()),
        budget_s=40.0),
    "decode": Sweep(
        "decode", f"one query (Nq = 1, decode) against Nk = {', '.join(map(str, QUICK_LENGTHS))} keys "
        "(D = 64, MHA; the quick sweep's error-vs-N family) and Nk = 257 at D = 128 with GQA; every "
        "dtype and causal mode, normal inputs, one seed",
        grid(DECODE_SHAPES + [(1, 8, 2, 1, 257, 128)]),
        budget_s=25.0),
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
    "backward": Sweep(
        "backward", f"gradients dq, dk, dv of the backward pass (upstream gradient dout drawn per point): "
        f"N = {', '.join(map(str, BACKWARD_LENGTHS))} (D = 64, MHA), GQA with Nq < Nk at D = 64 and MQA with "
        "Nq > Nk at D = 72 (rows that see no key when causal); normal dout, and all-positive, sparse and "
        f"loss-scaled dout at N = {BACKWARD_SHAPE[3]}; every dtype and causal mode, normal inputs, one seed; "
        "each gradient judged by fa_verify's bound and by the rules others use",
        grid(_seq_curve(BACKWARD_LENGTHS, heads=2) + [(1, 4, 2, 96, 160, 64), (1, 4, 1, 100, 64, 72)],
             douts=("normal",))
        + grid([BACKWARD_SHAPE], douts=BACKWARD_DOUTS),
        budget_s=40.0, kind="backward"),
    "fp8": Sweep(
        "fp8", f"FP8 inputs (e4m3, bf16 output) of the FP8 backends: N = {', '.join(map(str, FP8_LENGTHS))} "
        "(D = 64, MHA), GQA at D = 128 and a decode step (Nq = 1, Nk = 257, MQA); the values of normal inputs "
        "stored under descales drawn per (batch, kv head) from each range "
        f"{', '.join(f'[{lo:g}, {hi:g}]' for lo, hi in FP8_DESCALE_RANGES)}; both causal modes, one seed; "
        "the floor is the exact output rounded to bf16",
        grid(_seq_curve(FP8_LENGTHS) + [(1, 8, 2, 256, 256, 128), (1, 4, 1, 1, 257, 64)], dtypes=("e4m3",),
             descales=FP8_DESCALE_RANGES),
        budget_s=60.0, kind="fp8"),
}


def get_sweep(name: str) -> Sweep:
    if name not in SWEEPS:
        raise InvalidArgumentError(f"sweep={name!r} is unknown; use one of {', '.join(SWEEPS)}")
    return SWEEPS[name]
