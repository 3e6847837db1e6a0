"""The nvcc check: every kernel compiles for sm_80 and sm_90 without a GPU, and the report is read right."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fa_verify.cli.main import main
from fa_verify.kernels import FAMILIES
from fa_verify.kernels.backward import FA2_BWD
from fa_verify.kernels.catalogue import FA2_TANH_APPROX, FA3_FP8
from fa_verify.kernels.mutants import load_mutants
from fa_verify.kernels.split_kv import SPLIT_KV
from fa_verify.kernels.nvcc import (
    NvccNotFoundError,
    check_build,
    compile_file,
    find_nvcc,
    nvcc_candidates,
    parse_resource_usage,
)

try:
    NVCC = find_nvcc()
    NVCC_MISSING = ""
except NvccNotFoundError as exc:
    NVCC, NVCC_MISSING = None, str(exc)

needs_nvcc = pytest.mark.skipif(NVCC is None, reason=f"nvcc not found: {NVCC_MISSING}")

SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fa2_fp16_d64' for 'sm_80'
ptxas info    : Function properties for fa2_fp16_d64
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 2048 bytes smem, 424 bytes cmem[0]
ptxas info    : Compiling entry function 'naive_fp32_d16' for 'sm_80'
ptxas info    : Function properties for naive_fp32_d16
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
"""


def test_parse_resource_usage():
    usage = parse_resource_usage(SAMPLE)
    assert usage["fa2_fp16_d64"] == dict(registers=80, static_smem=2048, stack_frame=8,
                                         spill_stores=4, spill_loads=12)
    assert usage["naive_fp32_d16"] == dict(registers=40, static_smem=0, stack_frame=0,
                                           spill_stores=0, spill_loads=0)


def test_missing_nvcc_is_a_setup_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr("fa_verify.kernels.nvcc._site_dirs", lambda: [tmp_path])
    with pytest.raises(NvccNotFoundError, match="pip install nvidia-cuda-nvcc"):
        find_nvcc()
    assert main(["build", "--nvcc"]) == 2
    assert "nvcc was not found" in capsys.readouterr().err


def test_nvcc_search_order(monkeypatch, tmp_path):
    wheel = tmp_path / "site" / "nvidia" / "cu13" / "bin"
    wheel.mkdir(parents=True)
    (wheel / "nvcc").write_text("#!/bin/sh\n")
    (wheel / "nvcc").chmod(0o755)
    home = tmp_path / "cuda"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr("fa_verify.kernels.nvcc._site_dirs", lambda: [tmp_path / "site"])
    assert nvcc_candidates()[0] == home / "bin" / "nvcc"
    assert find_nvcc() == wheel / "nvcc"  # CUDA_HOME has none: the wheel's is next
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (home / "bin" / "nvcc").chmod(0o755)
    assert find_nvcc() == home / "bin" / "nvcc"


@pytest.mark.slow
@needs_nvcc
def test_every_kernel_compiles_for_sm80_and_sm90():
    results = check_build(("sm_80", "sm_90"))
    sources = {f.source for f in FAMILIES.values()}
    assert len(results) == 2 * len(sources)
    for r in results:
        assert r.ok, f"{r.source} [{r.arch}] failed:\n{r.log}\n{r.command}"
        families = [FAMILIES[name] for name in r.families]
        assert [e.entry for e in r.entries] == [e for f in families for e in f.entries()]
        for e in r.entries:
            assert 0 < e.registers <= 255
            assert e.static_smem == 0  # the kernels use dynamic shared memory only
            name, dtype, d = e.entry.rsplit("_", 2)
            head_dim, _, head_dim_v = d[1:].partition("v")  # d64, or d192v128 where D_v != D
            assert e.dynamic_smem == FAMILIES[name].shared_bytes(int(head_dim), dtype,
                                                                 int(head_dim_v) if head_dim_v else None)
            # fits every sm_80+ GPU (sm_86/89 allow 99 KiB per block)
            assert e.dynamic_smem + e.static_smem <= 99 * 1024


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kernel", [SPLIT_KV, FA2_BWD, FA2_TANH_APPROX], ids=lambda kernel: kernel.name)
def test_kernels_with_their_own_abi_compile(kernel, arch):
    """split_kv.cu, fa2_bwd.cu and fa2_tanh_approx.cu (not in FAMILIES): every entry, launched
    with the resources their host sides give them (fa2_tanh_approx: 30 s for both archs here)."""
    result = compile_file([kernel], arch, NVCC)
    assert result.ok, f"{result.log}\n{result.command}"
    assert [e.entry for e in result.entries] == kernel.entries()
    for e in result.entries:
        assert 0 < e.registers <= 255 and e.static_smem == 0
        assert e.dynamic_smem == kernel.resources(e.entry)[1]


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_the_fp8_kernel_compiles_for_the_fp8_archs(arch):
    """fa3_fp8.cu with NVIDIA's cuda_fp8.h where the hardware converts FP8 (sm_89, sm_90: cvt's
    e4m3x2/e5m2x2), every entry without spills and within sm_89's 99 KiB of shared memory
    (measured with nvcc 13: 64-128 registers, 90 s for both archs on this loaded 2-core machine)."""
    result = compile_file([FA3_FP8], arch, NVCC)
    assert result.ok, f"{result.log}\n{result.command}"
    assert [e.entry for e in result.entries] == FA3_FP8.entries()
    for e in result.entries:
        assert 0 < e.registers <= 255 and e.spill_stores == 0 and e.static_smem == 0
        assert e.dynamic_smem == FA3_FP8.resources(e.entry)[1] <= 99 * 1024


@pytest.mark.slow
@needs_nvcc
def test_every_mutant_compiles_for_sm80(tmp_path):
    """A mutant is a bug a GPU would run, not one only the CPU runner's shim accepts.

    Compiled with -G: front end and ptxas check the mutated source the same, and without the
    optimiser's unrolling fa2_bwd.cu takes 3 s instead of 58 (55 mutants overran 600 s on CI's
    2 cores). The unmutated files are compiled optimised by the tests above."""
    mutants = load_mutants()
    sources = [m.materialise(tmp_path / m.name) for m in mutants]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda m, src: compile_file([m.kernel_family], "sm_80", NVCC, ("-G",),
                                                             source_path=src),
                                mutants, sources))
    for m, r in zip(mutants, results):
        assert r.ok, f"mutant {m.name} does not compile:\n{r.log}\n{r.command}"
        assert [e.entry for e in r.entries] == m.kernel_family.entries()


@needs_nvcc
def test_build_command_json_and_compile_failure(tmp_path, monkeypatch, capsys):
    assert main(["build", "--nvcc", "--arch", "sm_90", "--kernel", "naive,naive16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["archs"] == ["sm_90"]
    assert [f["families"] for f in report["files"]] == [["naive", "naive16"]]  # one file, compiled once
    (entry,) = [e for f in report["files"] for e in f["entries"] if e["entry"] == "naive_fp32_d64"]
    assert entry["registers"] > 0 and entry["threads"] == 128

    # A kernel that does not compile: exit 1 and nvcc's error shown.
    broken = tmp_path / "kernels"
    broken.mkdir()
    src = Path(FAMILIES["naive"].source_path)
    (broken / "fa_common.cuh").write_text((src.parent / "fa_common.cuh").read_text())
    (broken / "naive.cu").write_text(src.read_text().replace("float dot = 0.0f;", "float dot = 0.0f"))
    monkeypatch.setenv("FA_VERIFY_KERNELS_DIR", str(broken))
    assert main(["build", "--nvcc", "--arch", "sm_80", "--kernel", "naive"]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "error" in captured.err


def test_bad_arguments(capsys):
    if NVCC is None:
        pytest.skip(f"nvcc not found: {NVCC_MISSING}")
    assert main(["build", "--arch", "compute_80"]) == 2
    assert "not a GPU target" in capsys.readouterr().err
    assert main(["build", "--kernel", "nope"]) == 2
    assert main(["build", "--arch", "sm_20"]) == 2
    assert "cannot generate code for sm_20" in capsys.readouterr().err
