"""Builds a CUDA C source into a shared library for the CPU runner, with a content-addressed cache.

Steps: preprocess the ``.cu`` with g++ and the force-included shim; turn inline PTX into calls of
the shim (``_ptx``); refuse what cannot be emulated
and rewrite ``__shared__`` (``_rewrite``); append the launch trampolines (``_trampolines``);
compile the unit and link it with the fiber runtime into ``module.so``.

Two cache levels, because preprocessing costs ~0.2 s and a test session builds the same kernels
again and again. A manifest keyed by the build's inputs (path, entries, flags, compiler, shim)
records the files the unit included and their hashes: if none changed, the library is reused
without running g++ at all. Otherwise the library is keyed by the hash of the final unit, so an
edit that changes nothing after preprocessing (a comment) still hits. The fiber runtime is
compiled once per flag set and linked into every module. A lock per manifest key makes processes
building the same inputs at once (pytest-xdist's workers) compile them once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fa_verify.cuda_cpu import _diagnostics, _host_code, _ptx, _rewrite, _trampolines
from fa_verify.errors import BackendUnavailableError, InvalidArgumentError, KernelBuildError

SHIM_DIR = Path(__file__).resolve().parent / "include"
RUNTIME_SOURCE = Path(__file__).resolve().parent / "runtime" / "fiber_runtime.cpp"
RACE_RUNTIME_SOURCE = RUNTIME_SOURCE.parent / "race_runtime.cpp"
SHIM_HEADER = SHIM_DIR / "fa_cuda_cpu.h"
_BUILDER_VERSION = "1"

_COMMON_FLAGS = (
    "-std=c++17",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",  # kernels reinterpret_cast buffers to float4, __half2, ...
    "-fno-threadsafe-statics",  # __shared__ statics need no guard: one OS thread runs a block
    "-fno-math-errno",
)
if platform.machine() in ("x86_64", "AMD64"):
    # The fiber switch returns into another stack: no CET shadow-stack marking on the module.
    _COMMON_FLAGS += ("-fcf-protection=none",)
_OPTIMIZE_FLAGS = ("-O2",)
_SANITIZE_FLAGS = ("-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer")
# The race detector's build: -g for the file:line of each access; the kernel's unit alone is
# instrumented (every load and store calls runtime/race_runtime.cpp), and linked without libtsan.
_RACECHECK_FLAGS = ("-O2", "-g", "-DFA_CPU_RACECHECK=1")
_RACECHECK_INSTRUMENT = ("-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0")


@dataclass(frozen=True)
class BuildResult:
    """A built kernel module: where its library is, and whether the cache supplied it."""

    library: Path
    cache_hit: bool
    seconds: float
    log: str  # the compiler's output (warnings), empty on a cache hit


def compiler() -> str:
    """The host C++ compiler: $FA_VERIFY_CXX, else g++."""
    return os.environ.get("FA_VERIFY_CXX", "g++")


def default_cache_dir() -> Path:
    """$FA_VERIFY_CACHE/cuda_cpu, else ~/.cache/fa_verify/cuda_cpu."""
    root = os.environ.get("FA_VERIFY_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "fa_verify"
    return base / "cuda_cpu"


@functools.lru_cache(maxsize=None)
def compiler_identity(cxx: str) -> str:
    """Version and target of the compiler: part of every cache key."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        machine = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BackendUnavailableError(
            f"the CUDA-on-CPU runner needs a C++17 compiler; {cxx!r} cannot be run ({exc}). "
            "Install g++ or set FA_VERIFY_CXX."
        ) from exc
    return version.splitlines()[0].strip() + " " + machine.strip()


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@functools.lru_cache(maxsize=1)
def _shim_digest() -> str:
    # Everything that shapes the compiled unit: shim headers, runtime, this builder, the rewrite.
    here = Path(__file__).parent
    files = sorted(SHIM_DIR.iterdir()) + sorted(RUNTIME_SOURCE.parent.iterdir()) + [
        Path(__file__), here / "_rewrite.py", here / "_ptx.py", here / "_trampolines.py"]
    return _sha256("".join(f.name + _sha256(f.read_bytes()) for f in files if f.is_file()))


def build(
    source: str | os.PathLike,
    entries: Mapping[str, Sequence[str]],
    *,
    include_dirs: Sequence[str | os.PathLike] = (),
    defines: Sequence[str] = (),
    sanitize: bool = False,
    racecheck: bool = False,
    arch: int = 80,
    cache_dir: str | os.PathLike | None = None,
) -> BuildResult:
    """Build (or fetch from the cache) the library for `source` with launchers for `entries`.

    `entries` maps each ``__global__`` kernel's name or template instantiation to its signature
    ('ptr' | 'int' | 'float' per parameter); `defines` are ``NAME`` or ``NAME=VALUE`` strings;
    `sanitize` builds with AddressSanitizer, `racecheck` with the race detector (not both). Raises KernelBuildError
    with the compiler's full output, KernelUnsupportedError for what the runner cannot emulate.
    """
    if sanitize and racecheck:
        raise InvalidArgumentError("sanitize=True and racecheck=True cannot be combined: build one of each")
    start = time.perf_counter()
    source = Path(source).resolve()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    cxx = compiler()
    identity = compiler_identity(cxx)
    flags = _COMMON_FLAGS + (_SANITIZE_FLAGS if sanitize else _RACECHECK_FLAGS if racecheck else _OPTIMIZE_FLAGS)
    macro_flags = (
        "-D__CUDACC__",
        f"-D__CUDA_ARCH__={int(arch) * 10}",
        "-DFA_VERIFY_CUDA_CPU=1",
        *(f"-D{d}" for d in defines),
    )
    include_flags = ("-I", str(SHIM_DIR), "-I", str(source.parent))
    for directory in include_dirs:
        include_flags += ("-I", str(Path(directory).resolve()))
    entries = {name: tuple(sig) for name, sig in entries.items()}

    inputs_key = _sha256(
        json.dumps(
            [_BUILDER_VERSION, str(source), entries, flags, macro_flags, include_flags, identity, _shim_digest()],
            sort_keys=True, default=repr,  # a struct parameter's layout by its dataclass repr
        )
    )
    manifest = cache / "manifests" / f"{inputs_key}.json"
    library = _from_manifest(manifest, cache)
    if library is not None:
        return BuildResult(library, True, time.perf_counter() - start, "")

    # One build per key at a time: a second process (pytest-xdist's other worker) waits for the
    # first and then finds its library, instead of compiling the same unit beside it.
    with _locked(cache / "locks" / f"{inputs_key}.lock"):
        library = _from_manifest(manifest, cache)
        if library is not None:
            return BuildResult(library, True, time.perf_counter() - start, "")
        with tempfile.TemporaryDirectory(prefix="build-", dir=cache) as work_dir:
            work = Path(work_dir)
            preprocessed, depends = _preprocess(cxx, source, flags, macro_flags, include_flags, work, entries)
            preprocessed = _ptx.rewrite_inline_asm(preprocessed, SHIM_DIR)
            _rewrite.check_supported(preprocessed, SHIM_DIR)
            unit = _rewrite.rewrite_shared(preprocessed)
            unit += _trampolines.generate(entries, str(source))
            runtime = _runtime_objects(cxx, identity, flags, cache, racecheck)
            unit_key = _sha256(json.dumps([_BUILDER_VERSION, identity, flags, _sha256(unit), [r.name for r in runtime]]))
            target = cache / unit_key[:32]
            library = target / "module.so"
            log = ""
            cache_hit = library.exists()
            if not cache_hit:
                (work / "kernel.ii").write_text(unit)
                runtime = tuple(str(r) for r in runtime)
                if racecheck:  # compiled instrumented, linked without ThreadSanitizer's runtime
                    command = (cxx, *flags, *_RACECHECK_INSTRUMENT, "-c", str(work / "kernel.ii"), "-o", str(work / "kernel.o"))
                    log = _run(command, source, "compile", entries)
                    command = (cxx, *flags, "-shared", "-Wl,-z,defs", str(work / "kernel.o"), *runtime, "-o",
                               str(work / "module.so"))
                    log += _run(command, source, "link", entries)
                    (work / "kernel.o").unlink()
                else:
                    command = (cxx, *flags, "-shared", str(work / "kernel.ii"), *runtime, "-o", str(work / "module.so"))
                    log = _run(command, source, "compile", entries)
                (work / "build.log").write_text(log)
                (work / "kernel.ii").unlink()
                _publish(work, target)
            _write_manifest(manifest, depends, library.relative_to(cache))
    return BuildResult(library, cache_hit, time.perf_counter() - start, log)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (created if missing), held while the block runs."""
    path.parent.mkdir(exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _preprocess(cxx, source, flags, macro_flags, include_flags, work, entries):
    output, depfile = work / "kernel.pp", work / "kernel.d"
    command = (
        cxx, "-E", *flags, *macro_flags, *include_flags, "-x", "c++", "-include", str(SHIM_HEADER),
        "-MMD", "-MF", str(depfile), str(source), "-o", str(output),
    )  # fmt: skip
    _run(command, source, "preprocess", entries)
    return output.read_text(errors="replace"), _parse_depfile(depfile.read_text())


def _run(command: tuple[str, ...], source: Path, stage: str, entries) -> str:
    proc = subprocess.run(command, capture_output=True, text=True, errors="replace")
    output = _host_code.originals((proc.stdout + proc.stderr).strip())
    if proc.returncode != 0:
        notes = _diagnostics.hints(output, entries)
        message = f"building {_host_code.originals(str(source))} for the CUDA-on-CPU runner failed ({stage})"
        if notes:
            message += ":\n" + "\n".join(f"  hint: {note}" for note in notes)
        compiler = os.path.basename(command[0])
        shown, left_out = _diagnostics.own_errors_first(output)
        if left_out:  # the whole output is kept beside the unit it is about
            log_file = source.with_suffix(f".{compiler}.log")
            log_file.write_text(output)
            message += (f"\n--- {compiler} output: the errors in your source (then {left_out} more in "
                        f"fa_verify's generated launch code, which follow from them: all in {log_file}) ---"
                        f"\n{shown}")
        else:
            message += f"\n--- {compiler} output ---\n{output}"
        raise KernelBuildError(message, log=output, command=command)
    return output


def _runtime_objects(cxx: str, identity: str, flags: tuple[str, ...], cache: Path, racecheck: bool) -> list[Path]:
    """The fiber runtime (and the race detector's, for a race build), compiled once per flag set."""
    objects = []
    for source in (RUNTIME_SOURCE, RACE_RUNTIME_SOURCE) if racecheck else (RUNTIME_SOURCE,):
        key = _sha256(json.dumps([_BUILDER_VERSION, identity, flags, _shim_digest(), source.name]))
        target = cache / f"{source.stem}-{key[:32]}.o"
        if not target.exists():
            with tempfile.TemporaryDirectory(prefix="runtime-", dir=cache) as work:
                obj = Path(work) / "runtime.o"
                command = (cxx, *flags, "-I", str(SHIM_DIR), "-c", str(source), "-o", str(obj))
                _run(command, source, f"compile {source.name}", ())
                os.replace(obj, target)
        objects.append(target)
    return objects


def _publish(work: Path, target: Path) -> None:
    """Move the finished build into place; a concurrent identical build may have won the race."""
    staged = work / "publish"
    staged.mkdir()
    for name in ("module.so", "build.log"):
        os.replace(work / name, staged / name)
    try:
        os.replace(staged, target)
    except OSError:
        if not (target / "module.so").exists():
            raise
        shutil.rmtree(staged, ignore_errors=True)


def _parse_depfile(text: str) -> list[str]:
    body = text.replace("\\\n", " ").split(":", 1)[1] if ":" in text else ""
    paths, current = [], ""
    for token in body.split(" "):  # a backslash-escaped space belongs to the path
        if token.endswith("\\"):
            current += token[:-1] + " "
            continue
        current += token
        if current.strip():
            paths.append(current.strip())
        current = ""
    return paths


def _write_manifest(manifest: Path, depends: list[str], library: Path) -> None:
    manifest.parent.mkdir(exist_ok=True)
    record = {"library": str(library), "depends": {p: _sha256(Path(p).read_bytes()) for p in depends}}
    tmp = manifest.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, manifest)


def _from_manifest(manifest: Path, cache: Path) -> Path | None:
    try:
        record = json.loads(manifest.read_text())
        library = cache / record["library"]
        if not library.exists():
            return None
        for path, digest in record["depends"].items():
            if _sha256(Path(path).read_bytes()) != digest:
                return None
        return library
    except (OSError, ValueError, KeyError):
        return None
