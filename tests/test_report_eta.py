"""The progress bar's time left (`report.eta`), on sweeps whose kernels take made-up times.

A fake clock stands for time: each backend's run advances it by a fixed overhead plus a cost
per unit of work, and its first run (untimed, as a kernel may compile then) by a compile time.
The time left the bar predicts is compared with the time the rest of the sweep then took on
that clock. Issue 25 saw "15% 90/594 runs 15s (eta 27789s)" for a sweep of 232 s.
"""

from __future__ import annotations

import io
import re
import time

import pytest

from fa_verify.backends import NaiveBackend
from fa_verify.report import environment
from fa_verify.report.budget import Budget
from fa_verify.report.eta import Eta
from fa_verify.report.runner import run_sweep
from fa_verify.results import ResultsStore
from fa_verify.sweeps import Sweep, grid

LENGTHS = (8, 16, 32, 64, 128)
BUDGET_S = 20.0


def _sweep(lengths=LENGTHS) -> Sweep:
    return Sweep("timed", "", grid([(1, 2, 2, n, n, 16) for n in lengths], dtypes=("fp16", "fp32"),
                                   causal=(False,)), budget_s=BUDGET_S)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Timed(NaiveBackend):
    """naive-fp32 under `name`, whose runs take `overhead + per_work * work` seconds on `clock`,
    the first one `compile_s` more."""

    def __init__(self, name, clock, overhead, per_work, compile_s):
        super().__init__("fp32")
        self.name, self.clock = name, clock
        self.overhead, self.per_work, self.compile_s = overhead, per_work, compile_s

    def _run(self, problem):
        work = problem.batch * problem.heads * problem.nq * problem.nk * problem.head_dim
        self.clock.now += self.overhead + self.per_work * work + self.compile_s
        self.compile_s = 0.0
        return super()._run(problem)


def _backends(clock):
    # a fast kernel and an emulated one (the CUDA-on-CPU runner), whose budget cuts its
    # largest runs: N = 128 takes 21 s, more than its whole budget
    return [_Timed("fast", clock, 0.01, 1e-8, compile_s=0.0),
            _Timed("slow", clock, 0.05, 4e-5, compile_s=30.0)]


class _Log(io.StringIO):
    """A terminal (every run gets a line), each line stamped with the clock."""

    def __init__(self, clock):
        super().__init__()
        self.clock, self.lines = clock, []

    def isatty(self) -> bool:
        return True

    def write(self, text) -> int:
        self.lines.append((self.clock(), text))
        return len(text)


def _etas(log, end: float) -> list:
    """(predicted, actual) seconds left at each bar line that predicts one."""
    found = []
    for at, line in log.lines:
        m = re.search(r"\(eta +([0-9?]+)s\)", line)
        if m and m.group(1) != "?":
            found.append((float(m.group(1)), end - at))
    return found


@pytest.fixture
def clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)  # the runner's timings
    monkeypatch.setattr(time, "monotonic", clock)  # the bar's elapsed time
    monkeypatch.setattr(environment, "collect", dict)  # run.json's machine (importing torch: seconds)
    return clock


def _within_3x(etas) -> None:
    for predicted, actual in etas:
        assert actual / 3 - 1 <= predicted <= 3 * actual + 1, etas


def test_the_time_left_is_predicted_from_the_runs_left_not_from_the_time_so_far(tmp_path, clock):
    log = _Log(clock)
    info = run_sweep(_sweep(), _backends(clock), ResultsStore(tmp_path / "r.jsonl"), stream=log)
    assert {s.backend for s in info.skips if s.kind == "budget"} == {"slow"}  # the cap is exercised
    etas = _etas(log, clock())
    # every line after the first point's runs predicts (before, nothing was timed: "?")
    assert len(etas) >= 2 * len(_sweep().points) - 4
    _within_3x(etas)  # was 8e4 s against 16 s: the compile time over the first runs' tiny work


def test_a_resumed_sweep_predicts_from_the_runs_recorded_before(tmp_path, clock):
    store = ResultsStore(tmp_path / "r.jsonl")
    run_sweep(_sweep(LENGTHS[:3]), _backends(clock), store, stream=_Log(clock))
    log = _Log(clock)
    records = store.read()
    run_sweep(_sweep(), _backends(clock), store, stream=log, done={r.key() for r in records},
              history=records)
    etas = _etas(log, clock())
    assert etas and "(eta    ?s)" not in log.lines[0][1]  # known from the first line: the store's timings
    _within_3x(etas)  # was "eta 0s" on the first line, then the compile time over the work


def test_the_budget_caps_a_backends_time_left():
    eta = Eta([("slow", n, 4.0 ** n) for n in range(1, 8)] + [("fast", n, 4.0 ** n) for n in range(1, 8)],
              budgets={"slow": Budget(10.0)})
    assert eta.seconds() is None  # nothing timed yet
    eta.done("slow", 1, 4.0, {"run": 1.0, "check": 0.0, "reference": 0.5})
    assert eta.seconds() is None  # "fast" has runs left and no time yet
    eta.done("fast", 1, 4.0, {"run": 0.1, "check": 0.1, "reference": 0.5})
    # the runs left, at 4^2 ... 4^7, grow as 4^(0.6 k), k = 1 ... 6: slow's at 1 s x that, the
    # 10 s left of its budget taking the first two (2.3 s, 5.3 s; 12 s would exceed it); fast's
    # run and check at 0.2 s x that; each point's comparators at 0.5 s x that
    grow = [4.0 ** (0.6 * k) for k in range(1, 7)]
    assert eta.seconds() == pytest.approx(grow[0] + grow[1] + 0.2 * sum(grow) + 0.5 * sum(grow))
    eta.drop("slow", 2)  # the budget refused it: no longer counted; the next one fits, not more
    assert eta.seconds() == pytest.approx(grow[1] + 0.2 * sum(grow) + 0.5 * sum(grow))
