"""Tensor-core emulation on the CUDA-on-CPU runner: inline PTX (checked against the PTX ISA's own
tables), tf32 wmma and cooperative_groups.

The kernels (tests/cuda_cpu_kernels/ptx.cu) only move raw per-lane registers in and out; which
matrix element each lane's register holds is written here, from the ISA's fragment-layout tables
("Matrix fragments for mma.m16n8k16/m16n8k8", "ldmatrix"), independently of the emulation.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fa_verify.cuda_cpu import CpuKernelModule
from fa_verify.error_model import TANH_APPROX_ERROR
from fa_verify.errors import KernelCrashError, KernelRaceError, KernelUnsupportedError

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
BF16 = ml_dtypes.bfloat16
MMA = {f"mma_{t}_k{k}": ["ptr", "ptr"] for t in ("f16", "bf16") for k in (8, 16)}
LDMATRIX = {f"ldmatrix_x{n}{t}": ["ptr"] * 3 for n in (1, 2, 4) for t in ("", "_trans")}
ENTRIES = {**MMA, **LDMATRIX, "cp_async_groups": ["ptr"] * 4, "ex2_and_shfl": ["ptr"] * 4,
           "mma_half_warp": ["ptr"], "cvt_pairs": ["ptr"] * 3, "tanh_approx": ["ptr", "ptr", "int"]}


@pytest.fixture(scope="module")
def ptx():
    return CpuKernelModule(KERNELS / "ptx.cu", ENTRIES)


def _lane(lane):
    return lane // 4, lane % 4  # groupID, threadID_in_group


def _pack(lo, hi):
    return np.uint32(int(lo) | (int(hi) << 16))


def _a_element(lane, i):
    g, t = _lane(lane)
    return g + 8 * ((i // 2) % 2), 2 * t + (i % 2) + 8 * (i // 4)


def _b_element(lane, i):
    g, t = _lane(lane)
    return 2 * t + (i % 2) + 8 * (i // 2), g


def _cd_element(lane, i):
    g, t = _lane(lane)
    return g + 8 * (i // 2), 2 * t + (i % 2)


@pytest.mark.parametrize("k", [16, 8])
@pytest.mark.parametrize("name, dtype", [("f16", np.float16), ("bf16", BF16)])
def test_mma_fragments_follow_the_isa_layout_and_multiply(ptx, k, name, dtype):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((16, k)).astype(dtype)
    b = rng.standard_normal((k, 8)).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    abits, bbits = a.view(np.uint16), b.view(np.uint16)
    regs = []
    for lane in range(32):
        regs += [_pack(abits[_a_element(lane, 2 * r)], abits[_a_element(lane, 2 * r + 1)]) for r in range(k // 4)]
        regs += [_pack(bbits[_b_element(lane, 2 * r)], bbits[_b_element(lane, 2 * r + 1)]) for r in range(k // 8)]
        regs += [c[_cd_element(lane, i)].view(np.uint32) for i in range(4)]
    out = np.zeros(32 * 4, np.uint32)
    ptx.launch(f"mma_{name}_k{k}", grid=1, block=32, args=[np.array(regs, np.uint32), out])
    d = np.zeros((16, 8), np.float32)
    for lane in range(32):
        for i in range(4):
            d[_cd_element(lane, i)] = out[lane * 4 + i].view(np.float32)
    # fp32 sums of exact products, k ascending from C (the runner's tensor-core model) ...
    expected = c.copy()
    for kk in range(k):
        expected += a[:, kk, None].astype(np.float32) * b[None, kk, :].astype(np.float32)
    np.testing.assert_array_equal(d, expected)
    # ... which is A B + C up to fp32 rounding
    np.testing.assert_allclose(d, a.astype(np.float64) @ b.astype(np.float64) + c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ldmatrix_fragments_follow_the_isa_layout(ptx, n, trans):
    table = np.arange(32 * 8, dtype=np.uint16)  # shared row r holds 8r .. 8r+7
    rows = np.random.default_rng(n).permutation(32).astype(np.int32)
    rows[8 * n:] = 1000  # addresses of lanes the shape does not use: never dereferenced
    out = np.zeros(32 * 4, np.uint32)
    ptx.launch(f"ldmatrix_x{n}{'_trans' if trans else ''}", grid=1, block=32, args=[table, rows, out])
    for lane in range(32):
        for j in range(n):
            matrix = table.reshape(32, 8)[rows[8 * j:8 * j + 8]]  # row r from the address of lane 8j+r
            if trans:
                lo, hi = matrix[2 * (lane % 4), lane // 4], matrix[2 * (lane % 4) + 1, lane // 4]
            else:
                lo, hi = matrix[lane // 4, 2 * (lane % 4)], matrix[lane // 4, 2 * (lane % 4) + 1]
            assert out[lane * 4 + j] == _pack(lo, hi), (lane, j)


def test_cp_async_lands_at_its_wait_group_only(ptx):
    src = np.arange(1, 4 * 64 + 1, dtype=np.uint32)
    before, middle, after = (np.zeros(4 * 64, np.uint32) for _ in range(3))
    ptx.launch("cp_async_groups", grid=1, block=64, args=[src, before, middle, after])
    nan = np.uint32(0xFFFFFFFF)  # shared memory's fill at block start
    words = src.reshape(64, 4)
    assert (before == nan).all()
    np.testing.assert_array_equal(middle.reshape(64, 4)[:, :2], words[:, :2])
    assert (middle.reshape(64, 4)[:, 2:] == nan).all()
    np.testing.assert_array_equal(after.reshape(64, 4)[:, :3], words[:, :3])  # src-size 4 of 8 ...
    assert (after.reshape(64, 4)[:, 3] == 0).all()  # ... the rest zero-filled


def _shfl(mode, lane, b, c, values):
    """PTX shfl.sync's pseudocode (ISA, "shfl.sync")."""
    segmask, clamp = (c >> 8) & 31, c & 31
    max_lane, min_lane = (lane & segmask) | (clamp & ~segmask), lane & segmask
    j, ok = {"up": (lane - b, lane - b >= max_lane), "down": (lane + b, lane + b <= max_lane),
             "bfly": (lane ^ b, (lane ^ b) <= max_lane)}.get(mode, (min_lane | (b & ~segmask), None))
    if ok is None:
        ok = j <= max_lane
    return values[j if ok else lane]


def test_tanh_approx_errs_near_but_within_its_documented_bound(ptx):
    """tanh.approx.f32: relative error up to 2^-10.987 (PTX ISA). The emulation reaches 90% of it
    over a sweep of arguments (93.7% measured), so a kernel using it is judged on an error of the documented size;
    subnormal results, ±0, ±inf and NaN come out as tanh gives them."""
    x = np.concatenate([np.linspace(-12, 12, 20001), [0.0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, np.nan, 3e-8]])
    x = x.astype(np.float32)
    y = np.zeros_like(x)
    ptx.launch("tanh_approx", grid=4, block=64, args=[x, y, len(x)])
    exact = np.tanh(x.astype(np.float64))
    normal = np.abs(exact) >= np.finfo(np.float32).tiny
    relative = np.abs(y[normal] - exact[normal]) / np.abs(exact[normal])
    assert 0.9 * TANH_APPROX_ERROR <= relative.max() <= TANH_APPROX_ERROR, relative.max() / TANH_APPROX_ERROR
    special = ~normal | ~np.isfinite(x)
    np.testing.assert_array_equal(y[special], np.tanh(x[special]))
    assert np.signbit(y[-7]) and not np.signbit(y[-8])  # -0 and +0 keep their signs


def test_ex2_approx_and_shfl_sync(ptx):
    x = np.array([0, 1, -1, 10.5, -3.25, 1e-40, -1e-40, -130, -149, 127.5, 0.3] + [0.1 * i for i in range(21)],
                 np.float32)
    ex2, ex2_ftz = np.zeros(32, np.float32), np.zeros(32, np.float32)
    shuffled = np.zeros(32 * 4, np.uint32)
    ptx.launch("ex2_and_shfl", grid=1, block=32, args=[x, ex2, ex2_ftz, shuffled])
    exact = np.exp2(x.astype(np.float64))
    np.testing.assert_allclose(ex2, exact, rtol=2.4e-7, atol=0)
    subnormal = np.abs(x) < np.finfo(np.float32).tiny
    flushed = np.where(subnormal, 1.0, exact)
    flushed = np.where(np.abs(flushed) < np.finfo(np.float32).tiny, 0.0, flushed)
    np.testing.assert_allclose(ex2_ftz, flushed, rtol=2.4e-7, atol=0)
    assert ex2_ftz[7] == 0 and ex2[7] > 0  # 2^-130: a subnormal result, flushed by .ftz only
    values = 100 + np.arange(32)
    for lane in range(32):
        expected = [_shfl("bfly", lane, 3, 0x1F, values), _shfl("idx", lane, lane // 8, 0x181F, values),
                    _shfl("up", lane, 2, 0, values), _shfl("down", lane, 5, 0x1F, values)]
        assert list(shuffled[4 * lane:4 * lane + 4]) == expected, lane


def test_cvt_packs_two_floats_rounded_to_nearest_even(ptx):
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(48) * 10.0 ** rng.integers(-6, 6, 48),
                        [1 + 2.0 ** -11, 1 + 2.0 ** -8, 65520.0, -1e-8, np.inf, np.nan, 0.0, -0.0,
                         1 + 3 * 2.0 ** -11, 3e38, 1e-45, -2.5, 7.0, 1e5, -7e4, 0.1]]).astype(np.float32)
    f16, bf16 = np.zeros(32, np.uint32), np.zeros(32, np.uint32)
    ptx.launch("cvt_pairs", grid=1, block=32, args=[x, f16, bf16])
    for packed, dtype in ((f16, np.float16), (bf16, BF16)):
        with np.errstate(over="ignore"):  # 3e38 and 1e5 overflow fp16, as on the GPU
            halves = x.astype(dtype).view(np.uint16).astype(np.uint32)  # numpy / ml_dtypes: nearest even
        expected = (halves[0::2] << 16) | halves[1::2]
        pair = 26  # x[52] = inf (upper half), x[53] = NaN (lower half)
        assert np.isinf(x[2 * pair]) and np.isnan(x[2 * pair + 1])
        others = np.arange(32) != pair
        np.testing.assert_array_equal(packed[others], expected[others])
        assert packed[pair] >> 16 == expected[pair] >> 16  # inf
        assert np.isnan(np.array([packed[pair] & 0xFFFF], np.uint16).view(dtype)[0])  # a NaN, any payload


def test_a_warp_collective_with_lanes_missing_traps(ptx):
    with pytest.raises(KernelCrashError, match=r"mma\.sync\.aligned\.m16n8k8.*ptx\.cu:\d+\).*all 32 lanes"):
        ptx.launch("mma_half_warp", grid=1, block=32, args=[np.zeros(32, np.uint32)])


def test_other_inline_assembly_fails_the_build_naming_the_instruction():
    with pytest.raises(KernelUnsupportedError, match=r"unsupported_asm\.cu:4: inline assembly `mov\.u32`: this PTX "
                                                     r"instruction is not emulated"):
        CpuKernelModule(KERNELS / "unsupported_asm.cu", {"lane_id": ["ptr"]})


# ---- tf32 wmma -------------------------------------------------------------------------------------------


def _tf32(x, rounding):
    """x as a tf32 (10-bit mantissa) value in float32: 'rna' (cvt.rna.tf32.f32) or truncated."""
    bits = x.astype(np.float32).view(np.uint32)
    if rounding == "rna":
        bits = bits + np.uint32(0x1000)  # half a tf32 unit: ties carry away from zero
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("convert, rounding", [(1, "rna"), (0, "truncated")])
def test_tf32_wmma_rounds_its_inputs(convert, rounding):
    gemm = CpuKernelModule(KERNELS / "wmma_tf32.cu", {"gemm_tf32": ["ptr"] * 3 + ["int"] * 4})
    rng = np.random.default_rng(11)
    m, n, k = 16, 32, 24
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a[0, :3] = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -11)]  # ties: away from zero under rna
    c = np.zeros((m, n), np.float32)
    gemm.launch("gemm_tf32", grid=(m // 16) * (n // 16), block=32, args=[a, b, c, m, n, k, convert])
    ta, tb = _tf32(a, rounding), _tf32(b, rounding)
    expected = np.zeros((m, n), np.float32)
    for kk in range(k):
        expected += ta[:, kk, None] * tb[None, kk, :]  # exact tf32 products, fp32 sums, k ascending
    np.testing.assert_array_equal(c, expected)
    assert not np.array_equal(c, a @ b)  # the inputs did lose precision


# ---- cooperative_groups ----------------------------------------------------------------------------------


def test_cooperative_groups_block_sync_and_tile_collectives():
    groups = CpuKernelModule(KERNELS / "coop_groups.cu", {"groups": ["ptr"] * 3})
    x = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    out, info = np.zeros(4 * 64, np.float32), np.zeros(2 * 64, np.uint32)
    groups.launch("groups", grid=1, block=64, args=[x, out, info])
    out = out.reshape(64, 4)
    expected_total = np.float32(0)
    for value in x:
        expected_total += value  # the kernel sums in thread order
    assert (out[:, 0] == expected_total).all()
    for t in range(64):
        warp, tile = x[t // 32 * 32:t // 32 * 32 + 32], x[t // 8 * 8:t // 8 * 8 + 8]
        assert out[t, 1] == pytest.approx(warp.astype(np.float64).sum(), abs=1e-5)
        assert out[t, 2] == tile.max()
        below = x[t + 1] if t % 8 != 7 else x[t]  # shfl_down past the tile's end keeps the own value
        assert out[t, 3] == below + 1000 * (t % 8)
        assert info[2 * t] == (t // 8) | ((t // 32) << 8) | (8 << 16)
        assert info[2 * t + 1] == sum(1 << i for i in range(8) if tile[i] > 0)
    assert len(set(out[:32, 1])) == 1  # the butterfly gives every lane of the tile the same sum


# ---- what the asm rewrite refuses, with the instruction and the line -----------------------------------


@pytest.mark.parametrize("statement, message", [
    ('asm("shfl.sync.bfly.b32 %0|p, %1, 1, 0x1f, -1;" : "=r"(y) : "r"(x));',
     r"`shfl\.sync\.bfly\.b32`: the predicate output"),
    ('asm("{ .reg .pred p; setp.ne.b32 p, %0, 0; }" :: "r"(x));', r"`\{ \.reg \.pred p` cannot run on the CPU"),
    ('asm("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};"'
     ' : "+r"(y), "+r"(z) : "r"(x), "r"(x), "r"(x), "r"(x), "r"(x), "r"(x));',
     r"only mma\.sync\.aligned\..*is emulated"),
    ('asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));', None),
    ('int r asm("r1");', r"asm label or an asm expression"),
])
def test_the_asm_rewrite_names_what_it_refuses(statement, message):
    from fa_verify.cuda_cpu._build import SHIM_DIR
    from fa_verify.cuda_cpu._ptx import rewrite_inline_asm

    text = f'# 1 "/home/user/k.cu"\nvoid f() {{\n  {statement}\n}}\n'
    if message is None:
        out = rewrite_inline_asm(text, SHIM_DIR)
        assert "asm" not in out and "ex2(" in out and out.count("\n") == text.count("\n")
        return
    with pytest.raises(KernelUnsupportedError, match=r"/home/user/k\.cu:2: .*" + message):
        rewrite_inline_asm(text, SHIM_DIR)


def test_the_race_detector_sees_cp_async_and_ldmatrix():
    """The copies are memcpy calls the race detector does not instrument: they announce their bytes."""
    kernel = CpuKernelModule(KERNELS / "ptx_race.cu", {"copy_then_ldmatrix": ["ptr", "ptr", "int"]}, racecheck=True)
    src = np.arange(64, dtype=np.uint16)
    out = np.zeros(32, np.uint32)
    kernel.launch("copy_then_ldmatrix", grid=1, block=64, args=[src, out, 1])
    assert out[5] == _pack(src[(5 // 4) * 8 + 2], src[(5 // 4) * 8 + 3])
    with pytest.raises(KernelRaceError, match=r"(?s)ptx_race\.cu:11.*ptx_race\.cu:17|ptx_race\.cu:17.*ptx_race\.cu:11"):
        kernel.launch("copy_then_ldmatrix", grid=1, block=64, args=[src, out, 0])
