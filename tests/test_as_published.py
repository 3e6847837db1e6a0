"""Kernels as their authors publish them, checked from a spec with no Python: headers and the
diagnostics that point at the kernel (issue 22, items 2 to 4).

Kernels (tests/cuda_cpu_kernels/as_published/, each with its .toml spec): ptx_header_attention.cu
(inline PTX in macros and forceinline helpers of ptx_macros.cuh, unused fp8/runtime-API/memcpy_async
includes), tiled_attention.cu (torch extension glue, launcher and PYBIND11_MODULE in the quoted header
attention_api.cuh; keys must be a multiple of 32, which only the launcher says), same_value_race.cu
and cross_warp_race.cu (a benign and a harmful race), row_stats_scratch.cu (running max and sum in a
buffer the host allocates).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fa_verify.cli.main import main
from fa_verify.cuda_cpu import CpuKernelModule
from fa_verify.cuda_cpu._faults import owner
from fa_verify.cuda_cpu._host_code import device_only_copy
from fa_verify.errors import KernelCrashError

KERNELS = Path(__file__).parent / "cuda_cpu_kernels" / "as_published"


def _check(capsys, tmp_path, name, *options, spec=None):
    """`fa_verify check NAME.cu --spec NAME.toml OPTIONS...`: (exit code, stdout + stderr)."""
    capsys.readouterr()
    code = main(["check", str(KERNELS / f"{name}.cu"), "--spec", str(spec or KERNELS / f"{name}.toml"),
                 "--profile", "ci", "--repro-dir", str(tmp_path / "repro"), *options])
    out, err = capsys.readouterr()
    return code, out + err


def _spec_with(tmp_path, name, before_limits="", limits=""):
    """NAME.toml with lines added before [limits] and inside it."""
    text = (KERNELS / f"{name}.toml").read_text()
    text = text.replace("[limits]\n", f"{before_limits}\n[limits]\n{limits}\n")
    spec = tmp_path / f"{name}.toml"
    spec.write_text(text)
    return spec


# --- headers as authors write them ----------------------------------------------------------------------

def test_ptx_in_header_macros_and_helpers_runs_from_its_spec(tmp_path, capsys):
    # ptx_macros.cuh is found beside the .cu (the copy the runner builds is elsewhere); its macros and
    # forceinline helpers hold every asm statement; cuda_fp8.h and friends are included, unused.
    code, out = _check(capsys, tmp_path, "ptx_header_attention", "--property", "oracle_agreement",
                       "--max-examples", "4")
    assert code == 0, out
    assert "PASS oracle_agreement" in out


def test_host_code_in_a_quoted_header_is_set_aside_line_for_line(tmp_path):
    copy, include_dirs = device_only_copy(KERNELS / "tiled_attention.cu", tmp_path)
    header = copy.parent / "attention_api.cuh"
    original = (KERNELS / "attention_api.cuh").read_text()
    kept = header.read_text()
    assert kept.count("\n") == original.count("\n") + 1  # + the #line directive naming the original
    assert kept.startswith(f'#line 1 "{(KERNELS / "attention_api.cuh").resolve()}"')
    for gone in ("torch/extension.h", "ATen/cuda", "TORCH_CHECK", "<<<", "PYBIND11_MODULE", "ceil_div("):
        assert gone not in kept, gone
    for stays in ("kKeyTile = 32", "__global__ void tiled_attention", "cuda_fp16.h"):
        assert stays in kept, stays
    assert include_dirs[0] == copy.parent and include_dirs[-1] == KERNELS.resolve()  # copies first


# --- diagnostics that point at the kernel ---------------------------------------------------------------

def test_races_are_graded_with_the_rule_they_break(tmp_path, capsys):
    code, out = _check(capsys, tmp_path, "same_value_race", "--property", "races", "--max-examples", "1")
    assert code == 1, out
    assert "1 benign on today's hardware, but undefined" in out and "changes results" not in out
    assert "every write storing the value already there" in out and "PTX memory consistency model" in out
    assert "same_value_race.cu:13" in out and "device_only" not in out  # the original file, not the copy
    code, out = _check(capsys, tmp_path, "cross_warp_race", "--property", "races", "--max-examples", "2")
    assert code == 1, out
    assert "[changes results] write/read race" in out and "a __syncthreads() must separate" in out


def test_an_empty_grid_is_a_failing_example_naming_the_precondition(tmp_path, capsys):
    spec = _spec_with(tmp_path, "tiled_attention")
    spec.write_text(spec.read_text().replace('"cdiv(Nq, 64)"', '"Nq // 64"'))
    code, out = _check(capsys, tmp_path, "tiled_attention", "--property", "convex_hull", "--max-examples", "2",
                       spec=spec)
    assert code == 1, out  # a failing example, not a spec error (exit 2)
    assert "the launch is empty for this shape: grid[0]='Nq // 64' gives 0 for B=1, H=1, Nq=1" in out


def test_a_missing_scratch_buffer_is_named_with_the_spec_key(tmp_path, capsys):
    code, out = _check(capsys, tmp_path, "row_stats_scratch", "--property", "convex_hull", "--max-examples", "1")
    assert code == 1, out
    assert "kernel crashed: SIGSEGV" in out
    assert "address 0x0 is a null pointer: argument 4 `null` is passed as a null pointer" in out
    assert "[scratch.NAME]" in out


def test_an_out_of_bounds_cp_async_is_reported_at_the_kernel_line(tmp_path, capsys):
    spec = _spec_with(tmp_path, "ptx_header_attention", before_limits="defines = {TAIL_GUARD = 0}")
    code, out = _check(capsys, tmp_path, "ptx_header_attention", "--property", "address_sanitizer",
                       "--max-examples", "1", spec=spec)
    assert code == 1, out
    line = next(n for n, text in enumerate((KERNELS / "ptx_header_attention.cu").read_text().splitlines(), 1)
                if "CP_ASYNC_CG(" in text and "k + at" in text)
    assert f"cp.async.cg.shared.global ({(KERNELS / 'ptx_header_attention.cu').resolve()}:{line})" in out, out
    assert "bytes past the end of argument 1 `k`" in out and "perform" not in out


def test_an_out_of_bounds_ld_global_is_reported_at_its_line(tmp_path):
    kernel = tmp_path / "load_past.cu"
    kernel.write_text('__global__ void load_past(const float* x, float* y) {\n    float v;\n'
                      '    asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(x + threadIdx.x));\n'
                      '    y[threadIdx.x] = v;\n}\n')
    module = CpuKernelModule(kernel, {"load_past": ["ptr", "ptr"]}, sanitize=True, cache_dir=tmp_path / "cache")
    with pytest.raises(KernelCrashError, match=r"ld.global.f32 \(.*load_past.cu:3\): reads 4 bytes .* is 0 bytes "
                                               r"past the end of argument 0 \(float32\[32\]"):
        module.launch("load_past", grid=1, block=64, args=[np.zeros(32, np.float32), np.zeros(64, np.float32)])


def test_spec_targets_write_reproducers(tmp_path, capsys):
    code, out = _check(capsys, tmp_path, "row_stats_scratch", "--property", "convex_hull", "--max-examples", "1")
    assert code == 1 and "reproduce: python3 " in out, out
    script = out.split("reproduce: python3 ")[1].split()[0]
    replay = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "argument 4 `null` is passed as a null pointer" in replay.stdout + replay.stderr


def test_a_stack_overflow_is_told_from_a_bad_pointer(tmp_path):
    kernel = tmp_path / "deep.cu"  # 256 KiB of locals on a 64 KiB stack: the frame skips the guard page
    kernel.write_text("__global__ void deep(float* o) {\n    volatile float big[65536];\n"
                      "    for (int i = 0; i < 65536; ++i) big[i] = i;\n    o[threadIdx.x] = big[threadIdx.x];\n}\n")
    module = CpuKernelModule(kernel, {"deep": ["ptr"]}, stack_kib=64, cache_dir=tmp_path / "cache")
    with pytest.raises(KernelCrashError, match="an emulated thread's stack overflowed .* larger stack_kib"):
        module.launch("deep", grid=1, block=2, args=[np.zeros(2, np.float32)])


def test_owner_names_the_argument_an_address_belongs_to():
    buffers, names = [(0x10000, 256), (0x20000, 256)], ["argument 0 `q`", "argument 1 `k`"]
    assert "256 bytes past the end of argument 0 `q`" in owner("at address 0x10200", buffers, names, [])
    assert "16 bytes before the start of argument 1 `k`" in owner("at address 0x1fff0", buffers, names, [])
    assert "16 bytes past a null pointer: argument 4 `l` is" in owner("SEGV on unknown address 0x000000000010",
                                                                      buffers, names, ["argument 4 `l`"])
    assert "outside every argument" in owner("at address 0x7f0000000000", buffers, names, [])
    assert owner("no address here", buffers, names, []) == ""


# --- precondition discovery -----------------------------------------------------------------------------

def test_an_undeclared_precondition_is_found_and_its_limits_line_printed(tmp_path, capsys):
    code, out = _check(capsys, tmp_path, "tiled_attention")
    assert code == 1, out
    assert "fail for every drawn Nk with Nk % 32 ≠ 0" in out, out
    assert "[limits]: seq-multiple = 32 (--seq-multiple 32)" in out
    spec = _spec_with(tmp_path, "tiled_attention", limits="seq-multiple = 32")  # declared: it passes
    code, out = _check(capsys, tmp_path, "tiled_attention", "--property", "convex_hull", "--max-examples", "5",
                       spec=spec)
    assert code == 0, out
