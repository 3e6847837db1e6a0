"""Ragged batches (fa_verify.ragged): validation, the layouts' round trips, the ragged backend base."""

import numpy as np
import pytest

from fa_verify import AttentionProblem, InvalidProblemError
from fa_verify.backends.buffers import SENTINEL_BITS
from fa_verify.backends.base import Backend
from fa_verify.backends.buffers import output_buffers
from fa_verify.backends.numpy_ragged import NumpyRaggedBackend
from fa_verify.errors import BackendOutputError, InvalidArgumentError
from fa_verify.precision import PrecisionModel
from fa_verify.ragged import PageLayout, RaggedProblem

LENGTHS = ((3, 5), (3, 1), (3, 9))  # (Nq_b, Nk_b)


def _sequences(lengths=LENGTHS, dtype="fp16", seed=0, h=4, hkv=2, d=8, **options):
    rng = np.random.default_rng(seed)
    return [AttentionProblem.from_float(rng.standard_normal((1, h, nq, d)), rng.standard_normal((1, hkv, nk, d)),
                                        rng.standard_normal((1, hkv, nk, d)), dtype, **options)
            for nq, nk in lengths]


def _varlen(**kwargs):
    return RaggedProblem(_sequences(**kwargs), "varlen")


def _paged(page_size=4, **kwargs):
    problem = _varlen(**kwargs)
    return problem.as_paged(PageLayout.contiguous(problem.seqlens_k, page_size, spare_blocks=2))


def _same_sequences(a: RaggedProblem, b: RaggedProblem) -> bool:
    return len(a.sequences) == len(b.sequences) and all(
        all(np.array_equal(getattr(x, n), getattr(y, n)) for n in "qkv") for x, y in zip(a.sequences, b.sequences))


# --- validation ---------------------------------------------------------------------------------
def _varlen_args(**changes):
    args = _varlen().varlen_inputs()
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, message", [
    (dict(cu_seqlens_q=np.array([0, 3, 2, 9], np.int32)), r"cu_seqlens_q must be non-decreasing .* cu_seqlens_q\[2\]=2 < cu_seqlens_q\[1\]=3"),
    (dict(cu_seqlens_k=np.array([1, 5, 6, 15], np.int32)), r"cu_seqlens_k\[0\]=1 must be 0"),
    (dict(cu_seqlens_k=np.array([0, 5, 6, 14], np.int32)), r"cu_seqlens_k\[-1\]=14 must be the number of packed rows, 15"),
    (dict(cu_seqlens_q=np.array([0, 3, 9], np.int32)), r"cu_seqlens_q has 3 entries and cu_seqlens_k 4"),
    (dict(cu_seqlens_q=np.array([0.0, 3, 6, 9])), r"cu_seqlens_q must be an integer array \[B\+1\]"),
    (dict(cu_seqlens_k=np.array([0, 6, 6, 15], np.int32)), r"sequence 1 has Nk = 0 .* empty sequences are not supported"),
    (dict(max_seqlen_k=8), r"max_seqlen_k=8 is below the longest sequence \(9\)"),
    (dict(q=np.zeros((9, 4, 8, 1), np.float16)), r"q must be a numpy array \[total, heads, D\]"),
])
def test_varlen_inputs_are_validated_naming_the_argument(changes, message):
    args = _varlen_args(**changes)
    with pytest.raises(InvalidProblemError, match=message):
        RaggedProblem.from_varlen(**args)


def _paged_args(**changes):
    args = _paged().paged_inputs(fill=0.0)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, message", [
    (dict(block_table=np.array([[0, 1, 0], [2, 0, 0], [3, 9, 5]], np.int32)),
     r"block_table\[2, 1\]=9 points past the cache's num_blocks=8 pages \(valid: 0 .. 7\); sequence 2 uses that page for its keys 4 .. 7"),
    (dict(block_table=np.array([[0, 1, 0], [-1, 0, 0], [3, 4, 5]], np.int32)), r"block_table\[1, 0\]=-1 points past"),
    (dict(cache_seqlens=np.array([5, 1, 13], np.int32)),
     r"cache_seqlens\[2\]=13 is beyond the block table's capacity max_blocks\*page_size = 3\*4 = 12"),
    (dict(cache_seqlens=np.array([5, 0, 9], np.int32)), r"sequence 1 has Nk = 0 .* not supported"),
    (dict(cache_seqlens=np.array([5, 1], np.int32)), r"cache_seqlens must be an integer array \[B\] = \[3\]"),
    (dict(block_table=np.zeros((2, 3), np.int32)), r"block_table has 2 rows for B=3"),
    (dict(block_table=np.zeros((3, 3))), r"block_table must be an integer array \[B, max_blocks\]"),
])
def test_paged_inputs_are_validated_naming_the_argument(changes, message):
    with pytest.raises(InvalidProblemError, match=message):
        RaggedProblem.from_paged(**_paged_args(**changes))


def test_table_entries_past_a_sequence_are_never_validated_nor_read():
    args = _paged_args()
    args["block_table"][1, 1:] = [-7, 10**6]  # sequence 1 has one key: only entry 0 is read
    assert _same_sequences(RaggedProblem.from_paged(**args), _paged())


@pytest.mark.parametrize("make, message", [
    (lambda: RaggedProblem(_sequences() + _sequences(dtype="fp32")[:1], "varlen"), r"sequence 3 disagrees .* dtype fp16 vs fp32"),
    (lambda: RaggedProblem(_sequences() + _sequences(hkv=1)[:1], "varlen"), r"sequence 3 disagrees .* Hkv 2 vs 1"),
    (lambda: RaggedProblem(_sequences() + _sequences(d=16)[:1], "varlen"), r"D 8 vs 16"),
    (lambda: RaggedProblem(_sequences() + _sequences(causal=True)[:1], "varlen"), r"causal False vs True"),
    (lambda: RaggedProblem(_sequences() + _sequences(softcap=5.0)[:1], "varlen"), r"softcap 0.0 vs 5.0"),
    (lambda: RaggedProblem(_sequences() + _sequences(window_size=(2, 0))[:1], "varlen"), r"window_size"),
    (lambda: RaggedProblem(_sequences() + _sequences(sinks=np.zeros(4))[:1], "varlen"), r"on sinks"),
    (lambda: RaggedProblem(_sequences(), "ragged"), r"layout='ragged'; use one of"),
    (lambda: RaggedProblem(_sequences(), "paged"), r"layout='paged' needs pages=PageLayout"),
    (lambda: RaggedProblem(_sequences(((1, 2), (2, 2))), "paged", PageLayout.contiguous([2, 2], 2)),
     r"every sequence needs the same Nq, got \[1, 2\]"),
    (lambda: RaggedProblem(_sequences(), "varlen", num_splits=-1), r"num_splits=-1 must be an integer >= 0"),
    (lambda: RaggedProblem((), "varlen"), r"at least one sequence"),
    (lambda: PageLayout(0, np.zeros((1, 1), np.int32), 1), r"page_size=0 must be an integer >= 1"),
    (lambda: RaggedProblem.from_varlen(**_varlen_args(), alibi_slopes=np.ones((2, 4))),
     r"alibi_slopes.shape=\[2, 4\] must be \[H\] or \[B, H\] with B=3"),
    (lambda: RaggedProblem.from_varlen(**_varlen_args(), window_size=(-3, 0)), r"left=-3 is below -1"),
])
def test_inconsistent_batches_are_rejected(make, message):
    with pytest.raises(InvalidProblemError, match=message):
        make()


def test_a_shared_page_must_hold_the_same_keys_for_every_sequence_using_it():
    seqs = _sequences(((2, 4), (2, 6)))
    table = np.array([[0, 0], [0, 1]], np.int32)  # both sequences' keys 0..3 in page 0
    with pytest.raises(InvalidProblemError, match=r"key 0 of sequence 0 in page 0 slot 0, which another key"):
        RaggedProblem(seqs, "paged", PageLayout(4, table, 2))
    shared_k = np.concatenate([seqs[0].k, seqs[1].k[:, :, 4:]], axis=2)
    shared_v = np.concatenate([seqs[0].v, seqs[1].v[:, :, 4:]], axis=2)
    seqs[1] = seqs[1].replace(k=shared_k, v=shared_v)
    problem = RaggedProblem(seqs, "paged", PageLayout(4, table, 2))
    assert _same_sequences(RaggedProblem.from_paged(**problem.paged_inputs()), problem)


# --- layouts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_varlen_inputs_round_trip(dtype):
    problem = RaggedProblem(_sequences(((3, 5), (1, 1), (7, 2)), dtype, causal=True, window_size=(2, 1)), "varlen")
    inputs = problem.varlen_inputs()
    assert inputs["q"].shape == (11, 4, 8) and inputs["k"].shape == (8, 2, 8)
    assert inputs["cu_seqlens_q"].tolist() == [0, 3, 4, 11] and inputs["cu_seqlens_k"].dtype == np.int32
    assert (inputs["max_seqlen_q"], inputs["max_seqlen_k"]) == (7, 5)
    # sequence 2's rows are rows 4..10 of q, head-major in the dense problem
    assert np.array_equal(inputs["q"][4:11].transpose(1, 0, 2), problem.sequences[2].q[0])
    again = RaggedProblem.from_varlen(**inputs, **{k: v for k, v in problem.options.items() if k != "alibi_slopes"})
    assert _same_sequences(again, problem) and again.window_size == (2, 1) and again.causal


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_inputs_round_trip_with_a_shuffled_table(page_size):
    problem = _paged(page_size)
    shuffled = problem.as_paged(problem.pages.shuffled(np.random.default_rng(3), problem.seqlens_k))
    assert not np.array_equal(shuffled.pages.block_table, problem.pages.block_table)
    for p in (problem, shuffled):
        inputs = p.paged_inputs()
        assert inputs["q"].shape == (3, 3, 4, 8) and inputs["cache_seqlens"].tolist() == [5, 1, 9]
        assert inputs["k_cache"].shape == (p.pages.num_blocks, page_size, 2, 8)
        # every slot no sequence uses holds the fill: 15 keys in the cache, the rest NaN
        assert int(np.isnan(inputs["k_cache"][..., 0, 0]).sum()) == p.pages.num_blocks * page_size - 15
        assert _same_sequences(RaggedProblem.from_paged(**inputs), problem)
    # key 6 of sequence 2 lives in slot 6 % page_size of its table's page 6 // page_size
    inputs = shuffled.paged_inputs()
    page = inputs["block_table"][2, 6 // page_size]
    assert np.array_equal(inputs["k_cache"][page, 6 % page_size], problem.sequences[2].k[0, :, 6])


def test_alibi_slopes_per_sequence_come_from_the_batch_rows():
    slopes = np.arange(12, dtype=np.float32).reshape(3, 4) / 16
    problem = RaggedProblem.from_varlen(**_varlen_args(), alibi_slopes=slopes)
    assert np.array_equal(problem.sequences[1].alibi_slopes, slopes[1])
    assert np.array_equal(problem.alibi_slopes, slopes) and problem.features == ("alibi",)
    shared = RaggedProblem.from_varlen(**_varlen_args(), alibi_slopes=slopes[0])
    assert shared.alibi_slopes.shape == (4,)


@pytest.mark.parametrize("layout", ["varlen", "paged"])
def test_split_and_join_are_inverse_and_follow_the_layout(layout):
    problem = _paged() if layout == "paged" else _varlen()
    rng = np.random.default_rng(1)
    out = rng.standard_normal(problem.out_shape).astype(np.float16)
    lse = rng.standard_normal(problem.lse_shape).astype(np.float32)
    parts = problem.split(out, lse)
    assert [p[0].shape for p in parts] == [(1, 4, 3, 8)] * 3 and parts[1][1].shape == (1, 4, 3)
    # row 1 of sequence 2, head 3: varlen row cu_q[2] + 1, LSE [H, total_q]; paged [B, Nq, H, D], LSE [B, H, Nq]
    if layout == "varlen":
        assert parts[2][0][0, 3, 1, 5] == out[7, 3, 5] and parts[2][1][0, 3, 1] == lse[3, 7]
    else:
        assert parts[2][0][0, 3, 1, 5] == out[2, 1, 3, 5] and parts[2][1][0, 3, 1] == lse[2, 3, 1]
    joined = problem.join(parts)
    assert np.array_equal(joined[0], out) and np.array_equal(joined[1], lse)
    with pytest.raises(InvalidArgumentError, match=r"out.shape=.* is not the"):
        problem.split(out[:-1], lse)


@pytest.mark.parametrize("layout", ["varlen", "paged"])
def test_unwritten_rows_are_named_by_sequence(layout):
    problem = _paged() if layout == "paged" else _varlen()
    out, _ = output_buffers(problem, "fp16")
    out = out.view
    out[...] = 0
    sentinel = np.array(SENTINEL_BITS[2], np.uint16).view(np.float16)
    if layout == "varlen":
        out[4, 1, 2] = sentinel     # sequence 1, row 1
    else:
        out[1, 1, 0, 0] = sentinel  # sequence 1, row 1
    out[-1, ..., -1] = np.nan       # a computed (canonical) NaN is no unwritten row
    assert problem.unwritten_rows(out) == [(1, 1)]


# --- the backend base ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["varlen", "paged"])
def test_numpy_ragged_backend_is_each_sequence_alone(layout):
    from fa_verify.backends.numpy_tiled import tiled_attention

    problem = _paged() if layout == "paged" else _varlen()
    out, lse = NumpyRaggedBackend(layout).run(problem)
    for seq, (o, l) in zip(problem.sequences, problem.split(out, lse)):
        alone = tiled_attention(seq, PrecisionModel.flash("fp16"))
        assert np.array_equal(o, alone[0]) and np.array_equal(l, alone[1])


class _Writes(Backend):
    kinds, name = ("paged",), "writes"

    def __init__(self, result):
        self.result = result

    def precision(self, dtype):
        return PrecisionModel.flash(dtype)

    def _run(self, problem):
        return self.result(problem, problem.inputs())


def _zeros(problem, inputs):
    return np.zeros(problem.out_shape, np.float16), np.zeros(problem.lse_shape, np.float32)


def _scribbles(problem, inputs):
    inputs["block_table"][0, 0] = 1
    return _zeros(problem, inputs)


@pytest.mark.parametrize("result, message", [
    (lambda p, i: (np.zeros((3, 4, 3, 8), np.float16), None), r"out with shape=\(3, 4, 3, 8\).* \(\[B,Nq,H,D\]\)"),
    (lambda p, i: (_zeros(p, i)[0], np.zeros((3, 3, 4), np.float32)), r"lse with shape=\(3, 3, 4\).*\[B,H,Nq\]"),
    (lambda p, i: (_zeros(p, i)[0].astype(np.float32), None), r"dtype=fp32; expected .* dtype=fp16"),
    (_scribbles, r"wrote into its input block_table"),
])
def test_the_base_checks_what_a_backend_returns_and_leaves(result, message):
    with pytest.raises(BackendOutputError, match=message):
        _Writes(result).run(_paged())


def test_the_base_refuses_what_a_backend_does_not_support():
    backend = _Writes(_zeros)
    with pytest.raises(InvalidArgumentError, match=r"runs paged problems, not varlen ones"):
        backend.run(_varlen())
    with pytest.raises(InvalidArgumentError, match=r"does not split the keys \(num_splits=2\)"):
        backend.run(_paged().replace(num_splits=2))
    with pytest.raises(InvalidArgumentError, match=r"sequence 0: writes does not implement softcap"):
        backend.run(_paged(softcap=2.0))
