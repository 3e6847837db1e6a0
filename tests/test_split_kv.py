"""kernels/split_kv.cu: split-KV decode over varlen and paged K/V, against the oracle per sequence.

Every case runs both launches (split, combine) on the CUDA-on-CPU runner; each sequence's rows of
out and LSE are judged by the error model of the kernel's precision (fa_verify.verdict) against
the certified reference of that sequence alone, and rows the kernel never wrote (they keep the
sentinel the output starts filled with) are failures. The grid's cases of a split_kv mutant's
layout (kernels/mutants/mutants.toml) must catch it.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from fa_verify.backends.split_kv import SplitKvCpuBackend, cpu_module, run_on_cpu, split_kv_backends
from fa_verify.backends.cuda_kernels import cpu_runner_availability
from fa_verify.errors import BackendOutputError, InvalidArgumentError, KernelRunError
from fa_verify.kernels import split_kv
from fa_verify.kernels.mutants import load_mutants
from fa_verify.problem import AttentionProblem
from fa_verify.properties import Selection
from fa_verify.ragged import PageLayout, RaggedProblem
from fa_verify.fp8_error_model import fp8_error_bound
from fa_verify.oracle.fp8 import reference_fp8
from fa_verify.properties.fp8 import _agreement as fp8_agreement
from fa_verify.strategies import make_paged_fp8_problem
from fa_verify.verdict import check_attention

CPU = cpu_runner_availability()
#: The ci profile with few examples, seeded: the suite's runs here take seconds.
SMALL = replace(Selection.from_profile("ci"), seed=0, max_examples=6)
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)
BLOCK_N = split_kv.CONFIGS[64].block_n


def ragged(layout, lens, *, H=4, Hkv=2, D=64, dtype="fp16", causal=True, page_size=16, splits=0, seed=0,
           alibi=False, per_tensor=False, **variants):
    """A ragged problem of sequences (Nq_b, Nk_b) with standard normal inputs; paged problems get a
    shuffled page table with spare pages (entries past a sequence's pages are random). variants:
    window_size, softcap, sinks as AttentionProblem takes them; alibi: random slopes per sequence.
    An FP8 dtype makes a paged FP8 KV cache (`strategies.make_paged_fp8_problem`; one Nq), its
    scales [1] if per_tensor, else [B, Hkv]."""
    if dtype in split_kv.FP8_DTYPES:
        return make_paged_fp8_problem([nk for _, nk in lens], lens[0][0], dtype, seed, heads=(H, Hkv), head_dim=D,
                                      page_size=page_size, per_tensor=per_tensor, causal=causal, num_splits=splits)
    rng = np.random.default_rng(seed)
    if "sinks" in variants:
        variants["sinks"] = np.asarray(variants["sinks"], np.float32)
    sequences = tuple(
        AttentionProblem.from_float(rng.standard_normal((1, H, nq, D)), rng.standard_normal((1, Hkv, nk, D)),
                                    rng.standard_normal((1, Hkv, nk, D)), dtype, causal=causal,
                                    alibi_slopes=rng.uniform(0, 0.5, H).astype(np.float32) if alibi else None,
                                    **variants)
        for nq, nk in lens)
    if layout == "varlen":
        return RaggedProblem(sequences, "varlen", num_splits=splits)
    seqlens_k = [nk for _, nk in lens]
    pages = PageLayout.contiguous(seqlens_k, page_size, spare_blocks=2).shuffled(rng, seqlens_k)
    return RaggedProblem(sequences, "paged", pages=pages, num_splits=splits)


#: The grid: decode (Nq = 1) and speculative decode (Nq = 4, 8), Nk = 257 (one key past 8 tiles)
#: beside short sequences (fewer keys than splits: empty splits), page sizes below, equal to and
#: above the kernel's key tile (16, 32, 64 vs 32), splits 1, 2, 3 and the kernel's own choice,
#: GQA, MQA and MHA, rows that see no key (varlen Nq_b > Nk_b, causal), each dtype and head dim,
#: and each variant.
CASES = {
    "paged-decode-p16-auto": ("paged", [(1, 257), (1, 5), (1, 64)], dict(page_size=16)),
    "paged-decode-p32-split2": ("paged", [(1, 257), (1, 33)], dict(page_size=BLOCK_N, splits=2)),
    "paged-spec-p64-split3": ("paged", [(4, 100), (4, 257), (4, 4)], dict(page_size=64, splits=3)),
    "paged-spec-p16-split1-mha": ("paged", [(8, 70), (8, 9)], dict(page_size=16, splits=1, Hkv=4)),
    "varlen-mixed-auto": ("varlen", [(3, 257), (1, 5), (8, 40)], {}),
    "varlen-masked-rows-split2": ("varlen", [(1, 30), (6, 3), (2, 65)], dict(splits=2)),
    "varlen-noncausal-mqa-split4": ("varlen", [(2, 257), (1, 1)], dict(splits=4, causal=False, Hkv=1)),
    "paged-bf16-d128-auto": ("paged", [(2, 90), (2, 257)], dict(page_size=32, dtype="bf16", D=128)),
    "varlen-fp32-d128-split2": ("varlen", [(1, 130), (4, 33)], dict(splits=2, dtype="fp32", D=128)),
    # the variants: a window crossing split and tile edges, a binding softcap, per-sequence ALiBi
    # slopes, sinks above and below the scores (rows without keys: LSE = sink)
    "varlen-window-softcap-split3": ("varlen", [(4, 150), (6, 3)],
                                     dict(splits=3, causal=False, window_size=(40, 2), softcap=1.5)),
    "paged-alibi-sinks-p16-auto": ("paged", [(2, 257), (2, 20)], dict(alibi=True, sinks=[3.0, -2.0, 0.0, 9.0])),
    # an FP8 KV cache: per-tensor and [B, Hkv] scales, e4m3 and e5m2, keys one past 8 tiles
    "paged-fp8-e4m3-tensor-scales-split3": ("paged", [(2, 257), (2, 5), (2, 64)],
                                            dict(dtype="e4m3", per_tensor=True, splits=3)),
    "paged-fp8-e5m2-head-scales-d128-auto": ("paged", [(1, 129), (1, 300)],
                                             dict(dtype="e5m2", D=128, page_size=32, causal=False)),
}


def failures_of(problem: RaggedProblem, run) -> list[str]:
    """What is wrong with `run(problem, inputs)`'s (out, lse): sequences the oracle rejects, rows
    never written, or the error the run raised."""
    try:
        out, lse = run(problem, problem.inputs())
    except (BackendOutputError, KernelRunError) as exc:
        return [f"{type(exc).__name__}: {str(exc).splitlines()[0]}"]
    found = [f"sequence {b} row {i} never written" for b, i in problem.unwritten_rows(out)[:3]]
    precision = split_kv.precision(problem.dtype)
    for b, (seq, (o, l)) in enumerate(zip(problem.sequences, problem.split(out, lse))):
        if seq.kind == "fp8":  # the FP8 oracle, error model and ensemble (fa_verify.properties.fp8)
            ref = reference_fp8(seq)
            failure, _ = fp8_agreement("fp8_agreement", seq, (o, l), ref, fp8_error_bound(seq, precision, ref))
            if failure:
                found.append(f"sequence {b} ({seq.describe()}): {failure.detail}")
            continue
        verdict = check_attention(o, seq, lse=l, precision=precision)
        if not verdict.passed:
            found.append(f"sequence {b} ({seq.describe()}): {verdict.message().splitlines()[0]}")
    return found


def case(name) -> RaggedProblem:
    layout, lens, options = CASES[name]
    return ragged(layout, lens, **options)


# --- the host side ------------------------------------------------------------------------------------

def test_configs_match_the_instantiations_in_the_source():
    text = split_kv.SPLIT_KV.source_path.read_text()
    for pattern in (r"^FA_FOR_EACH_DTYPE\(SPLIT_KV_ENTRY, ", r"^SPLIT_KV_FOR_EACH_FP8\(SPLIT_KV_FP8_ENTRY, "):
        lines = re.findall(pattern + r"(\d+), (\d+), (\d+), (\d+)\)", text, re.M)
        assert {int(d): split_kv.TileConfig(int(m), int(n), int(t)) for d, m, n, t in lines} == split_kv.CONFIGS


def test_auto_num_splits_fills_the_sms_within_the_key_tiles():
    assert split_kv.auto_num_splits(1, 4, 257, 32) == 9              # 27 blocks wanted, 9 key tiles
    assert split_kv.auto_num_splits(2, 8, 10_000, 32) == 7           # ceil(108 / 16)
    assert split_kv.auto_num_splits(1, 1, 100_000, 32) == split_kv.MAX_AUTO_SPLITS
    assert split_kv.auto_num_splits(64, 32, 4096, 32) == 1           # the batch fills the SMs alone
    assert split_kv.auto_num_splits(1, 1, 1, 32) == 1


def test_plan_shapes_and_scratch_start_as_nan():
    problem = case("paged-spec-p64-split3")
    out, lse = np.empty(problem.out_shape, np.float16), np.empty(problem.lse_shape, np.float32)
    plan = split_kv.plan(problem, problem.inputs(), out, lse)
    total_q = sum(problem.seqlens_q)
    assert plan.num_splits == 3 and plan.split.grid == (3, 4, 3) and plan.combine.grid == (3, 4, 1)
    assert plan.buffers["o_partial"].shape == (3, total_q, 4, 64) and np.isnan(plan.buffers["o_partial"]).all()
    assert plan.buffers["lse_partial"].shape == (2, 3, 4, total_q) and np.isnan(plan.buffers["lse_partial"]).all()
    assert list(plan.buffers["cu_seqlens_q"]) == [0, 4, 8, 12]
    assert len(plan.split.args) == len(split_kv.SPLIT_SIGNATURE)
    assert len(plan.combine.args) == len(split_kv.COMBINE_SIGNATURE)
    assert all(plan.buffers[name] is None for name in ("q_descale", "k_descale", "v_descale"))


def test_an_fp8_cache_plans_its_scales_as_b_by_hkv_descales_and_a_bf16_output():
    problem = case("paged-fp8-e4m3-tensor-scales-split3")
    out, lse = np.empty(problem.out_shape, np.uint16), np.empty(problem.lse_shape, np.float32)
    plan = split_kv.plan(problem, problem.inputs(), out, lse)
    assert plan.split.entry == "split_kv_paged_e4m3_d64" and plan.combine.entry == "split_kv_combine_paged_e4m3_d64"
    scales = problem.scales()
    for descale, name in (("q_descale", "q_descale"), ("k_descale", "k_scale"), ("v_descale", "v_scale")):
        x = plan.buffers[descale]
        assert x.shape == (3, 2) and x.dtype == np.float32 and np.all(x == scales[name][0]), descale
    assert plan.buffers["q"].dtype == np.uint8 and split_kv.precision("e4m3").output == "bf16"
    backend = SplitKvCpuBackend("paged")
    assert backend.kinds == ("paged", "paged-fp8") and SplitKvCpuBackend("varlen").kinds == ("varlen",)
    assert "e4m3" in backend.dtypes and "e4m3" not in SplitKvCpuBackend("varlen").dtypes


def test_unsupported_problems_are_named():
    backend = SplitKvCpuBackend("paged")
    assert "D in {64, 128}" in backend.supports(ragged("paged", [(1, 8)], D=32))
    assert "no entry for D=32" in split_kv.supports(ragged("paged", [(1, 8)], D=32))
    assert "runs paged and paged-fp8 problems, not varlen ones" in backend.supports(ragged("varlen", [(1, 8)]))
    top_left = RaggedProblem(tuple(s.replace(causal_alignment="top-left") for s in ragged("varlen", [(1, 8)]).sequences),
                             "varlen")
    assert "bottom-right" in SplitKvCpuBackend("varlen").supports(top_left)
    with pytest.raises(InvalidArgumentError, match="cannot run"):
        backend.run(ragged("paged", [(1, 8)], D=32))


def test_backends_are_ragged_split_kv_backends():
    names = [b.name for b in split_kv_backends()]
    assert names == ["split-kv-cpu", "split-kv-varlen-cpu", "split-kv-pycuda", "split-kv-varlen-pycuda"]
    assert all(b.splits and b.features == split_kv.FEATURES and b.writes_buffers for b in split_kv_backends())


# --- the kernel against the oracle ---------------------------------------------------------------------

@needs_cpu_runner
@pytest.mark.parametrize("name", CASES)
def test_split_kv_matches_the_oracle_per_sequence(name):
    problem = case(name)
    backend = SplitKvCpuBackend(problem.layout)
    assert failures_of(problem, lambda p, inputs: backend.run(p)) == []


@needs_cpu_runner
@pytest.mark.parametrize("options", [dict(logit_spread=6.0), dict(offset_gap=7.3), dict(spread="saturating")],
                         ids=["wide-logits", "p-offset", "saturating"])
def test_the_fp8_cache_entries_compute_fa3s_fp8_model_bit_for_bit(options):
    """One split of 32-key tiles is fp8_emulation's FP8 forward at block_n = 32 (the scale folded as
    fl(fl(scale q_d) k_d), P 2^8 in e4m3 with subnormal P at wide logits, v's descale last): out
    bit for bit, the LSE within a few fp32 ulps (its log and sums in another order)."""
    from fa_verify.backends.numpy_fp8 import NumpyPagedFP8Backend

    problem = make_paged_fp8_problem((257, 5, 64), 2, "e4m3", 1, heads=(4, 2), head_dim=64, page_size=16,
                                     causal=True, num_splits=1, **options)
    out, lse = SplitKvCpuBackend("paged").run(problem)
    model_out, model_lse = NumpyPagedFP8Backend(block_n=BLOCK_N).run(problem.replace(num_splits=0))
    assert np.array_equal(out.view(np.uint16), model_out.view(np.uint16))
    assert np.abs(lse - model_lse).max() <= 4e-6


@needs_cpu_runner
def test_rows_that_see_no_key_get_zero_and_minus_inf():
    problem = case("varlen-masked-rows-split2")  # sequence 1: 6 rows, 3 keys: rows 0..2 see none
    out, lse = SplitKvCpuBackend("varlen").run(problem)
    o, l = problem.split(out, lse)[1]
    assert (o[0, :, :3] == 0).all() and (l[0, :, :3] == -np.inf).all()
    assert np.isfinite(l[0, :, 3:]).all()


@needs_cpu_runner
def test_split_counts_agree_within_the_merge():
    """1, 2 and the kernel's own split count: the same sequences, each within the error model
    (the oracle test above), and close to one another (the merge only reorders fp32 sums)."""
    base = case("paged-decode-p16-auto")
    backend = SplitKvCpuBackend("paged")
    outs = [backend.run(base.replace(num_splits=n))[0].astype(np.float32) for n in (1, 2, 0)]
    assert np.abs(outs[0] - outs[1]).max() < 2e-3 and np.abs(outs[0] - outs[2]).max() < 2e-3


@needs_cpu_runner
def test_address_sanitizer_and_race_detector_are_clean():
    """The paged gather with a shuffled table under AddressSanitizer; the varlen layout with fully
    masked rows and empty splits under the race detector (a KernelRaceError would fail it)."""
    paged = case("paged-spec-p64-split3")
    assert failures_of(paged, lambda p, inputs: SplitKvCpuBackend("paged", sanitize=True).run(p)) == []
    varlen = case("varlen-masked-rows-split2")
    racecheck = cpu_module(racecheck=True)
    assert failures_of(varlen, lambda p, inputs: run_on_cpu(p, inputs, racecheck, "split-kv-race")) == []


# --- mutants ----------------------------------------------------------------------------------------------

MUTANTS = load_mutants(families=["split_kv"])
#: The first in the default run, the others marked slow (a build each; `python3 -m pytest -m slow`
#: and .ci/run run them), as tests/test_judge.py does; `fa_verify mutants --family split_kv` kills all.
GRID_MUTANTS = [pytest.param(m, id=m.name, marks=[pytest.mark.slow] if i else []) for i, m in enumerate(MUTANTS)]


@needs_cpu_runner
@pytest.mark.parametrize("mutant", GRID_MUTANTS)
def test_mutant_is_caught_by_the_grid(mutant):
    from fa_verify.judge.mutants import mutant_module

    module = mutant_module(mutant)
    found = [f"{name}: {line}" for name, (layout, _, _) in CASES.items() if layout == mutant.layout
             for line in failures_of(case(name), lambda p, inputs: run_on_cpu(p, inputs, module, mutant.name))]
    assert found, f"mutant {mutant.name} ({mutant.description}) passed every {mutant.layout} case of the grid"


# --- the varlen/paged properties, and the mutants' layouts ------------------------------------------------

def test_a_split_kv_mutant_must_name_its_layout(tmp_path):
    entry = '[[mutant]]\nname = "m"\nfamily = "split_kv"\nbug_class = "b"\ndescription = "d"\nfind = "f"\nreplace = "r"\n' \
            'caught_by = "oracle"\n'
    (tmp_path / "m.toml").write_text(entry)
    with pytest.raises(InvalidArgumentError, match="name the layout"):
        load_mutants(tmp_path / "m.toml")
    (tmp_path / "m.toml").write_text(entry.replace('family = "split_kv"', 'family = "fa2"\nlayout = "paged"'))
    with pytest.raises(InvalidArgumentError, match="other families' none"):
        load_mutants(tmp_path / "m.toml")


@pytest.mark.slow  # the default run searches these properties on both backends: properties/test_varlen_paged.py
@needs_cpu_runner
@pytest.mark.parametrize("layout", ["paged", "varlen"])
def test_the_ragged_properties_pass_the_kernel(layout):
    from fa_verify.judge import run_suite

    run = run_suite(SplitKvCpuBackend(layout), SMALL)
    assert not run.killed, run.detail
    assert {p["status"] for p in run.properties} <= {"passed", "not applicable"} and run.examples > 0
