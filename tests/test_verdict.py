"""Verdicts on real outputs: correct kernels pass, seeded bugs fail and the message names the
rule; shape, finite, masked-row and ensemble rules; message and record formats."""

import json
import re
from functools import lru_cache

import numpy as np
import pytest
from implementations import torch_math_public

from fa_verify import AttentionMismatch, AttentionProblem, InvalidArgumentError, PrecisionModel
from fa_verify.backends import naive_attention, tiled_attention
from fa_verify.dtypes import numpy_dtype, round_to
from fa_verify.error_model import error_bound
from fa_verify.oracle import reference
from fa_verify.verdict import (
    DEFAULT_ENSEMBLE_FACTOR,
    FLOOR_ROUNDINGS,
    RULES,
    Verdict,
    assert_attention_close,
    check_attention,
)

DTYPES = ("fp16", "bf16", "fp32")


def _inputs(kind, rng, shape_q, shape_kv):
    if kind == "normal":
        return rng.standard_normal(shape_q), rng.standard_normal(shape_kv), rng.standard_normal(shape_kv)
    if kind == "fa3_outliers":  # N(0,1) + N(0,100) * Bernoulli(0.001)
        def draw(s):
            return rng.standard_normal(s) + rng.normal(0, 10, s) * (rng.random(s) < 1e-3)
        return draw(shape_q), draw(shape_kv), draw(shape_kv)
    if kind == "large_logits":
        return 4 * rng.standard_normal(shape_q), 4 * rng.standard_normal(shape_kv), rng.standard_normal(shape_kv)
    raise ValueError(kind)


@lru_cache(maxsize=None)
def _case(kind, dtype, causal, n=128, heads=2, seed=0):
    rng = np.random.default_rng(seed)
    problem = AttentionProblem.from_float(*_inputs(kind, rng, (1, heads, n, 64), (1, heads, n, 64)),
                                          dtype, causal=causal)
    return problem, reference(problem)


# --- a FlashAttention-2 model with seeded bugs (mutants) ---------------------------------------

def _fa2(problem, bug=None, block=64):
    """FA2's forward pass in numpy (fp32 state, P stored in the input dtype), with one bug."""
    f32 = np.float32
    store = numpy_dtype(problem.dtype)
    q = problem.q.astype(f32)
    k, v = (np.repeat(x.astype(f32), problem.group_size, axis=1) for x in (problem.k, problem.v))
    scale = f32(problem.scale_value * (1.03 if bug == "scale_3pct" else 1.0))
    limit = problem.key_limit()
    if bug == "mask_sees_next_key":
        limit = np.minimum(limit + 1, problem.nk)
    if bug == "mask_misses_diagonal":
        limit = limit - 1
    if bug == "drop_last_key":
        limit = np.minimum(limit, problem.nk - 1)
    # fp16 accumulator: rounded after every 16-key mma step (bf16 for bf16 inputs)
    acc_dtype = (np.float16 if problem.dtype != "bf16" else store) if bug == "lowp_accumulator" else f32
    m = np.full(q.shape[:-1], -np.inf, f32)
    l = np.zeros(q.shape[:-1], f32)
    acc = np.zeros(q.shape, f32)
    for k0 in range(0, problem.nk, block):
        s = (q @ np.swapaxes(k[..., k0:k0 + block, :], -1, -2)) * scale
        s = np.where(np.arange(k0, k0 + s.shape[-1]) < limit[:, None], s, f32(-np.inf))
        m_new = np.maximum(m, s.max(axis=-1))
        shift = np.where(m_new == -np.inf, f32(0), m_new)
        alpha = np.exp(m - shift)
        p = np.exp(s - shift[..., None])
        l = alpha * l + p.sum(axis=-1, dtype=f32)
        pv = p.astype(store).astype(f32)
        if bug != "no_rescale":
            acc = alpha[..., None] * acc
        if bug == "lowp_accumulator":
            for j in range(0, pv.shape[-1], 16):
                acc = (acc + pv[..., j:j + 16] @ v[..., k0 + j:k0 + j + 16, :]).astype(acc_dtype).astype(f32)
        else:
            acc = acc + pv @ v[..., k0:k0 + block, :]
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        if bug == "masked_rows_nan":
            out = acc / l[..., None]
        else:
            out = acc / np.where(l > 0, l, f32(1))[..., None]
        lse = np.where(l > 0, m + (np.log2(l) if bug == "lse_log2" else np.log(l)), f32(-np.inf))
    return out.astype(store), lse.astype(f32)


def _torch_flash(problem):
    pytest.importorskip("torch")
    from fa_verify.backends import TorchSdpaBackend
    return TorchSdpaBackend("flash-cpu").run(problem)


def _torch_math(problem):
    return torch_math_public(problem)


# --- correct kernels pass --------------------------------------------------------------------

CORRECT = {
    "torch-flash-cpu": _torch_flash,
    "torch-math": _torch_math,
    "numpy-fa2": lambda p: tiled_attention(p, PrecisionModel.flash(p.dtype)),
    "fa2-mutant-harness-without-bug": _fa2,
    "float64-rounded": lambda p: (round_to(reference(p).out, p.dtype), None),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["normal", "fa3_outliers", "large_logits"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_kernels_pass_with_margin(name, dtype, kind, causal, record_property):
    problem, ref = _case(kind, dtype, causal)
    out, lse = CORRECT[name](problem)
    verdict = assert_attention_close(out, problem, lse=lse, reference=ref)
    record_property("bound_ratio", verdict.bound_ratio)
    record_property("ensemble_ratio", verdict.ensemble_ratio)
    assert verdict.passed and verdict.rule is None
    assert verdict.bound_ratio <= 0.75, verdict.message()
    assert verdict.ensemble_ratio <= 0.5, verdict.message()
    assert verdict.lse_bound_ratio is None or verdict.lse_bound_ratio <= 0.75


# --- seeded bugs fail, naming the rule ---------------------------------------------------------

BUGS = {
    # bug: (rule it must break, inputs where it shows)
    "scale_3pct": ("error_bound", ("normal", "fa3_outliers", "large_logits")),
    "no_rescale": ("error_bound", ("normal", "fa3_outliers", "large_logits")),
    "lse_log2": ("lse_bound", ("normal", "fa3_outliers", "large_logits")),
}


@pytest.mark.parametrize("kind", ["normal", "fa3_outliers", "large_logits"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bug", list(BUGS))
def test_seeded_bugs_fail(bug, dtype, kind, record_property):
    rule, kinds = BUGS[bug]
    problem, ref = _case(kind, dtype, True)
    out, lse = _fa2(problem, bug)
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    record_property("bound_ratio", verdict.bound_ratio)
    assert not verdict.passed and verdict.rule == rule, verdict.message()
    assert f"failed rule {rule!r}" in verdict.message()
    with pytest.raises(AttentionMismatch) as info:
        assert_attention_close(out, problem, lse=lse, reference=ref)
    assert info.value.verdict.rule == rule


@pytest.mark.parametrize("kind", ["normal", "fa3_outliers", "large_logits"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bug", ["mask_sees_next_key", "mask_misses_diagonal"])
def test_causal_mask_off_by_one_fails(bug, dtype, kind):
    problem, ref = _case(kind, dtype, True)
    out, lse = _fa2(problem, bug)
    verdict = check_attention(out, problem, reference=ref)
    assert verdict.rule == "error_bound" and verdict.bound_ratio > 5, verdict.message()
    with_lse = check_attention(out, problem, lse=lse, reference=ref)
    # Missing the diagonal leaves row 0 without keys: LSE -inf where the reference is finite.
    assert with_lse.rule == ("finite" if bug == "mask_misses_diagonal" else "error_bound")


@pytest.mark.parametrize("kind", ["normal", "fa3_outliers", "large_logits"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropping_the_last_key_fails(dtype, kind):
    problem, ref = _case(kind, dtype, False)
    out, lse = _fa2(problem, "drop_last_key")
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    assert verdict.rule == "error_bound", verdict.message()


@pytest.mark.parametrize("kind", ["normal", "fa3_outliers", "large_logits"])
def test_fp16_accumulation_claimed_fp32_fails_for_fp32_inputs(kind):
    problem, ref = _case(kind, "fp32", False, n=256)
    out, lse = _fa2(problem, "lowp_accumulator")
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    assert verdict.rule == "error_bound" and verdict.bound_ratio > 2, verdict.message()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_16bit_accumulation_of_16bit_inputs_fails_on_long_outlier_rows(dtype):
    """With 16-bit inputs the accumulator's rounding (u |acc| per 16 keys) is of the size of the
    P rounding the flash model allows (u D per key): at N = 128 on normal inputs the mutant
    stays within 0.6-0.9 of the bound (not caught). It shows on long rows and outliers."""
    problem, ref = _case("fa3_outliers", dtype, False, n=1024, heads=1)
    out, lse = _fa2(problem, "lowp_accumulator")
    verdict = check_attention(out, problem, lse=lse, reference=ref, ensemble_factor=None)
    assert verdict.rule == "error_bound" and verdict.bound_ratio > 1.3, verdict.message()


def test_claimed_precision_matters():
    """FA2 rounds P to fp16: correct under `flash`, a violation when fp32 P is claimed."""
    problem, ref = _case("normal", "fp16", False)
    out, lse = tiled_attention(problem, PrecisionModel.flash("fp16"))
    assert check_attention(out, problem, lse=lse, reference=ref).passed
    strict = check_attention(out, problem, lse=lse, reference=ref, precision="fp32-accumulate")
    assert strict.rule == "error_bound"
    assert "p=fp32" in strict.message()


# --- the other rules ---------------------------------------------------------------------------

def test_shape_rule():
    problem, ref = _case("normal", "fp16", False)
    out, lse = _fa2(problem)
    verdict = check_attention(out[:, :, :-1], problem, lse=lse, reference=ref)
    assert verdict.rule == "shape" and not verdict.passed
    assert "out.shape=(1, 2, 127, 64)" in verdict.message()
    verdict = check_attention(out, problem, lse=lse[..., None], reference=ref)
    assert verdict.rule == "shape" and "lse.shape" in verdict.detail


def test_finite_rule_names_the_first_bad_element():
    problem, ref = _case("normal", "bf16", False)
    out, lse = _fa2(problem)
    out = out.copy()
    out[0, 1, 5, 7] = np.nan
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    assert verdict.rule == "finite"
    assert "first nan at [0, 1, 5, 7]" in verdict.message()
    assert verdict.worst_index == (0, 1, 5, 7) and verdict.bound_ratio == np.inf
    lse = lse.copy()
    lse[0, 0, 3] = np.inf
    out, _ = _fa2(problem)
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    assert verdict.rule == "finite" and "[0, 0, 3]" in verdict.detail


def _masked_problem(dtype="fp16"):
    rng = np.random.default_rng(3)
    # bottom-right causal with Nq > Nk: the first Nq - Nk = 8 query rows attend no key
    return AttentionProblem.from_float(rng.standard_normal((1, 2, 40, 32)), rng.standard_normal((1, 2, 32, 32)),
                                       rng.standard_normal((1, 2, 32, 32)), dtype, causal=True)


def test_masked_rows_must_be_zero_and_minus_inf():
    problem = _masked_problem()
    ref = reference(problem)
    out, lse = _fa2(problem)
    assert check_attention(out, problem, lse=lse, reference=ref).passed
    bad = out.copy()
    bad[0, 0, 2, 3] = 1e-3
    verdict = check_attention(bad, problem, lse=lse, reference=ref)
    assert verdict.rule == "masked_rows" and "not 0" in verdict.detail
    zero_lse = np.where(np.isfinite(lse), lse, np.float32(0))  # torch's CPU flash convention
    verdict = check_attention(out, problem, lse=zero_lse, reference=ref)
    assert verdict.rule == "masked_rows" and "not -inf" in verdict.detail
    # NaN (0/0) in fully masked rows: the finite rule comes first
    out_nan, lse_nan = _fa2(problem, "masked_rows_nan")
    assert check_attention(out_nan, problem, lse=lse_nan, reference=ref).rule == "finite"


def test_torch_flash_cpu_masked_row_lse_convention_is_reported():
    pytest.importorskip("torch")
    problem = _masked_problem()
    out, lse = _torch_flash(problem)
    verdict = check_attention(out, problem, lse=lse)
    assert verdict.rule == "masked_rows"   # LSE 0 where fa_verify's convention says -inf
    assert check_attention(out, problem).passed  # the output itself is right


def test_ensemble_rule_catches_what_the_loose_fp32_bound_admits():
    """fp32: an error 20x the largest of the honest ensemble's stays inside the worst-case bound
    (which is 10-100x looser than real fp32 errors) but fails the ensemble rule."""
    from fa_verify.honest_ensemble import ensemble_errors

    problem, ref = _case("normal", "fp32", False)
    ensemble = ensemble_errors(problem, PrecisionModel.flash("fp32"), ref)
    rng = np.random.default_rng(0)
    out = (ref.out + 20 * ensemble.max_error * ref.row_scale * rng.choice([-1.0, 1.0], ref.out.shape))
    verdict = check_attention(out.astype(np.float32), problem, reference=ref)
    assert verdict.bound_ratio < 1 and verdict.rule == "ensemble", verdict.message()
    assert verdict.ensemble_ratio > 1 and verdict.ensemble_factor == DEFAULT_ENSEMBLE_FACTOR
    assert verdict.ensemble_error == ensemble.max_error and verdict.ensemble_member == ensemble.worst_member
    assert "honest implementations of this precision model" in verdict.message()
    skipped = check_attention(out.astype(np.float32), problem, reference=ref, ensemble_factor=None)
    assert skipped.passed and skipped.ensemble_ratio is None
    assert check_attention(out.astype(np.float32), problem, reference=ref, ensemble=ensemble,
                           ensemble_factor=50).passed


ENSEMBLE_LINE = re.compile(
    r"Ensemble rule: max normalised error (\S+); allowed per element \(K × E \+ floor\) × row scale \+ "
    r"absolute floor, with K = (\S+), E = (\S+) \(.* reached by '([\w-]+)'\), floor = (\S+) × \(u_out (\S+) "
    r"\+ √Nk (\S+) × u_pv (\S+)\) = (\S+), so K × E \+ floor = (\S+); absolute floor (\S+); used (\S+) of "
    r"it at \[[\d, ]+\]: error (\S+) against (\S+) × row scale (\S+) \+ (\S+) = (\S+)$")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ensemble_allowance_is_printed_with_every_term(dtype):
    """The printed terms reproduce the printed allowance and the "used" ratio (3-4 digits)."""
    problem, ref = _case("large_logits", dtype, True)
    out, lse = _fa2(problem, "scale_3pct")
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    line = next(x for x in verdict.message().splitlines() if x.startswith("Ensemble rule:"))
    match = ENSEMBLE_LINE.match(line)
    assert match, line
    (err_max, k, e, member, floor_k, u_out, sqrt_nk, u_pv, floor, per_row, absolute, used, err, per_row2,
     row_scale, absolute2, allowed) = match.groups()
    assert float(k) == DEFAULT_ENSEMBLE_FACTOR and member == verdict.ensemble_member
    assert float(floor) == pytest.approx(float(floor_k) * (float(u_out) + float(sqrt_nk) * float(u_pv)), rel=2e-3)
    assert float(floor_k) == FLOOR_ROUNDINGS and float(sqrt_nk) == pytest.approx(np.sqrt(problem.nk), rel=5e-4)
    assert float(per_row) == pytest.approx(float(k) * float(e) + float(floor), rel=2e-3) and per_row == per_row2
    assert float(allowed) == pytest.approx(float(per_row) * float(row_scale) + float(absolute), rel=2e-3)
    assert float(used) == pytest.approx(float(err) / float(allowed), rel=5e-3)
    assert absolute == absolute2 and float(err_max) == pytest.approx(verdict.normalised_error, rel=1e-3)


# --- message and record formats ---------------------------------------------------------------

MISMATCH = re.compile(
    r"Mismatched elements: (\d+) / (\d+) \((\d+\.\d|[\d.e-]+)%\) exceed the error-model bound; "
    r"worst at \[(\d+), (\d+), (\d+), (\d+)\]: got \S+, reference \S+ ± \S+, "
    r"error \S+ = (\S+) × bound \S+ \(dominant term: (\w+)\)")


def test_message_reads_like_torch_testing():
    problem, ref = _case("normal", "fp16", False)
    out, lse = _fa2(problem, "scale_3pct")
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    text = verdict.message()
    first, second = text.splitlines()[:2]
    assert first.startswith("attention output failed rule 'error_bound' (B=1 H=2")
    match = MISMATCH.search(second)
    assert match, second
    assert int(match.group(1)) == verdict.over_count and int(match.group(2)) == verdict.total
    assert tuple(int(match.group(i)) for i in range(4, 8)) == verdict.worst_index
    assert float(match.group(8)) == pytest.approx(verdict.bound_ratio, rel=1e-2)
    assert match.group(9) == verdict.dominant_term
    assert "LSE:" in text and "Ensemble rule:" in text and "Errors: normalised max" in text
    assert 0 < verdict.share_over <= 1


def test_verdict_as_dict_is_json_ready():
    problem, ref = _case("normal", "bf16", True)
    out, lse = _fa2(problem)
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    record = verdict.as_dict()
    assert record["passed"] is True and record["rule"] is None
    assert record["summary"]["normalised"]["count"] == out.size
    assert set(RULES) >= {"shape", "finite", "masked_rows", "error_bound", "lse_bound", "ensemble"}
    json.loads(json.dumps(record))
    assert isinstance(verdict, Verdict)


def test_torch_tensors_and_precision_strings_are_accepted():
    torch = pytest.importorskip("torch")
    from fa_verify.backends.torch_arrays import to_torch
    problem, ref = _case("normal", "bf16", False)
    out, lse = _fa2(problem)
    verdict = check_attention(to_torch(out), problem, lse=torch.from_numpy(lse), reference=ref,
                              precision="flash")
    assert verdict.passed and verdict.summary.dtype == "bf16"


def test_a_precision_too_coarse_to_bound_is_reported_not_hidden():
    """bf16 score accumulation: gamma_64(2^-8) = 1/3, no first-order bound exists."""
    problem, ref = _case("normal", "bf16", False)
    precision = PrecisionModel.same_precision("bf16")
    out, lse = naive_attention(problem, precision)
    verdict = check_attention(out, problem, lse=lse, precision=precision, reference=ref)
    assert verdict.passed and verdict.unbounded_count == verdict.total
    assert verdict.message().startswith("attention output passes the rules that could judge it")
    assert "No finite bound for" in verdict.message()
    assert verdict.ensemble_ratio < 1  # the ensemble rule still judges


def test_bad_arguments():
    problem, ref = _case("normal", "fp16", False)
    out, _ = _fa2(problem)
    with pytest.raises(InvalidArgumentError, match="ensemble_factor"):
        check_attention(out, problem, reference=ref, ensemble_factor=-1)
    with pytest.raises(InvalidArgumentError, match="precision"):
        check_attention(out, problem, reference=ref, precision=3)
    with pytest.raises(InvalidArgumentError, match="AttentionProblem"):
        check_attention(out, "problem")


LSE_LINE = re.compile(
    r"LSE: (\d+) / (\d+) rows \(([\d.e-]+)%\) exceed the bound; worst at \[(\d+), (\d+), (\d+)\]: got \S+, "
    r"reference \S+, error (\S+) = (\S+) × bound (\S+) \(dominant term: (\w+)\)")
NUMBERS = re.compile(
    r"\((?P<share>[\d.e-]+)%\) exceed the error-model bound; worst at \[[\d, ]+\]: got \S+, reference \S+ "
    r"± (?P<reference_bound>\S+), error (?P<error>\S+) = \S+ × bound (?P<bound>\S+) ")
SUMMARY = re.compile(
    r"Errors: normalised max (\S+), p99 (\S+), median (\S+); abs max (\S+), RMSE (\S+), mean (\S+); "
    r"ULP \((\w+)\) max (\S+)$")


def test_every_number_in_the_message_is_the_verdicts_own():
    """The message shows each field it names, rounded for reading (2 significant digits for the
    errors and bounds): parsed back, every number is that field to its shown precision."""
    problem, ref = _case("normal", "fp16", False)
    out, lse = _fa2(problem, "scale_3pct")
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    lines = verdict.message().splitlines()
    mismatch = NUMBERS.search(lines[1])
    assert mismatch, lines[1]
    assert float(mismatch["share"]) == pytest.approx(100 * verdict.share_over, abs=0.051)
    for name in ("reference_bound", "error", "bound"):
        field = {"reference_bound": verdict.worst_reference_bound, "error": verdict.worst_error,
                 "bound": verdict.worst_bound}[name]
        assert float(mismatch[name]) == pytest.approx(field, rel=0.05), name
    lse_line = LSE_LINE.search(lines[2])
    assert lse_line, lines[2]
    (over, total, share, *index, error, ratio, bound, term) = lse_line.groups()
    assert (int(over), int(total)) == (verdict.lse_over_count, verdict.lse_total)
    assert float(share) == pytest.approx(100 * verdict.lse_over_count / verdict.lse_total, abs=0.051)
    assert tuple(int(i) for i in index) == verdict.lse_worst_index and term == verdict.lse_dominant_term
    assert float(error) == pytest.approx(verdict.lse_worst_error, rel=0.05)
    assert float(bound) == pytest.approx(verdict.lse_worst_bound, rel=0.05)
    assert float(ratio) == pytest.approx(verdict.lse_bound_ratio, rel=5e-3)
    summary = SUMMARY.search(lines[-1])
    assert summary, lines[-1]
    s = verdict.summary
    expected = (s.normalised.max, s.normalised.p99, s.normalised.median, s.abs.max, s.abs.rmse, s.abs.mean)
    for shown, field in zip(summary.groups()[:6], expected, strict=True):
        assert float(shown) == pytest.approx(field, rel=0.05)
    assert summary[7] == s.dtype and float(summary[8]) == pytest.approx(s.ulp.max, rel=5e-3)


def test_a_passing_message_says_so_and_still_shows_the_worst_element():
    problem, ref = _case("normal", "fp16", False)
    out, lse = _fa2(problem)
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    lines = verdict.message().splitlines()
    assert verdict.passed
    assert lines[0].startswith("attention output agrees with the reference within the error model (B=1 H=2")
    assert lines[1].startswith(f"Mismatched elements: 0 / {verdict.total} (0.0%)")
    assert lines[2].startswith(f"LSE: 0 / {verdict.lse_total} rows (0.0%)")


def _quiet_failures():
    """A finite and a masked-row failure whose output measurement has nothing over its bound."""
    problem, ref = _case("normal", "fp16", False)
    out, lse = _fa2(problem)
    nan_lse = lse.copy()
    nan_lse[0, 0, 3] = np.nan
    yield check_attention(out, problem, lse=nan_lse, reference=ref)
    problem = _masked_problem()
    out, lse = _fa2(problem)
    yield check_attention(out, problem, lse=np.where(np.isfinite(lse), lse, np.float32(0)), reference=reference(problem))


def test_after_a_finite_or_masked_row_failure_only_exceeding_measurements_are_shown():
    """A measurement with nothing over its bound is noise next to a NaN or a masked-row failure:
    its line is left out; one that does exceed (the NaN's LSE row) is kept."""
    finite, masked = _quiet_failures()
    assert (finite.rule, masked.rule) == ("finite", "masked_rows")
    for verdict in (finite, masked):
        assert verdict.over_count == 0 and verdict.worst_index is not None
        assert "Mismatched elements" not in verdict.message(), verdict.message()
    assert finite.lse_over_count == 1 and "LSE: 1 / 256 rows" in finite.message()
    assert masked.lse_over_count == 0 and masked.lse_worst_index is not None and "LSE:" not in masked.message()


def test_a_verdict_without_measurements_and_with_a_cause():
    """A bare verdict (nothing measured) prints its head alone; a likely cause gets its own line."""
    bare = Verdict(passed=False, rule="shape", problem="P", precision="M", detail="out.shape=(1,)")
    assert bare.message() == "attention output failed rule 'shape' (P; precision M)\nout.shape=(1,)"
    passed = Verdict(passed=True, rule=None, problem="P", precision="M", cause="a likely cause")
    assert passed.message().splitlines() == [
        "attention output agrees with the reference within the error model (P; precision M)", "a likely cause"]


def test_a_tiny_share_over_the_bound_is_not_shown_as_zero():
    """One element in 100,000 over the bound: 0.001 %, not "0.0%"; shares of 0.1 % and more are
    shown to 0.1 %."""
    def share(over, total):
        verdict = Verdict(passed=False, rule="error_bound", problem="P", precision="M", total=total,
                          over_count=over, worst_index=(0, 0, 0, 0), bound_ratio=2.0)
        return MISMATCH_SHARE.search(verdict.message())[1]
    assert float(share(1, 100_000)) == pytest.approx(1e-3)
    assert share(3, 8) == "37.5" and share(0, 8) == "0.0"


MISMATCH_SHARE = re.compile(r"Mismatched elements: \d+ / \d+ \(([\d.e-]+)%\)")


def test_verdict_record_carries_indices_as_lists_and_the_share_over():
    problem, ref = _case("normal", "fp16", False)
    out, lse = _fa2(problem, "scale_3pct")
    verdict = check_attention(out, problem, lse=lse, reference=ref)
    record = verdict.as_dict()
    assert record["worst_index"] == list(verdict.worst_index) and record["lse_worst_index"] == list(verdict.lse_worst_index)
    assert record["share_over"] == verdict.over_count / verdict.total > 0.5


def test_assert_attention_close_returns_the_passing_verdict_and_raises_with_the_failing_one():
    problem, ref = _case("normal", "fp16", False)
    out, lse = _fa2(problem)
    verdict = assert_attention_close(out, problem, lse=lse, reference=ref, precision="flash")
    assert isinstance(verdict, Verdict) and verdict.passed and verdict.lse_bound_ratio is not None
    bad, bad_lse = _fa2(problem, "scale_3pct")
    with pytest.raises(AttentionMismatch) as info:
        assert_attention_close(bad, problem, lse=bad_lse, reference=ref, ensemble_factor=None)
    failed = info.value.verdict
    assert failed.rule == "error_bound" and failed.ensemble_ratio is None
    assert str(info.value) == failed.message()
    with pytest.raises(AttentionMismatch) as strict:  # the precision argument reaches the check
        assert_attention_close(out, problem, lse=lse, reference=ref, precision="fp32-accumulate",
                               ensemble_factor=None)
    assert "p=fp32" in str(strict.value)


# --- each part of check_attention decides on an input made for it -----------------------------

@lru_cache(maxsize=None)
def _tiny(spec="flash,out=fp64", dtype="fp16"):
    """B=1, H=2 (one K/V head), Nq=10 > Nk=8 bottom-right causal: rows 0 and 1 attend no key;
    V's column 0 is 0, so the row scale is 0 there. out=fp64: outputs carry any error exactly."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 10, 16))
    k, v = rng.standard_normal((2, 1, 1, 8, 16))
    v[..., 0] = 0.0
    problem = AttentionProblem.from_float(q, k, v, dtype, causal=True)
    precision = PrecisionModel.parse(spec, dtype)
    ref = reference(problem)
    return problem, precision, ref, error_bound(problem, precision, ref)


def _exact(problem, precision, ref):
    """The reference as the precision model stores the output (lse in fp32)."""
    return round_to(ref.out, precision.output), ref.lse.astype(np.float32)


def _fake_ensemble(errors, rows=20):
    from fa_verify.honest_ensemble import EnsembleErrors
    return EnsembleErrors(dict(errors), rows=rows, total_rows=20)


def _allowance(problem, precision, ref, factor, e, ftz_part=0.0):
    """(K E + floor) row scale + absolute floor, from the module doc's formula."""
    from fa_verify.dtypes import finfo, unit_roundoff
    floor = FLOOR_ROUNDINGS * (unit_roundoff(precision.output) + np.sqrt(problem.nk) * unit_roundoff(precision.pv_accumulation))
    absolute = (problem.nk + 2) * float(finfo(precision.pv_accumulation).smallest_subnormal) + ftz_part
    return (factor * e + floor) * np.broadcast_to(ref.row_scale, problem.out_shape) + absolute, floor, absolute


@pytest.mark.parametrize("used", [0.9, 1.1])
@pytest.mark.parametrize("e", [2e-5, 0.0], ids=["K*E-decides", "floor-decides"])
def test_the_ensemble_rule_allows_k_e_plus_floor_per_element_and_no_more(e, used):
    """One element off by 0.9 or 1.1 x (K E + floor) x its row scale + absolute floor (E = 2e-5:
    K E is over 200x the floor; E = 0: the floor alone): passes at 0.9 and fails the ensemble rule
    at 1.1 (the error-model bound, over 2x wider here, passes both); every field of the rule is its
    formula; E is the largest finite member error and K scales it."""
    problem, precision, ref, bound = _tiny()
    ensemble = _fake_ensemble({"a": e / 2, "b": e, "c": np.inf})
    allowed, floor, absolute = _allowance(problem, precision, ref, DEFAULT_ENSEMBLE_FACTOR, e)
    out, lse = _exact(problem, precision, ref)
    index = (0, 1, 6, 5)
    out[index] += used * allowed[index]
    verdict = check_attention(out, problem, lse=lse, precision=precision, reference=ref, bound=bound, ensemble=ensemble)
    assert verdict.bound_ratio < 0.5 and verdict.lse_bound_ratio < 1e-3
    assert verdict.passed == (used < 1) and verdict.rule == (None if used < 1 else "ensemble"), verdict.message()
    assert verdict.ensemble_ratio == pytest.approx(used, rel=1e-9) and verdict.ensemble_worst_index == index
    assert verdict.ensemble_worst_error == abs(out[index] - ref.out[index])
    assert verdict.ensemble_worst_row_scale == ref.row_scale[index]
    assert verdict.ensemble_worst_allowed == pytest.approx(allowed[index], rel=1e-12)
    assert (verdict.ensemble_factor, verdict.ensemble_error, verdict.ensemble_member) == (4.0, e, "b" if e else "a")
    assert verdict.ensemble_errors == ensemble.errors and (verdict.ensemble_rows, verdict.total_rows) == (20, 20)
    assert (verdict.floor_u_out, verdict.floor_sqrt_nk, verdict.floor_u_pv) == (2.0 ** -53, np.sqrt(8), 2.0 ** -24)
    assert verdict.ensemble_floor == pytest.approx(floor, rel=1e-15) and verdict.absolute_floor == absolute
    half = check_attention(out, problem, lse=lse, precision=precision, reference=ref, bound=bound, ensemble=ensemble,
                           ensemble_factor=2)
    expected = used * allowed[index] / _allowance(problem, precision, ref, 2.0, e)[0][index]
    assert half.ensemble_ratio == pytest.approx(expected, rel=1e-9) and half.ensemble_factor == 2.0


@pytest.mark.parametrize("ftz", [False, True])
def test_where_the_row_scale_is_0_the_absolute_floor_decides(ftz):
    """V's column 0 is 0: the allowance there is the absolute floor alone, (Nk + 2) subnormal
    spacings of the P·V dtype, plus flushing V and the output when ftz is declared (fp16
    same-precision: P·V in fp16, so the subnormal part, 1 % of the flush terms, still shows)."""
    from fa_verify.error_model import flushed_output_error

    problem, precision, ref, bound = _tiny("same-precision")
    if ftz:
        precision = precision.replace(ftz=True)
    flushed = flushed_output_error(precision) if ftz else 0.0
    allowed, _, absolute = _allowance(problem, precision, ref, DEFAULT_ENSEMBLE_FACTOR, 0.0, flushed)
    assert absolute == 10 * 2.0 ** -24 + (2 * 2.0 ** -14 if ftz else 0.0)
    out, _ = _exact(problem, precision, ref)
    index = (0, 0, 4, 0)
    assert ref.row_scale[index] == 0
    out[index] = 0.9 * absolute  # rounded to fp16
    assert 0.85 < float(out[index]) / absolute < 0.95
    verdict = check_attention(out, problem, precision=precision, reference=ref, bound=bound,
                              ensemble=_fake_ensemble({"a": 0.0}))
    assert verdict.absolute_floor == absolute and verdict.ensemble_worst_index == index
    assert verdict.ensemble_ratio == pytest.approx(float(out[index]) / absolute, rel=1e-12)
    assert verdict.ensemble_worst_row_scale == 0 and verdict.floor_u_out == verdict.floor_u_pv == 2.0 ** -11


def test_without_a_precomputed_ensemble_the_rule_runs_it_on_the_rows_the_bound_picks(monkeypatch):
    """ensemble=None: the members run on this problem and precision, against this reference, on
    the rows the bound picks (FULL_WORK lowered so that 20 rows are a large problem)."""
    from fa_verify import honest_ensemble
    from fa_verify.honest_ensemble import ensemble_errors

    monkeypatch.setattr(honest_ensemble, "FULL_WORK", 100)
    monkeypatch.setattr(honest_ensemble, "MAX_ROWS", 8)
    problem, precision, ref, bound = _tiny("flash")
    out, lse = _exact(problem, precision, ref)
    verdict = check_attention(out, problem, lse=lse, precision="flash", reference=ref, bound=bound)
    expected = ensemble_errors(problem, precision, ref, bound)
    assert verdict.ensemble_errors == expected.errors and verdict.ensemble_error == expected.max_error > 0
    assert (verdict.ensemble_rows, verdict.total_rows) == (expected.rows, 20) and expected.rows < 20
    assert expected.rows != ensemble_errors(problem, precision, ref).rows  # the bound's rows, not the spread alone
    skipped = check_attention(out, problem, lse=lse, reference=ref, bound=bound, ensemble_factor=None)
    assert skipped.passed and skipped.ensemble_ratio is None and skipped.ensemble_errors is None


def _flash_tiny():
    problem, precision, ref, bound = _tiny("flash")
    out, lse = _exact(problem, precision, ref)
    return problem, ref, bound, out, lse


def _judge(out, lse=None, **kwargs):
    problem, ref, bound, *_ = _flash_tiny()
    return check_attention(out, problem, lse=lse, reference=ref, bound=bound, **kwargs)


def test_the_rounded_reference_passes_every_rule_with_the_counts_over_live_rows():
    """The reference rounded to fp16 passes; the counts are over the rows that attend a key
    (8 of 10 per head: 8 x 2 x 16 outputs, 16 LSEs); nothing over, nothing unbounded, no cause."""
    problem, ref, bound, out, lse = _flash_tiny()
    verdict = _judge(out, lse)
    assert verdict.passed and verdict.rule is None and verdict.detail == "" and verdict.cause == ""
    assert (verdict.total, verdict.over_count, verdict.unbounded_count) == (256, 0, 0)
    assert (verdict.lse_total, verdict.lse_over_count) == (16, 0)
    assert verdict.summary is not None and verdict.summary.dtype == "fp16" and verdict.summary.lse_abs is not None
    assert _judge(out).summary.lse_abs is None
    assert verdict.normalised_error == pytest.approx(np.max(np.where(
        ref.row_scale > 0, np.abs(out - ref.out) / np.where(ref.row_scale > 0, ref.row_scale, 1), 0)), rel=1e-12)


def test_one_element_over_the_bound_is_found_and_described():
    """An error 3x the bound at one element: rule error_bound, 1 element over, and the worst
    element's fields are that element's own numbers."""
    problem, ref, bound, out, lse = _flash_tiny()
    index = (0, 1, 7, 9)
    out[index] = ref.out[index] + 3 * bound.out[index]
    verdict = _judge(out, lse)
    err = abs(float(out[index]) - ref.out[index])
    assert verdict.rule == "error_bound" and not verdict.passed and verdict.over_count == 1
    assert verdict.worst_index == index and verdict.bound_ratio == pytest.approx(err / bound.out[index], rel=1e-12)
    assert 2.5 < verdict.bound_ratio < 3.5
    assert (verdict.worst_value, verdict.worst_reference) == (float(out[index]), ref.out[index])
    assert verdict.worst_reference_bound == ref.out_bound[index] and verdict.worst_bound == bound.out[index]
    assert verdict.worst_error == err and verdict.dominant_term == bound.dominant_out_term(index)


def test_one_lse_over_its_bound_is_found_and_described():
    problem, ref, bound, out, lse = _flash_tiny()
    row = (0, 0, 6)
    lse[row] = ref.lse[row] + 4 * bound.lse[row]
    verdict = _judge(out, lse)
    err = abs(float(lse[row]) - ref.lse[row])
    assert verdict.rule == "lse_bound" and verdict.lse_over_count == 1 and verdict.lse_worst_index == row
    assert verdict.lse_bound_ratio == pytest.approx(err / bound.lse[row], rel=1e-9) and verdict.lse_bound_ratio > 3
    assert (verdict.lse_worst_value, verdict.lse_worst_reference) == (float(lse[row]), ref.lse[row])
    assert verdict.lse_worst_error == pytest.approx(err, rel=1e-12) and verdict.lse_worst_bound == bound.lse[row]
    assert verdict.lse_dominant_term == bound.dominant_lse_term(row) and verdict.over_count == 0


CONVENTION = " (convention: output 0, LSE -inf)"


@pytest.mark.parametrize("where, value, rule, text", [
    ("out", np.inf, "finite", "out holds 1 NaN/Inf values where the reference is finite (first inf at [0, 1, 4, 2])"),
    ("out", np.nan, "finite", "out holds 1 NaN/Inf values where the reference is finite (first nan at [0, 1, 4, 2])"),
    ("out-masked", 0.5, "masked_rows", "1 outputs of fully masked rows are not 0 (first 0.5 at [0, 1, 1, 2])" + CONVENTION),
    ("lse", -np.inf, "finite", "lse holds 1 NaN/Inf values where the reference is finite (first -inf at [0, 1, 4])"),
    ("lse", np.nan, "finite", "lse holds 1 NaN/Inf values where the reference is finite (first nan at [0, 1, 4])"),
    ("lse-masked", np.nan, "finite", "lse holds 1 NaN/Inf values where the reference is finite (first nan at [0, 1, 1]); "
                                     "1 LSEs of fully masked rows are not -inf (first nan at [0, 1, 1])" + CONVENTION),
    ("lse-masked", np.inf, "masked_rows", "1 LSEs of fully masked rows are not -inf (first inf at [0, 1, 1])" + CONVENTION),
    ("lse-masked", 0.0, "masked_rows", "1 LSEs of fully masked rows are not -inf (first 0.0 at [0, 1, 1])" + CONVENTION),
])
def test_each_non_finite_or_masked_row_value_names_its_rule_and_its_first_element(where, value, rule, text):
    """NaN anywhere and ±inf where the reference is finite break "finite"; a masked row must be
    exactly 0 with LSE -inf, and -inf there is right; each detail names the count and the first
    element. Rows 0-1 attend no key; errors there do not count against the bound."""
    problem, ref, bound, out, lse = _flash_tiny()
    (out if where.startswith("out") else lse)[(0, 1, 1 if where.endswith("masked") else 4) + ((2,) if where.startswith("out") else ())] = value
    verdict = _judge(out, lse)
    assert (verdict.rule, verdict.passed) == (rule, False) and verdict.detail == text, verdict.detail
    if where == "out-masked":
        assert verdict.over_count == 0 and verdict.bound_ratio < 1 and verdict.total == 256
    if where == "lse-masked":
        assert verdict.lse_over_count == 0 and verdict.lse_total == 16
    if where == "lse":  # a NaN or -inf LSE is an infinite error, over any bound
        assert verdict.lse_over_count == 1 and verdict.lse_bound_ratio == np.inf and verdict.lse_worst_index == (0, 1, 4)
    assert _judge(out).rule == (rule if where.startswith("out") else None)  # without the LSE: out alone


def test_failures_are_reported_in_rule_order_with_every_detail():
    """A masked-row output, an LSE -inf where finite and an element over its bound together: the
    verdict names the first rule in RULES order and joins the details of all."""
    problem, ref, bound, out, lse = _flash_tiny()
    out[0, 0, 0, 3] = 0.25
    out[0, 1, 7, 9] = ref.out[0, 1, 7, 9] + 3 * bound.out[0, 1, 7, 9]
    lse[0, 0, 5] = -np.inf
    verdict = _judge(out, lse)
    assert verdict.rule == "finite" and verdict.over_count == 1
    assert verdict.detail.startswith("lse holds 1 NaN/Inf") and "; 1 outputs of fully masked rows are not 0" in verdict.detail
    assert verdict.lse_over_count == 1 and verdict.lse_bound_ratio == np.inf
    without = _judge(out)  # no LSE: the masked row comes first
    assert without.rule == "masked_rows" and without.detail.startswith("1 outputs of fully masked rows")
    out[0, 1, 4, 2], lse[0, 0, 1] = np.nan, 0.0  # two parts within "finite" and within "masked_rows"
    both = _judge(out, lse)
    assert both.detail == (
        "out holds 1 NaN/Inf values where the reference is finite (first nan at [0, 1, 4, 2]); "
        "lse holds 1 NaN/Inf values where the reference is finite (first -inf at [0, 0, 5]); "
        "1 outputs of fully masked rows are not 0 (first 0.25 at [0, 0, 0, 3]); "
        "1 LSEs of fully masked rows are not -inf (first 0.0 at [0, 0, 1]) (convention: output 0, LSE -inf)")


def test_the_arguments_are_checked_before_anything_is_computed():
    problem, ref, bound, out, lse = _flash_tiny()
    for factor in (0, -1.0, np.inf, np.nan, "4"):
        with pytest.raises(InvalidArgumentError, match="ensemble_factor"):
            _judge(out, lse, ensemble_factor=factor)
    assert _judge(out, lse, ensemble_factor=4).ensemble_factor == 4.0
    assert _judge(out, lse, ensemble_factor=0.5).ensemble_factor == 0.5
    with pytest.raises(InvalidArgumentError, match=r"^out is None; pass the kernel's output \[B, H, Nq, D\]$"):
        _judge(None, lse)
    with pytest.raises(InvalidArgumentError, match="^problem must be an AttentionProblem, got str$"):
        check_attention(out, "problem")

    class NotAnArray:
        def __array__(self, *args, **kwargs):
            raise ValueError("no")

    with pytest.raises(InvalidArgumentError, match="^out of type NotAnArray is not an array$"):
        _judge(NotAnArray(), lse)
    with pytest.raises(InvalidArgumentError, match="^lse of type NotAnArray is not an array$"):
        _judge(out, NotAnArray())
    wide = _judge(out.astype(np.float32), lse)
    assert (wide.rule, wide.passed) == ("shape", False) and wide.detail == (
        "out.dtype=float32 but the precision model (" + PrecisionModel.flash("fp16").describe() + ") stores the output "
        "in fp16: pass the output as the kernel stores it, or declare the dtype it stores in the model "
        "(precision='...,out=fp32' for an fp32 output)")
    short = _judge(out[:, :, 1:], lse)
    assert (short.rule, short.passed) == ("shape", False)
    assert short.detail == "out.shape=(1, 2, 9, 16) but the problem needs [B, H, Nq, D] = (1, 2, 10, 16)"
    bad_lse = _judge(out, lse[..., None])
    assert (bad_lse.rule, bad_lse.passed) == ("shape", False)
    assert bad_lse.detail == "lse.shape=(1, 2, 10, 1) but the problem needs [B, H, Nq] = (1, 2, 10)"
    assert problem.describe() == short.problem and short.precision == PrecisionModel.flash("fp16").describe()


def test_an_error_equal_to_its_allowance_passes_every_rule():
    """Each rule fails only above its allowance: an error exactly equal to the element's bound,
    to the row's LSE bound, or to the ensemble allowance (the absolute floor where the row scale
    is 0) passes; an element with an infinite bound is counted as unbounded."""
    from dataclasses import replace

    from fa_verify.metrics import lse_errors

    problem, precision, ref, bound = _tiny()
    out, lse = _exact(problem, precision, ref)
    index, row, zero = (0, 1, 6, 5), (0, 0, 7), (0, 1, 3, 0)
    out[index] += 0.5 * bound.out[index]
    lse[row] += np.float32(0.5 * bound.lse[row])
    absolute = 10 * 2.0 ** -149
    out[zero] = absolute  # row scale 0: allowed exactly the absolute floor
    bound_out, bound_lse = bound.out.copy(), bound.lse.copy()
    bound_out[index] = abs(out[index] - ref.out[index])
    bound_lse[row] = abs(lse_errors(lse, ref.lse)[row])
    bound_out[0, 0, 9, 11] = np.inf
    tight = replace(bound, out=bound_out, lse=bound_lse)
    verdict = check_attention(out, problem, lse=lse, precision=precision, reference=ref, bound=tight,
                              ensemble=_fake_ensemble({"a": 1e-3}))  # K E ~ 7x the error at `index`
    assert verdict.passed, verdict.message()
    assert (verdict.over_count, verdict.bound_ratio, verdict.worst_index) == (0, 1.0, index)
    assert (verdict.lse_over_count, verdict.lse_bound_ratio, verdict.lse_worst_index) == (0, 1.0, row)
    assert (verdict.ensemble_ratio, verdict.ensemble_worst_index) == (1.0, zero) and verdict.absolute_floor == absolute
    assert verdict.unbounded_count == 1


def test_without_a_reference_or_a_bound_they_are_computed_with_the_arguments_given():
    """reference=None and bound=None: the oracle's reference and `error_bound` with the given
    accumulation and lam (the verdict's numbers are theirs)."""
    problem, precision, ref, bound = _tiny("flash")
    out, lse = _exact(problem, precision, ref)
    index = (0, 1, 7, 9)
    out[index] = ref.out[index] + 3 * bound.out[index]
    alone = check_attention(out, problem, lse=lse, ensemble=_fake_ensemble({"a": 1e-3}))
    given = _judge(out, lse, ensemble=_fake_ensemble({"a": 1e-3}))
    assert alone.as_dict() == given.as_dict() and alone.worst_bound == bound.out[index]
    for accumulation, lam in (("probabilistic", 1.0), ("worst-case", 0.5)):
        other = error_bound(problem, precision, ref, accumulation=accumulation, lam=lam)
        verdict = check_attention(out, problem, lse=lse, reference=ref, ensemble=_fake_ensemble({"a": 1e-3}),
                                  accumulation=accumulation, lam=lam)
        assert verdict.worst_bound == other.out[verdict.worst_index]
        assert verdict.lse_worst_bound == other.lse[verdict.lse_worst_index]


def test_a_failure_in_a_row_below_the_normal_range_gets_its_cause_and_a_pass_does_not():
    """V's column 1 of size 1e-6 (fp16 subnormal): the rounded reference passes with no cause; an
    output flushed to 0 there fails, and the verdict says where, how large, and "flush-to-zero?"."""
    from fa_verify.causes import tiny_scale_note
    from fa_verify.metrics import OutputErrors

    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((3, 1, 1, 6, 8))
    v[..., 1] = 1e-6 * (1 + rng.random((1, 1, 6)))
    problem = AttentionProblem.from_float(q, k, v, "fp16")
    ref = reference(problem)
    out = round_to(ref.out, "fp16")
    passed = check_attention(out, problem, reference=ref)
    assert passed.passed and passed.cause == ""
    flushed = out.copy()
    flushed[..., 1] = 0
    verdict = check_attention(flushed, problem, reference=ref)
    assert not verdict.passed and verdict.rule == "error_bound"
    errors = OutputErrors.compute(flushed, ref.out, ref.row_scale, "fp16")
    assert verdict.cause == tiny_scale_note(errors, flushed.astype(np.float64), ref.out, "fp16")
    assert "below the fp16 normal range" in verdict.cause and "a flush-to-zero target?" in verdict.cause
    assert verdict.cause in verdict.message()


def test_ratio_is_err_over_bound_with_0_over_0_as_0_and_x_over_0_as_inf_silently():
    import warnings

    from fa_verify.verdict import _ratio

    err = np.array([0.0, 1.0, 0.0, 2.0, np.inf, 3.0])
    bound = np.array([0.0, 0.0, 1.0, 4.0, 1.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = _ratio(err, bound)
    assert r.dtype == np.float64
    np.testing.assert_array_equal(r, [0.0, np.inf, 0.0, 0.5, np.inf, 3.0])
