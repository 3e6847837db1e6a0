"""`fa_verify bench oracle`: the certified reference against plain float64 numpy attention."""

from __future__ import annotations

import math
import time

import numpy as np

from fa_verify.bench.timing import best_times
from fa_verify.oracle import reference
from fa_verify.problem import AttentionProblem

#: The targets: certified time <= 1.5x plain float64 (its P.[V | |V|] GEMM alone is 1.5x
#: plain's two GEMMs), bound <= 1e-12 of the row scale.
TARGET_RATIO = 1.5
TARGET_BOUND = 1e-12
#: Fast sizes are timed more often (best of more runs): at least this long per side, so that a
#: busy machine's noise does not decide a ratio of 10 ms runs.
TIMED_SECONDS = 0.5
MAX_REPEATS = 50


def plain_float64_attention(problem: AttentionProblem) -> np.ndarray:
    """Unmasked float64 attention the obvious way: the speed baseline, with no bound."""
    q = problem.q64()
    k, v = problem.kv64()
    s = np.matmul(q, k.swapaxes(-1, -2)) * problem.scale_value
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    return np.matmul(s, v) / s.sum(axis=-1)[..., None]


def _problem(n: int, head_dim: int, seed: int) -> AttentionProblem:
    rng = np.random.default_rng(seed)
    shape = (1, 1, n, head_dim)
    return AttentionProblem.from_float(*(rng.standard_normal(shape) for _ in range(3)), "fp16",
                                       tags=(("distribution", "normal"), ("seed", seed)))


def run(sizes=(1024, 4096), head_dim: int = 128, repeats: int = 5, mpmath_n: int = 64,
        seed: int = 0, progress=None) -> dict:
    """Time both paths per size; report ratios, the largest certified bound, and mpmath's time."""
    rows = []
    for n in sizes:
        if progress:
            progress(f"oracle bench: N={n}, D={head_dim}")
        problem = _problem(n, head_dim, seed)
        ref = reference(problem)
        once = best_times({"plain": lambda: plain_float64_attention(problem)}, 1)["plain"]
        rounds = max(repeats, min(MAX_REPEATS, math.ceil(TIMED_SECONDS / once)))
        times = best_times({"plain": lambda: plain_float64_attention(problem),
                            "certified": lambda: reference(problem)}, rounds)
        rows.append({
            "n": n, "head_dim": head_dim, "dtype": "fp16",
            "plain_float64_s": times["plain"], "certified_s": times["certified"], "repeats": rounds,
            "ratio": times["certified"] / times["plain"],
            "max_relative_bound": ref.relative_bound, "mpmath_rows": ref.mpmath_rows,
        })
    if progress:
        progress(f"oracle bench: pure mpmath at N={mpmath_n}")
    small = _problem(mpmath_n, head_dim, seed)
    start = time.perf_counter()
    reference(small, method="mpmath")
    mpmath_s = time.perf_counter() - start
    return {
        "benchmark": "oracle",
        "sizes": rows,
        "mpmath": {"n": mpmath_n, "head_dim": head_dim, "seconds": mpmath_s},
        "target": {"ratio": TARGET_RATIO, "relative_bound": TARGET_BOUND},
        "meets_target": all(r["ratio"] <= TARGET_RATIO and r["max_relative_bound"] <= TARGET_BOUND
                            for r in rows),
    }


def format_text(result: dict) -> str:
    lines = [f"{'N':>6} {'D':>4}  {'plain f64':>10}  {'certified':>10}  {'ratio':>6}  "
             f"{'max bound/row scale':>20}  {'best of':>7}"]
    for r in result["sizes"]:
        lines.append(f"{r['n']:>6} {r['head_dim']:>4}  {r['plain_float64_s']:>9.4f}s  "
                     f"{r['certified_s']:>9.4f}s  {r['ratio']:>6.2f}  {r['max_relative_bound']:>20.3e}"
                     f"  {r['repeats']:>7}")
    mp = result["mpmath"]
    lines.append(f"pure mpmath (50 digits) at N={mp['n']}, D={mp['head_dim']}: {mp['seconds']:.2f}s")
    t = result["target"]
    verdict = "meets" if result["meets_target"] else "MISSES"
    lines.append(f"{verdict} the target: ratio <= {t['ratio']:g}, bound <= {t['relative_bound']:g}")
    return "\n".join(lines)
