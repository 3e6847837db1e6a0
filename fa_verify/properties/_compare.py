"""Elementwise comparisons for properties, with torch.testing-style messages.

Two kinds: `exceeding` (|got - want| against a per-element tolerance) and `differing`
(identical values required). Both take a boolean `where` selecting the elements that the
property speaks about, and return None when everything selected agrees. An infinity equals
only itself; NaN is identical to NaN but within no tolerance of anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.causes import got_expected


@dataclass(frozen=True)
class Mismatch:
    """The elements that break a comparison: how many, and the worst (or first) of them."""

    count: int
    total: int
    index: tuple
    got: float
    want: float
    error: float
    #: the tolerance at `index`; None for comparisons that require identical values
    tolerance: float | None = None

    def describe(self, what: str) -> str:
        share = 100.0 * self.count / self.total if self.total else 0.0
        head = f"{what}: {self.count} / {self.total} elements ({share:.3g}%)"
        where = f"at {list(self.index)}: {got_expected(self.got, self.want)}"
        if self.tolerance is None:
            return f"{head} differ; first {where}"
        ratio = self.error / self.tolerance if self.tolerance > 0 else float("inf")
        return (f"{head} exceed the tolerance; worst {where}, error {self.error:.3g} = "
                f"{ratio:.3g} x tolerance {self.tolerance:.3g}")


def _as64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def errors(got, want) -> np.ndarray:
    """|got - want|: 0 where they are the same infinity, inf where either is NaN (a NaN
    satisfies no numeric relation)."""
    got, want = _as64(got), _as64(want)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - want)
    err[got == want] = 0.0
    err[np.isnan(err)] = np.inf
    return err


def _selection(shape, where) -> np.ndarray:
    return np.ones(shape, bool) if where is None else np.broadcast_to(where, shape)


def exceeding(got, want, tolerance, where=None) -> tuple[Mismatch | None, float]:
    """(the mismatch or None, the largest error / tolerance over the selected elements)."""
    err = errors(got, want)
    tol = np.nan_to_num(np.broadcast_to(_as64(tolerance), err.shape), nan=0.0, posinf=np.inf)
    selected = _selection(err.shape, where)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(selected, np.where(err == 0, 0.0, err / tol), 0.0)
    worst = float(ratio.max(initial=0.0))
    over = selected & (err > tol)
    if not over.any():
        return None, worst
    index = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    return Mismatch(count=int(over.sum()), total=int(selected.sum()),
                    index=tuple(int(i) for i in index), got=float(_as64(got)[index]),
                    want=float(_as64(want)[index]), error=float(err[index]),
                    tolerance=float(tol[index])), worst


def differing(got, want, where=None) -> Mismatch | None:
    """The elements where `got` and `want` are not identical (+0 and -0 count as equal, and so
    do two NaNs: two runs that both give NaN agree)."""
    err = errors(got, want)
    err[np.isnan(_as64(got)) & np.isnan(_as64(want))] = 0.0
    selected = _selection(err.shape, where)
    bad = selected & (err != 0)
    if not bad.any():
        return None
    index = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return Mismatch(count=int(bad.sum()), total=int(selected.sum()),
                    index=tuple(int(i) for i in index), got=float(_as64(got)[index]),
                    want=float(_as64(want)[index]), error=float(err[index]))
