"""kernels/fa2_bwd.cu, FlashAttention-2's backward pass, against a float64 gradient written here
(tests/test_nvcc.py compiles it for sm_80 and sm_90).

Each case's q, k, v, dout are drawn and rounded to the dtype; the forward (out, lse) and every
gradient are computed in float64 below from the rounded inputs, and the kernel gets out rounded
to the dtype and lse rounded to fp32, as a forward kernel hands them over. The kernels run on the
CUDA-on-CPU runner (and, in test_pycuda_fake_driver.py, through PyCUDA on the fake driver).

Tolerances: the kernel's error model, elementwise, from the magnitudes of the exact terms (so a
cancelling sum gets no tighter bound than its terms allow). With u the dtype's unit roundoff and
u32 fp32's:
- P = exp(S - lse) carries a relative error rel_P = u (P rounded for dV) + (D + 8) u32 (|S|-sized
  terms: the fp32 dot product over D, lse rounded to fp32, the softcap and ALiBi terms) x the
  magnitude a = scale |q|.|k| + |lse| + |bias| + softcap;
- dS_ij = P_ij (dP_ij - Delta_i) then has error at most
  E_ij = (3 u + rel_P + (D + 2) u32) |P_ij| A_ij,  A_ij = (|dO| |V|^T)_ij + sum_c |dO_ic O_ic|
  (dS rounded to the dtype, out given rounded to it, dP and Delta summed in fp32);
- dQ = scale dS K: 2 scale (E |K|)_ic + Nk u32 scale (|dS| |K|) + u |dQ| (fp32 sums, the final
  rounding); dK likewise with Q (summed over the GQA group); dV = P^T dO:
  2 (rel_P + Nq u32) (|P|^T |dO|) + u |dV|; dsink_h: 4 (u + (D + |lse|) u32) sum_i P_sink,i
  sum_c |dO_ic O_ic|.
The factor 2 covers the bounds' second-order terms. A gradient outside its bound, a NaN, or a
nonzero dQ row of a query that sees no key is a failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest

from fa_verify.backends.cuda_kernels import cpu_module, cpu_runner_availability
from fa_verify.dtypes import round_to
from fa_verify.errors import InvalidArgumentError, KernelRaceError, KernelSanitizerError
from fa_verify.kernels import backward
from fa_verify.kernels.backward import FA2_BWD, plan, run_fa2_backward, run_plan_on_cpu
from fa_verify.kernels.mutants import load_mutants
from fa_verify.problem import AttentionProblem

CPU = cpu_runner_availability()
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)
UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8, "fp32": 2.0**-24}
U32 = 2.0**-24


@dataclass
class Case:
    problem: AttentionProblem
    out: np.ndarray      # the forward's output, rounded to the dtype
    lse: np.ndarray      # float32
    dout: np.ndarray     # the dtype, possibly a strided view
    ref: dict            # float64 gradients and the magnitudes of their bounds


def reference(problem: AttentionProblem, dout: np.ndarray) -> dict:
    """The forward and backward in float64, and each gradient's error bound (the module's doc)."""
    B, H, Nq, D = problem.q.shape
    g, u = problem.group_size, UNIT[problem.dtype]
    q = problem.q64()
    k, v = problem.kv64()
    do = dout.astype(np.float64)
    scale = problem.scale_value
    raw = scale * q @ k.transpose(0, 1, 3, 2)
    s = problem.capped(raw)
    magnitude = scale * np.abs(q) @ np.abs(k).transpose(0, 1, 3, 2) + problem.softcap
    bias = problem.alibi_bias(np.arange(B)[:, None, None], np.arange(H)[None, :, None], np.arange(Nq)[None, None, :])
    if bias is not None:
        s = s + bias
        magnitude = magnitude + np.abs(bias)
    s = np.where(problem.mask, s, -np.inf)
    sinks = None if problem.sinks is None else problem.sinks.astype(np.float64)[None, :, None]
    m = s.max(axis=-1)
    if sinks is not None:
        m = np.maximum(m, sinks)
    shift = np.where(np.isfinite(m), m, 0.0)
    total = np.exp(s - shift[..., None]).sum(-1) + (0.0 if sinks is None else np.exp(sinks - shift))
    with np.errstate(divide="ignore"):
        lse = shift + np.log(total)
    p = np.where(problem.mask, np.exp(s - np.where(np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = p @ v
    delta = (do * out).sum(-1)
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - delta[..., None])
    if problem.softcap > 0:
        ds = ds * (1 - np.tanh(raw / problem.softcap) ** 2)
    finite_lse = np.where(np.isfinite(lse), np.abs(lse), 0.0)
    rel_p = u + (D + 8) * U32 * (magnitude + finite_lse[..., None])
    size = np.abs(do) @ np.abs(v).transpose(0, 1, 3, 2) + np.abs(do * out).sum(-1)[..., None]
    err_ds = (3 * u + rel_p + (D + 2) * U32) * p * size

    def per_kv_head(x):  # [B, H, Nk, D] -> [B, Hkv, Nk, D], summing each group
        return x.reshape(B, H // g, g, *x.shape[2:]).sum(2)

    ref = {
        "out": out, "lse": lse,
        "dq": scale * ds @ k,
        "dk": per_kv_head(scale * ds.transpose(0, 1, 3, 2) @ q),
        "dv": per_kv_head(p.transpose(0, 1, 3, 2) @ do),
        "masked_rows": problem.masked_rows,
    }
    ref["tol_dq"] = 2 * scale * err_ds @ np.abs(k) + problem.nk * U32 * scale * np.abs(ds) @ np.abs(k) + u * np.abs(ref["dq"])
    ref["tol_dk"] = per_kv_head(2 * scale * err_ds.transpose(0, 1, 3, 2) @ np.abs(q)
                                + problem.nq * U32 * scale * np.abs(ds).transpose(0, 1, 3, 2) @ np.abs(q)) + u * np.abs(ref["dk"])
    ref["tol_dv"] = per_kv_head(2 * (rel_p + Nq * U32).transpose(0, 1, 3, 2) * p.transpose(0, 1, 3, 2) @ np.abs(do)) \
        + u * np.abs(ref["dv"])
    if sinks is not None:
        p_sink = np.exp(sinks - lse)
        ref["dsinks"] = -(p_sink * delta).sum(axis=(0, 2))
        ref["tol_dsinks"] = 4 * ((u + (D + finite_lse) * U32) * p_sink * np.abs(do * out).sum(-1)).sum(axis=(0, 2))
    return ref


def make_case(shape, dtype, *, seed=0, anti_aligned=0, dout_layout="bhsd", **options) -> Case:
    """Standard normal q, k, v, dout of `shape` (B, H, Hkv, Nq, Nk, D); anti_aligned: that many query
    rows of every head point against every key (k = 4 + noise, those q = -4 - noise: scores near
    -16 sqrt(D), lse very negative); dout_layout "bshd": dout a strided view of [B, Nq, H, D] memory."""
    B, H, Hkv, Nq, Nk, D = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Nq, D))
    k = rng.standard_normal((B, Hkv, Nk, D))
    if anti_aligned:
        k = 4 + 0.1 * k
        q[:, :, :anti_aligned] = -4 - 0.1 * np.abs(q[:, :, :anti_aligned])
    problem = AttentionProblem.from_float(q, k, rng.standard_normal((B, Hkv, Nk, D)), dtype, **options)
    dout = round_to(rng.standard_normal((B, Nq, H, D)), dtype).transpose(0, 2, 1, 3)
    if dout_layout == "bhsd":
        dout = np.ascontiguousarray(dout)
    ref = reference(problem, dout)
    out = round_to(ref["out"], dtype)
    return Case(problem, out, ref["lse"].astype(np.float32), dout, ref)


def _alibi(H):
    return (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)


#: The grid: every dtype; causal bottom-right and top-left with Nq != Nk both ways (bottom-right
#: Nq > Nk: rows that see no key); GQA ratio 3, MQA and MHA; D 40, 64, 72; Nk = 1, 63, 64, 65 mod 64
#: (a partial last key tile of 32, or none); each variant (a window crossing tiles, a binding
#: softcap, ALiBi [H] and [B, H], sinks above and below the scores, all at once); rows with very
#: negative lse beside a partial key tile; dout in bshd memory; D 128 (shared memory past 48 KiB).
CASES = {
    "fp16-bottom-right-gqa3-d64-nk65": ((1, 3, 1, 50, 65, 64), "fp16", dict(causal=True)),
    "bf16-top-left-gqa3-d40-nk63": ((1, 3, 1, 70, 63, 40), "bf16", dict(causal=True, causal_alignment="top-left")),
    "fp32-top-left-d72-nk129": ((1, 2, 2, 40, 129, 72), "fp32", dict(causal=True, causal_alignment="top-left")),
    "fp16-noncausal-b2-d72-nk64": ((2, 2, 1, 33, 64, 72), "fp16", {}),
    "bf16-bottom-right-masked-rows-d64-nk1": ((1, 3, 1, 40, 1, 64), "bf16", dict(causal=True)),
    "fp32-bottom-right-masked-rows-gqa3-d40-nk63": ((1, 3, 1, 90, 63, 40), "fp32", dict(causal=True)),
    "fp16-window-gqa3-d64": ((1, 3, 1, 45, 100, 64), "fp16", dict(window_size=(17, 5))),
    "bf16-causal-window-top-left-d40": ((1, 2, 1, 70, 40, 40), "bf16",
                                        dict(causal=True, causal_alignment="top-left", window_size=(20, -1))),
    "fp16-softcap-d40": ((1, 3, 1, 37, 65, 40), "fp16", dict(softcap=0.5)),
    "fp32-alibi-per-batch-d64": ((2, 2, 2, 33, 70, 64), "fp32",
                                 dict(causal=True, alibi_slopes=np.linspace(0.05, 0.6, 4, dtype=np.float32).reshape(2, 2))),
    "bf16-sinks-gqa3-d72": ((1, 3, 1, 40, 65, 72), "bf16", dict(sinks=np.array([-1.0, 2.5, 9.0], np.float32))),
    "fp16-all-variants-gqa3-d64": ((1, 3, 1, 50, 97, 64), "fp16",
                                   dict(causal=True, window_size=(24, -1), softcap=2.0, alibi_slopes=_alibi(3),
                                        sinks=np.full(3, 1.5, np.float32))),
    "fp16-anti-aligned-d64-nk65": ((1, 3, 1, 20, 65, 64), "fp16", dict(anti_aligned=8)),
    "bf16-dout-bshd-gqa3-d64": ((1, 3, 1, 30, 65, 64), "bf16", dict(dout_layout="bshd")),
    "fp16-d128-opt-in-nk33": ((1, 2, 2, 20, 33, 128), "fp16", dict(causal=True)),  # 75 KiB of shared memory
}
_CACHE: dict = {}


def case(name) -> Case:
    if name not in _CACHE:
        shape, dtype, options = CASES[name]
        _CACHE[name] = make_case(shape, dtype, **options)
    return _CACHE[name]


def failures(c: Case, grads) -> list[str]:
    """What is wrong with (dq, dk, dv, dsinks): elements outside their bound (or NaN), the worst
    one named; dQ rows of queries that see no key not exactly 0."""
    found = []
    dq, dk, dv, dsinks = grads
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)):
        if name == "dsinks" and c.problem.sinks is None:
            assert x is None
            continue
        err = np.abs(x.astype(np.float64) - c.ref[name])
        bad = ~(err <= c.ref[f"tol_{name}"])
        if bad.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                excess = np.where(bad, np.nan_to_num(err / c.ref[f"tol_{name}"], nan=np.inf), 0)
            worst = np.unravel_index(np.argmax(excess), err.shape)
            found.append(f"{name}: {bad.sum()} of {bad.size} outside the bound, worst at {worst}: "
                         f"{x[worst]!r} vs {c.ref[name][worst]:.6g} (bound {c.ref[f'tol_{name}'][worst]:.3g})")
    rows = c.ref["masked_rows"]
    if rows.any() and not (dq[:, :, rows] == 0).all():
        found.append("dq: rows that see no key are not 0")
    return found


def run(c: Case, **kwargs):
    return run_fa2_backward(c.problem, c.out, c.lse, c.dout, **kwargs)


# --- the host side ------------------------------------------------------------------------------------

def test_configs_match_the_instantiations_in_the_source():
    text = FA2_BWD.source_path.read_text()
    lines = re.findall(r"^FA_FOR_EACH_DTYPE\(FA2_BWD_ENTRY, (\d+), (\d+), (\d+), (\d+)\)", text, re.M)
    assert {int(d): backward.TileConfig(int(m), int(n), int(t)) for d, m, n, t in lines} == backward.CONFIGS
    assert f"#define FA2_BWD_PRE_ROWS {backward.PRE_ROWS}\n" in text


def test_plan_launches_and_buffers():
    c = case("bf16-dout-bshd-gqa3-d64")
    atomic, deterministic = (plan(c.problem, c.out, c.lse, c.dout, deterministic=d) for d in (False, True))
    assert [launch.entry for launch in atomic.launches] == ["fa2_bwd_pre_bf16_d64", "fa2_bwd_bf16_d64",
                                                            "fa2_bwd_convert_bf16_d64"]
    assert [launch.entry for launch in deterministic.launches][1:] == ["fa2_bwd_bf16_d64", "fa2_bwd_dq_bf16_d64"]
    assert atomic.launches[1].grid == (3, 1, 1) and deterministic.launches[2].grid == (1, 3, 1)
    assert atomic.buffers["dq_accum"].shape == (1, 3, 30, 64) and deterministic.buffers["dq_accum"] is None
    # dout passed as it lies in memory, with its bshd strides (batch, head, row) in elements
    assert atomic.launches[1].args[18:21] == (30 * 3 * 64, 64, 3 * 64)
    for launch in atomic.launches + deterministic.launches:
        assert len(launch.args) == len(launch.signature) == len(backward.signatures()[launch.entry])


def test_unsupported_problems_and_bad_arguments_are_named():
    c = case("bf16-dout-bshd-gqa3-d64")
    odd = make_case((1, 1, 1, 4, 4, 32), "fp16")
    with pytest.raises(InvalidArgumentError, match="no entry for D=32"):
        run(odd)
    with pytest.raises(InvalidArgumentError, match="lse must be float32"):
        run_fa2_backward(c.problem, c.out, c.lse.astype(np.float64), c.dout)
    with pytest.raises(InvalidArgumentError, match="dout must be"):
        run_fa2_backward(c.problem, c.out, c.lse, c.dout[:, :, :-1])
    with pytest.raises(InvalidArgumentError, match="runner="):
        run(c, runner="gpu")


# --- the kernel against the float64 gradient -----------------------------------------------------------

@needs_cpu_runner
@pytest.mark.parametrize("name", CASES)
def test_gradients_within_the_error_model(name):
    c = case(name)
    assert failures(c, run(c)) == []


@needs_cpu_runner
@pytest.mark.parametrize("name", ["fp16-all-variants-gqa3-d64", "fp32-bottom-right-masked-rows-gqa3-d40-nk63"])
def test_deterministic_mode_is_within_the_model_and_repeats_bit_for_bit(name):
    """Deterministic dQ (no atomics) passes the same bounds and repeats bitwise; dK, dV repeat
    bitwise in both modes and agree between them (the same key-tile pass computes them)."""
    c = case(name)
    first, second = run(c, deterministic=True), run(c, deterministic=True)
    assert failures(c, first) == []
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(first, second) if a is not None)
    atomic, again = run(c), run(c)
    for x, y, z in zip(atomic[1:3], again[1:3], first[1:3]):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)) and np.array_equal(x.view(np.uint8), z.view(np.uint8))


@needs_cpu_runner
def test_rows_that_see_no_key_get_exact_zeros_and_add_nothing():
    c = case("fp32-bottom-right-masked-rows-gqa3-d40-nk63")  # rows 0 .. 26 see no key
    dq, dk, dv, _ = run(c)
    # (row 27 sees one key: P = 1, dS = dP - Delta = 0 up to rounding)
    assert (dq[:, :, :27] == 0).all() and (dq[:, :, 28:] != 0).any(axis=-1).all()
    # their dout does not reach dK, dV: changing it changes nothing, bit for bit
    dout = c.dout.copy()
    dout[:, :, :27] = 7
    _, dk2, dv2, _ = run_fa2_backward(c.problem, c.out, c.lse, dout)
    assert np.array_equal(dk, dk2) and np.array_equal(dv, dv2)


@needs_cpu_runner
def test_very_negative_lse_rows_are_finite():
    c = case("fp16-anti-aligned-d64-nk65")
    assert c.lse[0, :, :8].max() < -100  # exp(0 - lse) overflows fp32: a padded key must stay masked
    dq, dk, dv, _ = run(c)
    assert all(np.isfinite(x.astype(np.float32)).all() for x in (dq, dk, dv))


@needs_cpu_runner
def test_address_sanitizer_and_race_detector_are_clean():
    """Partial key and query tiles, GQA, sinks (atomics) under AddressSanitizer; both modes, a
    window and masked rows under the race detector (a KernelRaceError would fail it)."""
    c = case("bf16-sinks-gqa3-d72")
    for module in (cpu_module(FA2_BWD, sanitize=True), cpu_module(FA2_BWD, racecheck=True)):
        for deterministic in (False, True):
            the_plan = plan(c.problem, c.out, c.lse, c.dout, deterministic=deterministic)
            run_plan_on_cpu(the_plan, module)
            assert failures(c, backward.gradients(the_plan, c.problem)) == []


# --- mutants --------------------------------------------------------------------------------------------

MUTANTS = load_mutants(families=["fa2_bwd"])
#: The first in the default run, the others marked slow (a build each, cached on disk afterwards).
GRID_MUTANTS = [pytest.param(m, id=m.name, marks=[pytest.mark.slow] if i else []) for i, m in enumerate(MUTANTS)]


def test_mutants_apply_once_to_the_current_source():
    original = FA2_BWD.source_path.read_text()
    assert len(MUTANTS) >= 13 and all(m.kernel_family is FA2_BWD for m in MUTANTS)
    for m in MUTANTS:
        assert original.count(m.find) == 1, m.name


@needs_cpu_runner
@pytest.mark.parametrize("mutant", GRID_MUTANTS)
def test_mutant_is_caught(mutant):
    """oracle: some case of the grid fails its bounds; property: it changes the numbers of some
    case (the backward property suite must find it); sanitizer / race: the mutated kernel trips
    AddressSanitizer / the race detector."""
    from fa_verify.judge.mutants import mutant_module

    sanitize, racecheck = mutant.caught_by == "sanitizer", mutant.caught_by == "race"
    if sanitize or racecheck:
        c = case("fp16-bottom-right-gqa3-d64-nk65")
        with pytest.raises(KernelSanitizerError if sanitize else KernelRaceError):
            run_plan_on_cpu(plan(c.problem, c.out, c.lse, c.dout), mutant_module(mutant, sanitize, racecheck))
        return
    source = mutant.mutate(FA2_BWD.source_path.read_text())
    found, changed = [], []
    for name in CASES:
        c = case(name)
        grads = run(c, source=source)
        found += [f"{name}: {line}" for line in failures(c, grads)]
        if any(a is not None and not np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(grads, run(c))):
            changed.append(name)
        if found and mutant.caught_by == "oracle":
            return
    assert mutant.caught_by == "property" and changed, \
        f"mutant {mutant.name} ({mutant.description}) passed every case" + ("" if changed else " bit for bit")
