"""The PyCUDA path on the FAKE CUDA driver (tests/fake_cuda_driver): no GPU is involved.

PyCUDA, built against a stub libcuda, runs in child processes whose library path holds the
fake driver: host memory as device memory, settable devices, injectable faults, each launch
run by the CUDA-on-CPU runner. What these tests show is that fa_verify drives PyCUDA and the
driver API correctly (compiling with nvcc for the device's arch, loading, opt-in, packing,
copies, errors, devices, worker protocol); they say nothing of how a GPU computes.

They skip, naming what is missing, where PyCUDA has not been built against the stub
(`python3 tests/fake_cuda_driver/build.py pycuda`, as .ci/run does) or a real driver is here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fake_cuda_driver import build

from fa_verify.backends.registry import builtin_backends
from fa_verify.kernels import FAMILIES

try:
    build.pycuda_dir()
    build.build_library("fake")
    FAKE = None
except build.FakeDriverUnavailable as exc:
    FAKE = str(exc)
pytestmark = pytest.mark.skipif(FAKE is not None, reason=f"fake driver unavailable: {FAKE}")

REPO = Path(__file__).resolve().parent.parent

#: Child-process prelude: a problem maker and a JSON answer on the last line of stdout.
PRELUDE = """
import json, sys
import numpy as np
from fa_verify.problem import AttentionProblem

def problem(B, H, Hkv, Nq, Nk, D, dtype="fp16", seed=0, **causal):
    rng = np.random.default_rng(seed)
    return AttentionProblem.from_float(rng.standard_normal((B, H, Nq, D)), rng.standard_normal((B, Hkv, Nk, D)),
                                       rng.standard_normal((B, Hkv, Nk, D)), dtype, **causal)

def answer(**values):
    print(json.dumps(values))
"""


def on_fake_driver(code: str, *, env_extra=None, driver="fake", omit=(), cwd=None, timeout=600, **settings):
    """Run `code` (after PRELUDE) in a child process on the fake driver; its JSON answer, or fail with its output."""
    env = build.environment(driver=driver, omit=omit, **settings)
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the kernels, through PyCUDA on the fake driver ----------------------------------------------------


#: Families left to -m slow: their nvcc builds are the long ones, and the PyCUDA launch path they
#: take is the one naive and mma_ptx take here (fa2's own launch, with its variants, is tested below).
_LONG_BUILDS = ("fa2", "naive16", "wmma")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in _LONG_BUILDS else f
                                    for f in sorted(FAMILIES) if FAMILIES[f].kind == "dense"])
def test_fake_driver_runs_every_family_bit_identical_to_the_cpu_runner(family):
    """Each -pycuda backend on the fake driver returns what its -cpu twin returns, bit for bit, and
    passes the oracle (a family per test: the suite's workers share them; fa3_fp8's FP8 problems
    below)."""
    answer = on_fake_driver(f"""
        from fa_verify.backends.cuda_kernels import CpuKernelBackend, PyCudaKernelBackend
        from fa_verify.kernels import FAMILIES
        from fa_verify.verdict import check_attention
        rows = []
        family = FAMILIES[{family!r}]
        for dtype in family.dtypes:
            p = problem(1, 4, 2, 70, 45, 64, dtype, seed=len(rows), causal=True)
            gpu, cpu = PyCudaKernelBackend({family!r}), CpuKernelBackend({family!r})
            assert gpu.availability().available, gpu.availability().reason
            (o, lse), (o2, lse2) = gpu.run(p), cpu.run(p)
            same = o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes()
            rows.append([dtype, same, check_attention(o, p, lse=lse, precision=gpu.precision(dtype)).passed])
        answer(rows=rows)
    """)
    assert len(answer["rows"]) == len(FAMILIES[family].dtypes)
    for dtype, same, passed in answer["rows"]:
        assert same and passed, (family, dtype, same, passed)


def test_fake_driver_runs_the_fp8_kernel_bit_identical_to_the_cpu_runner():
    """fa3-fp8-pycuda on the fake driver: FP8 inputs as bytes, the descales as device copies of
    [B, Hkv] arrays (per-tensor ones broadcast), a bf16 output; what fa3-fp8-cpu returns, bit for
    bit, within FA3's FP8 error model."""
    answer = on_fake_driver("""
        from fa_verify.backends.cuda_kernels import CpuKernelBackend, PyCudaKernelBackend
        from fa_verify.properties.fp8 import check_fp8_agreement
        from fa_verify.strategies import make_fp8_problem
        rows = []
        for fmt, options in (("e4m3", dict(causal=True)), ("e5m2", dict(per_tensor=True, offset_gap=7.3))):
            p = make_fp8_problem((2, 4, 2, 70, 45, 64), fmt, len(rows), **options)
            gpu, cpu = PyCudaKernelBackend("fa3_fp8"), CpuKernelBackend("fa3_fp8")
            assert gpu.availability().available, gpu.availability().reason
            (o, lse), (o2, lse2) = gpu.run(p), cpu.run(p)
            same = o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes()
            rows.append([fmt, str(o.dtype), same, check_fp8_agreement(gpu, p).passed])
        answer(rows=rows)
    """)
    assert [row[:2] for row in answer["rows"]] == [["e4m3", "bfloat16"], ["e5m2", "bfloat16"]]
    for fmt, _, same, passed in answer["rows"]:
        assert same and passed, fmt


def test_fake_driver_runs_fa2_variants_bit_identical_to_the_cpu_runner():
    """fa2-pycuda passes window, softcap, ALiBi slopes ([B, H]: the batch stride) and sinks as
    fa2-cpu does (device copies of the arrays, null pointers when off): bit-identical outputs."""
    answer = on_fake_driver("""
        from fa_verify.backends.cuda_kernels import CpuKernelBackend, PyCudaKernelBackend
        from fa_verify.verdict import check_attention
        slopes = np.linspace(0.05, 0.6, 8, dtype=np.float32).reshape(2, 4)
        variants = [dict(window_size=(9, 4)), dict(softcap=0.5), dict(alibi_slopes=slopes),
                    dict(causal=True, window_size=(20, -1), softcap=2.0, alibi_slopes=slopes[0],
                         sinks=np.linspace(-1, 2, 4, dtype=np.float32))]
        rows = []
        for options in variants:
            p = problem(2, 4, 2, 70, 45, 32, "bf16", seed=len(rows), **options)
            gpu, cpu = PyCudaKernelBackend("fa2"), CpuKernelBackend("fa2")
            (o, lse), (o2, lse2) = gpu.run(p), cpu.run(p)
            same = o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes()
            rows.append([p.describe(), same, check_attention(o, p, lse=lse, precision=gpu.precision("bf16")).passed])
        answer(rows=rows)
    """)
    assert len(answer["rows"]) == 4
    for what, same, passed in answer["rows"]:
        assert same and passed, what


@pytest.mark.slow
def test_stub_driver_pycuda_compiles_every_kernel_for_sm80_and_sm90():
    """The compile path as the runner takes it (pycuda.compiler.compile, fa_verify's nvcc), with only the stub
    driver loaded: no device is needed to build the cubins; each is an ELF for its architecture."""
    answer = on_fake_driver("""
        from fa_verify.kernels import FAMILIES
        from fa_verify.kernels.pycuda_runner import compile_cubin
        archs = {}
        for family in FAMILIES.values():
            for arch in ("sm_80", "sm_90"):
                cubin = compile_cubin(family, arch)
                archs[f"{family.name} {arch}"] = [cubin[:4].decode("latin-1"), cubin[49],
                                                  all(entry.encode() in cubin for entry in family.entries())]
        answer(archs=archs)
    """, driver="stub")
    assert len(answer["archs"]) == 2 * len(FAMILIES)
    for what, (magic, sm, entries) in answer["archs"].items():
        assert magic == "\x7fELF" and sm == int(what[-2:]) and entries, what


def test_fake_driver_runs_split_kv_bit_identical_to_the_cpu_runner():
    """split-kv-pycuda and split-kv-varlen-pycuda (two launches, int32 metadata, a null block
    table for varlen, ALiBi slopes and sinks or null pointers, fp32 scratch, an FP8 cache's descales) on the fake driver return what the -cpu backends return, bit
    for bit, and leave no row unwritten."""
    answer = on_fake_driver("""
        sys.path.insert(0, "tests")
        from test_split_kv import case
        from fa_verify.backends.split_kv import SplitKvCpuBackend, SplitKvPyCudaBackend
        rows = {}
        for name in ("paged-spec-p64-split3", "varlen-masked-rows-split2", "paged-alibi-sinks-p16-auto",
                     "paged-fp8-e4m3-tensor-scales-split3"):
            problem = case(name)
            gpu = SplitKvPyCudaBackend(problem.layout).run(problem)
            cpu = SplitKvCpuBackend(problem.layout).run(problem)
            rows[name] = [all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(gpu, cpu)),
                          len(problem.unwritten_rows(gpu[0]))]
        answer(rows=rows)
    """)
    assert answer["rows"] == {"paged-spec-p64-split3": [True, 0], "varlen-masked-rows-split2": [True, 0],
                              "paged-alibi-sinks-p16-auto": [True, 0], "paged-fp8-e4m3-tensor-scales-split3": [True, 0]}


@pytest.mark.slow  # nvcc builds fa2_bwd.cu's cubin first: ~70 s on a fresh machine (.ci/run's slow pass runs it)
def test_fake_driver_runs_fa2_bwd_bit_identical_to_the_cpu_runner():
    """run_fa2_backward through PyCUDA (four entries, a strided dout, null pointers for the unused
    variants and, deterministic, the dQ workspace) on the fake driver returns what the CPU runner
    returns, bit for bit, in both modes."""
    answer = on_fake_driver("""
        sys.path.insert(0, "tests")
        from test_backward_kernel import case
        from fa_verify.kernels.backward import run_fa2_backward
        rows = {}
        for name in ("fp16-all-variants-gqa3-d64", "bf16-dout-bshd-gqa3-d64", "fp32-top-left-d72-nk129"):
            c = case(name)
            for deterministic in (False, True):
                gpu, cpu = (run_fa2_backward(c.problem, c.out, c.lse, c.dout, runner=runner, deterministic=deterministic)
                            for runner in ("pycuda", "cpu"))
                rows[f"{name} {deterministic}"] = all(a is None and b is None or np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                                      for a, b in zip(gpu, cpu))
        answer(rows=rows)
    """)
    assert answer["rows"] and all(answer["rows"].values()), answer["rows"]


@pytest.mark.slow
def test_fake_driver_runs_the_pycuda_tests_of_test_kernels():
    """tests/test_kernels.py's PyCUDA tests (every family x dtype x causal mode against the oracle, and
    agreement with the CPU runner), which skip without a driver, all pass on the fake driver."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "pycuda",
                           str(REPO / "tests" / "test_kernels.py")], env=build.environment(), cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and "skipped" not in summary, proc.stdout[-6000:]
    assert int(summary.split(" passed")[0].split()[-1]) >= 32, summary


def test_fake_driver_needs_the_shared_memory_opt_in_and_the_runner_sets_it():
    """fa2 D=128 needs > 48 KiB: the fake refuses the launch without the opt-in, as a driver does; the runner opts in."""
    answer = on_fake_driver("""
        import pycuda.driver as cuda
        from fa_verify.backends.cuda_kernels import PyCudaKernelBackend
        from fa_verify.kernels.pycuda_runner import compile_cubin
        from fa_verify.kernels import FAMILIES
        p = problem(1, 1, 1, 20, 20, 128, "fp32")
        launch = FAMILIES["fa2"].launch(p)
        o, lse = PyCudaKernelBackend("fa2").run(p)
        cuda.init()
        ctx = cuda.Device(0).make_context()
        func = cuda.module_from_buffer(compile_cubin(FAMILIES["fa2"], "sm_80")).get_function(launch.entry)
        buffers = [cuda.mem_alloc(4 * 20 * 128) for _ in range(4)] + [cuda.mem_alloc(4 * 20)]
        scalars = [np.int32(x) for x in launch.scalars[:5]] + [np.float32(launch.scalars[5])] + [np.int32(x) for x in launch.scalars[6:]]
        scalars += [np.int32(-1), np.int32(-1), np.float32(0), np.uintp(0), np.int32(0), np.uintp(0)]  # no variant
        try:
            func(*buffers, *scalars, grid=launch.grid, block=launch.block, shared=launch.shared_bytes)
            refused = ""
        except cuda.Error as exc:
            refused = str(exc)
        ctx.pop()
        answer(shared=launch.shared_bytes, finite=bool(np.isfinite(lse).all()), refused=refused)
    """)
    assert answer["shared"] > 48 * 1024 and answer["finite"]
    assert "cuLaunchKernel failed: invalid value" in answer["refused"]


def test_fake_driver_fault_in_a_launch_is_a_kernel_error_and_the_worker_restarts():
    """An injected launch failure is the kernel's error; the poisoned worker is replaced by a fresh one."""
    answer = on_fake_driver("""
        import os
        from fa_verify.errors import KernelRunError
        from fa_verify.kernels import FAMILIES
        from fa_verify.kernels.pycuda_runner import PyCudaWorker
        p = problem(1, 1, 1, 8, 8, 16, "fp32")
        worker = PyCudaWorker(timeout=120)
        try:
            worker.run(FAMILIES["naive"], FAMILIES["naive"].launch(p), p.q, p.k, p.v)
            error = "none"
        except KernelRunError as exc:
            error = str(exc)
        os.environ["FA_FAKE_CUDA_FAULTS"] = ""  # the next worker's driver has no fault
        lse = worker.run(FAMILIES["naive"], FAMILIES["naive"].launch(p), p.q, p.k, p.v)[1]
        answer(error=error, starts=worker.starts, finite=bool(np.isfinite(lse).all()))
        worker.close()
    """, faults="cuLaunchKernel=719")
    assert "unspecified launch failure" in answer["error"] and "fake driver device 0" in answer["error"]
    assert answer["starts"] == 2 and answer["finite"]


# --- the ten points of issue 13, each on the fake driver --------------------------------------------------

BACKENDS = "from fa_verify.kernels.pycuda_runner import pycuda_availability\nanswer(reason=pycuda_availability().reason)\n"


@pytest.mark.parametrize("driver, omit, expected", [
    (None, (), "the CUDA driver library (libcuda.so.1) is not found"),
    ("stub", (), "is a stub"),
    ("stub", ("cuCtxCreate_v4",), "older than the CUDA toolkit pycuda was built with (it lacks cuCtxCreate_v4)"),
])
def test_fake_driver_point1_availability_names_the_driver_problem_not_pycuda(driver, omit, expected):
    """No driver library, a stub, a driver lacking a newer entry point: each said as such, never 'pycuda is not installed'."""
    env_extra = {"LD_LIBRARY_PATH": ""} if driver is None else None
    answer = on_fake_driver(BACKENDS, driver=driver or "", omit=omit, env_extra=env_extra)
    assert expected in answer["reason"], answer["reason"]


def test_fake_driver_point1_backends_command_explains_why_pycuda_is_unavailable():
    env = build.environment(driver="stub")
    proc = subprocess.run([sys.executable, "-m", "fa_verify", "backends"], env=env, capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0
    lines = [line for line in proc.stdout.splitlines() if "-pycuda" in line]
    pycuda_backends = {b.name for b in builtin_backends() if b.name.endswith("-pycuda")}
    assert {line.split()[0] for line in lines} == pycuda_backends and all("unavailable: the CUDA driver library loaded here is a stub" in line
                                   for line in lines), proc.stdout


def test_fake_driver_point2_compiles_with_fa_verifys_nvcc_not_the_one_on_path():
    """nvcc only under $CUDA_HOME (as fa_verify build finds it): the run works; no nvcc anywhere: a setup error."""
    from fa_verify.kernels.nvcc import find_nvcc

    root = build.toolkit()[1].parent
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvcc").exists())
    code = """
        from fa_verify.backends.cuda_kernels import PyCudaKernelBackend
        from fa_verify.kernels.pycuda_runner import pycuda_availability
        b = PyCudaKernelBackend("naive")
        reason = pycuda_availability().reason
        lse = None if reason else b.run(problem(1, 1, 1, 8, 8, 16, "fp32"))[1]
        answer(reason=reason, finite=lse is not None and bool(np.isfinite(lse).all()))
    """
    assert (root / "bin" / "nvcc").is_file() and find_nvcc()
    found = on_fake_driver(code, env_extra={"PATH": path, "CUDA_HOME": str(root)})
    assert found == {"reason": "", "finite": True}
    missing = on_fake_driver(code, env_extra={"PATH": path, "CUDA_HOME": "", "CUDA_PATH": "", "PYTHONNOUSERSITE": "1"})
    if "nvcc" in missing["reason"]:  # pip wheels of nvcc in site-packages are found too: then there is nothing to miss
        assert missing["reason"].startswith("PyCUDA compiles the kernels with nvcc: nvcc was not found")


def test_fake_driver_point3_a_driver_older_than_the_toolkit_is_named():
    answer = on_fake_driver(BACKENDS, driver_version=12040)
    assert "the CUDA driver supports CUDA 12.4 but nvcc" in answer["reason"]
    assert "is CUDA 13" in answer["reason"] or "is CUDA 1" in answer["reason"]


def test_fake_driver_point4_wmma_on_sm75_is_unsupported_not_a_compile_error():
    answer = on_fake_driver("""
        from fa_verify.backends.cuda_kernels import PyCudaKernelBackend
        answer(wmma=PyCudaKernelBackend("wmma").supports(problem(1, 1, 1, 8, 8, 64, "fp16")),
               naive=PyCudaKernelBackend("naive").supports(problem(1, 1, 1, 8, 8, 64, "fp16")))
    """, devices="7.5:65536")
    assert answer["wmma"] == ("wmma.cu needs compute capability 8.0 or newer (bf16 wmma fragments); "
                              "this device is sm_75")
    assert answer["naive"] is None


def test_fake_driver_point5_one_rule_picks_the_device():
    """FA_VERIFY_CUDA_DEVICE=1 on two fake devices: availability, the shared-memory limit and the worker all use device 1."""
    answer = on_fake_driver("""
        from fa_verify.backends.cuda_kernels import PyCudaKernelBackend
        from fa_verify.kernels import FAMILIES
        from fa_verify.kernels.pycuda_runner import PyCudaWorker, pycuda_availability
        p = problem(1, 2, 1, 9, 12, 16, "fp32")
        worker = PyCudaWorker()
        o, lse = worker.run(FAMILIES["naive"], FAMILIES["naive"].launch(p), p.q, p.k, p.v)
        big = problem(1, 1, 1, 8, 8, 256, "fp32")
        answer(available=pycuda_availability().available, arch=worker.arch, name=worker.device_name,
               fa2_d256=PyCudaKernelBackend("fa2").supports(big), finite=bool(np.isfinite(lse).all()))
        worker.close()
    """, devices="8.0:49152,9.0:232448", env_extra={"FA_VERIFY_CUDA_DEVICE": "1"})
    assert answer["available"] and answer["arch"] == "sm_90" and "device 1" in answer["name"]
    assert answer["fa2_d256"] is None and answer["finite"]  # device 0 (48 KiB) could not run fa2 D=256
    outside = on_fake_driver(BACKENDS, devices="8.0", env_extra={"FA_VERIFY_CUDA_DEVICE": "1"})
    assert outside["reason"] == "FA_VERIFY_CUDA_DEVICE=1 but the driver sees 1 device(s)"


def test_fake_driver_point6_device_printf_does_not_corrupt_the_worker_protocol(tmp_path):
    """A kernel that printfs (the fake driver writes it to fd 1, as a driver does) runs; its text is in the worker's log."""
    kernels = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", kernels, ignore=shutil.ignore_patterns("mutants"))
    source = (kernels / "naive.cu").read_text()
    first = source.index("{", source.index("__global__")) + 1
    (kernels / "naive.cu").write_text(source[:first] + ' if (threadIdx.x == 0 && blockIdx.x == 0) printf("hello from the kernel\\n"); '
                                      + source[first:])
    answer = on_fake_driver("""
        from fa_verify.kernels import FAMILIES
        from fa_verify.kernels.pycuda_runner import PyCudaWorker
        p = problem(1, 1, 1, 8, 8, 16, "fp32")
        worker = PyCudaWorker(timeout=120)
        o, lse = worker.run(FAMILIES["naive"], FAMILIES["naive"].launch(p), p.q, p.k, p.v)
        o, lse = worker.run(FAMILIES["naive"], FAMILIES["naive"].launch(p), p.q, p.k, p.v)
        answer(finite=bool(np.isfinite(lse).all()), starts=worker.starts, log=worker.log())
        worker.close()
    """, env_extra={"FA_VERIFY_KERNELS_DIR": str(kernels)})
    assert answer["finite"] and answer["starts"] == 1
    assert "hello from the kernel" in answer["log"]


def test_fake_driver_point8_a_half_written_pycuda_cache_entry_is_never_loaded(tmp_path):
    """PyCUDA's cache writes in place; fa_verify's is written under a temporary name and renamed."""
    code = """
        from fa_verify.backends.cuda_kernels import PyCudaKernelBackend
        lse = PyCudaKernelBackend("naive").run(problem(1, 1, 1, 8, 8, 16, "fp32"))[1]
        answer(finite=bool(np.isfinite(lse).all()))
    """
    env = {"PYCUDA_CACHE_DIR": str(tmp_path)}
    assert on_fake_driver(code, env_extra=env)["finite"]
    for cached in tmp_path.rglob("*"):
        if cached.is_file():
            cached.write_bytes(b"")  # a concurrent PyCUDA writer has opened the entry ("wb") and not yet written
    assert on_fake_driver(code, env_extra=env)["finite"]


def test_fake_driver_point9_out_of_memory_and_shared_memory_keep_the_worker():
    answer = on_fake_driver("""
        from fa_verify.errors import BackendUnavailableError
        from fa_verify.kernels import FAMILIES
        from fa_verify.kernels.pycuda_runner import PyCudaWorker
        worker = PyCudaWorker(timeout=120)
        errors = []
        for family, p in (("naive", problem(1, 4, 4, 200, 200, 64, "fp32")),     # ~1.3 MB: over 1 MiB
                          ("fa2", problem(1, 1, 1, 8, 8, 128, "fp32"))):         # > 48 KiB of shared memory
            try:
                worker.run(FAMILIES[family], FAMILIES[family].launch(p), p.q, p.k, p.v)
            except BackendUnavailableError as exc:
                errors.append(str(exc))
        p = problem(1, 1, 1, 8, 8, 16, "fp32")
        lse = worker.run(FAMILIES["naive"], FAMILIES["naive"].launch(p), p.q, p.k, p.v)[1]
        answer(errors=errors, starts=worker.starts, finite=bool(np.isfinite(lse).all()))
        worker.close()
    """, memory=1 << 20, devices="8.0:49152")
    oom, shared = answer["errors"]
    assert "out of memory on fa_verify fake driver device 0" in oom and "failed on" not in oom
    assert "needs" in shared and "allows 49152" in shared
    assert answer["starts"] == 1 and answer["finite"]


def test_fake_driver_point10_the_worker_imports_the_callers_fa_verify(tmp_path):
    """A caller that found fa_verify through sys.path (not PYTHONPATH, not the current folder) gets a worker running that copy."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "fa_verify", copy / "fa_verify", ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = build.environment()
    env["PYTHONPATH"] = str(build.pycuda_dir())  # pycuda only: fa_verify comes from the copy
    env["FA_VERIFY_KERNELS_DIR"] = str(REPO / "kernels")
    code = PRELUDE.replace("import json, sys", f"import json, sys\nsys.path.insert(0, {str(copy)!r})") + textwrap.dedent("""
        from fa_verify.kernels import FAMILIES
        from fa_verify.kernels.pycuda_runner import PyCudaWorker
        p = problem(1, 1, 1, 8, 8, 16, "fp32")
        worker = PyCudaWorker(timeout=120)
        worker.run(FAMILIES["naive"], FAMILIES["naive"].launch(p), p.q, p.k, p.v)
        answer(package=worker.package)
        worker.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=elsewhere, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["package"] == str(copy / "fa_verify")


def test_a_kernel_spec_drives_pycuda_as_it_drives_the_cpu_runner():
    """published_flash.cu, its host code set aside, compiled by nvcc, its template entries found by their mangled
    names and launched through PyCUDA as its spec says: bit-identical to the CPU runner, and the oracle passes."""
    kernels = REPO / "tests" / "cuda_cpu_kernels"
    source, spec = kernels / "published_flash.cu", kernels / "published_flash.toml"
    answer = on_fake_driver(f"""
        from fa_verify.backends.spec_kernel import SpecKernelBackend
        from fa_verify.backends.spec_pycuda import SpecPyCudaBackend
        from fa_verify.verdict import check_attention
        gpu, cpu = SpecPyCudaBackend({str(source)!r}, {str(spec)!r}), SpecKernelBackend({str(source)!r}, {str(spec)!r})
        assert gpu.availability().available, gpu.availability().reason
        rows = []
        for dtype, shape, causal in [("fp16", (1, 2, 2, 70, 45, 64), True), ("fp32", (2, 2, 1, 33, 100, 64), False)]:
            p = problem(*shape, dtype, seed=len(rows), causal=causal)
            (o, lse), (o2, lse2) = gpu.run(p), cpu.run(p)
            rows.append([dtype, o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes(),
                         check_attention(o, p, lse=lse, precision=gpu.precision(dtype)).passed])
        answer(rows=rows, names=sorted(gpu.build()[2].values()))
    """, spec=f"{source}{os.pathsep}{spec}")
    assert answer["rows"] == [["fp16", True, True], ["fp32", True, True]]
    assert all(name.startswith("_Z16flash_fwd_kernel") for name in answer["names"])


@pytest.mark.parametrize("stem, shape, dtype", [
    ("split_combine", (1, 2, 2, 40, 70, 32), "fp16"),  # two launches sharing two scratch workspaces
    ("fa1_global_stats", (2, 1, 1, 33, 33, 16), "fp32"),  # scratch filled with -inf and 0, o zeroed
    ("struct_args", (1, 2, 1, 20, 30, 32), "fp16"),  # a struct by value, packed from the spec's layout
    ("template_seq", (1, 1, 1, 16, 32, 16), "fp32"),  # an entry over Nk, found by its mangled name
])
def test_spec_keys_drive_pycuda_as_they_drive_the_cpu_runner(stem, shape, dtype):
    """Scratch buffers, o-fill, [[launch]] lists, struct arguments and template entries over a drawn
    dimension through PyCUDA: bit-identical to the CPU runner, and the oracle passes."""
    kernels = REPO / "tests" / "cuda_cpu_kernels"
    source, spec = kernels / f"{stem}.cu", kernels / f"{stem}.toml"
    answer = on_fake_driver(f"""
        from fa_verify.backends.spec_kernel import SpecKernelBackend
        from fa_verify.backends.spec_pycuda import SpecPyCudaBackend
        from fa_verify.verdict import check_attention
        gpu, cpu = SpecPyCudaBackend({str(source)!r}, {str(spec)!r}), SpecKernelBackend({str(source)!r}, {str(spec)!r})
        p = problem(*{shape!r}, {dtype!r}, seed=1)
        (o, lse), (o2, lse2) = gpu.run(p), cpu.run(p)
        answer(same=o.tobytes() == o2.tobytes() and (lse is None or lse.tobytes() == lse2.tobytes()),
               passed=check_attention(o, p, lse=lse, precision=gpu.precision({dtype!r})).passed)
    """, spec=f"{source}{os.pathsep}{spec}")
    assert answer == {"same": True, "passed": True}


@pytest.mark.slow
def test_an_fp8_kernel_spec_drives_pycuda_as_it_drives_the_cpu_runner():
    """fp8_rows.cu (cuda_fp8.h's __nv_fp8_e4m3 / e5m2, compiled by nvcc against NVIDIA's own header)
    with its descale pointers through PyCUDA: bit-identical to the CPU runner's emulation, and agreeing."""
    kernels = REPO / "tests" / "cuda_cpu_kernels"
    source, spec = kernels / "fp8_rows.cu", kernels / "fp8_rows.toml"
    answer = on_fake_driver(f"""
        from fa_verify.backends.spec_kernel import SpecKernelBackend
        from fa_verify.backends.spec_pycuda import SpecPyCudaBackend
        from fa_verify.properties.fp8 import check_fp8_agreement
        from fa_verify.strategies._fp8 import make_fp8_problem
        gpu, cpu = SpecPyCudaBackend({str(source)!r}, {str(spec)!r}), SpecKernelBackend({str(source)!r}, {str(spec)!r})
        rows = []
        for fmt, causal in (("e4m3", True), ("e5m2", False)):
            p = make_fp8_problem((2, 4, 2, 5, 20, 16), fmt, 3, causal=causal)
            (o, lse), (o2, lse2) = gpu.run(p), cpu.run(p)
            rows.append([fmt, o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes(),
                         check_fp8_agreement(gpu, p).passed])
        answer(rows=rows)
    """, spec=f"{source}{os.pathsep}{spec}")
    assert answer["rows"] == [["e4m3", True, True], ["e5m2", True, True]]


def test_check_runs_a_spec_on_pycuda_with_its_shared_memory_opt_in():
    """`check kernel.cu --spec kernel.toml --runner pycuda`: raw_pointer_flash asks for 64 KiB of dynamic shared
    memory, which launches only after the spec's opt-in (cuFuncSetAttribute) as on a GPU."""
    kernels = REPO / "tests" / "cuda_cpu_kernels"
    source, spec = kernels / "raw_pointer_flash.cu", kernels / "raw_pointer_flash.toml"
    env = build.environment(spec=f"{source}{os.pathsep}{spec}")
    proc = subprocess.run([sys.executable, "-m", "fa_verify", "check", str(source), "--spec", str(spec), "--runner",
                           "pycuda", "--property", "convex_hull", "--max-examples", "2"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS raw_pointer_flash-pycuda" in proc.stdout
