"""Relations between two problems with the same exact answer, judged within the error model.

  * keys and values permuted together (non-causal): O and LSE unchanged;
  * queries permuted (non-causal): O and LSE rows permuted alike;
  * every key shifted by a vector c: scores of row i move by scale q_i.c, the softmax does not,
    so O is unchanged and LSE moves by exactly scale q_i.c.

Not bitwise: a tiled kernel sums keys in tile order and rescales when the running maximum
grows, so a permutation or a shift legitimately changes its rounding (and a GEMM may round a
row differently at a tile edge). Each output is within its error-model bound B of the exact
answer, so the two may differ by B + B' (each from its own problem: the bound depends on
the key order and the logits). A pass is guarded (`fa_verify.null_model`): where a trivial
output in place of the second run would pass too, the example is uninformative.

Shifted keys must stay exact in the dtype. On a few coordinates d the keys are first put on
a grid g_d (both problems use the grid keys), then shifted by c_d = +-2^(E_d + t), where
2^E_d >= max|k_d| and t >= 2 - p (p significand bits) sets the size of the shift. With
g_d = 2^(E_d + max(t, 0) + 1 - p): |k + c| <= 2^(E_d + max(t, 0) + 1) = 2^p g_d and c is a
multiple of g_d, so k + c is a multiple of g_d that fits p bits — exact.
"""

from __future__ import annotations

import math

import numpy as np

from fa_verify.dtypes import finfo
from fa_verify.error_model import error_bound
from fa_verify.null_model import guard
from fa_verify.oracle import reference
from fa_verify.properties._compare import exceeding
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported
from fa_verify.references import judging

#: Largest |scale q.c| the score shift aims at: beyond exp's fp32 range for a kernel that
#: forgets the max subtraction (e^89 overflows), well inside it for one that does not.
MAX_SHIFT = 128.0


def _relation(name: str, backend, problem, related, what: str, comparisons) -> PropertyResult:
    """Run the two `related` problems and judge `comparisons(runs, precision)`: an iterable of
    (label, got, expected, tolerance, where), LSE entries only when both runs returned one.
    A pass is guarded: would a trivial output in place of the second run pass as well?"""
    reason = unsupported(backend, *related)
    if reason:
        return not_applicable(name, problem, reason)
    runs = [backend.run(p) for p in related]
    has_lse = all(lse is not None for _, lse in runs)
    precision = backend.precision(problem.dtype)

    def mismatches(second):
        """(what breaks the relation, the largest error / tolerance, whether any tolerance is finite)."""
        found, worst, bounded = [], 0.0, False
        for label, got, expected, tol, where in comparisons([runs[0], second], precision):
            if label.startswith("LSE") and not has_lse:
                continue
            mismatch, ratio = exceeding(got, expected, tol, where)
            worst = max(worst, ratio)
            finite = np.isfinite(np.broadcast_to(tol, np.shape(got)))
            bounded |= bool((finite if where is None else finite & where).any())
            if mismatch is not None:
                found.append(mismatch.describe(label))
        return found, worst, bounded

    found, worst, bounded = mismatches(runs[1])
    if found:
        return failed(name, problem, f"{what}: " + "; ".join(found), worst)
    if not bounded:  # nothing was judged: not a pass
        return not_applicable(name, problem, f"{what}: the error model has no finite bound there under "
                                             f"{precision.describe()}, so nothing can be judged")
    judge = judging(related[1])
    nulls = judge.null_outputs(related[1], judge.reference(related[1]), precision)
    null_guard = guard(nulls, lambda null: not mismatches((null.out, null.lse))[0],
                       judged=("out", "lse") if has_lse else ("out",))
    note = "" if has_lse else "no LSE returned: only the output was checked"
    return passed(name, problem, note=note, worst_ratio=worst, guard=null_guard)


def _shown(perm: np.ndarray) -> str:
    return str(perm.tolist()[:16]) + ("..." if perm.size > 16 else "")


def permuted_keys(problem, perm: np.ndarray):
    """`problem` (forward) with its keys and values permuted together by `perm`."""
    return problem.replace(k=problem.k[:, :, perm], v=problem.v[:, :, perm])


def permuted_queries(problem, perm: np.ndarray):
    """`problem` (forward) with its query rows permuted by `perm`."""
    return problem.replace(q=problem.q[:, :, perm])


def check_key_permutation(backend, problem, *, seed: int = 0) -> PropertyResult:
    """Permuting keys and values together (non-causal) leaves O and LSE unchanged."""
    backend = as_backend(backend)
    if problem.causal:
        return not_applicable("key_permutation", problem, "causal masks depend on key positions")
    perm = np.random.default_rng(seed).permutation(problem.nk)
    derived = permuted_keys(problem, perm)

    def comparisons(runs, precision):
        (out, lse), (out_p, lse_p) = runs
        judge = judging(problem)
        ref = judge.reference(problem)  # the exact answer, and so its bounds, do not depend on key order
        bound, bound_p = judge.error_bound(problem, precision, ref), judge.error_bound(derived, precision, ref)
        return [("O", out_p, out, bound.out + bound_p.out, None),
                ("LSE", lse_p, lse, bound.lse + bound_p.lse, None)]

    return _relation("key_permutation", backend, problem, (problem, derived),
                     f"keys and values permuted by {_shown(perm)}", comparisons)


def check_query_permutation(backend, problem, *, seed: int = 0) -> PropertyResult:
    """Permuting the queries (non-causal) permutes the rows of O and LSE alike."""
    backend = as_backend(backend)
    if problem.causal:
        return not_applicable("query_permutation", problem, "causal masks depend on query positions")
    perm = np.random.default_rng(seed).permutation(problem.nq)
    derived = permuted_queries(problem, perm)

    def comparisons(runs, precision):
        (out, lse), (out_p, lse_p) = runs
        judge = judging(problem)
        bound = judge.error_bound(problem, precision, judge.reference(problem))  # row bounds permute with the rows
        return [("O", out_p, out[:, :, perm], 2 * bound.out[:, :, perm], None),
                ("LSE", lse_p, None if lse is None else lse[:, :, perm], 2 * bound.lse[:, :, perm], None)]

    return _relation("query_permutation", backend, problem, (problem, derived),
                     f"queries permuted by {_shown(perm)}", comparisons)


def shifted_keys(problem, rng):
    """(grid problem, shifted problem, shift [B,H,Nq] of the scaled scores, coordinates), or a
    reason string when the keys are too close to the dtype's maximum to shift exactly."""
    info = finfo(problem.dtype)
    p = int(info.nmant) + 1
    k, q = problem.k.astype(np.float64), problem.q64()
    coords = rng.choice(problem.head_dim, size=int(rng.integers(1, min(4, problem.head_dim) + 1)),
                        replace=False)
    # E per (batch, kv head, coordinate): 2^E >= max |k_d|, at least the smallest normal.
    top = np.abs(k[..., coords]).max(axis=2)
    e = np.ceil(np.log2(np.maximum(top, float(info.smallest_normal))))
    signs = rng.choice([-1.0, 1.0], size=e.shape)

    def score_shift(c):  # scale q.c per row, c [B, Hkv, len(coords)]
        c_rows = np.repeat(c, problem.group_size, axis=1)
        return problem.scale_value * np.einsum("bhid,bhd->bhi", q[..., coords], c_rows)

    # c = +-2^(E + t): one t for all, aiming at a largest shift drawn up to MAX_SHIFT, with
    # t >= 2 - p (so c stays a multiple of the grid) and k + c below the dtype's maximum.
    largest = float(np.abs(score_shift(signs * np.exp2(e))).max())
    t = math.floor(math.log2(MAX_SHIFT * rng.uniform(0.05, 1.0) / largest)) if largest > 0 else 0
    t = min(max(t, 2 - p), int(math.floor(math.log2(float(info.max)))) - 1 - int(e.max()))
    if t < 2 - p:
        return "the keys are too close to the dtype's maximum to be shifted exactly"
    grid = np.maximum(np.exp2(e + max(t, 0) + 1 - p), float(info.smallest_subnormal))
    c = signs * np.exp2(e + t)
    grid_k, moved_k = k.copy(), k.copy()
    grid_k[..., coords] = np.round(k[..., coords] / grid[:, :, None]) * grid[:, :, None]
    moved_k[..., coords] = grid_k[..., coords] + c[:, :, None]
    dtype = problem.k.dtype
    return (problem.replace(k=grid_k.astype(dtype)), problem.replace(k=moved_k.astype(dtype)),
            score_shift(c), coords)


def check_score_shift(backend, problem, *, seed: int = 0) -> PropertyResult:
    """Adding a vector c to every key leaves O unchanged and moves LSE by scale q.c exactly."""
    backend = as_backend(backend)
    shifted = shifted_keys(problem, np.random.default_rng(seed))
    if isinstance(shifted, str):
        return not_applicable("score_shift", problem, shifted)
    grid, moved, shift, coords = shifted

    def comparisons(runs, precision):
        (out, lse), (out_s, lse_s) = runs
        bound = error_bound(grid, precision, reference(grid))
        bound_s = error_bound(moved, precision, reference(moved))
        expected = None if lse is None else lse.astype(np.float64) + shift
        # Fully masked rows have no scores to shift (the masked-rows property judges them).
        return [("O", out_s, out, bound.out + bound_s.out, None),
                ("LSE - scale q.c", lse_s, expected,
                 bound.lse + bound_s.lse + 2.0 ** -50 * np.abs(shift), ~grid.masked_rows)]

    return _relation("score_shift", backend, problem, (grid, moved),
                     f"keys shifted on coordinates {sorted(int(d) for d in coords)} (scaled scores "
                     f"moved by up to {float(np.abs(shift).max()):.3g})", comparisons)
