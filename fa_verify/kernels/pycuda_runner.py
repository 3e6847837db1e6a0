"""Launch the kernels on a GPU through PyCUDA, in this process or in a restartable worker.

`PyCudaKernels` compiles a family's .cu with `SourceModule(no_extern_c=True)` for the device's
arch (PyCUDA caches the binary on disk, keyed on the source, its headers and the options; this
class caches the loaded module per process), sets the dynamic shared memory attribute where a
launch needs more than 48 KiB, launches, and synchronises after every launch so a fault is
reported at the launch that caused it. Arrays are numpy (fp16 / bf16 travel as uint16 bits) or
torch CUDA tensors (in-process only; `pycuda.autoprimaryctx` shares torch's context).

An illegal address poisons a CUDA context for good, so the backends run launches in a worker
process (`PyCudaWorker`): a CUDA error there is reported as KernelRunError, the worker's death
as KernelCrashError, a hang as KernelTimeoutError (fa_verify.errors, as the CPU runner reports
them); the worker is discarded and the next launch starts a fresh one.

Nothing here can run without a CUDA driver and a GPU; `pycuda_availability` says why not.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache

import numpy as np

from fa_verify.backends.base import Availability
from fa_verify.errors import (
    FaVerifyError,
    KernelBuildError,
    KernelCrashError,
    KernelRunError,
    KernelTimeoutError,
)
from fa_verify.kernels.catalogue import (
    DEFAULT_SHARED_LIMIT,
    FAMILIES,
    NVCC_OPTIONS,
    KernelFamily,
    Launch,
    kernels_dir,
)

PYCUDA_MISSING = "pycuda is not installed (pip install 'fa-verify[cuda]'; needs a CUDA driver)"
#: Seconds a launch (with its copies) may take in the worker before it is killed.
DEFAULT_TIMEOUT = 120.0
#: Seconds the worker may take to compile one kernel file (nvcc; PyCUDA caches the result on disk).
COMPILE_TIMEOUT = 900.0


@lru_cache(maxsize=1)
def pycuda_availability() -> Availability:
    """Whether PyCUDA, a driver and a GPU are here (checked once; creates no context)."""
    try:
        import pycuda.driver as cuda
    except ImportError:
        return Availability(False, PYCUDA_MISSING)
    except Exception as exc:  # pycuda present but libcuda missing or broken
        return Availability(False, f"pycuda cannot load the CUDA driver: {exc}")
    try:
        cuda.init()
        count = cuda.Device.count()
    except Exception as exc:
        return Availability(False, f"the CUDA driver does not start: {exc}")
    if count == 0:
        return Availability(False, "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES?)")
    return Availability(True)


@lru_cache(maxsize=1)
def device_shared_limit() -> int:
    """Dynamic shared memory a block of device 0 may opt in to (bytes)."""
    import pycuda.driver as cuda

    cuda.init()
    dev = cuda.Device(int(os.environ.get("FA_VERIFY_CUDA_DEVICE", "0")))
    try:
        return int(dev.get_attribute(cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
    except (AttributeError, cuda.Error):
        return DEFAULT_SHARED_LIMIT


def _pointer(x) -> np.uintp:
    """A device pointer argument from a DeviceAllocation or a torch CUDA tensor."""
    if hasattr(x, "data_ptr"):  # torch.Tensor
        if not x.is_cuda or not x.is_contiguous():
            raise FaVerifyError("torch tensors passed to a kernel must be contiguous CUDA tensors")
        return np.uintp(x.data_ptr())
    return np.uintp(int(x))


class PyCudaKernels:
    """The compiled modules of every family on the current context's device (in-process)."""

    def __init__(self):
        import pycuda.driver as cuda

        self._cuda = cuda
        dev = cuda.Context.get_device()
        major, minor = dev.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.device_name = dev.name()
        try:
            self.shared_limit = int(dev.get_attribute(cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
        except (AttributeError, cuda.Error):
            self.shared_limit = DEFAULT_SHARED_LIMIT
        self._modules: dict[str, object] = {}
        self._shared_set: dict[str, int] = {}

    def module(self, family: KernelFamily):
        if family.name not in self._modules:
            from pycuda.compiler import SourceModule

            source = family.source_path.read_text()
            self._modules[family.name] = SourceModule(
                source, no_extern_c=True, arch=self.arch, options=list(NVCC_OPTIONS),
                include_dirs=[str(kernels_dir())])
        return self._modules[family.name]

    def function(self, family: KernelFamily, launch: Launch):
        func = self.module(family).get_function(launch.entry)
        if launch.shared_bytes > DEFAULT_SHARED_LIMIT and self._shared_set.get(launch.entry, 0) < launch.shared_bytes:
            if launch.shared_bytes > self.shared_limit:
                raise FaVerifyError(f"{launch.entry} needs {launch.shared_bytes} bytes of shared memory; "
                                    f"{self.device_name} allows {self.shared_limit}")
            func.set_attribute(self._cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.shared_bytes)
            self._shared_set[launch.entry] = launch.shared_bytes
        return func

    def launch(self, family: KernelFamily, launch: Launch, q, k, v, o, lse, scratch=None) -> None:
        """Launch on device buffers (DeviceAllocation or torch CUDA tensors) and synchronise."""
        B, H, Hkv, Nq, Nk, scale, causal, offset = launch.scalars
        args = [_pointer(x) for x in (q, k, v, o, lse)]
        args += [np.int32(B), np.int32(H), np.int32(Hkv), np.int32(Nq), np.int32(Nk),
                 np.float32(scale), np.int32(causal), np.int32(offset)]
        if family.scratch:
            args.append(_pointer(scratch))
        func = self.function(family, launch)
        func(*args, grid=launch.grid, block=launch.block, shared=launch.shared_bytes)
        self._cuda.Context.synchronize()  # every launch checked: a fault surfaces here

    def run_numpy(self, family: KernelFamily, launch: Launch, q: np.ndarray, k: np.ndarray,
                  v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copy numpy inputs in, launch, copy (o, lse) out. fp16/bf16 arrays may be uint16 views."""
        cuda = self._cuda
        B, H, Hkv, Nq, Nk = launch.scalars[:5]
        q, k, v = (np.ascontiguousarray(x) for x in (q, k, v))
        o = np.empty_like(q)
        lse = np.empty((B, H, Nq), dtype=np.float32)
        buffers = [cuda.mem_alloc(max(1, x.nbytes)) for x in (q, k, v, o, lse)]
        scratch = None
        try:
            for buf, x in zip(buffers[:3], (q, k, v)):
                cuda.memcpy_htod(buf, x)
            # NaN-filled outputs: an element the kernel never writes shows up as NaN.
            cuda.memcpy_htod(buffers[3], np.full(o.shape, 0xFFFF if o.itemsize == 2 else np.nan,
                                                 dtype=np.uint16 if o.itemsize == 2 else o.dtype))
            cuda.memcpy_htod(buffers[4], np.full(lse.shape, np.nan, np.float32))
            if launch.scratch_dtype:
                itemsize = 4 if launch.scratch_dtype == "fp32" else 2
                scratch = cuda.mem_alloc(max(1, launch.scratch_elements * itemsize))
            self.launch(family, launch, *buffers, scratch=scratch)
            cuda.memcpy_dtoh(o, buffers[3])
            cuda.memcpy_dtoh(lse, buffers[4])
        finally:
            for buf in buffers + ([scratch] if scratch is not None else []):
                buf.free()
        return o, lse


def run_torch(family: KernelFamily, q, k, v, *, causal: bool = False,
              causal_alignment: str = "bottom-right", scale: float | None = None, kernels=None):
    """(o, lse) of torch CUDA tensors q [B,H,Nq,D], k/v [B,Hkv,Nk,D], in this process.

    Shares torch's CUDA context (pycuda.autoprimaryctx). A fault here poisons that context: use
    the backends (worker process) when a kernel may be broken.
    """
    import torch
    import pycuda.autoprimaryctx  # noqa: F401

    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(q.dtype)
    if dtype is None or not (q.dtype == k.dtype == v.dtype):
        raise FaVerifyError(f"q, k, v must share one of fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    (B, H, Nq, D), (_, Hkv, Nk, _) = q.shape, k.shape
    launch = family.launch_for(B, H, Hkv, Nq, Nk, D, dtype, causal=causal,
                               causal_alignment=causal_alignment, scale=scale)
    q, k, v = (x.contiguous() for x in (q, k, v))
    o = torch.empty_like(q)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    scratch = None
    if launch.scratch_dtype:
        scratch_dtype = torch.float32 if launch.scratch_dtype == "fp32" else q.dtype
        scratch = torch.empty(max(1, launch.scratch_elements), dtype=scratch_dtype, device=q.device)
    torch.cuda.synchronize(q.device)
    global _IN_PROCESS
    if kernels is None:
        if _IN_PROCESS is None:
            _IN_PROCESS = PyCudaKernels()
        kernels = _IN_PROCESS
    kernels.launch(family, launch, q, k, v, o, lse, scratch=scratch)
    return o, lse


_IN_PROCESS: PyCudaKernels | None = None


# --- the worker process ---------------------------------------------------------------------------

def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the other side closed the pipe")
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))


def worker_main() -> None:
    """The worker's loop: ("compile", family) -> ("ok",); (family, launch, q, k, v) -> ("ok", o, lse);
    any failure -> ("error", kind, message), after which the worker exits (its context may be poisoned)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    import pycuda.autoinit  # noqa: F401  (one context for the life of this worker)

    kernels = PyCudaKernels()
    _send(stdout, ("ready", kernels.arch, kernels.device_name, kernels.shared_limit))
    while True:
        try:
            request = _receive(stdin)
        except EOFError:
            return
        try:
            if request[0] == "compile":
                kernels.module(FAMILIES[request[1]])
                _send(stdout, ("ok",))
                continue
            family_name, launch, q, k, v = request
            o, lse = kernels.run_numpy(FAMILIES[family_name], launch, q, k, v)
            _send(stdout, ("ok", o, lse))
        except Exception as exc:  # a CUDA error leaves the context unusable: report and exit
            _send(stdout, ("error", type(exc).__name__, str(exc)))
            return


class PyCudaWorker:
    """A worker process owning one CUDA context; restarted after any failure."""

    #: The worker's command line; tests substitute a fake worker that speaks the same protocol.
    COMMAND = (sys.executable, "-c", "from fa_verify.kernels.pycuda_runner import worker_main; worker_main()")

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, command=None):
        self.timeout = timeout
        self.command = list(command or self.COMMAND)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.arch = self.device_name = None
        self.starts = 0
        self._compiled: set[str] = set()  # families this worker has compiled

    def _start(self) -> None:
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty worker never blocks
        self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log)
        self.starts += 1
        self._compiled = set()
        reply = self._call(None, timeout=3 * self.timeout, startup=True)
        _, self.arch, self.device_name, self.shared_limit = reply

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _call(self, request, timeout: float, startup: bool = False):
        """Send a request (None at startup) and wait for the reply within `timeout` seconds."""
        proc = self._proc
        result: list = []

        def exchange():
            try:
                if request is not None:
                    _send(proc.stdin, request)
                result.append(_receive(proc.stdout))
            except (EOFError, OSError, pickle.UnpicklingError) as exc:
                result.append(exc)

        thread = threading.Thread(target=exchange, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            self._stop()
            what = "kernel" if request is not None and request[0] != "compile" else "the PyCUDA worker"
            raise KernelTimeoutError(f"{what} timed out after {timeout:g} s (PyCUDA worker killed)")
        reply = result[0]
        if isinstance(reply, Exception):
            code = proc.wait()
            self._log.seek(0)
            stderr = self._log.read().decode(errors="replace")[-4000:].strip()
            self._proc = None
            if code < 0:
                try:
                    how = signal.Signals(-code).name
                except ValueError:
                    how = f"signal {-code}"
            else:
                how = f"exit status {code}"
            last = stderr.splitlines()[-1] if stderr else ""
            what = "the PyCUDA worker did not start" if startup else "kernel crashed"
            raise KernelCrashError(f"{what}: {how}{': ' + last if last else ''}", detail=stderr)
        return reply

    def run(self, family: KernelFamily, launch: Launch, q, k, v) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            if family.name not in self._compiled:  # compiling is not part of the launch's time
                reply = self._call(("compile", family.name), timeout=COMPILE_TIMEOUT)
                if reply[0] == "ok":
                    self._compiled.add(family.name)
            if family.name in self._compiled:
                reply = self._call((family.name, launch, q, k, v), timeout=self.timeout)
                if reply[0] == "ok":
                    return reply[1], reply[2]
            self._stop()  # the context is poisoned
            _, kind, message = reply
            if kind == "CompileError":
                raise KernelBuildError(f"PyCUDA could not compile {family.source}: {message}", log=message)
            raise KernelRunError(f"{launch.entry} failed on the GPU: {kind}: {message}")

    def close(self) -> None:
        with self._lock:
            self._stop()


_WORKER: PyCudaWorker | None = None


def shared_worker() -> PyCudaWorker:
    global _WORKER
    if _WORKER is None:
        _WORKER = PyCudaWorker()
    return _WORKER
