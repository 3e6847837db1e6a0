"""Error measures of a kernel's output against the reference: absolute, normalised, in ULPs.

Three views of one elementwise error, because each hides something the others show:
- absolute |out - ref|: what a downstream consumer sees;
- normalised |out - ref| / D_ic, with D_ic = sum_j p_ij |v_jc| the row scale: attention's
  natural unit (an output that cancels to ~0 still has a large D), so errors of rows with very
  different magnitudes compare; 0/0 is 0 (a fully masked row that correctly outputs 0);
- ULPs of the output dtype at the reference value: how far from "rounded correctly" (0.5 ulp).

Per tensor each view is summarised by `ErrorStats` (max, p99, median, RMSE of the magnitudes
and the signed mean, i.e. the bias). LSE is measured absolutely. A NaN output is an infinite
error, never a skipped one; a fully masked row must give LSE -inf exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fa_verify.dtypes import dtype_name, ulp
from fa_verify.errors import InvalidArgumentError


@dataclass(frozen=True)
class ErrorStats:
    """Summary of signed errors: max / p99 / median / RMSE of |e|, and the signed mean of e.

    NaN errors count as infinitely large magnitudes (max and RMSE become inf) and make the
    signed mean NaN: a bias is undefined when some errors are. p99 is the nearest-rank
    percentile (an element that occurs), so it stays meaningful when some errors are inf.
    """

    max: float
    p99: float
    median: float
    rmse: float
    mean: float
    count: int

    @classmethod
    def from_values(cls, values) -> "ErrorStats":
        e = np.asarray(values, dtype=np.float64).ravel()
        if e.size == 0:
            return cls(max=0.0, p99=0.0, median=0.0, rmse=0.0, mean=0.0, count=0)
        mag = np.abs(e)
        mag[np.isnan(mag)] = np.inf
        with np.errstate(over="ignore", invalid="ignore"):
            rmse = float(np.sqrt(np.mean(np.square(mag))))
            mean = float(np.mean(e))
        return cls(
            max=float(mag.max()),
            p99=float(np.quantile(mag, 0.99, method="inverted_cdf")),
            median=float(np.median(mag)),
            rmse=rmse,
            mean=mean,
            count=int(e.size),
        )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class OutputErrors:
    """Elementwise errors of an output [B, H, Nq, D], all float64.

    `signed` is out - ref (NaN where out is NaN); the other three are magnitudes with NaN
    replaced by inf, so that max/argmax can never skip a NaN.
    """

    signed: np.ndarray
    abs: np.ndarray
    normalised: np.ndarray
    ulp: np.ndarray
    #: the units: D_ic and the output dtype's spacing at the reference value
    row_scale: np.ndarray
    ulp_size: np.ndarray

    @classmethod
    def compute(cls, out, ref_out, row_scale, dtype) -> "OutputErrors":
        """Errors of `out` against `ref_out` (float64), normalised by `row_scale`, ULPs of `dtype`."""
        got = np.asarray(out).astype(np.float64)
        ref = np.asarray(ref_out, dtype=np.float64)
        scale = np.asarray(row_scale, dtype=np.float64)
        if got.shape != ref.shape or scale.shape != ref.shape:
            raise InvalidArgumentError(
                f"out.shape={got.shape!r}, reference shape={ref.shape!r} and "
                f"row_scale.shape={scale.shape!r} must be equal")
        with np.errstate(invalid="ignore", over="ignore"):
            signed = got - ref
        magnitude = np.abs(signed)
        magnitude[np.isnan(magnitude)] = np.inf
        spacing = ulp(ref, dtype)  # > 0 everywhere: the subnormal spacing at 0
        return cls(
            signed=signed,
            abs=magnitude,
            normalised=_safe_ratio(magnitude, scale),
            ulp=magnitude / spacing,
            row_scale=scale,
            ulp_size=spacing,
        )

    def stats(self) -> dict:
        """ErrorStats of the three views, from the signed errors so each carries its bias."""
        return {
            "abs": ErrorStats.from_values(self.signed),
            "normalised": ErrorStats.from_values(_safe_ratio(self.signed, self.row_scale)),
            "ulp": ErrorStats.from_values(self.signed / self.ulp_size),
        }


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den elementwise with 0/0 = 0 and x/0 = inf·sign(x); NaN numerators stay NaN."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = num / den
    zero = (den == 0) & (num == 0)
    return np.where(zero, 0.0, ratio)


def lse_errors(lse, ref_lse) -> np.ndarray:
    """Signed LSE errors in float64; at fully masked rows (reference -inf) the kernel must
    give -inf exactly: error 0 then, +inf for anything else (finite, +inf), NaN stays NaN."""
    got = np.asarray(lse).astype(np.float64)
    ref = np.asarray(ref_lse, dtype=np.float64)
    if got.shape != ref.shape:
        raise InvalidArgumentError(f"lse.shape={got.shape!r} must equal the reference's {ref.shape!r}")
    with np.errstate(invalid="ignore"):
        signed = got - ref
    masked = ref == -np.inf
    signed[masked & (got == -np.inf)] = 0.0
    signed[masked & ~np.isnan(got) & (got != -np.inf)] = np.inf
    return signed


@dataclass(frozen=True)
class ErrorSummary:
    """Per-tensor error statistics of one output (and LSE, when the kernel returned one)."""

    #: output dtype the ULP view is measured in
    dtype: str
    abs: ErrorStats
    normalised: ErrorStats
    ulp: ErrorStats
    #: absolute LSE errors; None when no LSE was measured
    lse_abs: ErrorStats | None
    #: (b, h, i, c) of the largest normalised error
    worst_index: tuple
    #: (b, h, i) of the largest LSE error, None without LSE
    lse_worst_index: tuple | None = None

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "abs": self.abs.as_dict(),
            "normalised": self.normalised.as_dict(),
            "ulp": self.ulp.as_dict(),
            "lse_abs": None if self.lse_abs is None else self.lse_abs.as_dict(),
            "worst_index": list(self.worst_index),
            "lse_worst_index": None if self.lse_worst_index is None else list(self.lse_worst_index),
        }


def _argmax_index(magnitude: np.ndarray) -> tuple:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(magnitude)), magnitude.shape))


def measure(out, reference, dtype=None, lse=None) -> ErrorSummary:
    """Error statistics of `out` (and `lse`) against a `Reference`.

    `dtype` is the output dtype for the ULP view (default: out's own dtype).
    """
    dtype = dtype_name(dtype if dtype is not None else np.asarray(out).dtype)
    errors = OutputErrors.compute(out, reference.out, reference.row_scale, dtype)
    stats = errors.stats()
    lse_stats = lse_worst = None
    if lse is not None:
        signed = lse_errors(lse, reference.lse)
        lse_stats = ErrorStats.from_values(signed)
        magnitude = np.abs(signed)
        magnitude[np.isnan(magnitude)] = np.inf
        lse_worst = _argmax_index(magnitude) if magnitude.size else None
    return ErrorSummary(
        dtype=dtype,
        abs=stats["abs"],
        normalised=stats["normalised"],
        ulp=stats["ulp"],
        lse_abs=lse_stats,
        worst_index=_argmax_index(errors.normalised),
        lse_worst_index=lse_worst,
    )
