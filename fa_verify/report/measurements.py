"""A cache of measurements keyed by their inputs: the report's fixed experiments cost ~nothing again.

A measurement is a JSON-serialisable dict computed from a spec (what is measured, on which
inputs: shape, dtype, distribution, seed, implementations) by code. Its key hashes the spec
together with the text of the code that computes it (the kernel sources and the Python modules
named by the experiment) and fa_verify's version, so an edit to any of them recomputes it.
Entries are files `<key>.json` under $FA_VERIFY_CACHE/measurements (default
~/.cache/fa_verify/measurements, beside the CUDA-on-CPU runner's build cache), written
atomically; an unreadable entry is recomputed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

import fa_verify
from fa_verify.cuda_cpu._build import default_cache_dir
from fa_verify.kernels.catalogue import kernels_dir


def default_folder() -> Path:
    """$FA_VERIFY_CACHE/measurements, else ~/.cache/fa_verify/measurements."""
    return default_cache_dir().parent / "measurements"


#: Files of a package that its code consists of (the CUDA-on-CPU runner's shim headers and
#: fiber runtime decide how a kernel's arithmetic runs, so they count).
_SOURCE_SUFFIXES = (".py", ".h", ".cpp")


def code_fingerprint(modules=(), kernel_files=()) -> str:
    """A hash of the source text of `modules` (dotted names; a package counts every .py, .h and
    .cpp file under it) and of `kernel_files` (names in the kernels folder), with fa_verify's version."""
    digest = hashlib.sha256(fa_verify.__version__.encode())
    paths = []
    for name in modules:
        path = Path(importlib.import_module(name).__file__)
        paths += (sorted(p for p in path.parent.rglob("*") if p.suffix in _SOURCE_SUFFIXES)
                  if path.name == "__init__.py" else [path])
    paths += [kernels_dir() / name for name in kernel_files]
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class MeasurementCache:
    """Measurements by key; `computed` and `reused` count what each `get` did."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder is not None else default_folder()
        self.computed = 0
        self.reused = 0

    def get(self, spec: dict, code: str, compute: Callable[[], dict]) -> dict:
        """The measurement of `spec` by the code whose fingerprint is `code`: from the cache,
        else `compute()` (then stored)."""
        key = hashlib.sha256(json.dumps([spec, code], sort_keys=True).encode()).hexdigest()[:32]
        path = self.folder / f"{key}.json"
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
            self.reused += 1
            return value
        except (OSError, ValueError):  # absent or damaged: measure again
            pass
        value = compute()
        self.computed += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False,
                                         encoding="utf-8") as tmp:
            json.dump(value, tmp)
        Path(tmp.name).replace(path)  # a reader never sees half an entry
        return value


def deviation(out, ref_out) -> dict:
    """What a measurement keeps of one output: max and RMSE of |O - O_ref| over its elements."""
    error = np.abs(np.asarray(out, dtype=np.float64) - ref_out)
    return {"max": float(error.max()), "rmse": float(np.sqrt(np.mean(error ** 2)))}


def measure_problems(cache: MeasurementCache, experiment: str, setup, code: str, axis: str, values,
                     seeds, measure_one: Callable[[object, int], dict], progress=None,
                     context: dict | None = None) -> dict:
    """An experiment's problems, one per (value of `axis`, seed), each through `cache`:
    {"setup": asdict(setup), "problems": [{axis: value, "seed": seed, **figures}, ...]}.
    `context`: more inputs of every problem's key (e.g. whether the kernels can run here)."""
    problems = []
    for value in values:
        for seed in seeds:
            if progress:
                progress(f"{experiment}, {axis} {value}, seed {seed}")
            spec = {"experiment": experiment, "setup": asdict(setup), axis: value, "seed": seed,
                    **(context or {})}
            problems.append({axis: value, "seed": seed,
                             **cache.get(spec, code, lambda: measure_one(value, seed))})
    return {"setup": asdict(setup), "problems": problems}


def seeds_text(seeds) -> str:
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
