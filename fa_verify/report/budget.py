"""A backend's time budget in a sweep: predict each run's time, refuse what would not fit.

The prediction scales the backend's largest timed run so far by work (B·H·Nq·Nk·D): the
largest run is the one least dominated by fixed overheads, so it extrapolates best. The first
run of a backend is not timed at all, because it may include compiling a kernel.
"""

from __future__ import annotations


class Budget:
    def __init__(self, seconds: float):
        self.total = float(seconds)
        self.left = float(seconds)
        self._rate = None  # seconds per unit of work, from the largest run
        self._largest = 0

    def predict(self, work: int) -> float | None:
        """Predicted seconds of a run of `work`, None before any timed run."""
        return None if self._rate is None else self._rate * work

    def refusal(self, work: int) -> str | None:
        """Why a run of `work` does not fit (None if it does, or if nothing predicts it yet)."""
        predicted = self.predict(work)
        if predicted is None or predicted <= self.left:
            return None
        return (f"predicted {predicted:.1f} s exceeds the {max(self.left, 0):.1f} s left of "
                f"the backend's {self.total:g} s budget")

    def charge(self, work: int, seconds: float) -> None:
        self.left -= seconds
        if work >= self._largest:
            self._largest = work
            self._rate = seconds / max(work, 1)
