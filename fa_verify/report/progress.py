"""A one-line progress bar on stderr: redrawn in place on a terminal, a line now and then in a log.

Progress is counted in work (B·H·Nq·Nk·D per run), not in runs: a sweep's runs differ in cost
by orders of magnitude, and the remaining time follows the work.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_work: float, stream=None, width: int = 28):
        self.total = max(float(total_work), 1.0)
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0.0
        self.runs = 0
        self.start = time.monotonic()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._logged = 0  # twentieths logged so far, off a terminal

    def advance(self, label: str, work: float) -> None:
        self.runs += 1
        self.done = min(self.done + work, self.total)
        # In a CI log, twenty lines are enough to see it move and not so many as to drown it.
        step = int(20 * self.done / self.total)
        if self._tty or step > self._logged:
            self._logged = step
            self._draw(label)

    def _draw(self, label: str) -> None:
        share = self.done / self.total
        elapsed = time.monotonic() - self.start
        eta = elapsed / share - elapsed if share else 0.0
        filled = int(share * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        line = (f"[{bar}] {100 * share:3.0f}% {self.runs} runs {elapsed:5.0f}s "
                f"(eta {eta:4.0f}s) {label}")
        if self._tty:
            self.stream.write("\r\033[K" + line[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
