"""cuda_fp8.h on the CUDA-on-CPU runner (fa_verify/cuda_cpu/include/cuda_fp8.h) against the formats:
every code decodes as ml_dtypes decodes it; every tie and edge of float -> fp8 rounds as ml_dtypes
rounds it (ties to even, subnormals, +-0, the overflow threshold), in both saturation modes, with
the places where CUDA's header and ml_dtypes differ asserted one by one: __NV_SATFINITE (ml_dtypes
does not saturate), a negative float NaN (CUDA drops the sign), a double (CUDA rounds it once,
ml_dtypes through float32). Kernels: tests/cuda_cpu_kernels/fp8.cu."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fa_verify.cuda_cpu import CpuKernelModule

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
CONVERT = ["ptr", "ptr", "int", "int", "int"]
ENTRIES = {"decode": ["ptr"] * 4 + ["int", "int"], "from_float": CONVERT, "from_double": CONVERT,
           "from_half": CONVERT, "from_bf16": CONVERT, "classes": ["ptr", "ptr", "int", "int"],
           "widen_vectors": ["ptr", "ptr", "ptr", "int", "int"]}
FORMATS = {"e4m3": (0, ml_dtypes.float8_e4m3fn), "e5m2": (1, ml_dtypes.float8_e5m2)}
NOSAT, SATFINITE = 0, 1
CODES = np.arange(256, dtype=np.uint16).astype(np.uint8)


@pytest.fixture(scope="module")
def fp8():
    return CpuKernelModule(KERNELS / "fp8.cu", ENTRIES)


def _convert(fp8, entry, x, sat, fmt):
    out = np.zeros(x.size, np.uint8)
    fp8.launch(entry, grid=1, block=128, args=[x, out, x.size, sat, FORMATS[fmt][0]])
    return out


def _finite(fmt):
    """The format's finite non-negative values, ascending, and their codes."""
    values = CODES[:128].view(FORMATS[fmt][1]).astype(np.float64)
    keep = np.isfinite(values)
    return values[keep], CODES[:128][keep]


def _edges(fmt) -> np.ndarray:
    """float32 inputs at every tie and edge: each value, each midpoint between neighbours (and the
    midpoint past the largest finite value), each of those one float32 ulp either side, half the
    smallest subnormal, far out of range, +-inf, NaN, +-0; both signs."""
    values, _ = _finite(fmt)
    top = values[-1] + (values[-1] - values[-2])  # where the next code would lie
    marks = np.concatenate([values, (values[:-1] + values[1:]) / 2, [(values[-1] + top) / 2, 2 * top, 1e30]])
    marks = marks.astype(np.float32)
    near = np.concatenate([marks, np.nextafter(marks, np.float32(np.inf)), np.nextafter(marks, np.float32(0))])
    x = np.concatenate([near, -near, np.float32([np.inf, -np.inf, np.nan, -np.nan])])
    return x.astype(np.float32)


def _bits(x, fmt):
    return np.asarray(x).astype(FORMATS[fmt][1]).view(np.uint8)


def _code(value, fmt) -> int:
    return int(_bits(value, fmt))


def _round_exact(x: np.ndarray, fmt: str, sat: int) -> np.ndarray:
    """x (float64, no NaN) rounded once to the nearest code, ties to the even code; past the largest
    finite value the format continues with one more step, where rounding up means overflow."""
    values, codes = _finite(fmt)
    top = values[-1] + (values[-1] - values[-2])
    grid = np.append(values, top)
    a = np.abs(x)
    hi = np.clip(np.searchsorted(grid, a), 1, grid.size - 1)
    lo = hi - 1
    below, above = a - grid[lo], grid[hi] - a
    even_low = (codes[lo] & 1) == 0
    pick = np.where((below < above) | ((below == above) & even_low), lo, hi)
    pick = np.where(a >= top, grid.size - 1, pick)
    nan, max_code = _code(np.nan, fmt), codes[-1]
    overflow = max_code if sat == SATFINITE else (nan if fmt == "e4m3" else _code(np.inf, fmt))
    out = np.where(pick == grid.size - 1, overflow, codes[np.minimum(pick, codes.size - 1)]).astype(np.uint8)
    return out | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes_as_ml_dtypes_does(fp8, fmt):
    halves, pairs, floats = np.zeros(256, np.uint16), np.zeros(512, np.uint16), np.zeros(256, np.float32)
    fp8.launch("decode", grid=1, block=64, args=[CODES, halves, pairs, floats, 256, FORMATS[fmt][0]])
    expected = CODES.view(FORMATS[fmt][1]).astype(np.float32)
    nan = np.isnan(expected)
    assert nan.sum() == (2 if fmt == "e4m3" else 6)
    np.testing.assert_array_equal(halves[~nan], expected[~nan].astype(np.float16).view(np.uint16))
    assert (halves[nan] == 0x7FFF).all()  # __half's canonical NaN, the sign dropped
    np.testing.assert_array_equal(floats[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert (floats[nan].view(np.uint32) == 0x7FFFFFFF).all()  # as cvt.f32.f16 widens 0x7FFF
    np.testing.assert_array_equal(pairs[0::2], halves)  # x from the low byte, y from the high one
    np.testing.assert_array_equal(pairs[1::2], halves[::-1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_float_without_saturation_rounds_as_ml_dtypes_except_a_negative_nan(fp8, fmt):
    x = _edges(fmt)
    out, reference = _convert(fp8, "from_float", x, NOSAT, fmt), _bits(x, fmt)
    number = ~np.isnan(x)
    np.testing.assert_array_equal(out[number], reference[number])
    np.testing.assert_array_equal(out[number], _round_exact(x[number].astype(np.float64), fmt, NOSAT))
    # e4m3 has no infinity: past 448 + 16 (and at +-inf) it gives NaN with the sign, e5m2 +-inf
    nan_code = _code(np.nan, fmt)
    assert set(out[np.isinf(x)]) == ({nan_code, nan_code | 0x80} if fmt == "e4m3" else set(_bits([np.inf, -np.inf], fmt)))
    # CUDA makes a float NaN its canonical (positive) NaN first; ml_dtypes keeps the sign
    assert (out[~number] == nan_code).all()
    assert set(reference[~number]) == {nan_code, nan_code | 0x80}


@pytest.mark.parametrize("fmt", FORMATS)
def test_float_with_satfinite_clamps_what_ml_dtypes_overflows(fp8, fmt):
    x = _edges(fmt)
    out, reference = _convert(fp8, "from_float", x, SATFINITE, fmt), _bits(x, fmt)
    values, codes = _finite(fmt)
    number = ~np.isnan(x)
    overflowed = number & ~np.isfinite(reference.view(FORMATS[fmt][1]).astype(np.float32))
    np.testing.assert_array_equal(out[number & ~overflowed], reference[number & ~overflowed])
    np.testing.assert_array_equal(out[overflowed], codes[-1] | np.where(x[overflowed] < 0, 0x80, 0))
    np.testing.assert_array_equal(out[number], _round_exact(x[number].astype(np.float64), fmt, SATFINITE))
    # the overflow threshold is the midpoint past the largest value: a tie goes to the even code
    tie = np.float32(values[-1] + (values[-1] - values[-2]) / 2)
    above = np.nextafter(tie, np.float32(np.inf))
    tie_out, above_out = _convert(fp8, "from_float", np.float32([tie, above]), NOSAT, fmt)
    assert tie_out == (codes[-1] if fmt == "e4m3" else _code(np.inf, fmt))  # 0x7E even, 0x7B odd
    assert above_out == (_code(np.nan, fmt) if fmt == "e4m3" else _code(np.inf, fmt))
    assert (out[np.isinf(x)] == codes[-1] | np.where(x[np.isinf(x)] < 0, 0x80, 0)).all()
    assert (out[~number] == _code(np.nan, fmt)).all()  # NaN is never saturated


@pytest.mark.parametrize("sat", [NOSAT, SATFINITE], ids=["nosat", "satfinite"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_double_rounds_once(fp8, fmt, sat):
    values, _ = _finite(fmt)
    ties = (values[:-1] + values[1:]) / 2
    nudged = np.concatenate([ties * (1 + 2.0**-40), ties * (1 - 2.0**-40), ties])
    x = np.concatenate([nudged, -nudged, np.random.default_rng(7).standard_normal(2000) * values[-1] / 4])
    out = _convert(fp8, "from_double", x, sat, fmt)
    np.testing.assert_array_equal(out, _round_exact(x, fmt, sat))
    # ml_dtypes rounds a float64 through float32, where a value 2^-40 off a tie is the tie: it gives the
    # tie's code to both neighbours of the tie, CUDA the nearer code
    n = len(ties)
    np.testing.assert_array_equal(_bits(x[:2 * n], fmt), np.tile(out[2 * n:3 * n], 2))
    assert (out[:n] != out[n:2 * n]).all()
    # and a double NaN keeps its sign (a float NaN does not)
    signed = _convert(fp8, "from_double", np.array([np.nan, -np.nan]), sat, fmt)
    nan_code = _code(np.nan, fmt)
    np.testing.assert_array_equal(signed, [nan_code, nan_code | 0x80])


@pytest.mark.parametrize("sat", [NOSAT, SATFINITE], ids=["nosat", "satfinite"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_half_and_bf16_rounds_as_its_float(fp8, fmt, sat):
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    for entry, dtype in (("from_half", np.float16), ("from_bf16", ml_dtypes.bfloat16)):
        x = patterns.view(dtype)
        as_float = x.astype(np.float32)
        np.testing.assert_array_equal(_convert(fp8, entry, x, sat, fmt), _convert(fp8, "from_float", as_float, sat, fmt),
                                      err_msg=entry)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_classes_saturate_and_pack_low_byte_first(fp8, fmt):
    x = _edges(fmt)
    x = x[: x.size - x.size % 4]
    out = np.zeros(7 * x.size, np.uint8)
    fp8.launch("classes", grid=1, block=64, args=[x, out, x.size, FORMATS[fmt][0]])
    rows = out.reshape(7, x.size)
    from_float = _convert(fp8, "from_float", x, SATFINITE, fmt)
    np.testing.assert_array_equal(rows[0], from_float)  # __nv_fp8_*(float)
    np.testing.assert_array_equal(rows[1], _convert(fp8, "from_double", x.astype(np.float64), SATFINITE, fmt))
    with np.errstate(over="ignore"):  # past 65504 a half is infinite: saturated all the same
        halves = x.astype(np.float16)
    np.testing.assert_array_equal(rows[2], _convert(fp8, "from_half", halves, SATFINITE, fmt))
    np.testing.assert_array_equal(rows[3], _convert(fp8, "from_bf16", x.astype(ml_dtypes.bfloat16), SATFINITE, fmt))
    np.testing.assert_array_equal(rows[4], from_float)  # __nv_fp8x2_*(float2): .x in the low byte
    np.testing.assert_array_equal(rows[5], from_float)  # __nv_fp8x4_*(float4): .x in the lowest byte
    by_pairs = rows[6].reshape(-1, 4)
    np.testing.assert_array_equal(by_pairs[:, :2], from_float.reshape(-1, 4)[:, :2])  # __nv_cvt_float2_to_fp8x2
    np.testing.assert_array_equal(by_pairs[:, 2:], rows[2].reshape(-1, 4)[:, 2:])  # __nv_cvt_halfraw2_to_fp8x2


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_vector_classes_widen_each_byte(fp8, fmt):
    codes = np.random.default_rng(11).permutation(CODES)
    out, halves = np.zeros(2 * 256, np.float32), np.zeros(256, np.uint16)
    fp8.launch("widen_vectors", grid=1, block=32, args=[codes, out, halves, 256, FORMATS[fmt][0]])
    scalar_halves, scalar_floats = np.zeros(256, np.uint16), np.zeros(256, np.float32)
    fp8.launch("decode", grid=1, block=64, args=[codes, scalar_halves, np.zeros(512, np.uint16), scalar_floats,
                                                  256, FORMATS[fmt][0]])
    for row in out.reshape(2, 256):  # float4 of the quad, float2 of the pairs
        np.testing.assert_array_equal(row.view(np.uint32), scalar_floats.view(np.uint32))
    np.testing.assert_array_equal(halves, scalar_halves)
