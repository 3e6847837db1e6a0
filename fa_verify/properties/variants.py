"""Properties of the variants (sliding window, softcap, ALiBi, sinks; fa_verify.problem).

  * variant_agreement: a problem with variants agrees with the oracle (output and LSE) under
    the error model, as oracle_agreement and lse_agreement judge dense ones;
  * wide_window: a window wider than the sequence (left >= Nk, right >= Nq + Nk) is no window;
  * softcap_limit: a softcap far above every |score| (tanh(x) = x to 1e-12 there) is no softcap,
    within the error model of the declared precision, tanh's accuracy included (an "absolute"
    tanh errs by ~c u_fp32: large caps get large tolerances, or none, and then the check does
    not apply);
  * feature_sensitivity: switching each variant of the problem off moves the output as it
    moves the reference; a variant that the target takes and silently ignores shows here
    with a message that says so;
  * window_independence: changing keys and values outside the windows of some rows (before
    their left edge or past their right edge) leaves those rows bitwise unchanged.

The pairs compare two runs of the target: |out_a - out_b - (ref_a - ref_b)| <= bound_a + bound_b
(each run within its error-model bound of its reference; rows without keys on either side
count exactly). Elements that are NaN or infinite in either run are left to variant_agreement's
"finite" rule (a 16-bit accumulator may overflow legitimately on extreme inputs) and counted
in the note.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fa_verify.dtypes import finfo
from fa_verify.error_model import error_bound
from fa_verify.oracle import reference
from fa_verify.problem import NO_WINDOW
from fa_verify.properties._compare import errors
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported
from fa_verify.properties.agreement import check_lse_agreement, check_oracle_agreement
from fa_verify.properties.independence import fresh_values, judge_identical

#: softcap_limit's cap, in units of the largest |score|: tanh(x) = x (1 - x^2 / 3 ...) moves a
#: logit by at most |s|^3 / (3 c^2), 3e-7 |s| here (and the references carry even that).
_SOFTCAP_HEADROOM = 1e3
#: ... but at most this share of the score dtype's largest value (a 16-bit score stage holds it).
_SOFTCAP_ROOM = 1 / 16


def _off(problem, feature):
    """The problem with `feature` switched off."""
    return problem.replace(**{"window": dict(window_size=NO_WINDOW), "softcap": dict(softcap=0.0),
                              "alibi": dict(alibi_slopes=None), "sinks": dict(sinks=None)}[feature])


def _relative(x, tolerance):
    """x / tolerance, 0 where x is 0 (rows without keys: no tolerance and nothing moved)."""
    return np.where(x == 0, 0.0, x / tolerance)


def _pair_mismatch(backend, first, second):
    """(out_a - out_b against ref_a - ref_b within bound_a + bound_b: None or a message, the worst
    ratio, the largest |ref_a - ref_b| / tolerance, the largest |out_a - out_b| / tolerance, a
    note, whether any element has a finite tolerance)."""
    precision = backend.precision(first.dtype)
    runs = []
    for problem in (first, second):
        out, _ = backend.run(problem)
        ref = reference(problem)
        runs.append((out.astype(np.float64), ref, error_bound(problem, precision, ref).out))
    (out_a, ref_a, bound_a), (out_b, ref_b, bound_b) = runs
    tolerance = bound_a + bound_b
    with np.errstate(invalid="ignore", over="ignore"):
        moved = out_a - out_b
        want = ref_a.out - ref_b.out
        err = errors(moved, want)
        finite = np.isfinite(out_a) & np.isfinite(out_b)
        ratio = np.where(finite, _relative(err, tolerance), 0.0)
        reference_moves = float(np.max(_relative(np.abs(want), tolerance), initial=0.0))
        target_moves = float(np.max(np.where(finite, _relative(np.abs(moved), tolerance), 0.0), initial=0.0))
    note = "" if finite.all() else f"{int((~finite).sum())} non-finite elements left to variant_agreement"
    bounded = bool(np.isfinite(tolerance).any())
    worst_index = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    worst = float(ratio[worst_index])
    if not worst <= 1:
        index = [int(i) for i in worst_index]
        message = (f"at {index}: the output moved by {moved[worst_index]:.6g} where the reference moves by "
                   f"{want[worst_index]:.6g} (difference {err[worst_index]:.3g} = {worst:.3g} x the two runs' "
                   f"error bounds {tolerance[worst_index]:.3g})")
        return message, worst, reference_moves, target_moves, note, bounded
    return None, worst, reference_moves, target_moves, note, bounded


def check_variant_agreement(backend, problem) -> PropertyResult:
    """A problem with variants agrees with the oracle: output, and LSE where the target returns one."""
    backend = as_backend(backend)
    if not problem.features:
        return not_applicable("variant_agreement", problem, "the problem uses no variant")
    results = [check_oracle_agreement(backend, problem), check_lse_agreement(backend, problem)]
    verdicts = tuple(v for r in results for v in r.verdicts)
    bad = [r for r in results if r.failed]
    if bad:
        return failed("variant_agreement", problem, "; ".join(f"{r.name}: {r.detail}" for r in bad),
                      bad[0].worst_ratio, verdicts)
    notes = [r.note or r.detail for r in results if r.note or not r.applicable]
    worst = max((r.worst_ratio for r in results if r.worst_ratio is not None), default=None)
    # the output's result decides pass or uninformative (a trivial output passing too)
    return dataclasses.replace(results[0], name="variant_agreement", note="; ".join(notes), worst_ratio=worst,
                               verdicts=verdicts)


def check_wide_window(backend, problem) -> PropertyResult:
    """A window wider than the sequence (left >= Nk, right >= Nq + Nk) gives what no window gives."""
    backend = as_backend(backend)
    wide = problem.nq + problem.nk
    windowed = problem.replace(window_size=(wide, wide))
    plain = problem.replace(window_size=NO_WINDOW)
    reason = unsupported(backend, windowed, plain)
    if reason:
        return not_applicable("wide_window", problem, reason)
    message, worst, _, _, note, _ = _pair_mismatch(backend, windowed, plain)
    if message:
        return failed("wide_window", problem, f"window_size={windowed.window_size} against no window: {message}",
                      worst)
    return passed("wide_window", problem, note=note, worst_ratio=worst)


def check_softcap_limit(backend, problem) -> PropertyResult:
    """A softcap far above every |score| gives what no softcap gives, within the error model."""
    backend = as_backend(backend)
    largest = problem.scale_value * float(np.max(np.linalg.norm(problem.q64(), axis=-1))) \
        * float(np.max(np.linalg.norm(problem.k.astype(np.float64), axis=-1)))
    room = float(finfo(backend.precision(problem.dtype).score_accumulation).max) * _SOFTCAP_ROOM
    cap = float(np.float32(min(_SOFTCAP_HEADROOM * max(largest, 1.0), room)))
    if cap < 0.1 * _SOFTCAP_HEADROOM * largest:
        return not_applicable("softcap_limit", problem, f"scores up to {largest:.3g}: no cap far above them fits "
                              "the score dtype")
    capped, plain = problem.replace(softcap=cap), problem.replace(softcap=0.0)
    reason = unsupported(backend, capped, plain)
    if reason:
        return not_applicable("softcap_limit", problem, reason)
    message, worst, _, _, note, bounded = _pair_mismatch(backend, capped, plain)
    if not bounded:  # a declared tanh (absolute: c u errors) can leave the error model's first-order range
        return not_applicable("softcap_limit", problem, f"softcap={cap:.6g}: the precision model "
                              f"({backend.precision(problem.dtype).describe()}) gives no finite error bound there")
    if message:
        return failed("softcap_limit", problem, f"softcap={cap:.6g} (far above every |score| <= {largest:.3g}) "
                      f"against no softcap: {message}", worst)
    return passed("softcap_limit", problem, note=note, worst_ratio=worst)


def check_feature_sensitivity(backend, problem) -> PropertyResult:
    """Switching each variant of the problem off moves the output as it moves the reference."""
    backend = as_backend(backend)
    if not problem.features:
        return not_applicable("feature_sensitivity", problem, "the problem uses no variant")
    found, notes, worst_all = [], [], 0.0
    for feature in problem.features:
        off = _off(problem, feature)
        reason = unsupported(backend, off)
        if reason:
            notes.append(f"{feature}: {reason}")
            continue
        message, worst, reference_moves, target_moves, note, _ = _pair_mismatch(backend, problem, off)
        worst_all = max(worst_all, worst)
        if note:
            notes.append(f"{feature}: {note}")
        if message is None:
            if reference_moves <= 1:
                notes.append(f"{feature} moves the reference by at most {reference_moves:.2g} x the error bounds "
                             "here: not informative for it")
            continue
        ignored = " (the output did not move beyond the error bounds: the variant looks ignored)" \
            if target_moves <= 1 < reference_moves else ""
        found.append(f"switching {feature} off{ignored}: {message}")
    if found:
        return failed("feature_sensitivity", problem, "; ".join(found), worst_all)
    return passed("feature_sensitivity", problem, note="; ".join(notes), worst_ratio=worst_all)


def check_window_independence(backend, problem, *, seed: int = 0) -> PropertyResult:
    """Changing keys and values outside some rows' windows leaves those rows bitwise unchanged."""
    backend = as_backend(backend)
    start, limit = problem.key_start(), problem.key_limit()
    live = limit > start
    # Cuts j0 with rows wholly on one side: keys < j0 before rows starting at >= j0, or keys
    # >= j0 past rows ending at <= j0. Cuts at a row's own edge catch an edge off by one.
    before = sorted({int(s) for s in start[live] if s > 0})
    after = sorted({int(x) for x in limit[live] if x < problem.nk})
    if not before and not after:
        return not_applicable("window_independence", problem, "every row with a key sees key 0 and key Nk - 1")
    rng = np.random.default_rng(seed)
    side = rng.choice([s for s, cuts in (("before", before), ("after", after)) if cuts])
    j0 = int(rng.choice(before if side == "before" else after))
    keys = np.arange(problem.nk)
    changed = (keys < j0 if side == "before" else keys >= j0)[None, None, :, None]
    rows = (start >= j0) if side == "before" else (limit <= j0)
    rows = np.broadcast_to(rows & live, problem.out_shape[:3])
    # Large new keys: a kernel that lets masked scores into its running max shows it.
    derived = problem.replace(k=fresh_values(rng, problem.k, changed, magnitude=8.0),
                              v=fresh_values(rng, problem.v, changed))
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable("window_independence", problem, reason)
    what = (f"changing keys/values {'0..' + str(j0 - 1) if side == 'before' else f'{j0}..{problem.nk - 1}'} "
            f"changed rows whose window {'starts at' if side == 'before' else 'ends before'} key {j0} "
            f"{'or later' if side == 'before' else 'or earlier'}")
    return judge_identical("window_independence", what, problem, backend.run(problem), backend.run(derived), rows)
