"""Outputs a target must write and inputs it must not: guarded output buffers, input snapshots,
determinism on fresh allocations. Each check is shown failing a deliberately bad target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fa_verify import AttentionProblem, PrecisionModel
from fa_verify.backends import CallableBackend
from fa_verify.backends.buffers import SENTINEL_BITS, GuardedOutput, check_written
from fa_verify.backends.cuda_kernels import cpu_runner_availability, run_on_cpu
from fa_verify.backends.naive import naive_attention
from fa_verify.backends.user_callable import output_parameters
from fa_verify.errors import BackendOutputError, InvalidArgumentError
from fa_verify.kernels import get_family
from fa_verify.properties import as_backend, check_determinism, check_oracle_agreement, search_property
from fa_verify.properties import Selection
from fa_verify.strategies import make_problem

CPU = cpu_runner_availability()
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)
FAULTS = Path(__file__).parent / "cuda_cpu_kernels" / "faults.cu"
BASICS = Path(__file__).parent / "cuda_cpu_kernels" / "basics.cu"


def attention(q, k, v, causal, scale):
    problem = AttentionProblem(q, k, v, causal=causal, scale=scale)
    return naive_attention(problem, PrecisionModel.flash(problem.dtype))


def problem(dtype="fp16", causal=False):
    return make_problem("normal", (1, 2, 1, 9, 11, 16), dtype, 1, causal=causal)


# --- inputs must come back bitwise unchanged --------------------------------------------------------


def test_a_run_function_that_writes_into_q_is_reported_with_the_first_changed_index():
    def scribbles(p):
        out, lse = attention(p.q, p.k, p.v, p.causal, p.scale_value)
        p.q[0, 1, 3, 2] += 1
        return out, lse

    with pytest.raises(BackendOutputError, match=r"wrote into its input q: 1 elements changed, first at \[0, 1, 3, 2\]"):
        as_backend(scribbles).run(problem())


def test_a_callable_that_writes_into_v_fails_the_property_search():
    def scribbles(q, k, v, *, causal, scale):
        out = attention(q, k, v, causal, scale)
        v[..., -1, :] = 0  # writes into the last key's value row after using it
        return out

    outcome = search_property(CallableBackend(scribbles), "oracle_agreement", Selection(max_examples=3))
    assert outcome.status == "failed"
    assert "wrote into its input v" in outcome.failure.detail


def test_torch_callables_are_checked_too():
    torch = pytest.importorskip("torch")

    def scribbles(q, k, v, *, causal, scale):
        k.mul_(2)
        return torch.zeros_like(q)

    with pytest.raises(BackendOutputError, match="wrote into its input k"):
        CallableBackend(scribbles, array="torch").run(problem())


# --- the out= / lse= form of the callable protocol ----------------------------------------------------


def fills(skip_row=None, past_end=0, lse=True):
    """An out=/lse= protocol function; it may skip a query row or write `past_end` elements too far."""

    def fill(q, k, v, *, causal, scale, out, lse=None):
        # torch tensors (array="torch") as numpy views of the same memory
        q, k, v, out, lse = (x.numpy() if hasattr(x, "numpy") else x for x in (q, k, v, out, lse))
        o, l = attention(q, k, v, causal, scale)
        rows = [i for i in range(out.shape[2]) if i != skip_row]
        out[:, :, rows] = o[:, :, rows]
        if lse is not None:
            lse[...] = l
        if past_end:
            flat = out.reshape(-1)
            np.lib.stride_tricks.as_strided(flat, (flat.size + past_end,), flat.strides)[flat.size:] = 0

    if not lse:
        return lambda q, k, v, *, causal, scale, out: fill(q, k, v, causal=causal, scale=scale, out=out)
    return fill


def test_the_out_form_is_detected_from_the_signature():
    assert output_parameters(fills()) == ("out", "lse")
    assert output_parameters(fills(lse=False)) == ("out",)
    assert output_parameters(attention) == ()
    with pytest.raises(InvalidArgumentError, match="takes lse= but not out="):
        output_parameters(lambda q, k, v, *, causal, scale, lse: None)


@pytest.mark.parametrize("array", ["numpy", "torch"])
def test_a_correct_out_form_function_passes(array):
    if array == "torch":
        pytest.importorskip("torch")
    backend = CallableBackend(fills(), array=array)
    p = problem()
    out, lse = backend.run(p)
    assert lse is not None and check_oracle_agreement(backend, p).passed
    out_only, no_lse = CallableBackend(fills(lse=False), array=array).run(p)
    assert no_lse is None and np.array_equal(out_only, out)


def test_an_unwritten_row_is_reported_with_its_index():
    with pytest.raises(BackendOutputError, match=r"out: 32 / 288 elements never written \(first at \[0, 0, 4, 0\]"):
        CallableBackend(fills(skip_row=4)).run(problem())


def test_a_write_past_the_end_is_reported():
    with pytest.raises(BackendOutputError, match=r"out: 3 elements written past its end \(first at flat element 288, 1 past"):
        CallableBackend(fills(past_end=3)).run(problem())


def test_an_unwritten_row_in_bshd_layout_is_reported_in_that_layout():
    def fill(q, k, v, *, causal, scale, out):  # bshd: out is [B, Nq, H, D]; row 2 of head 1 skipped
        o, _ = attention(*(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)), causal, scale)
        o = o.transpose(0, 2, 1, 3)
        out[:, :2], out[:, 3:], out[:, 2, 0] = o[:, :2], o[:, 3:], o[:, 2, 0]

    with pytest.raises(BackendOutputError, match=r"16 / 288 elements never written \(first at \[0, 2, 1, 0\] of \[1, 9, 2, 16\]"):
        CallableBackend(fill, layout="bshd").run(problem())


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_the_sentinel_is_a_nan_of_every_dtype_and_not_the_canonical_one(dtype):
    from fa_verify.dtypes import numpy_dtype

    buffer = GuardedOutput.allocate("out", (2, 3), numpy_dtype(dtype))
    assert np.isnan(buffer.buffer.astype(np.float32)).all()
    with np.errstate(invalid="ignore"):
        computed = (np.zeros(2, np.float32) / 0).astype(numpy_dtype(dtype))  # the NaN arithmetic gives
    bits = computed.view(np.uint16 if computed.itemsize == 2 else np.uint32)
    assert np.isnan(computed.astype(np.float32)).all() and (bits != SENTINEL_BITS[computed.itemsize]).all()
    buffer.view[...] = np.nan  # a computed NaN counts as written
    check_written("t", buffer)


# --- the CUDA-on-CPU runner ------------------------------------------------------------------------------


@needs_cpu_runner
@pytest.mark.parametrize("isolated", [True, False])
def test_the_runner_passes_pointers_into_guarded_buffers(isolated):
    from fa_verify.cuda_cpu import CpuKernelModule, Inside

    faults = CpuKernelModule(FAULTS, {"write_past_end": ["ptr", "int"]}, isolated=isolated)
    out = GuardedOutput.allocate("out", (100,), np.float32)
    faults.launch("write_past_end", grid=1, block=128, args=[Inside(out.buffer, out.offset), 100])
    with pytest.raises(BackendOutputError, match=r"1 elements written past its end \(first at flat element 100"):
        check_written("write_past_end", out)
    basics = CpuKernelModule(BASICS, {"vector_add": ["ptr", "ptr", "ptr", "int"]}, isolated=isolated)
    a = np.ones(100, np.float32)
    out = GuardedOutput.allocate("c", (100,), np.float32)
    basics.launch("vector_add", grid=1, block=128, args=[a, a, Inside(out.buffer, out.offset), 90])
    with pytest.raises(BackendOutputError, match=r"c: 10 / 100 elements never written \(first at \[90\]"):
        check_written("vector_add", out)


class OutOfBounds:
    """A stand-in kernel module: computes the right answer, then writes one element past o's end
    (or before its start)."""

    def __init__(self, problem, before=False):
        self.problem, self.before = problem, before

    def launch(self, entry, grid, block, shared, args, **options):
        o, lse = args[3], args[4]
        out, l = naive_attention(self.problem, get_family("fa2").precision(self.problem.dtype))
        size = out.size
        o.array[o.offset:o.offset + size] = out.reshape(-1).view(o.array.dtype)
        lse.array[lse.offset:lse.offset + l.size] = l.reshape(-1)
        o.array[o.offset - 1 if self.before else o.offset + size] = 0


@needs_cpu_runner
@pytest.mark.parametrize("before", [False, True])
def test_run_on_cpu_reports_writes_outside_o(before):
    p = problem("fp32")
    where = "before its start" if before else "past its end"
    with pytest.raises(BackendOutputError, match=f"o: 1 elements written {where}"):
        run_on_cpu(get_family("fa2"), p, module=OutOfBounds(p, before))


# --- determinism on fresh allocations ----------------------------------------------------------------


def test_determinism_runs_on_fresh_copies():
    """A nondeterministic target that memoises by input address passed when determinism ran the
    same arrays twice; on fresh copies it is caught."""
    cache = {}

    def memoised(p):
        key = p.q.ctypes.data
        if key not in cache:  # each computation comes out a little different
            out, lse = attention(p.q, p.k, p.v, p.causal, p.scale_value)
            cache[key] = (out + np.float16(len(cache) * 1e-3), lse)
        return cache[key]

    result = check_determinism(memoised, problem())
    assert result.failed and "fresh copies" in result.detail


@needs_cpu_runner
def test_the_runner_reads_inputs_inside_their_nan_padding():
    from fa_verify.backends.cuda_kernels import CpuKernelBackend
    from fa_verify.judge.mutants import MutantBackend
    from fa_verify.kernels.mutants import load_mutants
    from fa_verify.properties import check_nan_padding, check_oracle_agreement

    p = make_problem("normal", (1, 1, 1, 5, 7, 16), "fp16", 0)
    assert check_nan_padding(CpuKernelBackend("fa2"), p).passed
    reads_past = MutantBackend({m.name: m for m in load_mutants()}["fa2-tile-read-out-of-bounds"])
    # The worker's NaN-filled guards around every argument make even the plain run read NaN.
    out, _ = reads_past.run(p)
    assert np.isnan(out.astype(np.float32)).any()
    result = check_oracle_agreement(reads_past, p)
    assert result.failed and "nan" in result.detail.lower()
