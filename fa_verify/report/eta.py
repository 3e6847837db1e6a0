"""How long the rest of a sweep takes, predicted from the runs left and the size of each.

A run costs its backend's run time and its verdict's; each point costs once the comparators
every backend's run of it is judged with (`runner.Comparators`: reference, naive attention,
rounded reference). Each cost is predicted as k·work^EXPONENT, k fitted to the runs timed so
far (per backend for run and verdict, over all points for the comparators). Over the sweeps'
sizes these times grow far slower than the work (B·H·Nq·Nk·D): fixed overheads dominate the
small runs and the verdict's ensemble runs on a subset of rows above `FULL_WORK`; measured on
the quick sweep, about as work^0.6 (each cost within 2x of it from N = 64 to 1024). Scaling
the first, smallest runs by work alone predicted hours for a sweep of minutes.

A backend's run time is capped by what is left of its time budget, as the budget skips the
runs that would exceed it. A backend's first run, untimed (it may compile a kernel), is no
cost of the runs left. Before every backend with runs left has a timed run, and before any
point's comparators are timed, the time left is unknown (None).
"""

from __future__ import annotations

from collections import defaultdict

#: Times grow as work to this power over the sweeps' sizes (see above).
EXPONENT = 0.6
#: The keys of Record.seconds: a run's own time, its verdict's, and its point's comparators'.
RUN, CHECK, REFERENCE = "run", "check", "reference"


class _Fit:
    """seconds ≈ k·work^EXPONENT, with k = Σ seconds / Σ work^EXPONENT over the runs timed
    (the large runs, least dominated by overheads, weigh most)."""

    def __init__(self):
        self.seconds = self.scale = 0.0

    def add(self, work: float, seconds: float) -> None:
        self.seconds += seconds
        self.scale += max(work, 1) ** EXPONENT

    def predict(self, work: float) -> float | None:
        return self.seconds / self.scale * max(work, 1) ** EXPONENT if self.scale else None


class Eta:
    """The seconds a sweep has left, from its planned runs as they are timed or taken out.

    runs: (backend, point, work) of every run planned, in the order they run (`point`: any
    hashable naming the point, `work`: its B·H·Nq·Nk·D).
    budgets: {backend: report.budget.Budget}: each one's `left` caps its run time.
    history: (backend, point, work, seconds) of runs timed before (--resume: the store's records).
    """

    def __init__(self, runs, budgets=None, history=()):
        self.left = {(backend, point): work for backend, point, work in runs}
        self.budgets = budgets or {}
        self.fits = defaultdict(_Fit)  # (backend, RUN or CHECK) or REFERENCE -> _Fit
        self.judged = set()  # points whose comparators are computed
        for backend, point, work, seconds in history:
            self._learn(backend, point, work, seconds)
        self.judged = set()  # a run computes the comparators of every point it runs afresh

    def _learn(self, backend, point, work, seconds: dict) -> None:
        for cost in (RUN, CHECK):
            if cost in seconds:
                self.fits[backend, cost].add(work, seconds[cost])
        if REFERENCE in seconds and point not in self.judged:  # every run of a point repeats it
            self.fits[REFERENCE].add(work, seconds[REFERENCE])
        self.judged.add(point)

    def done(self, backend, point, work, seconds: dict) -> None:
        """A run finished; `seconds`: its record's timings."""
        self.left.pop((backend, point), None)
        self._learn(backend, point, work, seconds)

    def drop(self, backend, point) -> None:
        """A planned run will not run (the budget refused it)."""
        self.left.pop((backend, point), None)

    def seconds(self) -> float | None:
        """The predicted seconds left; None while some cost cannot be predicted yet."""
        by_backend = defaultdict(list)
        for (backend, point), work in self.left.items():
            by_backend[backend].append((point, work))
        total, points = 0.0, {}
        for backend, runs in by_backend.items():
            run, check = self.fits[backend, RUN], self.fits[backend, CHECK]
            budget = self.budgets.get(backend)
            allowed = budget.left if budget is not None else float("inf")
            for point, work in runs:
                cost = run.predict(work)
                if cost is None:
                    return None
                if cost > allowed:  # the budget skips it, and the larger runs after it
                    break
                allowed -= cost
                total += cost + (check.predict(work) or 0.0)
                if point not in self.judged:
                    points[point] = work
        if points:
            reference = self.fits[REFERENCE]
            if not reference.scale:
                return None
            total += sum(reference.predict(work) for work in points.values())
        return total
