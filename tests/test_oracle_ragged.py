"""The oracle and the error model of ragged batches (fa_verify.oracle.ragged): the certified
reference of every sequence within its bound of the mpmath definition on adversarial batches,
in the layout's shapes, and a correct ragged backend within the error model."""

import numpy as np
import pytest
from test_oracle import _assert_within_bounds

from fa_verify import AttentionProblem
from fa_verify.backends.numpy_ragged import NumpyRaggedBackend
from fa_verify.error_model import error_bound
from fa_verify.oracle import reference
from fa_verify.oracle.ragged import ragged_error_bound, reference_ragged
from fa_verify.precision import PrecisionModel
from fa_verify.ragged import PageLayout, RaggedProblem


def _batch(lengths, dtype="fp32", spread=1.0, h=2, hkv=1, d=8, seed=0, alibi=None, **options):
    rng = np.random.default_rng(seed)
    seqs = [AttentionProblem.from_float(rng.standard_normal((1, h, nq, d)) * spread,
                                        rng.standard_normal((1, hkv, nk, d)) * spread,
                                        rng.standard_normal((1, hkv, nk, d)), dtype,
                                        alibi_slopes=None if alibi is None else alibi[b], **options)
            for b, (nq, nk) in enumerate(lengths)]
    return RaggedProblem(seqs, "varlen")


def _paged(problem, page_size, seed=0):
    layout = PageLayout.contiguous(problem.seqlens_k, page_size, spare_blocks=1)
    return problem.as_paged(layout.shuffled(np.random.default_rng(seed), problem.seqlens_k))


CASES = {
    # single query / single key sequences beside longer ones
    "lengths_one": _batch([(1, 1), (4, 9), (1, 7), (3, 1)], "fp16", spread=3.0),
    # Nq_b > Nk_b under bottom-right causal: rows before the diagonal see no key, per sequence
    "causal_rows_without_keys": _batch([(6, 2), (1, 1), (5, 8)], causal=True),
    # window (0, 0): one key per row, none for rows whose diagonal falls before key 0
    "window_zero_rows_without_keys": _batch([(7, 3), (2, 5), (4, 4)], window_size=(0, 0)),
    "window_with_sink_rows_without_keys": _batch([(6, 2), (3, 9)], window_size=(1, 0), sinks=[2.0, -5.0]),
    # large logits, a binding softcap, per-sequence ALiBi slopes (huge and negative)
    "softcap_alibi_per_sequence": _batch([(3, 5), (1, 11), (4, 2)], "bf16", spread=5.0, softcap=0.5,
                                         alibi=[[1e4, -30.0], [0.5, 0.25], [0.0, 8.0]]),
    # decode: Nq = 1 against long caches, GQA
    "decode": _batch([(1, 33), (1, 1), (1, 17)], "fp16", h=4, hkv=2, causal=True, window_size=(8, 0)),
    # speculative decode: a few queries each, paged-compatible (equal Nq), a sink
    "speculative": _batch([(3, 3), (3, 12), (3, 5)], "bf16", causal=True, sinks=[1.0, -1.0]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_certified_within_bound_of_mpmath_per_sequence(name):
    problem = CASES[name]
    fast, exact = reference_ragged(problem), reference_ragged(problem, method="mpmath")
    for seq_fast, seq_exact in zip(fast.sequences, exact.sequences):
        _assert_within_bounds(seq_fast, seq_exact)
    # the layout's arrays are the sequences' arrays
    assert fast.out.shape == problem.out_shape and fast.lse_bound.shape == problem.lse_shape
    for (out, lse), seq in zip(problem.split(fast.out_bound, fast.lse), fast.sequences):
        assert np.array_equal(out, seq.out_bound) and np.array_equal(lse, seq.lse)


def test_rows_without_keys_follow_the_convention_in_the_layouts():
    problem = CASES["causal_rows_without_keys"]  # sequence 0: rows 0..3 see no key
    ref = reference_ragged(problem)
    assert (ref.lse[:, :4] == -np.inf).all() and (ref.out[:4] == 0).all() and np.isfinite(ref.lse[:, 4:]).all()
    with_sink = reference_ragged(CASES["window_with_sink_rows_without_keys"])
    # sequence 0 (Nq 6, Nk 2), window (1, 0): rows 0..2 see no key, LSE = the sink of each head
    np.testing.assert_array_equal(with_sink.lse[:, :3], [[2.0] * 3, [-5.0] * 3])
    paged = reference_ragged(_paged(CASES["decode"], 4))
    assert paged.out.shape == (3, 1, 4, 8) and paged.lse.shape == (3, 4, 1)


@pytest.mark.parametrize("name, layout", [("lengths_one", "varlen"), ("softcap_alibi_per_sequence", "varlen"),
                                          ("decode", "paged"), ("speculative", "paged")])
def test_a_correct_ragged_backend_is_within_the_error_model(name, layout):
    problem = CASES[name] if layout == "varlen" else _paged(CASES[name], 2)
    out, lse = NumpyRaggedBackend(layout).run(problem)
    ref = reference_ragged(problem)
    bound = ragged_error_bound(problem, PrecisionModel.flash(problem.dtype), ref)
    assert bound.out.shape == problem.out_shape and bound.lse.shape == problem.lse_shape
    assert (np.abs(out.astype(np.float64) - ref.out) <= bound.out).all()
    finite = np.isfinite(ref.lse)
    assert (np.abs(lse[finite] - ref.lse[finite]) <= bound.lse[finite]).all()
    assert (lse[~finite] == -np.inf).all()


# --- What reference_ragged and ragged_error_bound pass to each sequence and keep ----------------

def test_reference_ragged_passes_the_digits_to_every_sequence():
    """reference_ragged(method="mpmath", digits=15) is reference(seq, "mpmath", 15) per sequence,
    kept in `sequences`, and differs from the default 50 digits somewhere (else nothing is pinned)."""
    problem = CASES["lengths_one"]
    ref = reference_ragged(problem, method="mpmath", digits=15)
    assert len(ref.sequences) == len(problem.sequences)
    for seq, got in zip(problem.sequences, ref.sequences, strict=True):
        want = reference(seq, "mpmath", 15)
        for name in ("out", "lse", "out_bound", "lse_bound"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    default = reference_ragged(problem, method="mpmath")
    assert not np.array_equal(default.out_bound, ref.out_bound)


def test_ragged_error_bound_passes_lambda_and_keeps_each_sequence_bound():
    """ragged_error_bound(..., "probabilistic", lam) is error_bound of every sequence with that
    lambda, each kept in `sequences`; lam = 2 against 33 keys gives another bound than the default
    (n > lam^2: the probabilistic gamma is below the worst case)."""
    problem = CASES["decode"]
    precision = PrecisionModel.flash(problem.dtype)
    ref = reference_ragged(problem)
    bound = ragged_error_bound(problem, precision, ref, "probabilistic", 2.0)
    assert len(bound.sequences) == len(problem.sequences)
    for seq, r, got in zip(problem.sequences, ref.sequences, bound.sequences, strict=True):
        want = error_bound(seq, precision, r, "probabilistic", 2.0)
        np.testing.assert_array_equal(got.out, want.out)
        np.testing.assert_array_equal(got.lse, want.lse)
    for (out, lse), seq in zip(problem.split(bound.out, bound.lse), bound.sequences, strict=True):
        assert np.array_equal(out, seq.out) and np.array_equal(lse, seq.lse)
    default = ragged_error_bound(problem, precision, ref, "probabilistic")
    assert not np.array_equal(default.out, bound.out)
