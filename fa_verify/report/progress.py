"""A one-line progress bar on stderr: redrawn in place on a terminal, a line now and then in a log.

It counts the runs the sweep will make: runs a backend does not support, or already has in
the results (--resume), are left out from the start, and a run the time budget refuses is
taken out when it is refused. The percentage is the share of those runs done, so it agrees
with the run count; the time left is predicted from the runs left, each by its size (`eta`),
and shown as "?" until there is something to predict it from. The last line says what ran
and what was skipped.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from fa_verify.report.eta import Eta


class Progress:
    """runs: (backend, point, work) of the runs planned, in order; budgets and history as
    `eta.Eta` takes them."""

    def __init__(self, runs, stream=None, width: int = 28, budgets=None, history=()):
        runs = list(runs)
        self.total_runs = len(runs)
        self.eta = Eta(runs, budgets, history)
        self.stream = stream or sys.stderr
        self.width = width
        self.runs = 0
        self.skipped = Counter()
        self.start = time.monotonic()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._logged = -1  # twentieths logged so far, off a terminal

    @property
    def share(self) -> float:
        return self.runs / self.total_runs if self.total_runs else 1.0

    def skip(self, kind: str, run=None) -> None:
        """A run of `kind` will not run; `run`: its (backend, point) when it was planned."""
        self.skipped[kind] += 1
        if run is not None:
            self.total_runs -= 1
            self.eta.drop(*run)

    def begin(self, label: str) -> None:
        """A run starts: show it (on a terminal always; in a log once per twentieth)."""
        step = int(20 * self.share)
        if self._tty or step > self._logged:
            self._logged = step
            self._write(self._line(label))

    def finish(self, backend, point, work, seconds: dict) -> None:
        """A planned run is done; `seconds`: its record's timings."""
        self.runs += 1
        self.eta.done(backend, point, work, seconds)

    def _line(self, label: str) -> str:
        elapsed = time.monotonic() - self.start
        left = self.eta.seconds()
        filled = int(self.share * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        eta = "   ?" if left is None else f"{left:4.0f}"
        return (f"[{bar}] {100 * self.share:3.0f}% {self.runs}/{self.total_runs} runs "
                f"{elapsed:5.0f}s (eta {eta}s) {label}")

    def _write(self, line: str) -> None:
        if self._tty:
            self.stream.write("\r\033[K" + line[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """The last line: the runs made, and the skipped ones by kind."""
        elapsed = time.monotonic() - self.start
        skipped = sum(self.skipped.values())
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.skipped.items()))
        self._write(f"{self.runs} runs in {elapsed:.0f}s; skipped {skipped}"
                    + (f" ({kinds})" if skipped else ""))
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
