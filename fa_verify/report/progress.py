"""A one-line progress bar on stderr: redrawn in place on a terminal, a line now and then in a log.

It counts the runs the sweep will make: runs a backend does not support, or already has in
the results (--resume), are left out from the start, and a run the time budget refuses is
taken out when it is refused. The percentage is the share of those runs done, so it agrees
with the run count; the remaining time is predicted from the work (B·H·Nq·Nk·D per run), as
runs differ in cost by orders of magnitude. The last line says what ran and what was skipped.
"""

from __future__ import annotations

import sys
import time
from collections import Counter


class Progress:
    def __init__(self, runs: int, work: float, stream=None, width: int = 28):
        self.total_runs = runs
        self.total_work = float(work)
        self.stream = stream or sys.stderr
        self.width = width
        self.runs = 0
        self.work = 0.0
        self.skipped = Counter()
        self.start = time.monotonic()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._logged = -1  # twentieths logged so far, off a terminal

    @property
    def share(self) -> float:
        return self.runs / self.total_runs if self.total_runs else 1.0

    def skip(self, kind: str, work: float = 0.0, planned: bool = True) -> None:
        """A run of `kind` will not run; `planned`: it was counted in the totals."""
        self.skipped[kind] += 1
        if planned:
            self.total_runs -= 1
            self.total_work -= work

    def begin(self, label: str) -> None:
        """A run starts: show it (on a terminal always; in a log once per twentieth)."""
        step = int(20 * self.share)
        if self._tty or step > self._logged:
            self._logged = step
            self._write(self._line(label))

    def finish(self, work: float) -> None:
        self.runs += 1
        self.work += work

    def _line(self, label: str) -> str:
        elapsed = time.monotonic() - self.start
        left = self.total_work - self.work
        eta = elapsed * left / self.work if self.work else 0.0
        filled = int(self.share * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        return (f"[{bar}] {100 * self.share:3.0f}% {self.runs}/{self.total_runs} runs "
                f"{elapsed:5.0f}s (eta {eta:4.0f}s) {label}")

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
