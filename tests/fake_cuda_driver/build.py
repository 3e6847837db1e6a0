"""Build the stub and fake CUDA drivers and a PyCUDA linked against the stub (test support).

Nothing here is a CUDA driver. `stub` is libcuda.so.1 generated from the toolkit's cuda.h
(every entry point fails with CUDA_ERROR_STUB_LIBRARY): PyCUDA links against it without a GPU.
`fake` adds fake_driver.c: host memory as device memory, launches run by the CUDA-on-CPU
runner. Both are refused on a machine with a real NVIDIA driver, so that neither can shadow it.

Everything is cached under ~/.cache/fa_verify/fake_cuda_driver/ ($FA_VERIFY_FAKE_DRIVER_CACHE):
the libraries keyed by their sources and the toolkit, PyCUDA installed into its own folder
(never into the environment: only processes given `environment()` see it), keyed by the PyCUDA
version, the toolkit's CUDA version and the Python version.

    python3 tests/fake_cuda_driver/build.py pycuda   # build (~2-4 min on 2 cores) or reuse; print its folder
    python3 tests/fake_cuda_driver/build.py env      # KEY=VALUE lines for a shell using the fake driver
"""

from __future__ import annotations

import argparse
import ctypes.util
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYCUDA_VERSION = "2026.1"
CACHE_ENV = "FA_VERIFY_FAKE_DRIVER_CACHE"


class FakeDriverUnavailable(RuntimeError):
    """The fake driver cannot be built or used here; the message says what is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fa_verify" / "fake_cuda_driver")


def real_driver() -> str | None:
    """Why this machine has a real NVIDIA driver (then the stub and fake must stay away), or None."""
    for path in ("/proc/driver/nvidia", "/dev/nvidiactl"):
        if os.path.exists(path):
            return f"{path} exists"
    if shutil.which("nvidia-smi"):
        return f"nvidia-smi is installed ({shutil.which('nvidia-smi')})"
    found = ctypes.util.find_library("cuda")
    if found and cache_dir().as_posix() not in (os.path.realpath(found)):
        return f"a CUDA driver library is installed ({found})"
    return None


def _refuse_on_real_driver() -> None:
    reason = real_driver()
    if reason:
        raise FakeDriverUnavailable(f"a real NVIDIA driver is here ({reason}): the stub and fake drivers "
                                    "refuse to shadow it; run the PyCUDA tests on the real GPU instead")


def toolkit() -> tuple[Path, Path, str]:
    """(nvcc, the include folder holding cuda.h, the CUDA release e.g. '13.0') of the nvcc fa_verify uses."""
    from fa_verify.kernels.nvcc import NvccNotFoundError, find_nvcc

    try:
        nvcc = find_nvcc()
    except NvccNotFoundError as exc:
        raise FakeDriverUnavailable(str(exc)) from None
    dry = subprocess.run([str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    includes = [Path(p) for p in re.findall(r'-I"?([^"\s]+)', " ".join(re.findall(r"INCLUDES=(.*)", dry)))]
    include = next((p.resolve() for p in includes if (p / "cuda.h").is_file()), None)
    if include is None:
        raise FakeDriverUnavailable(f"cuda.h was not found beside {nvcc} (looked in {', '.join(map(str, includes))}); "
                                    "pip install nvidia-cuda-runtime (it holds cuda.h)")
    if not (include / "cudaProfiler.h").is_file():
        raise FakeDriverUnavailable(f"{include} has no cudaProfiler.h, which PyCUDA needs: "
                                    "pip install nvidia-cuda-profiler-api (or use a full toolkit)")
    version = re.search(r"release (\d+\.\d+)", subprocess.run([str(nvcc), "--version"], capture_output=True,
                                                              text=True).stdout)
    return nvcc, include, version.group(1) if version else "unknown"


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def build_library(kind: str = "fake", omit: tuple[str, ...] = ()) -> Path:
    """The folder holding `kind` ("stub" or "fake") as libcuda.so.1 and libcuda.so; built once.

    omit: entry points of the stub left out, as an older driver lacks them (e.g. "cuCtxCreate_v4");
    the fake's own definitions stay."""
    _refuse_on_real_driver()
    _, include, version = toolkit()
    sources = [HERE / "generate_stub.py"] + ([HERE / "fake_driver.c"] if kind == "fake" else [])
    key = _digest(kind, HERE, include, version, sorted(omit), *(p.read_bytes() for p in sources))
    folder = cache_dir() / f"{kind}-{key}"
    if (folder / "libcuda.so.1").is_file():
        return folder
    work = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=cache_dir().mkdir(parents=True, exist_ok=True) or cache_dir()))
    generate = subprocess.run([sys.executable, str(HERE / "generate_stub.py"), "--cuda-include", str(include),
                               "-o", str(work / "stub.c"), *[f"--omit={name}" for name in omit]],
                              capture_output=True, text=True)
    if generate.returncode or not shutil.which("cc"):
        shutil.rmtree(work, ignore_errors=True)
        raise FakeDriverUnavailable(f"generating the {kind} driver needs a C compiler (cc): {generate.stderr.strip()}")
    command = ["cc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(work / "libcuda.so.1"),
               str(work / "stub.c")]
    if kind == "fake":
        command += ["-DFA_STUB_ERROR=801", f"-I{include}", f"-I{sysconfig.get_paths()['include']}",
                    f'-DFA_FAKE_DRIVER_PYTHON_DIR="{HERE.parent}"', str(HERE / "fake_driver.c")]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        shutil.rmtree(work, ignore_errors=True)
        raise FakeDriverUnavailable(f"building the {kind} driver failed:\n{proc.stderr}")
    (work / "libcuda.so").symlink_to("libcuda.so.1")
    try:
        work.rename(folder)
    except OSError:  # another process built it first
        shutil.rmtree(work, ignore_errors=True)
    return folder


def pycuda_dir(build: bool = False) -> Path:
    """The folder PyCUDA (built against the stub) is installed in; built when `build`, else must exist."""
    _, include, version = toolkit()
    folder = cache_dir() / f"pycuda-{PYCUDA_VERSION}-cuda{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    if (folder / "pycuda" / "driver.py").is_file():
        return folder
    if not build:
        raise FakeDriverUnavailable(f"PyCUDA has not been built against the stub driver here ({folder} is missing): "
                                    "run python3 tests/fake_cuda_driver/build.py pycuda")
    stub = build_library("stub")
    with tempfile.TemporaryDirectory(prefix="pycuda-build-") as tmp:
        pip = [sys.executable, "-m", "pip"]
        subprocess.run(pip + ["download", "--no-deps", "--no-binary", "pycuda", "--no-build-isolation",
                              f"pycuda=={PYCUDA_VERSION}", "-d", tmp], check=True)
        shutil.unpack_archive(next(Path(tmp).glob("pycuda-*.tar.gz")), tmp)
        source = next(p for p in Path(tmp).glob("pycuda-*") if p.is_dir())
        subprocess.run([sys.executable, "configure.py", f"--cuda-root={include.parent}", f"--cuda-inc-dir={include}",
                        f"--cudadrv-lib-dir={stub}", "--no-cuda-enable-curand"], cwd=source, check=True)
        subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", ".", "-w", tmp], cwd=source, check=True)
        partial = Path(tempfile.mkdtemp(prefix="pycuda-install-", dir=cache_dir()))
        subprocess.run(pip + ["install", "--target", str(partial), next(Path(tmp).glob("pycuda-*.whl"))], check=True)
    partial.rename(folder)
    return folder


def environment(base=None, *, driver: str = "fake", omit: tuple[str, ...] = (), **settings) -> dict:
    """Environment variables of a process that runs PyCUDA on the fake (or stub) driver.

    settings: the fake's FA_FAKE_CUDA_* variables by their lower-case suffix, e.g.
    devices="8.0:166912,7.5:65536", memory=1 << 20, driver_version=12040, faults="cuMemAlloc_v2=2".
    """
    env = dict(os.environ if base is None else base)
    library = build_library(driver, omit) if driver else None
    paths = [str(pycuda_dir())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if library:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(library)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    for name, value in settings.items():
        env[f"FA_FAKE_CUDA_{name.upper()}"] = str(value)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the stub/fake CUDA drivers and PyCUDA (test support).")
    parser.add_argument("what", choices=("pycuda", "env"))
    args = parser.parse_args(argv)
    try:
        if args.what == "pycuda":
            print(pycuda_dir(build=True))
        else:
            env = environment()
            for name in ("PYTHONPATH", "LD_LIBRARY_PATH"):
                print(f"{name}={env[name]}")
    except FakeDriverUnavailable as exc:
        print(f"fake CUDA driver: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
