"""Properties of FP8 attention (the kind "fp8": `fa_verify.fp8.FP8Problem`; and "paged-fp8", a
paged batch of FP8 sequences: an FP8 KV cache, `fa_verify.ragged`).

* fp8_agreement: out (and the LSE, if returned) within the target's FP8 error model
  (`fp8_error_model.fp8_error_bound`) of the certified reference of the true inputs, and out
  within the honest FP8 ensemble's allowance (`fp8_ensemble`: K x its largest error + floor);
  a paged batch part by part (each sequence is an FP8 problem), reporting the sequence.
* kv_scale_sensitivity (paged-fp8): the cache's k_scale or v_scale multiplied by a factor that
  is no power of two (the whole per-tensor [1] scale, or one (sequence, kv head) of a [B, Hkv]
  one): each sequence's outputs move as its reference's do (agreement on the changed batch, and
  a change wherever the reference's exceeds both bounds), and where one entry changed, every
  other sequence and kv head stays bitwise the same. Catches a cache's scales ignored, swapped
  or read for the wrong sequence.
* descale_sensitivity: one descale (q's, k's or v's) of one (batch, kv head) multiplied by a
  factor that is no power of two: the outputs of every other group stay bitwise the same, and
  the group's outputs move as the reference's do (agreement on the changed problem, and a change
  wherever the reference's exceeds both bounds). Catches descales dropped, swapped (v reading
  k's), applied twice, or read at the wrong granularity (one for all heads, q's by query head).
  Per-tensor descales ([1]) are given as [B, Hkv] here: the same values, then one changed.
* descale_rescaling: the same true inputs stored differently, x 2^-e re-encoded with d 2^e
  (only where every value stays exactly representable), give bitwise the same outputs: a
  kernel that applies a descale where it should not, or not where it should, cannot.
* saturation_finite: stored values at the format's largest finite value (448 for e4m3) in q, k
  and v, with the problem's descales: a finite true result, so no NaN or infinity may come back,
  and the output agrees with the reference.
* fp8_head_independence: the stored values and descales of every other (batch, kv head) changed
  leave one group's outputs bitwise the same.
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import finfo, round_to
from fa_verify.fp8 import DESCALES
from fa_verify.fp8_ensemble import ensemble_allowance, normalised_error
from fa_verify.fp8_error_model import fp8_error_bound
from fa_verify.oracle.fp8 import reference_fp8
from fa_verify.properties._compare import differing, exceeding
from fa_verify.properties._result import failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported
from fa_verify.verdict import DEFAULT_ENSEMBLE_FACTOR

#: Factors a changed descale is multiplied by: never powers of two, up and down.
SENSITIVITY_FACTORS = (1.37, 0.61, 2.9, 0.23)
#: The powers of two e of the rescaling relation (x 2^-e, d 2^e), both directions.
RESCALING_EXPONENTS = (1, 2, 3, -1, -2)


def _judged(backend, problem):
    """(the certified reference, the bound of the target's precision model) of `problem`."""
    ref = reference_fp8(problem)
    return ref, fp8_error_bound(problem, backend.precision(problem.dtype), ref)


def _agreement(name: str, problem, result, ref, bound, allowance=None):
    """(failed, saying what exceeds its bound (or the FP8 ensemble's allowance) and where, or
    None; the largest error / bound). allowance: `ensemble_allowance(problem, bound.precision,
    ref)` when the caller has it already (the FP8 judging table judges one case many times)."""
    out, lse = result
    mismatch, worst = exceeding(out, ref.out, bound.out)
    if mismatch is not None:
        term = bound.dominant_out_term(mismatch.index)
        return failed(name, problem, f"{mismatch.describe('out')} (largest term: {term}; precision "
                                     f"{bound.precision.describe()})", worst_ratio=worst), worst
    allowance, member, honest = allowance or ensemble_allowance(problem, bound.precision, ref)
    error = normalised_error(out, ref)
    if error > allowance:
        return failed(name, problem, f"out: normalised error {error:.3g} > {DEFAULT_ENSEMBLE_FACTOR:g} x the honest "
                                     f"FP8 ensemble's {honest:.3g} ({member!r}) + floor = {allowance:.3g} (rule "
                                     "'ensemble'; fa_verify.fp8_ensemble)", worst_ratio=worst), worst
    if lse is not None:
        mismatch, lse_worst = exceeding(lse, ref.lse, bound.lse)
        worst = max(worst, lse_worst)
        if mismatch is not None:
            return failed(name, problem, mismatch.describe("lse"), worst_ratio=worst), worst
    return None, worst


def _in_part(problem, index: int) -> str:
    """How a message about part `index` begins ("" for a problem of one part)."""
    label = problem.part_label(index)
    return f"{label}: " if label else ""


def check_fp8_agreement(backend, problem):
    """out (and LSE) agree with the certified reference of the true inputs within the FP8 error model."""
    name = "fp8_agreement"
    backend = as_backend(backend)
    worst = 0.0
    for i, (part, result) in enumerate(zip(problem.parts(), problem.split(*backend.run(problem)))):
        failure, part_worst = _agreement(name, part, result, *_judged(backend, part))
        worst = max(worst, part_worst)
        if failure:
            return failed(name, problem, _in_part(problem, i) + failure.detail, worst_ratio=worst,
                          part=i if len(problem.parts()) > 1 else None)
    return passed(name, problem, worst_ratio=worst)


def _group_rows(problem, b: int, kv_head: int) -> np.ndarray:
    """Boolean [B, H, Nq]: the rows of the query heads of (batch b, kv head kv_head)."""
    rows = np.zeros(problem.lse_shape, bool)
    G = problem.group_size
    rows[b, kv_head * G:(kv_head + 1) * G] = True
    return rows


def _identical_elsewhere(name: str, problem, first, second, rows, why: str):
    """Failed where an output outside `rows` differs between two runs, else None."""
    for what, x, y, where in (("out", first[0], second[0], ~rows[..., None]), ("lse", first[1], second[1], ~rows)):
        if x is None or y is None:
            continue
        mismatch = differing(y, x, where)
        if mismatch is not None:
            return failed(name, problem, f"{why}: {mismatch.describe(what)}")
    return None


def _per_group(problem):
    """The problem with every descale given as [B, Hkv] (the same values)."""
    return problem.replace(**{n: problem.descale(n).astype(np.float32) for n in DESCALES})


def check_descale_sensitivity(backend, problem, *, seed: int = 0):
    """Changing one descale of one (batch, kv head) changes exactly that group's outputs, as the reference's."""
    name = "descale_sensitivity"
    backend = as_backend(backend)
    rng = np.random.default_rng(seed)
    base = _per_group(problem)
    b, kv_head = int(rng.integers(problem.batch)), int(rng.integers(problem.kv_heads))
    which, factor = DESCALES[int(rng.integers(3))], SENSITIVITY_FACTORS[int(rng.integers(4))]
    changed = getattr(base, which).copy()
    changed[b, kv_head] = np.float32(changed[b, kv_head] * factor)
    derived = base.replace(**{which: changed})
    reason = unsupported(backend, base, derived)
    if reason:
        return not_applicable(name, problem, reason)
    first, second = backend.run(base), backend.run(derived)
    what = f"{which}[{b}, {kv_head}] x {factor}"
    failure = _identical_elsewhere(name, problem, first, second, _group_rows(problem, b, kv_head),
                                   f"changing {what} changed another (batch, kv head)'s output")
    if failure:
        return failure
    (ref, bound), (ref_after, bound_after) = _judged(backend, base), _judged(backend, derived)
    failure, worst = _agreement(name, derived, second, ref_after, bound_after)
    if failure:
        return failed(name, problem, f"after {what}: {failure.detail}", worst_ratio=worst)
    # where the reference moved by more than both bounds, a target that stood still is wrong
    still = (np.abs(ref_after.out - ref.out) > bound.out + bound_after.out) & (first[0] == second[0])
    if still.any():
        index = tuple(int(i) for i in np.argwhere(still)[0])
        return failed(name, problem, f"changing {what} moved the reference's out at {list(index)} from "
                                     f"{ref.out[index]:.6g} to {ref_after.out[index]:.6g}, but not the target's")
    return passed(name, problem, worst_ratio=worst)


def _rescaled(problem, which: str, e: int):
    """The problem with tensor `which` stored as x 2^-e and its descale d 2^e, or None where a
    value would not stay exactly representable (or a descale would leave float32's normal range)."""
    x = getattr(problem, which)
    moved = x.astype(np.float64) * 2.0 ** -e
    stored = round_to(moved, problem.dtype)
    descale = getattr(problem, which + "_descale").astype(np.float64) * 2.0 ** e
    if not np.array_equal(stored.astype(np.float64), moved) or not (
            np.all(descale < float(finfo("fp32").max)) and np.all(descale >= float(finfo("fp32").smallest_normal))):
        return None
    return problem.replace(**{which: stored, which + "_descale": descale.astype(np.float32)})


def check_descale_rescaling(backend, problem, *, seed: int = 0):
    """(x, d) and (x 2^-e re-encoded, d 2^e) give bitwise the same out and LSE."""
    name = "descale_rescaling"
    backend = as_backend(backend)
    rng = np.random.default_rng(seed)
    for _ in range(8):
        which = "qkv"[int(rng.integers(3))]
        e = RESCALING_EXPONENTS[int(rng.integers(len(RESCALING_EXPONENTS)))]
        derived = _rescaled(problem, which, e)
        if derived is not None:
            break
    else:
        return not_applicable(name, problem, "no power-of-two rescaling keeps every stored value exact")
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable(name, problem, reason)
    failure = _identical_elsewhere(name, problem, backend.run(problem), backend.run(derived),
                                   np.zeros(problem.lse_shape, bool),
                                   f"{which} stored x 2^{-e} with {which}_descale x 2^{e} (the same true values) "
                                   "changed the output")
    return failure or passed(name, problem)


def _saturated(problem, rng):
    """The problem with a quarter of v's stored values, and q's and k's beyond half the format's
    largest finite value, set to +-that value (448 in e4m3): the logits keep their spread."""
    top = float(finfo(problem.dtype).max)

    def saturate(x, pick):
        values = x.astype(np.float64)
        return round_to(np.where(pick, np.where(values < 0, -top, top), values), problem.dtype)

    q, k = (saturate(x, np.abs(x.astype(np.float64)) >= top / 2) for x in (problem.q, problem.k))
    return problem.replace(q=q, k=k, v=saturate(problem.v, rng.random(problem.v.shape) < 0.25))


def check_saturation_finite(backend, problem, *, seed: int = 0):
    """Stored values at the format's largest finite value give finite outputs that agree with the reference."""
    name = "saturation_finite"
    backend = as_backend(backend)
    derived = _saturated(problem, np.random.default_rng(seed))
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable(name, problem, reason)
    result = backend.run(derived)  # a NaN or infinity fails through `backends.watch`
    failure, worst = _agreement(name, derived, result, *_judged(backend, derived))
    return failure or passed(name, problem, worst_ratio=worst)


def check_fp8_head_independence(backend, problem, *, seed: int = 0):
    """One (batch, kv head)'s outputs ignore every other group's stored values and descales."""
    name = "fp8_head_independence"
    backend = as_backend(backend)
    if problem.batch * problem.kv_heads == 1:
        return not_applicable(name, problem, "B = Hkv = 1: no other (batch, kv head)")
    rng = np.random.default_rng(seed)
    base = _per_group(problem)
    b, kv_head = int(rng.integers(problem.batch)), int(rng.integers(problem.kv_heads))
    rows = _group_rows(problem, b, kv_head)
    kv_rows = np.zeros((problem.batch, problem.kv_heads), bool)
    kv_rows[b, kv_head] = True

    def other(x, keep):  # the kept group's values, the others' permuted along their last axis
        return np.where(keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim)), x, rng.permutation(x, axis=-1))

    derived = base.replace(q=other(base.q, rows[..., 0]), k=other(base.k, kv_rows), v=other(base.v, kv_rows),
                           **{n: np.where(kv_rows, getattr(base, n), getattr(base, n) * np.float32(1.5))
                              .astype(np.float32) for n in DESCALES})
    reason = unsupported(backend, base, derived)
    if reason:
        return not_applicable(name, problem, reason)
    failure = _identical_elsewhere(name, problem, backend.run(base), backend.run(derived), ~rows,
                                   f"changing every other (batch, kv head)'s inputs changed batch {b}, kv head {kv_head}")
    return failure or passed(name, problem)


#: The scales of an FP8 KV cache that kv_scale_sensitivity changes (the paged protocol's names).
KV_SCALES = ("k_scale", "v_scale")


def check_kv_scale_sensitivity(backend, problem, *, seed: int = 0):
    """Changing an FP8 KV cache's k_scale or v_scale moves each sequence's outputs as its reference's, and no other's."""
    name = "kv_scale_sensitivity"
    backend = as_backend(backend)
    rng = np.random.default_rng(seed)
    keyword, factor = KV_SCALES[int(rng.integers(2))], SENSITIVITY_FACTORS[int(rng.integers(4))]
    changed = problem.scales()[keyword].copy()
    b = kv_head = None
    if changed.shape == (1,):
        changed *= np.float32(factor)
        what = f"{keyword} x {factor}"
    else:
        b, kv_head = int(rng.integers(problem.batch)), int(rng.integers(problem.kv_heads))
        changed[b, kv_head] = np.float32(changed[b, kv_head] * factor)
        what = f"{keyword}[{b}, {kv_head}] x {factor}"
    derived = problem.with_scales(**{keyword: changed})
    reason = unsupported(backend, problem, derived)
    if reason:
        return not_applicable(name, problem, reason)
    before, after = problem.split(*backend.run(problem)), derived.split(*backend.run(derived))
    worst = 0.0
    for i, (part, part_after) in enumerate(zip(problem.parts(), derived.parts())):
        if b is not None:  # one entry changed: everything outside its (sequence, kv head) stays
            rows = _group_rows(part, 0, kv_head) if i == b else np.zeros(part.lse_shape, bool)
            failure = _identical_elsewhere(name, part, before[i], after[i], rows,
                                           f"changing {what} changed another (sequence, kv head)'s output")
            if failure:
                return failed(name, problem, _in_part(problem, i) + failure.detail, part=i)
            if i != b:
                continue
        (ref, bound), (ref_after, bound_after) = _judged(backend, part), _judged(backend, part_after)
        failure, part_worst = _agreement(name, part_after, after[i], ref_after, bound_after)
        worst = max(worst, part_worst)
        if failure:
            return failed(name, problem, f"after {what}: {_in_part(problem, i)}{failure.detail}", worst_ratio=worst,
                          part=i)
        # where the reference moved by more than both bounds, a target that stood still is wrong
        still = (np.abs(ref_after.out - ref.out) > bound.out + bound_after.out) & (before[i][0] == after[i][0])
        if still.any():
            index = tuple(int(x) for x in np.argwhere(still)[0])
            return failed(name, problem, f"{_in_part(problem, i)}changing {what} moved the reference's out at "
                                         f"{list(index)} from {ref.out[index]:.6g} to {ref_after.out[index]:.6g}, "
                                         "but not the target's", part=i)
    return passed(name, problem, worst_ratio=worst)
