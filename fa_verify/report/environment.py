"""The machine a report was made on: versions, CPU, GPU and which backends could run."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    """GPU names from nvidia-smi; none where it is missing (no import of torch.cuda needed)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def collect() -> dict:
    """A JSON-ready description of this machine and the built-in backends' availability."""
    from fa_verify import __version__
    from fa_verify.backends import backend_table

    return {
        "fa_verify": __version__,
        "python": sys.version.split()[0],
        "packages": {name: _version(name) for name in
                     ("numpy", "mpmath", "ml_dtypes", "torch", "pycuda", "matplotlib", "jinja2")},
        "platform": platform.platform(),
        "cpu": _cpu(),
        "cpu_count": os.cpu_count(),
        "gpus": _gpus(),
        "backends": [{"name": row["name"], "available": row["available"], "reason": row["reason"]}
                     for row in backend_table()],
    }
