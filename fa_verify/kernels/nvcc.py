"""The nvcc check: compile every kernel for real GPU targets without a GPU, report resource usage.

`nvcc -cubin -arch=sm_XX --resource-usage` runs the whole device tool chain (front end, cicc,
ptxas) and prints, per entry point, registers, static shared memory, stack frame and spills.
Dynamic shared memory is not in the binary: the catalogue computes it per entry. nvcc is looked
for on PATH, then under $CUDA_HOME / $CUDA_PATH, then in the pip wheels (`nvidia-cuda-nvcc`:
nvidia/cu13/bin for CUDA 13, nvidia/cuda_nvcc/bin before).
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fa_verify.errors import FaVerifyError, InvalidArgumentError
from fa_verify.kernels.catalogue import FAMILIES, NVCC_OPTIONS, KernelFamily

DEFAULT_ARCHS = ("sm_80", "sm_90")
_WHEEL_BIN_DIRS = ("nvidia/cu13/bin", "nvidia/cuda_nvcc/bin")
_WHEEL_INCLUDE_DIRS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cuda_nvcc/include")


class NvccNotFoundError(FaVerifyError, RuntimeError):
    """No nvcc here; the message says where fa_verify looked and how to get one."""


def _site_dirs() -> list[Path]:
    dirs = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    dirs += [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")]
    dirs += [p for p in sys.path if p.endswith("-packages")]
    return [Path(d) for d in dict.fromkeys(d for d in dirs if d)]


def nvcc_candidates() -> list[Path]:
    """Where find_nvcc looks, in order (existing or not)."""
    found = []
    on_path = shutil.which("nvcc")
    if on_path:
        found.append(Path(on_path))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            found.append(Path(os.environ[var]) / "bin" / "nvcc")
    for base in _site_dirs():
        found += [base / sub / "nvcc" for sub in _WHEEL_BIN_DIRS]
    return found


def find_nvcc() -> Path:
    """The nvcc to use, or NvccNotFoundError saying where it looked."""
    candidates = nvcc_candidates()
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    looked = ", ".join(str(p) for p in candidates) or "(nothing to look at)"
    raise NvccNotFoundError(
        "nvcc was not found on PATH, under $CUDA_HOME/$CUDA_PATH, or in the pip wheels "
        f"(looked at: PATH, {looked}); install the CUDA toolkit or `pip install nvidia-cuda-nvcc` "
        "(CUDA 13's wheel provides nvcc and the headers)")


def cuda_include_dirs(nvcc: Path) -> list[Path]:
    """Folders to add with -I so that cuda_fp16.h and mma.h are found (pip-wheel nvcc layouts)."""
    own = nvcc.resolve().parent.parent / "include"
    if (own / "cuda_fp16.h").is_file():
        return []  # a toolkit install: nvcc finds its headers itself
    dirs = []
    for base in _site_dirs():
        for sub in _WHEEL_INCLUDE_DIRS:
            if (base / sub / "cuda_fp16.h").is_file() or (base / sub / "mma.h").is_file():
                dirs.append(base / sub)
    return dirs


def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"release (\S+), V(\S+)", out)
    return match.group(2) if match else out.strip().splitlines()[-1] if out.strip() else "unknown"


def supported_archs(nvcc: Path) -> set[str]:
    """The sm_XX targets this nvcc can generate code for."""
    proc = subprocess.run([str(nvcc), "--list-gpu-code"], capture_output=True, text=True, timeout=60)
    return set(proc.stdout.split()) if proc.returncode == 0 else set()


@dataclass(frozen=True)
class EntryUsage:
    """ptxas's resource report for one entry point on one architecture."""

    entry: str
    arch: str
    registers: int
    #: static shared memory (bytes); the kernels here use dynamic shared memory only
    static_smem: int
    #: dynamic shared memory the catalogue requests for this entry (bytes)
    dynamic_smem: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    threads: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class FileResult:
    """One (kernel file, arch) compilation, holding the entries of every family in the file."""

    source: str
    families: list
    arch: str
    ok: bool
    seconds: float
    entries: list = field(default_factory=list)
    #: compiler output when the compilation failed (errors), or its warnings
    log: str = ""
    command: str = ""


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resource_usage(text: str) -> dict[str, dict]:
    """{entry: {registers, static_smem, stack_frame, spill_stores, spill_loads}} from ptxas -v output."""
    usage: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = usage.setdefault(m.group(1), dict(registers=0, static_smem=0, stack_frame=0,
                                                         spill_stores=0, spill_loads=0))
            continue
        if current is None:
            continue
        m = _PROPS.search(line)
        if m:
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        m = _USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            current["static_smem"] = int(s.group(1)) if s else 0
    return usage


def compile_file(families: list[KernelFamily], arch: str, nvcc: Path, extra_options=(),
                 source_path: Path | None = None) -> FileResult:
    """nvcc -cubin one kernel file (all `families` must share it) for one arch; parse its entries.

    `source_path`: another copy of the families' source (a mutant's), with its fa_common.cuh
    beside it."""
    import time

    source_path = Path(source_path) if source_path else families[0].source_path
    with tempfile.TemporaryDirectory(prefix="fa_verify_nvcc_") as tmp:
        cmd = [str(nvcc), f"-arch={arch}", "-cubin", "-o", str(Path(tmp) / "kernels.cubin"),
               "--resource-usage", *NVCC_OPTIONS, "-I", str(source_path.parent),
               *[f"-I{d}" for d in cuda_include_dirs(nvcc)], *extra_options, str(source_path)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    result = FileResult(source=source_path.name, families=[f.name for f in families], arch=arch,
                        ok=proc.returncode == 0, seconds=seconds, command=" ".join(cmd))
    usage = parse_resource_usage(log)
    expected = [(family, entry) for family in families for entry in family.entries()]
    if result.ok:
        missing = [entry for _, entry in expected if entry not in usage]
        if missing:
            result.ok = False
            result.log = f"nvcc compiled {source_path.name} but these catalogued entries are missing: {missing}\n"
    result.log += "\n".join(line for line in log.splitlines()
                            if "ptxas info" not in line and not line.startswith("    ") and line.strip())
    for family, entry in expected:
        if entry not in usage:
            continue
        threads, dynamic_smem = family.resources(entry)
        result.entries.append(EntryUsage(entry=entry, arch=arch, threads=threads, dynamic_smem=dynamic_smem,
                                         **usage[entry]))
    return result


def check_build(archs=DEFAULT_ARCHS, families=None, nvcc: Path | None = None,
                jobs: int | None = None) -> list[FileResult]:
    """Compile every kernel file for every arch, in parallel; never raises on a compile error."""
    nvcc = nvcc or find_nvcc()
    archs = list(archs)
    for arch in archs:
        if not re.fullmatch(r"sm_\d+[af]?", arch):
            raise InvalidArgumentError(f"arch={arch!r} is not a GPU target; use e.g. sm_80 or sm_90")
    known = supported_archs(nvcc)
    unknown = [a for a in archs if known and re.sub(r"[af]$", "", a) not in known]
    if unknown:
        raise InvalidArgumentError(
            f"nvcc {nvcc_version(nvcc)} ({nvcc}) cannot generate code for {', '.join(unknown)}; "
            f"it supports {', '.join(sorted(known))}")
    by_source: dict[str, list[KernelFamily]] = {}
    for f in (families or FAMILIES):
        family = FAMILIES[f] if isinstance(f, str) else f
        by_source.setdefault(family.source, []).append(family)
    jobs = jobs or max(1, min(len(by_source) * len(archs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compile_file, fams, arch, nvcc) for fams in by_source.values() for arch in archs]
        return [f.result() for f in futures]
