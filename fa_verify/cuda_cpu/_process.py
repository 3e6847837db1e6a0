"""The parent's side of the worker process: start it, send launches, and turn its death into errors.

A kernel that crashes takes only the worker down: the parent sees the pipe close, reads the exit
signal (or AddressSanitizer's report, which the worker's stderr log holds), raises
KernelCrashError or KernelSanitizerError, and starts a fresh worker at the next launch. A kernel
that does not answer within the timeout is killed and reported as KernelTimeoutError.

Sanitizer launches run in their own worker started with LD_PRELOAD=libasan: the ASan runtime must
be the first library of a process, which a Python that is already running cannot arrange.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from fa_verify import isolation
from fa_verify.cuda_cpu import _faults
from fa_verify.cuda_cpu._host_code import originals
from fa_verify.errors import (
    BackendUnavailableError,
    KernelCrashError,
    KernelRunError,
    KernelSanitizerError,
    KernelTimeoutError,
)

_WORKER_SCRIPT = Path(__file__).resolve().parent / "_worker.py"
_STARTUP_TIMEOUT = 60.0
_ASAN_OPTIONS = (
    "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=66:handle_segv=1:handle_abort=1:"
    "detect_odr_violation=0:allocator_may_return_null=1:symbolize=1:print_summary=1"
)
_REPORT_LINES = 40


def asan_runtime() -> str:
    """Path of the compiler's libasan, for LD_PRELOAD."""
    from fa_verify.cuda_cpu._build import compiler

    try:
        out = subprocess.run([compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    except OSError as exc:
        raise BackendUnavailableError(f"cannot locate AddressSanitizer's runtime: {exc}") from exc
    if not out or not os.path.isabs(out) or not os.path.exists(out):
        raise BackendUnavailableError(
            "the sanitizer mode needs AddressSanitizer's runtime (libasan), which the compiler does not have; "
            "install it (Debian: libasan8 / the gcc package)"
        )
    return os.path.realpath(out)


class WorkerProcess:
    """The worker subprocess (sanitizer or not), started on first use and after every death;
    the process itself is fa_verify.isolation's."""

    def __init__(self, sanitize: bool):
        self.sanitize = sanitize
        self._process = isolation.WorkerProcess([sys.executable, "-S", str(_WORKER_SCRIPT)],
                                                cwd=str(_WORKER_SCRIPT.parent), startup_timeout=_STARTUP_TIMEOUT)

    def _environment(self) -> dict:
        env = dict(os.environ)
        if self.sanitize:
            env["LD_PRELOAD"] = asan_runtime()
            env["ASAN_OPTIONS"] = _ASAN_OPTIONS + (":" + env["ASAN_OPTIONS"] if env.get("ASAN_OPTIONS") else "")
        else:
            env.pop("LD_PRELOAD", None)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def _start(self) -> None:
        self._process.env = self._environment()  # as the environment is now, as it was at each start before
        try:
            self._process.start()
        except isolation.WorkerTimedOut:
            raise KernelRunError(f"the CUDA-on-CPU worker did not start within {_STARTUP_TIMEOUT:g} s") from None
        except isolation.WorkerDied as died:
            raise KernelRunError("the CUDA-on-CPU worker failed to start:\n" + died.output[-4000:],
                                 detail=died.output) from None

    def close(self) -> None:
        self._process.close()

    def run(self, request: dict, timeout: float, what: str, buffer_names: list[str],
            null_names: list[str] = ()) -> tuple[dict, str]:
        """Send one launch; return (result, the kernel's printed output) or raise a KernelRunError.

        `what` names the launch, `buffer_names` the request's buffers and `null_names` the
        arguments passed as null pointers, for the messages.
        """
        buffers: list[tuple[int, int]] = []

        def announced(kind, table) -> None:
            buffers[:] = table

        with self._process.lock:
            if not self._process.alive:
                self._process.stop()
                self._start()
            try:
                kind, payload = self._process.call(request, timeout, interim=("buffers",), on_interim=announced)
            except isolation.WorkerTimedOut:
                raise KernelTimeoutError(f"kernel timed out after {timeout:g} s ({what})") from None
            except isolation.WorkerDied as died:
                raise _death_error(died.status, died.output, buffers, what, buffer_names, null_names) from None
            output = self._process.output()
            if kind == "error":
                raise KernelRunError(f"the CUDA-on-CPU worker could not run {what}: {payload}", detail=output)
            return payload, output


def _death_error(status: int, output: str, buffers, what: str, buffer_names: list[str],
                 null_names=()) -> KernelRunError:
    output = originals(output)
    report, before = _asan_report(output)
    owner = _faults.owner(output, buffers, buffer_names, null_names)
    if report is not None:
        kind = re.search(r"AddressSanitizer: ([\w-]+)", report)
        kind = kind.group(1) if kind else "error"
        if kind in ("SEGV", "BUS", "FPE", "ILL", "ABRT", "stack-overflow", "DEADLYSIGNAL"):
            signame = {"stack-overflow": "SIGSEGV (stack overflow)", "DEADLYSIGNAL": "a fatal signal"}
            signame = signame.get(kind, "SIG" + kind)
            printed = "\n".join(before.strip().splitlines()[-10:])  # e.g. a failed assert's message
            text = (printed + "\n" if printed else "") + report
            return KernelCrashError(f"kernel crashed: {signame} ({what}){owner}\n{text}", detail=output)
        where = _locate(kind, report, buffers, buffer_names)
        return KernelSanitizerError(f"AddressSanitizer: {kind}{where} ({what})\n{report}", detail=report)
    if status < 0:
        name = isolation.describe_status(status)
        message = f"kernel crashed: {name} ({what}){owner}"
        if name == "SIGSEGV" and not owner:
            message += ("\n(an invalid address: sanitize=True reports the access; or a fiber stack overflow: "
                        "large per-thread arrays may need a larger stack_kib)")
    else:
        message = f"kernel crashed: the worker exited with status {status} ({what})"
    tail = "\n".join(output.strip().splitlines()[-_REPORT_LINES:])
    return KernelCrashError(message + ("\n" + tail if tail else ""), detail=output)


def _asan_report(output: str) -> tuple[str | None, str]:
    """(ASan's report, cut to its first lines, or None; what the process printed before it)."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "ERROR: AddressSanitizer" in line or "AddressSanitizer:DEADLYSIGNAL" in line:
            start = i - 1 if i > 0 and lines[i - 1].startswith("=====") else i
            return "\n".join(lines[start : start + _REPORT_LINES]), "\n".join(lines[:start])
    return None, output


def _locate(kind: str, report: str, buffers: list[tuple[int, int]], buffer_names: list[str]) -> str:
    """Say which kernel argument or which shared memory an ASan report is about."""
    if kind == "use-after-poison":  # the runtime poisons only the dynamic shared memory past shared_bytes
        return " in dynamic shared memory, beyond the launch's shared_bytes"
    region = re.search(r"region \[0x([0-9a-f]+),0x([0-9a-f]+)\)", report)
    if region:
        start = int(region.group(1), 16)
        for index, (address, size) in enumerate(buffers):
            if address == start and index < len(buffer_names):
                return f" on {buffer_names[index]}"
    # A read past the end lies to the right of its variable (and maybe to the left of the next one).
    variable = re.search(r"to the right of global variable '([^']+)'", report) or re.search(
        r"global variable '([^']+)'", report)
    if variable:
        return f" at __shared__ or global variable '{variable.group(1)}'"
    return ""


_workers: dict[bool, WorkerProcess] = {}
_workers_lock = threading.Lock()


def worker(sanitize: bool) -> WorkerProcess:
    with _workers_lock:
        if sanitize not in _workers:
            _workers[sanitize] = WorkerProcess(sanitize)
        return _workers[sanitize]


@atexit.register
def shutdown_workers() -> None:
    """Stop the worker processes (they restart on the next launch)."""
    with _workers_lock:
        for w in _workers.values():
            w.close()
        _workers.clear()
