"""The null-model guard: trivial outputs, which of them a tolerance accepts, and the counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.dtypes import numpy_dtype, round_to
from fa_verify.null_model import NullGuard, guard, null_outputs
from fa_verify.oracle import reference
from fa_verify.properties import (
    FAILED,
    PASSED,
    UNINFORMATIVE,
    Property,
    Selection,
    check_key_permutation,
    check_lse_agreement,
    check_merge_law,
    check_oracle_agreement,
    search_property,
)
from fa_verify.properties._result import passed
from fa_verify.strategies import DISTRIBUTIONS, make_problem


def nulls_of(problem, out_dtype=None):
    return {n.name: n for n in null_outputs(problem, reference(problem), out_dtype or problem.dtype)}


def test_trivial_outputs_follow_their_definitions_and_the_masked_row_convention():
    # bottom-right causal with Nq > Nk: rows 0..2 see no key, row 3 sees key 0 only, ...
    p = make_problem("normal", (1, 2, 1, 7, 4, 8), "fp32", 3, causal=True)
    nulls = nulls_of(p)
    assert set(nulls) == {"zeros", "uniform attention", "queries shifted by one row", "another q"}
    v = p.v.astype(np.float64)[0, 0]
    uniform = nulls["uniform attention"]
    for i, n in enumerate(p.key_limit()):
        expected = v[:n].mean(axis=0) if n else np.zeros(8)
        np.testing.assert_allclose(uniform.out[0, 1, i], expected, rtol=1e-6)
        assert uniform.lse[0, 1, i] == (np.float32(np.log(n)) if n else -np.inf)
    for null in nulls.values():
        assert (null.out[:, :, :3] == 0).all() and (null.lse[:, :, :3] == -np.inf).all()
        assert null.out.dtype == np.float32 and null.lse.dtype == np.float32
    shifted, ref = nulls["queries shifted by one row"], reference(p)
    np.testing.assert_array_equal(shifted.out[:, :, 4:], ref.out[:, :, 3:-1].astype(np.float32))


def test_a_trivial_output_that_is_the_right_answer_is_not_tried():
    one_key = nulls_of(make_problem("normal", (1, 1, 1, 5, 1, 16), "fp16", 0))
    assert one_key["uniform attention"].exact(("out",))  # one key: uniform attention is exact
    assert not one_key["zeros"].exact(("out",))
    assert not one_key["uniform attention"].exact(("lse",))  # log 1 = 0 is not the score
    tried = guard(one_key.values(), lambda null: True)
    assert "uniform attention" not in tried.tried and "zeros" in tried.passing and not tried.informative


def test_guard_outcome_and_its_description():
    nulls = nulls_of(make_problem("normal", (1, 1, 1, 6, 9, 16), "bf16", 2)).values()
    tight = guard(nulls, lambda null: False)
    assert tight.informative and len(tight.tried) == 4 and "informative" in tight.describe()
    loose = guard(nulls, lambda null: null.name == "zeros")
    assert not loose.informative and "the trivial output zeros passes the same tolerance" in loose.describe()


def uniform_target(problem):
    """Uniform attention over the attended keys, as a target: it knows nothing of q and k."""
    null = nulls_of(problem)["uniform attention"]
    return null.out.astype(problem.q.dtype), null.lse


def zeros_target(problem):
    return np.zeros(problem.out_shape, problem.q.dtype), np.zeros(problem.out_shape[:3], np.float32)


@pytest.mark.parametrize("target, name", [(uniform_target, "uniform attention"), (zeros_target, "zeros")])
def test_a_trivial_target_never_passes_unless_it_is_the_right_answer(target, name):
    """On every distribution, a trivial target either fails or its example is uninformative;
    it passes only where its output is the exact answer (constant scores: uniform attention)."""
    statuses = set()
    for distribution in DISTRIBUTIONS:
        for dtype in ("fp16", "bf16", "fp32"):
            p = make_problem(distribution, (1, 2, 1, 7, 9, 16), dtype, 1, causal=True)
            null = nulls_of(p)[name]
            for check, judged in ((check_oracle_agreement, ("out",)), (check_lse_agreement, ("lse",)),
                                  (check_merge_law, ("out", "lse"))):
                result = check(target, p)
                statuses.add(result.status)
                assert result.status != PASSED or null.exact(judged), (check.__name__, p.describe(), result.message())
    assert FAILED in statuses


def test_the_guard_flags_a_loose_example_of_a_real_backend():
    """Tiny scores: attention is nearly uniform, so a relation between two runs cannot tell a
    kernel that ignores q from one that does not."""
    p = make_problem("tiny", (2, 3, 1, 64, 64, 5), "fp16", 3)
    result = check_key_permutation(get_backend("numpy-tiled"), p, seed=0)
    assert result.status == UNINFORMATIVE and not result.passed and not result.failed
    assert result.informative is False and "uniform attention" in result.detail
    normal = check_key_permutation(get_backend("numpy-tiled"), make_problem("normal", (2, 3, 1, 64, 64, 5), "fp16", 3))
    assert normal.passed and normal.informative is True


def _loose(backend, problem):
    """A check whose tolerance accepts anything."""
    return passed("loose", problem, guard=NullGuard(tried=("zeros",), passing=("zeros",)))


def _bitwise(backend, problem):
    return passed("bitwise", problem)


def test_search_counts_informative_examples_and_fails_a_property_with_none(monkeypatch):
    from fa_verify.properties import registry

    monkeypatch.setattr(registry, "PROPERTIES",
                        registry.PROPERTIES + (Property("loose", _loose), Property("bitwise", _bitwise)))
    selection = Selection(max_examples=5, dtypes=("fp32",))
    outcome = search_property(zeros_target, "loose", selection)
    assert outcome.status == FAILED and outcome.failure is None
    assert outcome.informative == 0 and outcome.uninformative == outcome.examples > 0
    assert outcome.uninformative_only  # fa_verify mutants counts it neither as a kill nor a false positive
    assert "no informative example" in outcome.message() and "zeros" in outcome.message()
    bitwise = search_property(zeros_target, "bitwise", selection)
    assert bitwise.passed and bitwise.informative is None and "informative" not in bitwise.message()
    agreement = search_property(get_backend("numpy-tiled"), "oracle_agreement", selection)
    assert agreement.passed and agreement.informative + agreement.uninformative == agreement.examples
    assert f"{agreement.informative} informative" in agreement.message()


def test_check_json_carries_the_counts(capsys):
    from fa_verify.cli.main import main

    assert main(["check", "numpy-tiled", "--property", "key_permutation", "--property", "determinism",
                 "--max-examples", "4", "--dtype", "fp32", "--json"]) == 0
    properties = json.loads(capsys.readouterr().out)["targets"][0]["properties"]
    guarded, bitwise = properties
    assert isinstance(guarded["informative"], int) and guarded["informative"] + guarded["uninformative"] == guarded["examples"]
    assert bitwise["informative"] is None and bitwise["uninformative"] == 0


def test_another_q_stays_finite_for_queries_near_the_dtype_maximum():
    from fa_verify import AttentionProblem

    q = np.full((1, 1, 4, 8), 60000, np.float16)
    k, v = np.ones((1, 1, 5, 8), np.float16), np.ones((1, 1, 5, 8), np.float16)
    nulls = nulls_of(AttentionProblem(q, k, v))
    assert np.isfinite(nulls["another q"].out).all()


def test_the_description_names_every_passing_output_in_plain_english():
    nulls = nulls_of(make_problem("normal", (1, 1, 1, 6, 9, 16), "bf16", 2)).values()
    two = guard(nulls, lambda null: null.name in ("zeros", "another q"))
    assert "the trivial outputs zeros, another q pass the same tolerance" in two.describe()
    one = guard(nulls, lambda null: null.name == "another q")
    assert "the trivial output another q passes the same tolerance" in one.describe()


def test_one_query_row_has_no_shifted_output_and_two_rows_do():
    """With one query row, "shifted by one row" is the exact answer itself: it is not built."""
    one = nulls_of(make_problem("normal", (1, 2, 1, 1, 9, 16), "fp32", 4))
    assert "queries shifted by one row" not in one and len(one) == 3
    two = nulls_of(make_problem("normal", (1, 2, 1, 2, 9, 16), "fp32", 4))
    assert "queries shifted by one row" in two


def test_shifted_rows_move_the_lse_with_the_output_in_every_head():
    p = make_problem("normal", (2, 3, 1, 6, 9, 16), "fp32", 5)
    shifted, ref = nulls_of(p)["queries shifted by one row"], reference(p)
    np.testing.assert_array_equal(shifted.out, np.roll(ref.out, 1, axis=2).astype(np.float32))
    np.testing.assert_array_equal(shifted.lse[:, :, 1:], ref.lse[:, :, :-1].astype(np.float32))
    np.testing.assert_array_equal(shifted.lse[:, :, 0], ref.lse[:, :, -1].astype(np.float32))


def test_fully_masked_rows_raise_no_floating_point_warnings():
    """log(0) and inf - inf at rows that see no key are expected, not reported."""
    import warnings

    p = make_problem("normal", (1, 2, 1, 7, 4, 8), "fp32", 3, causal=True)  # rows 0..2 see no key
    assert p.masked_rows.any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nulls_of(p)


def test_uniform_attention_is_the_exact_answer_when_every_score_is_zero():
    """q = 0: every score is 0, attention is uniform over the attended keys in O and in LSE
    (log n), masked rows included (0 and -inf on both sides), so it is never tried."""
    from fa_verify import AttentionProblem

    p = make_problem("normal", (1, 2, 1, 7, 4, 8), "fp32", 3, causal=True)
    p = AttentionProblem(np.zeros_like(p.q), p.k, p.v, causal=p.causal)
    assert p.masked_rows.any()
    uniform = nulls_of(p)["uniform attention"]
    assert uniform.exact(("out", "lse"))
    assert "uniform attention" not in guard(nulls_of(p).values(), lambda null: True, judged=("out", "lse")).tried


def test_another_q_has_the_spread_of_q_and_is_reproducible(monkeypatch):
    """Fresh queries of the same root-mean-square as q, from a fixed seed."""
    from fa_verify import AttentionProblem
    from fa_verify.backends import naive

    seen = []
    real = naive.naive_attention
    monkeypatch.setattr(naive, "naive_attention", lambda problem, model: seen.append(problem.q64()) or real(problem, model))
    rng = np.random.default_rng(7)
    q = (8 * rng.standard_normal((1, 2, 64, 16))).astype(np.float32)
    kv = rng.standard_normal((1, 2, 32, 16)).astype(np.float32)
    first = nulls_of(AttentionProblem(q, kv, kv))["another q"]
    second = nulls_of(AttentionProblem(q, kv, kv))["another q"]
    fresh = seen[0]
    assert np.sqrt(np.mean(fresh ** 2)) == pytest.approx(np.sqrt(np.mean(q.astype(np.float64) ** 2)), rel=0.1)
    assert not np.array_equal(fresh, q) and np.array_equal(seen[1], fresh)
    np.testing.assert_array_equal(first.out, second.out)
    nulls_of(AttentionProblem(np.zeros_like(q), kv, kv))
    assert np.sqrt(np.mean(seen[2] ** 2)) == pytest.approx(1.0, rel=0.1)


def test_a_batch_passes_a_trivial_output_only_if_every_part_that_tried_it_does():
    from fa_verify.null_model import batch_guard

    first = NullGuard(tried=("zeros", "uniform attention"), passing=("zeros", "uniform attention"))
    second = NullGuard(tried=("zeros", "another q"), passing=("another q",))
    third = NullGuard(tried=("uniform attention",), passing=("uniform attention",))
    whole = batch_guard([first, second, third])
    assert whole.tried == ("zeros", "uniform attention", "another q")
    assert whole.passing == ("uniform attention", "another q")  # zeros fails the second part
    assert batch_guard([second]).passing == ("another q",) and batch_guard([]).informative


def _fp8_problem(q, k, v, dv, **kwargs):
    """An e4m3 problem of these stored values, q and k descales 0.75 and 1.25, v descales `dv`
    ([B, Hkv]): none a power of two, so a descale applied twice or divided shows."""
    from fa_verify.fp8 import FP8Problem

    B, Hkv = np.shape(dv)
    return FP8Problem.from_float(q, k, v, "e4m3", q_descale=np.full((B, Hkv), 0.75),
                                 k_descale=np.full((B, Hkv), 1.25), v_descale=dv, **kwargs)


def _fp8_nulls(p, out_dtype="fp32"):
    from fa_verify.null_model import fp8_null_outputs
    from fa_verify.oracle.fp8 import reference_fp8

    return {n.name: n for n in fp8_null_outputs(p, reference_fp8(p), out_dtype)}


def test_fp8_trivial_outputs_are_the_groups_fp32_trivial_outputs_times_their_v_descale():
    """Per (batch, kv head) group with its G query heads: uniform attention is fl32(mean of the
    attended stored v rows) x dv (the group's trivial output as an fp32 kernel returns it, then
    descaled), LSE log(n) in float32; zeros are 0 with LSE 0; shifted rows are the reference's
    rows moved by one; a row that sees no key is (0, -inf) in all; O in `out_dtype`."""
    from fa_verify.oracle import reference
    from fa_verify.oracle.fp8 import groups, reference_fp8

    rng = np.random.default_rng(3)
    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 4, 3, 4
    dv = np.array([[0.3, 1.7], [5.5, 0.09]], np.float32)
    # bottom-right causal, Nq > Nk: row 0 sees no key, row i sees keys 0..i-1
    p = _fp8_problem(rng.uniform(-2, 2, (B, H, Nq, D)), rng.uniform(-2, 2, (B, Hkv, Nk, D)),
                     rng.uniform(-2, 2, (B, Hkv, Nk, D)), dv, causal=True)
    nulls = _fp8_nulls(p, "fp64")
    assert list(nulls) == ["zeros", "uniform attention", "queries shifted by one row", "another q"]
    ref = reference_fp8(p)
    v = p.v.astype(np.float64)
    uniform, unrounded = np.zeros(p.out_shape), np.zeros(p.out_shape)
    for b in range(B):
        for h in range(H):
            kh = h // 2
            for i in range(1, Nq):
                mean = v[b, kh, :i].sum(axis=0) / i
                uniform[b, h, i] = np.float32(mean).astype(np.float64) * float(dv[b, kh])
                unrounded[b, h, i] = mean * float(dv[b, kh])
    np.testing.assert_array_equal(nulls["uniform attention"].out, uniform)
    assert not np.array_equal(uniform, unrounded)  # the fp32 step shows in float64
    log_n = np.array([-np.inf, 0.0, np.log(2), np.log(3)], np.float32)
    np.testing.assert_array_equal(nulls["uniform attention"].lse, np.broadcast_to(log_n, (B, H, Nq)))
    assert (nulls["zeros"].out == 0).all() and (nulls["zeros"].lse[..., 1:] == 0).all()
    shifted = nulls["queries shifted by one row"]
    np.testing.assert_allclose(shifted.out[:, :, 2:], ref.out[:, :, 1:-1], rtol=2e-7, atol=0)
    np.testing.assert_allclose(shifted.lse[:, :, 2:], ref.lse[:, :, 1:-1], rtol=2e-7)
    another = nulls["another q"]
    for g in groups(p):
        dense = {n.name: n for n in null_outputs(g.dense, reference(g.dense), "fp32")}["another q"]
        np.testing.assert_array_equal(another.out[g.b, g.heads], dense.out[0].astype(np.float64) * g.v_descale)
        np.testing.assert_array_equal(another.lse[g.b, g.heads], dense.lse[0])
    for null in nulls.values():
        assert null.out.dtype == np.float64 and null.lse.dtype == np.float32
        assert (null.out[:, :, 0] == 0).all() and (null.lse[:, :, 0] == -np.inf).all()
        assert not null.exact_out and not null.exact_lse
    bf16 = _fp8_nulls(p, "bf16")["uniform attention"]
    assert bf16.out.dtype == numpy_dtype("bf16")
    np.testing.assert_array_equal(bf16.out, round_to(uniform, "bf16"))


def test_an_fp8_trivial_output_is_the_right_answer_only_where_it_is_in_every_group():
    """Exactness of an FP8 trivial output is the AND over the (batch, kv head) groups: one key
    makes uniform attention exact in O everywhere; v = 0 makes zeros exact in O and q = 0
    uniform attention exact in the LSE, but only if every group has it (here, with two groups,
    only the first or both); a lone group (B = Hkv = 1) is judged alone."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.uniform(-2, 2, shape) for shape in ((2, 2, 3, 4), (2, 1, 3, 4), (2, 1, 3, 4)))
    dv = np.array([[0.3], [1.7]], np.float32)
    one_key = _fp8_nulls(_fp8_problem(q, k[:, :, :1], v[:, :, :1], dv))
    assert one_key["uniform attention"].exact_out is True and one_key["zeros"].exact_out is False
    assert one_key["uniform attention"].exact_lse is False  # log 1 = 0 is not the score
    for both in (False, True):
        first = slice(None) if both else slice(0, 1)
        v0, q0 = v.copy(), q.copy()
        v0[first], q0[first] = 0, 0
        assert _fp8_nulls(_fp8_problem(q, k, v0, dv))["zeros"].exact_out is both
        uniform = _fp8_nulls(_fp8_problem(q0, k, v, dv))["uniform attention"]
        assert uniform.exact_lse is both and uniform.exact_out is both
    alone = _fp8_nulls(_fp8_problem(np.zeros((1, 2, 3, 4)), k[:1], v[:1], dv[:1]))
    assert list(alone) == ["zeros", "uniform attention", "queries shifted by one row", "another q"]
    assert alone["uniform attention"].exact_lse is True and alone["zeros"].exact_lse is False


def _judged_against(c, out_bound, lse, lse_bound):
    """The zeros output of a fixed problem judged against a made-up reference: O = c and
    LSE = `lse` everywhere, with these bounds. Non-causal, Nk = 3, D = 2: slack = 9 u64; the
    largest attended |v| is 4 in both heads, at key 0 in d = 0 in head 0, at key 2 (the last)
    in d = 0 in head 1; d = 1 and the other keys stay at or below 1."""
    from fa_verify import AttentionProblem
    from fa_verify.oracle.result import Reference

    v = np.array([[[4, 0.25], [0.5, 1], [1, 0.5]], [[0.5, 1], [1, 0.5], [4, 0.25]]], np.float32)[None]
    p = AttentionProblem(np.ones((1, 2, 2, 2), np.float32), np.ones((1, 2, 3, 2), np.float32), v)
    ones = np.ones(p.out_shape)
    ref = Reference(out=c * ones, lse=lse * ones[..., 0], out_bound=out_bound * ones,
                    lse_bound=lse_bound * ones[..., 0], row_scale=ones, method="certified")
    return {n.name: n for n in null_outputs(p, ref, "fp32")}["zeros"]


def test_a_trivial_output_is_exact_up_to_the_bound_plus_nk_plus_d_plus_4_float64_roundings():
    """O: |out - ref.out| <= out_bound + (Nk + D + 4) u64 max attended |v| (the largest over
    every attended key and coordinate: 4 here, not the last key's or one coordinate's 1); LSE:
    <= lse_bound + (Nk + D + 4) u64 (1 + |ref.lse|). At equality (all exact in float64) it is
    the right answer; a quarter of the slack further on O, one ulp further on the LSE, or the
    LSE's slack term alone at 1.5 slack, it is not."""
    slack = (3 + 2 + 4) * 2.0 ** -53
    b = 2.0 ** -40
    assert _judged_against(b + 4 * slack, b, 0.0, 0.0).exact_out
    assert not _judged_against(b + 4.25 * slack, b, 0.0, 0.0).exact_out
    assert _judged_against(0.0, 0.0, 1.0, 1 - 2 * slack).exact_lse  # 1 <= (1 - 2 slack) + slack (1 + 1)
    assert not _judged_against(0.0, 0.0, 1.0, 1 - 2 * slack - 2.0 ** -53).exact_lse
    assert not _judged_against(0.0, 0.0, 1.5 * slack, 0.0).exact_lse  # 1.5 slack > slack (1 + 1.5 slack)
