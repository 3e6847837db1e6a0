"""The CUDA-on-CPU runner: build, schedule, shim numerics, isolation, sanitizer, diagnostics.

The kernels live in tests/cuda_cpu_kernels/. Builds go to the default cache (FA_VERIFY_CACHE), so
a second run starts warm; the cache test uses its own directory.
"""

from __future__ import annotations

import re
import shutil
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fa_verify.cuda_cpu import CpuKernelModule, build
from fa_verify.errors import (
    InvalidArgumentError,
    KernelBuildError,
    KernelCrashError,
    KernelDeadlockError,
    KernelSanitizerError,
    KernelTimeoutError,
)
from pathlib import Path

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
BF16 = ml_dtypes.bfloat16

BASICS = {
    "vector_add": ["ptr", "ptr", "ptr", "int"],
    "block_sum": ["ptr", "ptr", "int"],
    "block_reverse": ["ptr", "ptr"],
    "warp_ops": ["ptr"] * 6,
    "early_exit": ["ptr", "ptr", "int"],
    "barrier_reductions": ["ptr", "ptr"],
    "indices": ["ptr"],
    "racy_shift": ["ptr"],
    "read_unwritten_shared": ["ptr"],
    "atomics": ["ptr", "ptr", "ptr"],
    "hello": ["int"],
    "sync_stress": ["ptr", "ptr", "int"],
}
CONVERT = {
    "float_to_half": ["ptr", "ptr", "int", "int"],
    "half_to_float": ["ptr", "ptr", "int"],
    "double_to_half": ["ptr", "ptr", "int"],
    "float_to_bf16": ["ptr", "ptr", "int", "int"],
    "bf16_to_float": ["ptr", "ptr", "int"],
    "half_arith": ["ptr"] * 4 + ["int"],
    "bf16_arith": ["ptr"] * 4 + ["int"],
}
GEMM = {name: ["ptr"] * 3 + ["int"] * 3 + ["float"] for name in ("gemm_f16_rr", "gemm_f16_rc", "gemm_bf16_rr")}
GEMM["gemm_misaligned"] = ["ptr", "ptr"]
FAULTS = {
    "write_past_end": ["ptr", "int"],
    "read_past_shared": ["ptr"],
    "read_past_dynamic_shared": ["ptr", "int"],
    "write_through": ["ptr"],
    "spin_forever": ["ptr"],
    "barrier_mismatch": ["ptr"],
    "calls_trap": ["ptr"],
}


@pytest.fixture(scope="module")
def basics():
    return CpuKernelModule(KERNELS / "basics.cu", BASICS)


@pytest.fixture(scope="module")
def convert():
    return CpuKernelModule(KERNELS / "convert.cu", CONVERT)


@pytest.fixture(scope="module")
def faults():
    return CpuKernelModule(KERNELS / "faults.cu", FAULTS)


@pytest.fixture(scope="module")
def faults_sanitized():
    return CpuKernelModule(KERNELS / "faults.cu", FAULTS, sanitize=True)


def bits16(a):
    return np.ascontiguousarray(a).view(np.uint16)


# ---- scheduling and memory model -------------------------------------------------------------------


def test_vector_add_over_a_grid_with_a_partial_last_block(basics):
    rng = np.random.default_rng(0)
    n = 1000
    a, b = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    c = np.full(n, -7.0, np.float32)
    basics.launch("vector_add", grid=(n + 127) // 128, block=128, args=[a, b, c, n])
    np.testing.assert_array_equal(c, a + b)


def test_block_reduction_in_static_shared_memory(basics):
    x = np.arange(1000, dtype=np.float32) / 7
    partial = np.zeros(4, np.float32)
    basics.launch("block_sum", grid=4, block=256, args=[x, partial, 1000])
    padded = np.zeros(1024, np.float32)
    padded[:1000] = x
    expected = padded.reshape(4, 256).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(partial, expected, rtol=1e-6)


def test_dynamic_shared_memory_is_per_block(basics):
    data = np.arange(3 * 64, dtype=np.int32)
    out = np.zeros_like(data)
    basics.launch("block_reverse", grid=3, block=64, shared_bytes=64 * 4, args=[data, out])
    np.testing.assert_array_equal(out, data.reshape(3, 64)[:, ::-1].ravel())


def test_warp_shuffles_and_ballot(basics):
    rng = np.random.default_rng(1)
    n = 64
    x = rng.integers(-8, 8, n).astype(np.float32)  # small integers: sums are exact in any order
    outs = [np.zeros(n, np.float32) for _ in range(3)] + [np.zeros(n, np.uint32), np.zeros(n, np.float32)]
    basics.launch("warp_ops", grid=1, block=n, args=[x, *outs])
    sum_xor, sum_down, bcast, ballot, up8 = outs
    warps = x.reshape(2, 32)
    np.testing.assert_array_equal(sum_xor, np.repeat(warps.sum(axis=1), 32))
    np.testing.assert_array_equal(sum_down[[0, 32]], warps.sum(axis=1))
    np.testing.assert_array_equal(bcast, np.repeat(warps[:, 5], 32))
    expected_ballot = [sum(1 << i for i in range(32) if w[i] > 0) for w in warps]
    np.testing.assert_array_equal(ballot, np.repeat(np.array(expected_ballot, np.uint32), 32))
    lane = np.arange(n) % 32
    np.testing.assert_array_equal(up8, np.where(lane % 8 == 0, x, np.roll(x, 1)))


def test_shuffle_from_a_lane_that_does_not_exist_reads_nan(basics):
    x = np.ones(48, np.float32)  # the second warp has 16 lanes; xor 16 names lanes 16-31 of it
    outs = [np.zeros(48, np.float32) for _ in range(3)] + [np.zeros(48, np.uint32), np.zeros(48, np.float32)]
    basics.launch("warp_ops", grid=1, block=48, args=[x, *outs])
    assert (outs[0][:32] == 32).all() and np.isnan(outs[0][32:]).all()
    assert (outs[3][32:] == 0xFFFF).all()  # the ballot counts the lanes that exist


def test_threads_returning_before_a_barrier_do_not_deadlock(basics):
    x = np.arange(128, dtype=np.float32)
    y = np.full(128, -1.0, np.float32)
    n = 50
    basics.launch("early_exit", grid=1, block=128, args=[x, y, n], timeout=20)
    np.testing.assert_array_equal(y[:n], 2 * x[:n][::-1] + 1)
    assert (y[n:] == -1).all()


def test_syncthreads_count_or_and(basics):
    flags = np.zeros(8 * 4, np.int32)
    flags[[3, 17, 30]] = 1
    out = np.zeros(3, np.int32)
    basics.launch("barrier_reductions", grid=1, block=(8, 4), args=[flags, out])
    assert out.tolist() == [3, 1, 0]
    flags[:] = 1
    basics.launch("barrier_reductions", grid=1, block=(8, 4), args=[flags, out])
    assert out.tolist() == [32, 1, 1]


def test_builtin_indices_of_a_3d_launch(basics):
    grid, block = (3, 2, 2), (4, 3, 2)
    n_blocks, n_threads = 12, 24
    out = np.zeros((n_blocks, n_threads, 4), np.int32)
    basics.launch("indices", grid=grid, block=block, args=[out])
    np.testing.assert_array_equal(out[:, :, 0], np.repeat(np.arange(n_blocks)[:, None], n_threads, axis=1))
    np.testing.assert_array_equal(out[:, :, 1], np.repeat(np.arange(n_threads)[None, :], n_blocks, axis=0))
    assert (out[:, :, 2] == 432).all() and (out[:, :, 3] == 322).all()


def test_schedule_orders_are_deterministic_and_expose_races(basics):
    def run(order, seed=0):
        out = np.zeros(64, np.int32)
        basics.launch("racy_shift", grid=1, block=64, args=[out], order=order, seed=seed)
        return out

    forward, reverse = run("forward"), run("reverse")
    np.testing.assert_array_equal(forward, run("forward"))
    np.testing.assert_array_equal(run("shuffle", 3), run("shuffle", 3))
    assert not np.array_equal(forward, reverse)  # the missing barrier shows under one order
    assert (forward[:63] == -1).all()  # unwritten shared memory reads as 0xFFFFFFFF
    np.testing.assert_array_equal(reverse[:63], np.arange(1, 64))


def test_unwritten_shared_memory_reads_as_nan(basics):
    out = np.zeros(64, np.float32)
    basics.launch("read_unwritten_shared", grid=1, block=32, shared_bytes=128, args=[out])
    assert np.isnan(out).all()


def test_atomics(basics):
    counter, total, maximum = np.zeros(1, np.int32), np.zeros(1, np.float32), np.zeros(1, np.uint32)
    basics.launch("atomics", grid=3, block=100, args=[counter, total, maximum])
    assert counter[0] == 300 and total[0] == 150.0 and maximum[0] == 299


def test_device_printf_reaches_the_caller(basics):
    basics.launch("hello", grid=2, block=32, args=[42])
    assert basics.last_output == "hello from the CPU runner: 42\n"


def test_barrier_heavy_loop_matches_numpy(basics):
    rng = np.random.default_rng(2)
    blocks, n, rounds = 2, 128, 40
    x = rng.standard_normal(blocks * n, dtype=np.float32)
    out = np.zeros_like(x)
    basics.launch("sync_stress", grid=blocks, block=n, args=[x, out, rounds])
    v = x.reshape(blocks, n).copy()
    half = np.float32(0.5)
    lane = np.arange(n)
    for r in range(rounds):
        v = half * (v + np.roll(v, -1, axis=1))
        partner = (lane // 32) * 32 + ((lane % 32) ^ (1 + r % 31))
        v = half * (v + v[:, partner])
    np.testing.assert_array_equal(out, v.ravel())


def test_in_process_mode_gives_the_same_results(basics):
    local = CpuKernelModule(KERNELS / "basics.cu", BASICS, isolated=False)
    x = np.arange(1000, dtype=np.float32)
    a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
    basics.launch("block_sum", grid=4, block=256, args=[x, a, 1000])
    local.launch("block_sum", grid=4, block=256, args=[x, b, 1000])
    np.testing.assert_array_equal(a, b)


def test_launch_arguments_are_checked(basics):
    a = np.zeros(8, np.float64)  # the kernel takes float*
    with pytest.raises(InvalidArgumentError, match=r"4-byte elements.*8-byte elements \(dtype float64\)"):
        basics.launch("vector_add", grid=1, block=8, args=[a, a, a, 8])
    with pytest.raises(InvalidArgumentError, match="block"):
        basics.launch("vector_add", grid=1, block=2048, args=[None, None, None, 0])
    with pytest.raises(InvalidArgumentError, match="takes 4"):
        basics.launch("vector_add", grid=1, block=8, args=[None])
    with pytest.raises(InvalidArgumentError, match="not an entry"):
        basics.launch("no_such_kernel", grid=1, block=8)


# ---- fp16 / bf16 bit-exactness ----------------------------------------------------------------------


def _interesting_floats(rng) -> np.ndarray:
    """Random bit patterns over every exponent, plus ties, subnormals and overflow edges of fp16/bf16."""
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    f16_ties = (halves[:-1] + halves[1:]) / 2  # exact midpoints (fit in float32)
    bf16_values = np.arange(0, 0x7F80, 7, dtype=np.uint32) << 16
    bf16_ties = (bf16_values | 0x8000).view(np.float32)
    edges = [0.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e30, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
             2.0**-14, 2.0**-14 * (1 - 2.0**-12), 6e-8, 3.4e38, np.inf, np.nan, 1e-45, 2.0**-133, 2.0**-134]
    values = np.concatenate([random_bits, f16_ties.astype(np.float32), bf16_ties, np.array(edges, np.float32)])
    return np.concatenate([values, -values]).astype(np.float32)


def _directed(rounded: np.ndarray, exact: np.ndarray, mode: int) -> np.ndarray:
    """From round-to-nearest results, the round-toward-zero / down / up ones (nextafter steps)."""
    out = rounded.copy()
    wide, target = rounded.astype(np.float64), exact.astype(np.float64)
    inf = np.array(np.inf, rounded.dtype)
    if mode == 1:
        step = np.abs(wide) > np.abs(target)
        out[step] = np.nextafter(rounded[step], np.zeros_like(rounded[step]))
    elif mode == 2:
        step = wide > target
        out[step] = np.nextafter(rounded[step], np.full_like(rounded[step], -inf))
    else:
        step = wide < target
        out[step] = np.nextafter(rounded[step], np.full_like(rounded[step], inf))
    return out


def _half_bits(x: np.ndarray, mode: int) -> np.ndarray:
    """x rounded to fp16 in `mode`, as bits: numpy's round to nearest, stepped for directed modes."""
    with np.errstate(over="ignore"):
        nearest = x.astype(np.float16)
        return bits16(_directed(nearest, x, mode) if mode else nearest)


def _bf16_bits(x: np.ndarray, mode: int) -> np.ndarray:
    """x rounded to bf16 in `mode`, as bits: ml_dtypes' round to nearest, bit arithmetic for directed modes."""
    if mode == 0:
        return bits16(x.astype(BF16))
    # directed rounding of a sign-magnitude format: drop the low 16 bits, maybe add one
    u = x.view(np.uint32)
    truncated, inexact, negative = (u >> 16).astype(np.uint16), (u & 0xFFFF) != 0, (u >> 31) == 1
    bump = inexact & (negative if mode == 2 else ~negative) if mode != 1 else np.zeros_like(inexact)
    return truncated + bump.astype(np.uint16)


@pytest.mark.parametrize("mode", [0, 1, 2, 3], ids=["rn", "rz", "rd", "ru"])
@pytest.mark.parametrize("entry, seed, expected_bits",
                         [("float_to_half", 3, _half_bits), ("float_to_bf16", 4, _bf16_bits)], ids=["half", "bf16"])
def test_float_to_16_bits_is_bit_exact(convert, entry, seed, expected_bits, mode):
    x = _interesting_floats(np.random.default_rng(seed))
    out = np.zeros(x.size, np.uint16)
    convert.launch(entry, grid=1, block=256, args=[x, out, x.size, mode])
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(out[finite], expected_bits(x[finite], mode))
    assert (out[~finite] == 0x7FFF).all()  # CUDA's canonical NaN


def test_half_and_bf16_to_float_are_exact_for_every_bit_pattern(convert):
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    out = np.zeros(2**16, np.float32)
    convert.launch("half_to_float", grid=1, block=256, args=[patterns.view(np.float16), out, 2**16])
    np.testing.assert_array_equal(out.view(np.uint32), patterns.view(np.float16).astype(np.float32).view(np.uint32))
    convert.launch("bf16_to_float", grid=1, block=256, args=[patterns.view(BF16), out, 2**16])
    np.testing.assert_array_equal(out.view(np.uint32), patterns.astype(np.uint32) << 16)


def test_double_to_half_rounds_once(convert):
    rng = np.random.default_rng(5)
    halves = np.arange(1, 0x7BFF, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = (halves[:-1] + halves[1:]) / 2
    nudged = np.concatenate([ties * (1 + 2.0**-40), ties * (1 - 2.0**-40)])  # float32 would round to the tie
    x = np.concatenate([nudged, rng.standard_normal(5000) * 1000, -nudged])
    out = np.zeros(x.size, np.float16)
    convert.launch("double_to_half", grid=1, block=256, args=[x, out, x.size])
    np.testing.assert_array_equal(bits16(out), bits16(x.astype(np.float16)))


def _round_fraction(value: Fraction, dtype) -> np.ndarray:
    """Round an exact rational to dtype, to nearest, ties to even."""
    guess = np.array(float(value), np.float64).astype(dtype)
    lo = hi = guess
    if Fraction(float(guess)) > value:
        lo = np.nextafter(guess, np.array(-np.inf, dtype))
    else:
        hi = np.nextafter(guess, np.array(np.inf, dtype))
    d_lo, d_hi = value - Fraction(float(lo)), Fraction(float(hi)) - value
    if d_lo != d_hi:
        return lo if d_lo < d_hi else hi
    return lo if int(bits16(np.array([lo]))[0]) % 2 == 0 else hi


@pytest.mark.parametrize("dtype, entry", [(np.float16, "half_arith"), (BF16, "bf16_arith")])
def test_half_precision_arithmetic_rounds_once(convert, dtype, entry):
    rng = np.random.default_rng(6)
    n = 400
    a, b, c = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 30.0], n)).astype(dtype), None, None
    b = (rng.standard_normal(n) * 3).astype(dtype)
    c = (rng.standard_normal(n) * rng.choice([1e-4, 1.0, 100.0], n)).astype(dtype)
    out = np.zeros(4 * n, dtype)
    convert.launch(entry, grid=1, block=128, args=[a, b, c, out, n])
    got = out.reshape(n, 4)
    for i in range(n):
        fa, fb, fc = (Fraction(float(v)) for v in (a[i], b[i], c[i]))
        exact = [fa + fb, fa * fb, fa / fb, fa * fb + fc]
        expected = np.array([_round_fraction(e, dtype) for e in exact], dtype)
        np.testing.assert_array_equal(bits16(got[i]), bits16(expected), err_msg=f"a={a[i]} b={b[i]} c={c[i]}")


# ---- wmma ---------------------------------------------------------------------------------------------


def _fp32_accumulated_gemm(a, b):
    """A @ B with exact products summed in fp32, k ascending: what the runner's mma_sync does."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1]):
        acc += a32[:, k, None] * b32[None, k, :]
    return acc


@pytest.mark.parametrize("entry, dtype, b_col_major", [("gemm_f16_rr", np.float16, False),
                                                        ("gemm_f16_rc", np.float16, True),
                                                        ("gemm_bf16_rr", BF16, False)])
def test_wmma_gemm_matches_fp32_accumulation(entry, dtype, b_col_major):
    gemm = CpuKernelModule(KERNELS / "wmma_gemm.cu", GEMM)
    rng = np.random.default_rng(7)
    m, n, k = 32, 48, 64
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c = np.zeros((m, n), np.float32)
    b_arg = np.ascontiguousarray(b.T) if b_col_major else b
    warps = (m // 16) * (n // 16)
    gemm.launch(entry, grid=warps, block=32, args=[a, b_arg, c, m, n, k, 0.5])
    expected = _fp32_accumulated_gemm(a, b) * np.float32(0.5)
    np.testing.assert_array_equal(c, expected)
    np.testing.assert_allclose(c, 0.5 * a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_wmma_checks_tile_alignment():
    gemm = CpuKernelModule(KERNELS / "wmma_gemm.cu", GEMM)
    with pytest.raises(KernelCrashError, match="kernel trapped: wmma::load_matrix_sync.*256-bit aligned"):
        gemm.launch("gemm_misaligned", grid=1, block=32, args=[np.zeros(512, np.float16), np.zeros(1, np.float32)])


# ---- failures become exceptions ---------------------------------------------------------------------


def test_sanitizer_reports_a_write_past_a_global_array(faults_sanitized):
    out = np.zeros(100, np.float32)
    with pytest.raises(KernelSanitizerError, match=r"heap-buffer-overflow on argument 0 \(float32\[100\]") as err:
        faults_sanitized.launch("write_past_end", grid=1, block=128, args=[out, 100])
    assert "faults.cu:6" in str(err.value)


def test_sanitizer_reports_a_read_past_a_shared_array(faults_sanitized):
    with pytest.raises(KernelSanitizerError, match="global-buffer-overflow.*'tile'"):
        faults_sanitized.launch("read_past_shared", grid=1, block=32, args=[np.zeros(32, np.float32)])


def test_sanitizer_reports_a_read_past_dynamic_shared_memory(faults_sanitized):
    out = np.zeros(32, np.float32)
    faults_sanitized.launch("read_past_dynamic_shared", grid=1, block=32, shared_bytes=256, args=[out, 32])
    with pytest.raises(KernelSanitizerError, match="dynamic shared memory"):
        faults_sanitized.launch("read_past_dynamic_shared", grid=1, block=32, shared_bytes=128, args=[out, 32])


def test_a_clean_kernel_passes_the_sanitizer(faults_sanitized):
    out = np.zeros(100, np.float32)
    faults_sanitized.launch("write_past_end", grid=1, block=128, args=[out, 99])
    assert (out[:100] == 1).all()


def test_a_segfault_is_reported_and_the_next_launch_works(faults):
    with pytest.raises(KernelCrashError, match="kernel crashed: SIGSEGV"):
        faults.launch("write_through", grid=1, block=32, args=[None])
    out = np.zeros(32, np.float32)
    faults.launch("write_through", grid=1, block=32, args=[out])
    assert (out == 1).all()


def test_a_hanging_kernel_times_out_and_the_next_launch_works(faults):
    with pytest.raises(KernelTimeoutError, match=r"kernel timed out after 1 s"):
        faults.launch("spin_forever", grid=1, block=32, args=[np.zeros(1, np.int32)], timeout=1)
    faults.launch("spin_forever", grid=1, block=32, args=[np.ones(1, np.int32)], timeout=30)


def test_a_barrier_deadlock_is_detected(faults):
    with pytest.raises(KernelDeadlockError, match=r"threads 0-0 wait at __syncthreads.*threads 1-31 wait at a warp"):
        faults.launch("barrier_mismatch", grid=1, block=32, args=[np.zeros(32, np.float32)])


def test_trap_names_the_thread(faults):
    with pytest.raises(KernelCrashError, match=r"__trap\(\) called in block \(0,0,0\), thread \(3,0,0\)"):
        faults.launch("calls_trap", grid=1, block=32, args=[np.zeros(32, np.float32)])


# ---- build diagnostics and cache ----------------------------------------------------------------------


def test_an_intrinsic_the_shim_lacks_is_named():
    with pytest.raises(KernelBuildError, match="`__match_any_sync` is not emulated by the CUDA-on-CPU shim"):
        CpuKernelModule(KERNELS / "unsupported_intrinsic.cu", {"uses_match": ["ptr"]})


def test_compiler_errors_are_shown_in_full():
    with pytest.raises(KernelBuildError) as err:
        CpuKernelModule(KERNELS / "syntax_error.cu", {"broken": ["ptr"]})
    message = str(err.value)
    assert "syntax_error.cu:3" in message and "undefined_variable_xyz" in message
    assert err.value.log and "error" in err.value.log


def test_the_authors_errors_come_first_and_the_generated_ones_are_counted(tmp_path):
    """A typo in a kernel template's parameter list breaks every launch trampoline generated for
    it: the author reads their own errors, the count of the rest and where all of them are."""
    source = tmp_path / "typo.cu"
    source.write_text("template <int N, typenme T>\n__global__ void fill(T* out) { out[threadIdx.x] = N; }\n")
    with pytest.raises(KernelBuildError) as err:
        CpuKernelModule(source, {"fill<4, float>": ["ptr"]})
    message, log = str(err.value), err.value.log
    own = message.split(" ---\n", 1)[1]
    assert "typo.cu:1" in own and "typenme" in own and "fa_verify launch trampolines" not in own
    generated = sum(": error: " in line for line in log.splitlines() if "fa_verify launch trampolines" in line)
    found = re.search(r"then (\d+) more in fa_verify's generated launch code, which follow from them: all in (\S+)\)",
                      message)
    assert generated > 0 and found and int(found.group(1)) >= generated
    assert Path(found.group(2)).read_text() == log


def test_signature_mismatch_fails_the_build():
    with pytest.raises(KernelBuildError, match="parameter 3 of kernel vector_add is not a floating-point value"):
        CpuKernelModule(KERNELS / "basics.cu", {"vector_add": ["ptr", "ptr", "ptr", "float"]})
    with pytest.raises(KernelBuildError, match="vector_add does not take 2 parameters"):
        CpuKernelModule(KERNELS / "basics.cu", {"vector_add": ["ptr", "ptr"]})
    with pytest.raises(KernelBuildError, match="entry point `missing_kernel` is not defined"):
        CpuKernelModule(KERNELS / "basics.cu", {"missing_kernel": []})


def test_builds_are_cached_by_content(tmp_path):
    source = tmp_path / "k.cu"
    header = tmp_path / "k_helper.cuh"
    header.write_text("#define FACTOR 2.0f\n")
    source.write_text('#include "k_helper.cuh"\n'
                      'extern "C" __global__ void scale(float* x) { x[threadIdx.x] *= FACTOR; }\n')
    cache = tmp_path / "cache"
    first = build(source, {"scale": ["ptr"]}, cache_dir=cache)
    second = build(source, {"scale": ["ptr"]}, cache_dir=cache)
    assert not first.cache_hit and second.cache_hit
    assert second.library == first.library and second.seconds < first.seconds
    header.write_text("#define FACTOR 3.0f\n")  # an included header changes the build
    third = build(source, {"scale": ["ptr"]}, cache_dir=cache)
    assert not third.cache_hit and third.library != first.library
    module = CpuKernelModule(source, {"scale": ["ptr"]}, cache_dir=cache)
    x = np.ones(4, np.float32)
    module.launch("scale", grid=1, block=4, args=[x])
    assert (x == 3).all()
    shutil.rmtree(cache)


def test_concurrent_builds_of_one_source_compile_it_once(tmp_path):
    """Two builders of the same inputs at once (xdist's workers; threads here): one compiles,
    the other waits for it and reuses its library."""
    from concurrent.futures import ThreadPoolExecutor

    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }\n')
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: build(source, {"scale": ["ptr"]}, cache_dir=tmp_path / "cache"), range(2)))
    assert sorted(r.cache_hit for r in results) == [False, True]
    assert results[0].library == results[1].library


def test_the_shim_surface_builds_and_behaves():
    module = CpuKernelModule(KERNELS / "shim_surface.cu", {"shim_surface": ["ptr", "ptr"]})
    out = np.zeros(64, np.float32)
    module.launch("shim_surface", grid=1, block=64, args=[np.arange(64, dtype=np.float32), out])
    checks = int(out[63])
    assert checks == 20
    assert (out[:checks] == 1).all(), f"failed checks (in source order): {np.flatnonzero(out[:checks] != 1)}"
