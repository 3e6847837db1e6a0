"""Interleaved best-of-N timing, so that machine noise hits both sides of a ratio alike."""

from __future__ import annotations

import time


def best_times(functions: dict, repeats: int) -> dict:
    """Run each function `repeats` times, round-robin; return the best wall time of each."""
    best = {name: float("inf") for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
