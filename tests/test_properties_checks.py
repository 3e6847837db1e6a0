"""Unit tests of the property functions of fa_verify.properties, one family at a time."""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from fa_verify import AttentionProblem
from fa_verify.backends import CallableBackend, get_backend
from fa_verify.errors import AttentionMismatch, InvalidArgumentError
from fa_verify.properties import (
    PASSED,
    UNINFORMATIVE,
    PropertyFailure,
    as_backend,
    check_batch_head_independence,
    check_constant_v,
    check_convex_hull,
    check_determinism,
    check_fully_masked_rows,
    check_key_permutation,
    check_lse_agreement,
    check_masked_key_independence,
    check_merge_law,
    check_nan_padding,
    check_oracle_agreement,
    check_query_permutation,
    check_score_shift,
    check_unbiased_rounding,
    check_v_affinity,
    pad_inputs,
    run_padded,
)
from fa_verify.properties._compare import differing, exceeding
from fa_verify.properties.metamorphic import shifted_keys
from fa_verify.properties.online_softmax import chunk_pieces
from fa_verify.strategies import DISTRIBUTION_NAMES, make_problem

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import attention_variants as variants  # noqa: E402

TILED = get_backend("numpy-tiled")
MODES = [(False, "bottom-right"), (True, "bottom-right"), (True, "top-left")]


def problem(shape=(1, 2, 1, 9, 13, 16), dtype="bf16", causal=False, alignment="bottom-right",
            distribution="normal", seed=0, scale=None):
    return make_problem(distribution, shape, dtype, seed, causal=causal, causal_alignment=alignment, scale=scale)


def variant(name, **options):
    return CallableBackend(getattr(variants, name), name=name, **options)


# --- results, targets, comparisons -----------------------------------------------------------------

def test_result_raises_only_when_failed():
    p = problem()
    ok = check_oracle_agreement(TILED, p)
    assert ok.passed and ok.raise_for_failure() is ok and ok.verdicts[0].passed
    bad = check_oracle_agreement(variant("partial_tiles"), p)
    with pytest.raises(PropertyFailure) as caught:
        bad.raise_for_failure()
    assert isinstance(caught.value, AttentionMismatch) and caught.value.result is bad
    assert "oracle_agreement" in str(caught.value) and "Nq=9" in str(caught.value)


def test_a_run_function_is_a_target_judged_under_flash():
    from fa_verify.backends import tiled_attention
    from fa_verify.precision import PrecisionModel

    def run(p):
        return tiled_attention(p, PrecisionModel.flash(p.dtype))[0]  # out only

    target = as_backend(run, name="mine")
    assert target.name == "mine" and target.precision("fp16") == PrecisionModel.flash("fp16")
    assert check_oracle_agreement(run, problem()).passed
    assert not check_lse_agreement(run, problem()).applicable
    with pytest.raises(InvalidArgumentError, match="only apply to run functions"):
        as_backend(TILED, precision="flash")


def test_comparisons_report_the_worst_element_and_treat_nan_as_a_failure():
    got = np.array([[1.0, 2.0], [3.0, np.nan]])
    want = np.array([[1.0, 2.5], [3.0, 4.0]])
    mismatch, worst = exceeding(got, want, 0.25)
    assert mismatch.count == 2 and mismatch.index == (1, 1) and worst == np.inf
    mismatch, worst = exceeding(got, want, 1.0, where=~np.isnan(got))
    assert mismatch is None and worst == 0.5
    assert differing(np.array([np.nan, -0.0, np.inf]), np.array([np.nan, 0.0, np.inf])) is None
    assert "1 / 2 elements (50%) differ; first at [1]" in differing(np.ones(2), np.array([1, 2.0])).describe("O")


# --- online softmax --------------------------------------------------------------------------------

@pytest.mark.parametrize("alignment", ["bottom-right", "top-left"])
def test_chunk_pieces_give_every_row_exactly_its_visible_keys(alignment):
    for nq, nk in itertools.product(range(1, 6), range(1, 6)):
        p = problem((1, 1, 1, nq, nk, 4), causal=True, alignment=alignment)
        for cuts in itertools.combinations(range(1, nk), min(2, nk - 1)):
            covered = np.zeros((nq, nk), int)
            for a, b in zip((0, *cuts), (*cuts, nk)):
                for piece in chunk_pieces(p, a, b):
                    sub = piece.problem(p)
                    assert alignment == "bottom-right" or sub.nq == sub.nk or not sub.causal
                    covered[piece.rows, piece.keys] += sub.mask
            assert (covered == p.mask).all(), (nq, nk, cuts)


@pytest.mark.parametrize("causal,alignment", MODES)
def test_merge_law_holds_for_a_correct_kernel(causal, alignment):
    for seed in range(6):
        p = problem((2, 2, 1, 17, 33, 16), causal=causal, alignment=alignment, seed=seed,
                    distribution=DISTRIBUTION_NAMES[seed])
        assert check_merge_law(TILED, p, seed=seed).passed


def test_merge_law_catches_a_wrong_lse_and_needs_one():
    p = problem()
    result = check_merge_law(variant("wrong_lse"), p, seed=1)
    assert result.failed and "chunk" in result.detail and "merged LSE vs whole" in result.detail
    assert "Nk=1" in check_merge_law(TILED, problem((1, 1, 1, 3, 1, 8))).detail
    assert "returns no LSE" in check_merge_law(get_backend("torch-sdpa-math"), p).detail


# --- the P.V stage ---------------------------------------------------------------------------------

@pytest.mark.parametrize("distribution", DISTRIBUTION_NAMES)
def test_convexity_properties_hold_for_a_correct_kernel_on_every_distribution(distribution):
    for dtype, (causal, alignment) in itertools.product(("fp16", "bf16", "fp32"), MODES):
        p = problem(dtype=dtype, causal=causal, alignment=alignment, distribution=distribution, seed=3)
        for check in (check_convex_hull, check_constant_v, check_v_affinity):
            result = check(TILED, p) if check is check_convex_hull else check(TILED, p, seed=5)
            # uninformative (tiny inputs: a trivial output passes too) is neither a pass nor a fail
            assert result.status in (PASSED, UNINFORMATIVE), result.message()


def test_convexity_catches_lost_rescaling():
    # scores that grow with the key index: the running max grows at every tile; V positive
    rng = np.random.default_rng(0)
    k = np.linspace(0, 4, 64)[None, None, :, None] * np.ones((1, 1, 64, 16))
    p = AttentionProblem.from_float(np.ones((1, 1, 8, 16)), k, 1 + rng.random((1, 1, 64, 16)), "bf16")
    for check in (check_convex_hull, check_constant_v, check_v_affinity):
        result = check(variant("lost_rescaling"), p) if check is check_convex_hull else \
            check(variant("lost_rescaling"), p, seed=0)
        assert result.failed, check.__name__


def test_v_affinity_requires_an_lse_independent_of_v():
    def run(p):
        out, lse = TILED.run(p)
        return out, lse + np.float32(1e-3) * p.v.astype(np.float32).sum(axis=(2, 3))[:, :, None]

    result = check_v_affinity(run, problem(), seed=2)
    assert result.failed and "LSE changed with V" in result.detail


# --- metamorphic relations -------------------------------------------------------------------------

def test_shifted_keys_are_exact_and_shift_every_key_alike():
    for seed, distribution in enumerate(DISTRIBUTION_NAMES * 3):
        for dtype in ("fp16", "bf16", "fp32"):
            p = problem((2, 4, 2, 5, 11, 1 + seed % 40), dtype=dtype, distribution=distribution, seed=seed)
            grid, moved, shift, coords = shifted_keys(p, np.random.default_rng(seed))
            diff = moved.k.astype(np.float64) - grid.k.astype(np.float64)
            assert (diff == diff[:, :, :1]).all() and np.isfinite(moved.k.astype(np.float64)).all()
            assert np.count_nonzero(diff[0, 0, 0]) == len(coords) and np.abs(shift).max() <= 128


def test_metamorphic_relations_hold_for_a_correct_kernel_and_catch_overflow():
    for causal, alignment in MODES:
        p = problem(causal=causal, alignment=alignment, distribution="large_logits", seed=2)
        for check in (check_key_permutation, check_query_permutation, check_score_shift):
            result = check(TILED, p, seed=4)
            assert result.passed or (causal and not result.applicable), result.message()
    # some shifts push the scores past exp's fp32 range (88.7): a kernel without the max overflows
    assert any(check_score_shift(variant("no_max_subtraction"), problem(dtype="fp32"), seed=s).failed
               for s in range(8))


# --- independence ----------------------------------------------------------------------------------

def test_independence_properties_hold_for_a_correct_kernel():
    for causal, alignment in MODES:
        p = problem((2, 4, 2, 9, 13, 16), causal=causal, alignment=alignment)
        assert check_batch_head_independence(TILED, p, seed=1).passed
        assert check_determinism(TILED, p).passed
        assert check_masked_key_independence(TILED, p, seed=1).applicable == causal


def test_independence_properties_catch_head_mapping_and_nondeterminism():
    p = problem((1, 4, 2, 9, 13, 16))
    # heads 1 and 2 read the wrong kv head (h % 2 instead of h // 2); the seed picks the head
    results = [check_batch_head_independence(variant("gqa_head_mapping"), p, seed=s) for s in range(6)]
    assert any(r.failed and "changed batch 0" in r.detail for r in results)
    assert not check_batch_head_independence(TILED, problem((1, 1, 1, 4, 4, 8))).applicable
    calls = itertools.count()

    def noisy(p):  # every other run's LSE moves by 1e-6
        out, lse = TILED.run(p)
        return out, lse + np.float32(next(calls) % 2 * 1e-6)

    result = check_determinism(noisy, p)
    assert result.failed and "two runs" in result.detail


def test_masked_key_independence_catches_a_kernel_that_sees_masked_keys():
    p = problem((1, 1, 1, 9, 5, 16), causal=True)  # Nq > Nk: top-left lets rows see masked keys
    assert check_masked_key_independence(variant("causal_alignment"), p, seed=0).failed
    sees_all = problem((1, 1, 1, 1, 4, 8), causal=True)
    assert "every row attends" in check_masked_key_independence(TILED, sees_all).detail


# --- fully masked rows -----------------------------------------------------------------------------

def test_fully_masked_rows():
    p = problem((1, 2, 1, 9, 5, 16))
    assert check_fully_masked_rows(TILED, p, seed=0).passed
    result = check_fully_masked_rows(variant("masked_rows_nan"), p, seed=0)
    assert result.failed and "O of fully masked rows (must be 0)" in result.detail
    assert "got NaN where the expected value is finite (0)" in result.detail
    assert not check_fully_masked_rows(TILED, problem((1, 1, 1, 1, 5, 8))).applicable
    top_left_only = variant("tiles_in_order", causal_alignment="top-left")
    assert "cannot run the derived problem" in check_fully_masked_rows(top_left_only, p).detail


# --- NaN padding -----------------------------------------------------------------------------------

def test_padded_inputs_are_contiguous_views_inside_nan():
    p = problem()
    padded = pad_inputs(p, pad_rows=4)
    for view, buffer, offset, original in zip((padded.problem.q, padded.problem.k, padded.problem.v),
                                              padded.buffers, padded.offsets, (p.q, p.k, p.v)):
        assert view.flags.c_contiguous and np.shares_memory(view, buffer)
        assert np.array_equal(view, original) and offset == 4 * p.head_dim
        outside = np.concatenate([buffer[:offset], buffer[offset + view.size:]]).astype(np.float32)
        assert np.isnan(outside).all()


def test_a_numpy_callable_receives_nan_padded_arguments():
    seen = []

    def fn(q, k, v, *, causal, scale):
        seen.append(k)
        return np.zeros_like(q)

    p = problem(dtype="fp32")
    run_padded(CallableBackend(fn), pad_inputs(p, pad_rows=2))
    k = seen[-1]
    assert np.array_equal(k, p.k) and np.isnan(k.base[:2 * p.head_dim]).all()


def test_a_torch_callable_receives_nan_padded_arguments():
    torch = pytest.importorskip("torch")
    seen = []

    def fn(q, k, v, *, causal, scale):
        seen.append(k)
        return torch.zeros_like(q)

    p = problem(dtype="bf16")
    run_padded(CallableBackend(fn, array="torch"), pad_inputs(p, pad_rows=2))
    k = seen[-1]
    before = torch.as_strided(k, (2 * p.head_dim,), (1,), 0)  # the storage in front of k
    assert k.storage_offset() == 2 * p.head_dim and torch.isnan(before).all()


def test_a_backend_hook_gets_the_padded_buffers():
    class Hooked(type(TILED)):
        calls = []

        def run_padded(self, padded):
            self.calls.append(padded)
            return self.run(padded.problem)

    backend = Hooked()
    assert check_nan_padding(backend, problem()).passed and len(Hooked.calls) == 1


def test_nan_padding_catches_reads_past_the_end():
    p = problem((1, 1, 1, 4, 13, 16))  # 13 keys: the last 16-key tile reads 3 rows too many
    assert check_nan_padding(variant("tiles_in_order"), p).passed
    result = check_nan_padding(variant("out_of_bounds"), p)
    assert result.failed and "reads outside its inputs" in result.detail


# --- unbiased rounding -----------------------------------------------------------------------------

def test_unbiased_rounding():
    p = problem((1, 4, 2, 64, 48, 32), dtype="bf16")
    assert check_unbiased_rounding(TILED, p, seed=0).passed
    result = check_unbiased_rounding(variant("truncation"), p, seed=0)
    assert result.failed and "toward zero" in result.detail
    assert "does not dominate" in check_unbiased_rounding(TILED, problem(dtype="fp32")).detail
    assert "too few" in check_unbiased_rounding(TILED, problem((1, 1, 1, 4, 4, 8))).detail
