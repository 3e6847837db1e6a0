"""Kernel specs: a published .cu file (host code and all) checked with a spec and one command.

Kernels: tests/cuda_cpu_kernels/published_flash.cu (a template kernel with a launcher, torch
extension glue, cuBLAS and a main) and raw_pointer_flash.cu (a plain extern "C" kernel whose
128-key tiles need 64 KiB of dynamic shared memory), each with its .toml spec beside it.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends.spec_kernel import SpecKernelBackend
from fa_verify.cli.main import main
from fa_verify.cuda_cpu._host_code import device_macros, set_aside
from fa_verify.errors import InvalidArgumentError, KernelLaunchError
from fa_verify.kernels import expressions
from fa_verify.kernels.spec import NAMES, KernelSpec
from fa_verify.problem import AttentionProblem
from fa_verify.verdict import check_attention

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
PUBLISHED = KERNELS / "published_flash.cu"
RAW = KERNELS / "raw_pointer_flash.cu"


def _problem(dtype, shape=(1, 2, 37, 45, 64), kv_heads=1, causal=False):
    B, H, Nq, Nk, D = shape
    rng = np.random.default_rng(7)
    return AttentionProblem.from_float(rng.standard_normal((B, H, Nq, D)), rng.standard_normal((B, kv_heads, Nk, D)),
                                       rng.standard_normal((B, kv_heads, Nk, D)), dtype, causal=causal)


def _spec(path: Path, **changes) -> KernelSpec:
    table = tomllib.loads(path.read_text())
    table.update(changes)
    return KernelSpec.from_dict(table, origin=path.name)


@pytest.mark.parametrize("dtype, causal", [("fp16", True), ("fp32", False)])
def test_a_template_kernel_runs_from_its_spec(dtype, causal):
    before = hashlib.sha256(PUBLISHED.read_bytes()).hexdigest()
    backend = SpecKernelBackend(PUBLISHED, KERNELS / "published_flash.toml")
    problem = _problem(dtype, causal=causal)  # GQA, Nq != Nk, N not a multiple of the tiles
    out, lse = backend.run(problem)
    assert check_attention(out, problem, lse=lse).passed
    assert hashlib.sha256(PUBLISHED.read_bytes()).hexdigest() == before  # the user's file is never edited


def test_host_code_is_set_aside_line_for_line():
    text = PUBLISHED.read_text()
    kept = set_aside(text)
    assert kept.count("\n") == text.count("\n")
    kept = re.sub(r"//[^\n]*", "", kept)  # the comments name what the file holds
    for gone in ("<<<", "PYBIND11_MODULE", "int main", "torch/extension.h", "cublas_v2.h", "flash_forward",
                 "launch_flash_fwd", "cublasCreate"):
        assert gone not in kept, gone
    for stays in ("flash_fwd_kernel(const T* __restrict__ q", "__device__ __forceinline__ float load<__half>",
                  "#include <cuda_fp16.h>", "#define CHECK_INPUT"):
        assert stays in kept, stays


def test_set_aside_keeps_device_code_types_and_initialised_variables(tmp_path):
    (tmp_path / "common.cuh").write_text("#define DEVICE_INLINE __device__ __forceinline__\n")
    source = """#include "common.cuh"
#define HD __host__ DEVICE_INLINE
DEVICE_INLINE float square(float x) { return x * x; }
HD float cube(float x) { return x * x * x; }
struct __align__(16) Pair { float a, b; };
__constant__ float table[2] = {1.f, 2.f};
constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ inline int twice(int x) { return 2 * x; }
namespace detail {
__global__ void k(float* o) { o[0] = '{'; /* } */ }
void launch(float* o) { k<<<1, 1>>>(o); }
}
extern "C" {
__global__ void c_kernel(float* o) { o[0] = 1; }
static void host_only(void) {}
}
static cublasHandle_t handle;
"""
    (tmp_path / "k.cu").write_text(source)
    assert device_macros(tmp_path / "k.cu") == ("DEVICE_INLINE", "HD")
    kept = set_aside(source, device_macros(tmp_path / "k.cu"))
    for stays in ("float square(float x) { return x * x; }", "float cube(float x)", "struct __align__(16) Pair", "table[2] = {1.f, 2.f}", "constexpr int cdiv", "twice(int x)",
                  "__global__ void k(float* o) { o[0] = '{'; /* } */ }", "c_kernel", "namespace detail {"):
        assert stays in kept, stays
    for gone in ("launch", "host_only", "cublasHandle_t"):
        assert gone not in kept, gone


def test_dynamic_shared_memory_over_48_kib_needs_the_spec_opt_in():
    problem = _problem("fp32", shape=(1, 2, 70, 150, 64), kv_heads=2)
    without = SpecKernelBackend(RAW, _spec(KERNELS / "raw_pointer_flash.toml", shared_opt_in=False))
    with pytest.raises(KernelLaunchError, match=r"invalid argument\).*65536 bytes.*shared-opt-in"):
        without.run(problem)
    opted_in = SpecKernelBackend(RAW, KERNELS / "raw_pointer_flash.toml")
    out, lse = opted_in.run(problem)
    assert lse is None and check_attention(out, problem).passed


def test_a_launch_over_48_kib_fails_check_like_a_gpu_launch(tmp_path, capsys):
    spec = tmp_path / "no_opt_in.toml"
    spec.write_text((KERNELS / "raw_pointer_flash.toml").read_text().replace("shared-opt-in = true", ""))
    code, out, err = _check(capsys, RAW, spec, "--property", "convex_hull", "--max-examples", "1",
                            "--repro-dir", str(tmp_path / "repro"))
    assert code == 1, out + err
    assert "FAIL convex_hull" in out and "cudaErrorInvalidValue (invalid argument)" in out


def _check(capsys, source, spec, *options):
    """`fa_verify check SOURCE --spec SPEC OPTIONS...` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(["check", str(source), "--spec", str(spec), *options])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("change, named", [
    ({"grid": ["cdiv(Nq, BLOCK)", "B * H"]}, "grid[0]='cdiv(Nq, BLOCK)' uses 'BLOCK'"),
    ({"block": "__import__('os').system('true')"}, "block[0]="),
    ({"shared-bytes": "D.bit_length()"}, "shared-bytes="),
    ({"params": ["q", "k", "o", "Nq"]}, "params has no v"),
    ({"layout": "sbhd"}, "layout='sbhd'"),
    ({"arch": "sm_81"}, "arch=sm_81"),
    ({"grids": [1]}, "'grids' is not a spec key"),
    ({"limits": {"dtype": "fp8"}}, "limits.dtype='fp8'"),
    ({"precision": "fast"}, "precision='fast'"),
    ({"limits": {"dtype": "fp32", "head-dims": [64], "causal": "no"}}, "no parameter passes Hkv"),
    ({"conventions": {"lse-base": 10}}, "conventions.lse-base=10"),
    # issue 25 item 10: checked before g++ runs (it printed 336 lines of errors from generated code)
    ({"entry": "no_such_kernel<{D}, {T}>"}, "entry='no_such_kernel<{D}, {T}>' names no kernel of"),
    # issue 22 item 1: scratch buffers, o-fill, structs, template entries, launches, causal-only, precision
    ({"scratch": {"m": {"size": "B * H * Nq", "fill": "minus infinity"}}}, "scratch.m.fill='minus infinity'"),
    ({"scratch": {"m": {"size": "N * 4"}}}, "scratch.m.size='N * 4' uses 'N'"),
    ({"scratch": {"m": {"size": 4, "dtype": "fp8"}}}, "scratch.m.dtype='fp8'"),
    ({"scratch": {"m": {"size": 4, "dtype": "int32", "fill": "-inf"}}}, "scratch.m.fill='-inf' is not an integer"),
    ({"scratch": {"k": {"size": 4}}}, "scratch.k: name it with an identifier that is not a buffer"),
    ({"scratch": {"m": {"elements": 4}}}, "scratch.m must be a table of size"),
    ({"o-fill": "zero"}, "o-fill='zero' must be a number or 'inf', '-inf', 'nan'"),
    ({"params": ["args"], "structs": {"args": {"fields": [["q", "float4", "q"]]}}}, "structs.args.fields.q='float4'"),
    ({"params": ["args"], "structs": {"args": {"fields": [["q", "float*", "Nq"]]}}},
     "structs.args.fields.q='Nq': a pointer field names a buffer"),
    ({"params": ["args"], "structs": {"args": {"fields": [["n", "int", "rows"]]}}},
     "structs.args.fields.n='rows' uses 'rows'"),
    ({"params": ["args"], "structs": {"args": {"fields": [["q", "float*"]]}}}, "fields = [[name, C type, value]"),
    ({"params": ["args"], "structs": {"args": {"fields": [["n", "int", "Nq"]], "align": 3}}},
     "structs.args.fields.align=3 must be a power of two"),
    ({"entry": "attention_fwd<{N}>"}, "placeholder {N}"),
    ({"launch": [{"entry": "attention_fwd", "params": ["q"], "grid": 1, "block": 1}]},
     "and [[launch]] tables are both given"),
    ({"limits": {"dtype": "fp32", "head-dims": [64], "heads": "mha", "causal": "both"}},
     "no parameter passes causal (params use none of causal, causal_offset), so the kernel cannot be told it: "
     "pass it in params, or declare [limits] causal = 'no' (never masked) or causal = 'yes' (always causal)"),
    ({"precision": "fp32-accumulate,inputs=fp9"}, "precision='fp32-accumulate,inputs=fp9'"),
])
def test_spec_errors_exit_2_naming_the_key(tmp_path, capsys, change, named):
    table = tomllib.loads((KERNELS / "raw_pointer_flash.toml").read_text())
    table.update(change)
    spec = tmp_path / "bad.toml"
    spec.write_text(_toml(table))
    code, out, err = _check(capsys, RAW, spec)
    assert code == 2, out + err
    assert named in err and "bad.toml" in err, err


@pytest.mark.parametrize("launches, named", [
    ([{"entry": "attention_fwd", "params": ["q", "k", "v", "o"], "grid": 1}], "launch[0].block missing"),
    ([{"entry": "attention_fwd", "params": ["q", "k", "v", "o"], "grid": 1, "block": 1, "blocks": 2}],
     "launch[0].blocks: not a launch key"),
    ([{"entry": "attention_fwd", "params": ["q", "k", "v", "o", "Nq"], "grid": 1, "block": 1},
      {"entry": "attention_fwd", "params": ["q"], "grid": "cdiv(N, 2)", "block": 1}],
     "launch[1].grid[0]='cdiv(N, 2)' uses 'N'"),
    ([{"entry": "attention_fwd", "params": ["q", "k", "v", "o", "workspace"], "grid": 1, "block": 1}],
     "launch[0].params[4]='workspace' is no buffer (q, k, v, o, lse, null), struct or problem name: if the host "
     "allocates it, declare it: [scratch.workspace]"),
    ([{"entry": "attention_fwd", "params": ["q", "k", "v"], "grid": 1, "block": 1}], "params has no o"),
    ([], "a [[launch]] table with them per launch"),
])
def test_launch_list_errors_exit_2_naming_the_launch(tmp_path, capsys, launches, named):
    table = {k: v for k, v in tomllib.loads((KERNELS / "raw_pointer_flash.toml").read_text()).items()
             if k.replace("-", "_") not in ("entry", "params", "grid", "block", "shared_bytes", "shared_opt_in")}
    spec = tmp_path / "bad.toml"
    spec.write_text(_toml({"launch": launches, **table}))
    code, out, err = _check(capsys, RAW, spec)
    assert code == 2, out + err
    assert named in err and "bad.toml" in err, err


def test_spec_conventions_are_what_the_kernel_is_judged_under(tmp_path, capsys):
    """published_flash.cu returns a natural-log LSE: declared base 2 in its spec, the LSE it
    returns is read as base 2 and fails; the verdict says what it was judged under."""
    table = tomllib.loads((KERNELS / "published_flash.toml").read_text())
    spec = tmp_path / "base2.toml"
    spec.write_text(_toml({**table, "conventions": {"lse-base": 2}}))
    options = ("--property", "lse_agreement", "--max-examples", "3", "--dtype", "fp32")
    code, out, err = _check(capsys, PUBLISHED, spec, *options)
    assert code == 1 and "FAIL lse_agreement" in out and "judged under: LSE base 2" in out, out + err
    code, out, err = _check(capsys, PUBLISHED, KERNELS / "published_flash.toml", *options)
    assert code == 0 and "PASS lse_agreement" in out, out + err


def _toml(table: dict) -> str:
    """A small TOML writer for the tests' tables (tomllib only reads): [limits] as a table, the rest inline."""
    lines, tables = [], []
    for key, value in table.items():
        if isinstance(value, dict) and key == "limits":
            tables.append(f"[{key}]\n" + _toml(value))
        else:
            lines.append(f"{key} = {_inline(value)}")
    return "\n".join(lines + tables) + "\n"


def _inline(value) -> str:
    import json

    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return json.dumps(value)


def test_expressions_are_a_whitelist_not_eval():
    tree = expressions.parse("cdiv(Nq, 64) * (2 if causal else 1) + max(D, 8) // 4", "x", NAMES)
    assert expressions.evaluate(tree, {"Nq": 65, "causal": 1, "D": 64}, "x") == 2 * 2 + 16
    for hostile in ("().__class__", "[1][0]", "lambda: 1", "open('f')", "f'{D}'", "2 ** 10 ** 9"):
        with pytest.raises(InvalidArgumentError, match="x="):
            expressions.evaluate(expressions.parse(hostile, "x", NAMES), {"D": 1}, "x")


def test_the_spec_as_a_python_object_and_its_entries():
    spec = KernelSpec(entry="flash_fwd_kernel<{D}, 64, 32, {T}>", params=["q", "k", "v", "o", "lse", "H", "Hkv",
                      "Nq", "Nk", "scale", "causal"], grid=["cdiv(Nq, 64)", "H", "B"], block=64, layout="bshd",
                      limits=_spec(KERNELS / "published_flash.toml").limits)
    assert list(spec.instantiations()) == ["flash_fwd_kernel<64, 64, 32, __half>", "flash_fwd_kernel<64, 64, 32, float>"]
    assert spec.signature(spec.launch[0]) == ["ptr"] * 5 + ["int"] * 4 + ["float", "int"]
    assert spec.limits.lse is True


def test_check_runs_an_address_sanitizer_pass_that_sees_reads_the_output_hides(tmp_path, capsys):
    # A mutant that loads K past its end for the last partial tile but never uses those keys:
    # the output is right (nan_padding passes), only AddressSanitizer sees the read.
    mutant = tmp_path / "reads_past_k.cu"
    source = PUBLISHED.read_text()
    assert "key < Nk ? load(k + at) : 0.f" in source
    mutant.write_text(source.replace("key < Nk ? load(k + at) : 0.f", "load(k + at)"))
    code, out, err = _check(capsys, mutant, KERNELS / "published_flash.toml", "--property", "nan_padding",
                            "--property", "address_sanitizer", "--max-examples", "3", "--dtype", "fp32",
                            "--repro-dir", str(tmp_path / "repro"))
    assert code == 1, out + err
    assert "PASS nan_padding" in out
    assert "FAIL address_sanitizer" in out and "heap-buffer-overflow on argument 1" in out
    assert "reads_past_k.cu:" in out


def test_a_kernel_without_a_scale_parameter_runs_only_the_default_scale():
    spec = _spec(KERNELS / "published_flash.toml", params=["q", "k", "v", "o", "lse", "H", "Hkv", "Nq", "Nk",
                                                           "1 / sqrt(D)", "causal"])
    backend = SpecKernelBackend(PUBLISHED, spec)
    problem = _problem("fp32")
    assert backend.supports(problem) is None
    assert "takes no scale" in backend.supports(problem.replace(scale=0.5))


def test_arch_option_holds_the_launch_to_that_arch(tmp_path, capsys):
    spec = tmp_path / "big.toml"  # 128 KiB of dynamic shared memory: within sm_80's 163 KiB, not sm_86's 99
    spec.write_text((KERNELS / "raw_pointer_flash.toml").read_text().replace(
        '"2 * 128 * D * 4"', '"4 * 128 * D * 4"'))
    options = ("--property", "convex_hull", "--max-examples", "1", "--repro-dir", str(tmp_path / "repro"))
    assert _check(capsys, RAW, spec, *options)[0] == 0
    code, out, _ = _check(capsys, RAW, spec, "--arch", "sm_86", *options)
    assert code == 1 and "sm_86 allows at most 101376 bytes" in out, out
    code, _, err = _check(capsys, RAW, spec, "--arch", "ampere", *options)
    assert code == 2 and "arch='ampere'" in err, err


def test_the_race_detector_runs_spec_kernels(tmp_path):
    from fa_verify.errors import KernelRaceError

    source = PUBLISHED.read_text()
    end_of_tile = "        __syncthreads();\n    }\n    if (!active) return;"
    assert end_of_tile in source
    racy = tmp_path / "no_barrier_after_tile.cu"  # the next tile's loads overwrite what others still read
    racy.write_text(source.replace(end_of_tile, "    }\n    if (!active) return;"))
    problem = _problem("fp32")  # Nk = 45: two key tiles of 32
    SpecKernelBackend(PUBLISHED, KERNELS / "published_flash.toml").run_racecheck(problem)
    with pytest.raises(KernelRaceError, match="no_barrier_after_tile.cu:"):
        SpecKernelBackend(racy, KERNELS / "published_flash.toml").run_racecheck(problem)


def test_runner_applies_only_to_spec_targets(capsys):
    code = main(["check", "naive16-cpu", "--runner", "pycuda"])
    assert code == 2 and "--runner applies to CUDA files checked with --spec" in capsys.readouterr().err
