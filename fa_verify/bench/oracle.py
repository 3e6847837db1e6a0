"""`fa_verify bench oracle`: the certified reference against plain float64 numpy attention, and the
certified gradients (`oracle.backward`) against plain float64 numpy gradients."""

from __future__ import annotations

import math
import time

import numpy as np

from fa_verify.bench.timing import best_times
from fa_verify.oracle import reference
from fa_verify.oracle.backward import gradient_reference
from fa_verify.problem import AttentionProblem

#: The targets: certified time <= 1.5x plain float64 (its P.[V | |V|] GEMM alone is 1.5x
#: plain's two GEMMs), bound <= 1e-12 of the row scale.
TARGET_RATIO = 1.5
TARGET_BOUND = 1e-12
#: The backward's target: certified gradients (the certified forward, then S, dP, dV, dQ, dK
#: again with their bound's row and column sums) <= 2x plain float64 gradients (forward and
#: backward, six GEMMs).
TARGET_BACKWARD_RATIO = 2.0
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


def plain_float64_gradients(problem: AttentionProblem, dout: np.ndarray) -> tuple:
    """Unmasked float64 (dq, dk, dv) the obvious way, forward included: the backward's baseline."""
    q = problem.q64()
    k, v = problem.kv64()
    p = np.matmul(q, k.swapaxes(-1, -2)) * problem.scale_value
    p -= p.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1)[..., None]
    delta = (dout * np.matmul(p, v)).sum(axis=-1)
    dv = np.matmul(p.swapaxes(-1, -2), dout)
    ds = np.matmul(dout, v.swapaxes(-1, -2))
    ds -= delta[..., None]
    ds *= p
    return np.matmul(ds, k) * problem.scale_value, np.matmul(ds.swapaxes(-1, -2), q) * problem.scale_value, dv


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
    backward = []
    for n in sizes:
        if progress:
            progress(f"oracle bench: gradients at N={n}, D={head_dim}")
        problem = _problem(n, head_dim, seed)
        dout = np.random.default_rng(seed + 1).standard_normal(problem.out_shape)
        grads = gradient_reference(problem, dout)
        once = best_times({"plain": lambda: plain_float64_gradients(problem, dout)}, 1)["plain"]
        rounds = max(repeats, min(MAX_REPEATS, math.ceil(TIMED_SECONDS / once)))
        times = best_times({"plain": lambda: plain_float64_gradients(problem, dout),
                            "certified": lambda: gradient_reference(problem, dout)}, rounds)
        backward.append({
            "n": n, "head_dim": head_dim, "dtype": "fp16", "repeats": rounds,
            "plain_float64_s": times["plain"], "certified_s": times["certified"],
            "ratio": times["certified"] / times["plain"],
            "max_relative_bound": max(float(bound.max() / np.abs(value).max())
                                      for value, bound in grads.tensors().values()),
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
        "backward": backward,
        "target": {"ratio": TARGET_RATIO, "relative_bound": TARGET_BOUND, "backward_ratio": TARGET_BACKWARD_RATIO},
        "meets_target": (all(r["ratio"] <= TARGET_RATIO and r["max_relative_bound"] <= TARGET_BOUND for r in rows)
                         and all(r["ratio"] <= TARGET_BACKWARD_RATIO for r in backward)),
    }


def format_text(result: dict) -> str:
    lines = [f"{'N':>6} {'D':>4}  {'plain f64':>10}  {'certified':>10}  {'ratio':>6}  "
             f"{'max bound/row scale':>20}  {'best of':>7}"]
    for r in result["sizes"]:
        lines.append(f"{r['n']:>6} {r['head_dim']:>4}  {r['plain_float64_s']:>9.4f}s  "
                     f"{r['certified_s']:>9.4f}s  {r['ratio']:>6.2f}  {r['max_relative_bound']:>20.3e}"
                     f"  {r['repeats']:>7}")
    lines.append("gradients (dq, dk, dv; forward included on both sides; bound relative to the largest |gradient|):")
    for r in result["backward"]:
        lines.append(f"{r['n']:>6} {r['head_dim']:>4}  {r['plain_float64_s']:>9.4f}s  "
                     f"{r['certified_s']:>9.4f}s  {r['ratio']:>6.2f}  {r['max_relative_bound']:>20.3e}"
                     f"  {r['repeats']:>7}")
    mp = result["mpmath"]
    lines.append(f"pure mpmath (50 digits) at N={mp['n']}, D={mp['head_dim']}: {mp['seconds']:.2f}s")
    t = result["target"]
    verdict = "meets" if result["meets_target"] else "MISSES"
    lines.append(f"{verdict} the target: ratio <= {t['ratio']:g}, bound <= {t['relative_bound']:g}; "
                 f"gradients' ratio <= {t['backward_ratio']:g}")
    return "\n".join(lines)
