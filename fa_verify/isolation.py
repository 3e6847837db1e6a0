"""The parent's side of a worker process: code under test that may crash, hang or exhaust memory
runs there, so that fa_verify survives it, reports it and starts a fresh worker. Used by the
CUDA-on-CPU runner (fa_verify.cuda_cpu._process) and by isolated MODULE:FUNC callables
(fa_verify.backends.user_callable); the worker's side of the protocol is worker_loop.serve.

Protocol (multiprocessing.connection framing over two pipes, whose descriptors are the last two
arguments of the worker's command line): the worker says ("ready", pid), then answers each request
with (kind, payload) messages; kinds the caller lists as interim come before the final one.
What the worker prints goes to a temporary file (never a pipe, which a chatty worker could fill),
read back when it dies.

The memory limit is RLIMIT_DATA, set on the running worker with prlimit: since Linux 4.7 it
counts what a process allocates (heap and private writable mappings, numpy's arrays included)
but not address space that is only reserved or mapped from files (shared libraries, the
PROT_NONE regions that malloc arenas and JIT runtimes reserve), which RLIMIT_AS would count and
so break a healthy torch or JAX worker. An allocation past it fails at once (MemoryError in
Python) whatever the machine has. cgroups would also count the pages touched, but need
privileges a CI job rarely has.
"""

from __future__ import annotations

import fcntl
import os
import re
import resource
import signal
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Connection

from fa_verify.errors import InvalidArgumentError

#: Seconds one call of an isolated callable may take (--timeout).
DEFAULT_TIMEOUT = 60.0
#: An isolated callable's memory limit (--memory-limit): a size, a share of the machine's memory or "none".
DEFAULT_MEMORY_LIMIT = "50%"
_STARTUP_TIMEOUT = 60.0
#: Seconds a timed-out worker is given to print its traceback before it is killed.
_TRACEBACK_WAIT = 0.2
#: The attribute of an exception raised in a worker process that says where ("path:line"): its
#: traceback, rebuilt in the parent, no longer does.
RAISED_AT = "fa_verify_raised_at"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class WorkerTimedOut(Exception):
    """The worker did not answer within the time limit; it has been killed. `output`: what it
    printed, with its traceback if it dumps one on the traceback signal."""

    def __init__(self, seconds: float, output: str = ""):
        super().__init__(f"no answer within {seconds:g} s")
        self.seconds, self.output = seconds, output


class WorkerDied(Exception):
    """The worker's process ended while a request was in flight (or before it said ready)."""

    def __init__(self, status: int, output: str):
        super().__init__(describe_status(status))
        self.status, self.output = status, output


def describe_status(status: int) -> str:
    """'SIGSEGV' for a process killed by a signal, else 'exit status N'."""
    if status >= 0:
        return f"exit status {status}"
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


def parse_size(text: str) -> int | None:
    """Bytes from '4GiB', '512M', '1000000' (binary units) or a share of the machine's memory
    such as '50%'; None from 'none'. InvalidArgumentError otherwise."""
    text = str(text).strip().lower()
    if text == "none":
        return None
    share = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
    if share and 0 < float(share.group(1)) <= 100:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * float(share.group(1)) / 100)
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", text)
    if not size or float(size.group(1)) <= 0:
        raise InvalidArgumentError(f"{text!r} is not a size: use e.g. 4GiB, 512MiB, 50% (of the machine's "
                                   "memory) or none")
    return int(float(size.group(1)) * _UNITS[size.group(2)])


def format_size(nbytes: int) -> str:
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.3g} {unit}"
    return f"{nbytes} bytes"


class WorkerProcess:
    """One worker subprocess, started on first use and after every death or kill.

    `command` is the worker's command line without the two pipe descriptors; `memory_limit` is
    bytes (RLIMIT_DATA) or None; `traceback_signal`, if given, is sent to a worker that timed out
    before it is killed, for a worker that prints where it is stuck on that signal (faulthandler).
    One request at a time: callers hold `lock`.
    """

    def __init__(self, command, *, env: dict | None = None, cwd: str | None = None,
                 memory_limit: int | None = None, startup_timeout: float = _STARTUP_TIMEOUT,
                 traceback_signal: int | None = None):
        self.command, self.env, self.cwd = list(command), env, cwd
        self.traceback_signal = traceback_signal
        self.memory_limit, self.startup_timeout = memory_limit, startup_timeout
        self.starts = 0
        self.lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._tx: Connection | None = None
        self._rx: Connection | None = None
        self._log = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the worker and wait for its ("ready", pid); raises WorkerTimedOut or WorkerDied."""
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        # O_APPEND: the worker appends while the parent reads with pread and truncates between requests.
        if self._log is None:
            self._log = tempfile.TemporaryFile(mode="a+b", prefix="fa_verify_worker_")
            # mode "a" seeks once; without the flag the worker's writes after a truncation leave a hole of NULs
            fcntl.fcntl(self._log.fileno(), fcntl.F_SETFL, fcntl.fcntl(self._log.fileno(), fcntl.F_GETFL) | os.O_APPEND)
        os.ftruncate(self._log.fileno(), 0)
        try:
            self._proc = subprocess.Popen(
                [*self.command, str(to_worker_r), str(from_worker_w)], pass_fds=(to_worker_r, from_worker_w),
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                start_new_session=True)  # Ctrl-C reaches the parent, which stops the worker
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self._tx = Connection(to_worker_w, readable=False)
        self._rx = Connection(from_worker_r, writable=False)
        self.starts += 1
        self._receive(time.monotonic() + self.startup_timeout, self.startup_timeout)
        if self.memory_limit is not None:
            hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
            resource.prlimit(self._proc.pid, resource.RLIMIT_DATA, (self.memory_limit, hard))

    def call(self, request, timeout: float, interim=(), on_interim=None) -> tuple[str, object]:
        """Send `request`; return the worker's final (kind, payload). Messages whose kind is in
        `interim` go to on_interim(kind, payload) on the way. Raises WorkerTimedOut (the worker
        is killed) or WorkerDied. The caller holds `lock`."""
        if not self.alive:
            self.stop()
            self.start()
        os.ftruncate(self._log.fileno(), 0)
        deadline = time.monotonic() + timeout
        try:
            self._tx.send(request)
            while True:
                kind, payload = self._receive(deadline, timeout)
                if kind not in interim:
                    return kind, payload
                on_interim(kind, payload)
        except OSError:  # the pipe broke while sending: the worker is gone
            raise self._died() from None
        except BaseException as exc:  # KeyboardInterrupt: the worker's late reply must not meet the next request
            if not isinstance(exc, (WorkerDied, WorkerTimedOut)):
                self.stop()
            raise

    def _receive(self, deadline: float, timeout: float):
        if not self._rx.poll(max(0.0, deadline - time.monotonic())):
            if self.traceback_signal is not None and self.alive:
                self._proc.send_signal(self.traceback_signal)
                time.sleep(_TRACEBACK_WAIT)
            output = self.output()
            self.stop()
            raise WorkerTimedOut(timeout, output)
        try:
            return self._rx.recv()
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> WorkerDied:
        status = self._proc.wait()
        output = self.output()
        self.stop()
        return WorkerDied(status, output)

    def output(self) -> str:
        """What the worker printed since the current request (or its start) began."""
        if self._log is None:
            return ""
        fd = self._log.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0).decode(errors="replace") if size else ""

    def stop(self) -> None:
        """Kill the worker (if running) and close its pipes; the next call starts a fresh one."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        for conn in (self._tx, self._rx):
            if conn is not None:
                conn.close()
        self._proc = self._tx = self._rx = None

    def close(self) -> None:
        """Let the worker exit on its own (it reads EOF), kill it if it lingers, drop the log."""
        with self.lock:
            if self._tx is not None:
                self._tx.close()
                self._tx = None
                try:
                    self._proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            self.stop()
            if self._log is not None:
                self._log.close()
                self._log = None
