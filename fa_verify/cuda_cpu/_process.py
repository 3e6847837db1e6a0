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
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

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
    """One worker subprocess (sanitizer or not), started on first use and after every death."""

    def __init__(self, sanitize: bool):
        self.sanitize = sanitize
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._tx: Connection | None = None
        self._rx: Connection | None = None
        self._log = None

    # -- lifecycle -------------------------------------------------------------------------------

    def _start(self) -> None:
        env = dict(os.environ)
        if self.sanitize:
            env["LD_PRELOAD"] = asan_runtime()
            env["ASAN_OPTIONS"] = _ASAN_OPTIONS + (":" + env["ASAN_OPTIONS"] if env.get("ASAN_OPTIONS") else "")
        else:
            env.pop("LD_PRELOAD", None)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        # O_APPEND: the worker appends while the parent reads with pread and truncates between launches.
        self._log = tempfile.TemporaryFile(mode="a+b", prefix="fa_verify_worker_")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", str(_WORKER_SCRIPT), str(to_worker_r), str(from_worker_w)],
                pass_fds=(to_worker_r, from_worker_w),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(_WORKER_SCRIPT.parent),
            )
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self._tx = Connection(to_worker_w, readable=False)
        self._rx = Connection(from_worker_r, writable=False)
        if not self._rx.poll(_STARTUP_TIMEOUT):
            self._kill()
            raise KernelRunError(f"the CUDA-on-CPU worker did not start within {_STARTUP_TIMEOUT:g} s")
        try:
            self._rx.recv()
        except (EOFError, OSError):
            text = self._read_log()
            self._reap()
            raise KernelRunError("the CUDA-on-CPU worker failed to start:\n" + text[-4000:], detail=text) from None

    def _reap(self) -> int:
        rc = self._proc.wait() if self._proc is not None else 0
        for conn in (self._tx, self._rx):
            if conn is not None:
                conn.close()
        self._proc = self._tx = self._rx = None
        return rc

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._tx.close()  # the worker reads EOF and exits
                self._tx = None
                try:
                    self._proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
                self._kill()
            if self._log is not None:
                self._log.close()
                self._log = None

    def _read_log(self) -> str:
        if self._log is None:
            return ""
        fd = self._log.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0).decode(errors="replace") if size else ""

    # -- one launch --------------------------------------------------------------------------------

    def run(self, request: dict, timeout: float, what: str, buffer_names: list[str]) -> tuple[dict, str]:
        """Send one launch; return (result, the kernel's printed output) or raise a KernelRunError.

        `what` names the launch and `buffer_names` the request's buffers, for the messages.
        """
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self._reap()
                self._start()
            os.ftruncate(self._log.fileno(), 0)
            buffers: list[tuple[int, int]] = []
            deadline = time.monotonic() + timeout
            try:
                self._tx.send(request)
                while True:
                    if not self._rx.poll(max(0.0, deadline - time.monotonic())):
                        self._kill()
                        raise KernelTimeoutError(f"kernel timed out after {timeout:g} s ({what})")
                    kind, payload = self._rx.recv()
                    if kind == "buffers":
                        buffers = payload
                        continue
                    break
            except (EOFError, OSError):
                output = self._read_log()
                status = self._reap()
                raise _death_error(status, output, buffers, what, buffer_names) from None
            except BaseException:  # KeyboardInterrupt: the worker's late reply must not meet the next request
                self._kill()
                raise
            output = self._read_log()
            if kind == "error":
                raise KernelRunError(f"the CUDA-on-CPU worker could not run {what}: {payload}", detail=output)
            return payload, output


def _death_error(status: int, output: str, buffers, what: str, buffer_names: list[str]) -> KernelRunError:
    report, before = _asan_report(output)
    if report is not None:
        kind = re.search(r"AddressSanitizer: ([\w-]+)", report)
        kind = kind.group(1) if kind else "error"
        if kind in ("SEGV", "BUS", "FPE", "ILL", "ABRT", "stack-overflow", "DEADLYSIGNAL"):
            signame = {"stack-overflow": "SIGSEGV (stack overflow)", "DEADLYSIGNAL": "a fatal signal"}
            signame = signame.get(kind, "SIG" + kind)
            printed = "\n".join(before.strip().splitlines()[-10:])  # e.g. a failed assert's message
            text = (printed + "\n" if printed else "") + report
            return KernelCrashError(f"kernel crashed: {signame} ({what})\n{text}", detail=output)
        where = _locate(kind, report, buffers, buffer_names)
        return KernelSanitizerError(f"AddressSanitizer: {kind}{where} ({what})\n{report}", detail=report)
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        message = f"kernel crashed: {name} ({what})"
        if name == "SIGSEGV":
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
    variable = re.search(r"global variable '([^']+)'", report)
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
