"""Launch the kernels on a GPU through PyCUDA, in this process or in a restartable worker.

`PyCudaKernels` compiles a family's .cu with `pycuda.compiler.compile(no_extern_c=True)`, run
by the nvcc that `fa_verify build --nvcc` uses (kernels/nvcc.py: PATH, $CUDA_HOME, the pip
wheels) for the device's arch, keeps the cubin in fa_verify's own cache (written under a
temporary name and renamed, so a parallel process never loads half a file), loads it, sets
the dynamic shared memory attribute where a launch needs more than 48 KiB, launches, and
synchronises after every launch so a fault is reported at the launch that caused it. Arrays
are numpy (fp16 / bf16 travel as uint16 bits) or torch CUDA tensors (in-process only, each in
the primary context of the tensors' own device, the one torch uses).

One rule picks the device everywhere: $FA_VERIFY_CUDA_DEVICE (default 0) for numpy problems,
the tensors' device for torch ones.

An illegal address poisons a CUDA context for good, so the backends run launches in a worker
process (`PyCudaWorker`), which talks over its own pipes (never stdout, where the driver
writes device printf): a fault is reported as KernelRunError, the worker's death as
KernelCrashError, a hang as KernelTimeoutError (fa_verify.errors, as the CPU runner reports
them), and the worker is restarted. Errors that leave the context usable (out of memory,
more shared memory than the device has) are reported as BackendUnavailableError and keep
the worker.

`pycuda_availability` says precisely why the path cannot run here: pycuda missing, no driver
library, a stub library, a driver older than the toolkit, no device, an arch nvcc cannot target.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from fa_verify.backends.base import Availability
from fa_verify.dtypes import numpy_dtype
from fa_verify.errors import (
    BackendUnavailableError,
    FaVerifyError,
    InvalidArgumentError,
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
#: The device numpy problems run on (an index among the visible CUDA devices).
DEVICE_ENV = "FA_VERIFY_CUDA_DEVICE"
#: Seconds a launch (with its copies) may take in the worker before it is killed.
DEFAULT_TIMEOUT = 120.0
#: Seconds the worker may take to compile one kernel file (nvcc; the cubin is cached on disk).
COMPILE_TIMEOUT = 900.0


def selected_device() -> int:
    """The device index numpy problems run on: $FA_VERIFY_CUDA_DEVICE, default 0."""
    value = os.environ.get(DEVICE_ENV, "0")
    if not value.isdigit():
        raise InvalidArgumentError(f"{DEVICE_ENV}={value!r} must be a device index such as 0 or 1")
    return int(value)


def _driver_load_problem(exc: ImportError) -> str:
    """Why `import pycuda.driver` failed, in terms of the driver (PyCUDA itself is installed)."""
    text = str(exc)
    missing = re.search(r"undefined symbol: (\w+)", text)
    if missing:
        return (f"the CUDA driver library is older than the CUDA toolkit pycuda was built with (it lacks "
                f"{missing.group(1)}): update the NVIDIA driver, or rebuild pycuda against the driver's CUDA version")
    if "libcuda" in text:
        return ("pycuda is installed but the CUDA driver library (libcuda.so.1) is not found: no NVIDIA driver is "
                f"installed here, or it is not on the library path ({text})")
    return f"pycuda is installed but does not import: {text}"


def _release(version: str) -> int:
    """'13.0.88' or '13.0' -> 13000, CUDA's integer version."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return major * 1000 + minor * 10


@lru_cache(maxsize=1)
def pycuda_availability() -> Availability:
    """Whether PyCUDA, a driver, the selected device and a usable nvcc are here (checked once; no context)."""
    if importlib.util.find_spec("pycuda") is None:
        return Availability(False, PYCUDA_MISSING)
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        return Availability(False, _driver_load_problem(exc))
    try:
        cuda.init()
        count = cuda.Device.count()
    except cuda.Error as exc:
        if "stub library" in str(exc):
            return Availability(False, "the CUDA driver library loaded here is a stub (libcuda.so from the toolkit's "
                                       "stubs or a test stub), not a driver: no NVIDIA driver is installed")
        return Availability(False, f"the CUDA driver does not start: {exc}")
    try:
        index = selected_device()
    except InvalidArgumentError as exc:
        return Availability(False, str(exc))
    if count == 0:
        return Availability(False, "the CUDA driver sees no device (CUDA_VISIBLE_DEVICES?)")
    if index >= count:
        return Availability(False, f"{DEVICE_ENV}={index} but the driver sees {count} device(s)")
    from fa_verify.kernels.nvcc import NvccNotFoundError, find_nvcc, nvcc_version, supported_archs

    try:
        nvcc = find_nvcc()
    except NvccNotFoundError as exc:
        return Availability(False, f"PyCUDA compiles the kernels with nvcc: {exc}")
    driver, toolkit = cuda.get_driver_version(), nvcc_version(nvcc)
    # cubins run on any driver of their CUDA major version (minor version compatibility), never an older major
    if re.match(r"\d+\.\d+", toolkit) and driver // 1000 < _release(toolkit) // 1000:
        return Availability(False, f"the CUDA driver supports CUDA {driver // 1000}.{driver % 1000 // 10} but nvcc "
                                   f"({nvcc}) is CUDA {toolkit}, whose cubins need a newer driver: update the driver "
                                   "or put an older toolkit's nvcc first (CUDA_HOME)")
    arch = "sm_%d%d" % cuda.Device(index).compute_capability()
    known = supported_archs(nvcc)
    if known and arch not in known:
        return Availability(False, f"nvcc {toolkit} ({nvcc}) cannot generate code for device {index} ({arch})")
    return Availability(True)


@lru_cache(maxsize=1)
def device_properties() -> tuple[str, str, int]:
    """(arch such as 'sm_80', name, opt-in dynamic shared memory per block) of the selected device."""
    import pycuda.driver as cuda

    cuda.init()
    return _properties(cuda.Device(selected_device()))


def _properties(dev) -> tuple[str, str, int]:
    import pycuda.driver as cuda

    major, minor = dev.compute_capability()
    try:
        limit = int(dev.get_attribute(cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
    except (AttributeError, cuda.Error):
        limit = DEFAULT_SHARED_LIMIT
    return f"sm_{major}{minor}", dev.name(), limit


def load_in_primary_context(load):
    """(context, load(cuda, arch)): the selected device's primary context, retained, and what `load`
    makes in it (modules are loaded into the current context); popped again, for callers that push
    it around each launch."""
    import pycuda.driver as cuda

    cuda.init()
    context = cuda.Device(selected_device()).retain_primary_context()
    context.push()
    try:
        return context, load(cuda, _properties(context.get_device())[0])
    finally:
        cuda.Context.pop()


def run_launches(context, module, launches, buffers: dict, outputs, offsets=None, what: str = "kernel") -> None:
    """Copy `buffers` ({name: host array; None: a null pointer}) to the device in `context`, run
    `launches` (each with entry, grid, block, shared_bytes, opt_in, signature and args, as
    split_kv.KernelLaunch: a str argument names a buffer, passed `offsets[name]` bytes into it; a
    list is a struct's fields) from `module` (anything with get_function(entry)) in order,
    synchronised after each so that a fault is reported at the launch that caused it, and copy the
    buffers named in `outputs` back into their host arrays. The parameters go as one buffer laid
    out by fa_verify.kernels.abi. A CUDA error is a KernelRunError naming `what`."""
    import pycuda.driver as cuda

    from fa_verify.kernels.abi import pack_parameters

    offsets = offsets or {}
    context.push()
    device = {}

    def value(a):
        if isinstance(a, list):
            return [value(v) for v in a]
        if isinstance(a, str):
            return int(device[a]) + offsets.get(a, 0) if a in device else 0
        return a

    try:
        for name, array in buffers.items():
            if array is not None:
                device[name] = cuda.mem_alloc(max(1, array.nbytes))
                cuda.memcpy_htod(device[name], np.ascontiguousarray(array))
        for launch in launches:
            packed = pack_parameters(list(launch.signature), [value(a) for a in launch.args])
            func = module.get_function(launch.entry)
            if launch.opt_in is not None and launch.opt_in > DEFAULT_SHARED_LIMIT:  # the host's opt-in
                func.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.opt_in)
            func(np.void(packed), grid=_three(launch.grid), block=_three(launch.block), shared=launch.shared_bytes)
            cuda.Context.synchronize()
        for name in outputs:
            if name in device:
                cuda.memcpy_dtoh(buffers[name], device[name])
    except cuda.Error as exc:
        raise KernelRunError(f"{what} failed through PyCUDA: {exc}") from None
    finally:
        for buf in device.values():
            buf.free()
        cuda.Context.pop()


def _three(dims) -> tuple:
    """grid or block as the three dimensions PyCUDA takes."""
    return tuple(int(n) for n in dims) + (1,) * (3 - len(dims))


def arch_problem(family: KernelFamily, arch: str) -> str | None:
    """Why `family` cannot be built for `arch`, or None."""
    if int(arch[3:]) < family.min_arch:
        return (f"{family.source} needs compute capability {family.min_arch // 10}.{family.min_arch % 10} or newer "
                f"({family.min_arch_reason}); this device is {arch}")
    return None


def _pointer(x) -> np.uintp:
    """A device pointer argument from a DeviceAllocation or a torch CUDA tensor."""
    if hasattr(x, "data_ptr"):  # torch.Tensor
        if not x.is_cuda or not x.is_contiguous():
            raise FaVerifyError("torch tensors passed to a kernel must be contiguous CUDA tensors")
        return np.uintp(x.data_ptr())
    return np.uintp(int(x))


# --- compiling: fa_verify's nvcc, fa_verify's cache ----------------------------------------------------------

def cubin_cache_dir() -> Path:
    """$FA_VERIFY_CACHE/pycuda, else ~/.cache/fa_verify/pycuda."""
    from fa_verify.cuda_cpu import default_cache_dir

    return default_cache_dir().parent / "pycuda"


def compile_cubin(family: KernelFamily, arch: str) -> bytes:
    """The family's cubin for `arch`, compiled once per source, headers, options and nvcc, then cached.

    Raises NvccNotFoundError (a setup error) or KernelBuildError with nvcc's output."""
    problem = arch_problem(family, arch)
    if problem:
        raise BackendUnavailableError(problem)
    headers = sorted(p for p in kernels_dir().iterdir() if p.suffix in (".cuh", ".h"))
    return cached_cubin(family.source_path.read_text(), family.source, arch, include_dirs=[str(kernels_dir())],
                        key_parts=[p.read_text() for p in headers])


def cached_cubin(source: str, name: str, arch: str, include_dirs: list[str], options=(), key_parts=()) -> bytes:
    """`source` (C++ text; `name` in messages and the cache) compiled by fa_verify's nvcc for `arch`, once per
    source, options, nvcc and `key_parts` (what else it reads: headers), then cached on disk.

    Raises NvccNotFoundError (a setup error) or KernelBuildError with nvcc's output."""
    from pycuda.compiler import compile as pycuda_compile
    from pycuda.driver import CompileError

    from fa_verify.kernels.nvcc import cuda_include_dirs, find_nvcc, nvcc_version

    nvcc = find_nvcc()
    options = [*NVCC_OPTIONS, *(f"-I{d}" for d in cuda_include_dirs(nvcc)), *options]
    key = hashlib.sha256("\0".join([source, *key_parts, *options, *include_dirs, arch, str(nvcc),
                                    nvcc_version(nvcc)]).encode()).hexdigest()[:24]
    path = cubin_cache_dir() / f"{name}-{arch}-{key}.cubin"
    if path.is_file():
        return path.read_bytes()
    try:
        cubin = pycuda_compile(source, nvcc=str(nvcc), options=options, no_extern_c=True, arch=arch,
                               include_dirs=include_dirs, cache_dir=False)
    except CompileError as exc:
        raise KernelBuildError(f"nvcc could not compile {name} for {arch}: {exc}",
                               log=getattr(exc, "stderr", "") or str(exc)) from None
    write_atomically(path, cubin)
    return cubin


def write_atomically(path: Path, data: bytes) -> None:
    """Write under a temporary name in the same folder, then rename: readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


class PyCudaKernels:
    """The loaded modules of every family on the current context's device (in-process)."""

    def __init__(self):
        import pycuda.driver as cuda

        self._cuda = cuda
        self.arch, self.device_name, self.shared_limit = _properties(cuda.Context.get_device())
        self._modules: dict[str, object] = {}
        self._shared_set: dict[str, int] = {}

    def module(self, family: KernelFamily):
        if family.name not in self._modules:
            self._modules[family.name] = self._cuda.module_from_buffer(compile_cubin(family, self.arch))
        return self._modules[family.name]

    def function(self, family: KernelFamily, launch: Launch):
        func = self.module(family).get_function(launch.entry)
        if launch.shared_bytes > DEFAULT_SHARED_LIMIT and self._shared_set.get(launch.entry, 0) < launch.shared_bytes:
            if launch.shared_bytes > self.shared_limit:
                raise BackendUnavailableError(f"{launch.entry} needs {launch.shared_bytes} bytes of shared memory; "
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
        arrays = []  # the trailing arrays (ALiBi slopes, sinks; descales), copied in for this launch
        try:
            for kind, value in zip(launch.trailing_signature, launch.trailing_arguments()):
                if kind == "ptr" and value is not None:
                    arrays.append(self.allocate(value.nbytes, launch.entry))
                    self._cuda.memcpy_htod(arrays[-1], value)
                    value = arrays[-1]
                args.append(np.uintp(0) if value is None else _pointer(value) if kind == "ptr"
                            else np.int32(value) if kind == "int" else np.float32(value))
            func = self.function(family, launch)
            func(*args, grid=tuple(int(g) for g in launch.grid), block=tuple(int(b) for b in launch.block),
                 shared=int(launch.shared_bytes))
            self._cuda.Context.synchronize()  # every launch checked: a fault surfaces here
        finally:
            for buffer in arrays:
                buffer.free()

    def allocate(self, nbytes: int, entry: str):
        """Device memory; running out is reported as BackendUnavailableError (the context stays usable)."""
        try:
            return self._cuda.mem_alloc(max(1, nbytes))
        except self._cuda.MemoryError as exc:
            raise BackendUnavailableError(f"{entry}: out of memory on {self.device_name} allocating {nbytes} bytes "
                                          f"({exc}); try a smaller problem") from None

    def run_numpy(self, family: KernelFamily, launch: Launch, q: np.ndarray, k: np.ndarray,
                  v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copy numpy inputs in, launch, copy (o, lse) out. fp16/bf16 arrays may be uint16 views, FP8
        arrays uint8 views; o comes back in the launch's output dtype (as uint16 bits for fp16/bf16)."""
        cuda = self._cuda
        B, H, Hkv, Nq, Nk = launch.scalars[:5]
        q, k, v = (np.ascontiguousarray(x) for x in (q, k, v))
        o_dtype = numpy_dtype(launch.output_dtype)
        o = np.empty(q.shape[:3] + v.shape[3:], np.uint16 if o_dtype.itemsize == 2 else o_dtype)  # [B, H, Nq, D_v]
        lse = np.empty((B, H, Nq), dtype=np.float32)
        sizes = [x.nbytes for x in (q, k, v, o, lse)]
        if launch.scratch_dtype:
            sizes.append(launch.scratch_elements * (4 if launch.scratch_dtype == "fp32" else 2))
        buffers = []
        try:
            for size in sizes:
                buffers.append(self.allocate(size, launch.entry))
            for buf, x in zip(buffers[:3], (q, k, v)):
                cuda.memcpy_htod(buf, x)
            # NaN-filled outputs: an element the kernel never writes shows up as NaN.
            cuda.memcpy_htod(buffers[3], np.full(o.shape, 0xFFFF if o.itemsize == 2 else np.nan,
                                                 dtype=np.uint16 if o.itemsize == 2 else o.dtype))
            cuda.memcpy_htod(buffers[4], np.full(lse.shape, np.nan, np.float32))
            self.launch(family, launch, *buffers[:5], scratch=buffers[5] if len(buffers) > 5 else None)
            cuda.memcpy_dtoh(o, buffers[3])
            cuda.memcpy_dtoh(lse, buffers[4])
        finally:
            for buf in buffers:
                buf.free()
        return o, lse


# --- torch CUDA tensors, in this process ---------------------------------------------------------------

def check_torch_inputs(q, k, v) -> str:
    """The fa_verify dtype of q, k, v [B,H,Nq,D] / [B,Hkv,Nk,D] / [B,Hkv,Nk,D_v], after checking shapes;
    InvalidArgumentError."""
    import torch

    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(q.dtype)
    if dtype is None or not (q.dtype == k.dtype == v.dtype):
        raise InvalidArgumentError(f"q, k, v must share one of fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise InvalidArgumentError(f"q must be [B,H,Nq,D], k [B,Hkv,Nk,D] and v [B,Hkv,Nk,D_v]; got q {tuple(q.shape)}, "
                                   f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    (B, H, _, D), (Bk, Hkv, _, Dk) = q.shape, k.shape
    if B != Bk or D != Dk:
        raise InvalidArgumentError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D")
    if Hkv == 0 or H % Hkv:
        raise InvalidArgumentError(f"q's heads H={H} must be a multiple of k/v's heads Hkv={Hkv} (MHA, GQA, MQA)")
    if not (q.device == k.device == v.device):
        raise InvalidArgumentError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    return dtype


def torch_outputs(q, v, launch: Launch):
    """(o, lse, scratch) on q's device, o [B, H, Nq, D_v] and lse NaN-filled so an element never
    written shows as NaN."""
    import torch

    B, H, _, Nq = launch.scalars[:4]
    o = torch.full(tuple(q.shape[:3]) + tuple(v.shape[3:]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, Nq), float("nan"), dtype=torch.float32, device=q.device)
    scratch = None
    if launch.scratch_dtype:
        scratch_dtype = torch.float32 if launch.scratch_dtype == "fp32" else q.dtype
        scratch = torch.empty(max(1, launch.scratch_elements), dtype=scratch_dtype, device=q.device)
    return o, lse, scratch


_TORCH_KERNELS: dict[int, tuple[object, PyCudaKernels]] = {}


def run_torch(family: KernelFamily, q, k, v, *, causal: bool = False,
              causal_alignment: str = "bottom-right", scale: float | None = None):
    """(o, lse) of torch CUDA tensors q [B,H,Nq,D], k [B,Hkv,Nk,D], v [B,Hkv,Nk,D_v], in this process,
    without copies.

    Runs in the primary context of the tensors' device (the one torch uses). A fault here poisons
    that context: use the backends (worker process) when a kernel may be broken.
    """
    import torch

    dtype = check_torch_inputs(q, k, v)
    if not q.is_cuda:
        raise InvalidArgumentError(f"run_torch takes CUDA tensors; q is on {q.device}")
    (B, H, Nq, D), (_, Hkv, Nk, _) = q.shape, k.shape
    launch = family.launch_for(B, H, Hkv, Nq, Nk, D, dtype, causal=causal,
                               causal_alignment=causal_alignment, scale=scale, head_dim_v=v.shape[3])
    q, k, v = (x.contiguous() for x in (q, k, v))
    o, lse, scratch = torch_outputs(q, v, launch)
    torch.cuda.synchronize(q.device)
    import pycuda.driver as cuda

    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _TORCH_KERNELS:
        cuda.init()
        context = cuda.Device(index).retain_primary_context()
        context.push()
        try:
            _TORCH_KERNELS[index] = (context, PyCudaKernels())
        finally:
            cuda.Context.pop()
    context, kernels = _TORCH_KERNELS[index]
    context.push()
    try:
        kernels.launch(family, launch, q, k, v, o, lse, scratch=scratch)
    finally:
        cuda.Context.pop()
    return o, lse


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


#: Errors after which the worker's context is still usable (fa_verify's own: no CUDA call failed,
#: or only an allocation did): it answers and keeps running.
_RECOVERABLE = (FaVerifyError,)


def worker_main(read_fd: int, write_fd: int) -> None:
    """The worker's loop over its own pipes: ("compile", family) -> ("ok",); (family, launch, q, k, v) ->
    ("ok", o, lse); a failure -> ("error", kind, message, recoverable); after an unrecoverable one
    the worker exits (its context may be poisoned)."""
    inbox, outbox = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
    os.dup2(2, 1)  # the driver's device printf and any C-level output land in the log, not the protocol
    sys.stdout = sys.stderr
    import pycuda.driver as cuda

    cuda.init()
    context = cuda.Device(selected_device()).retain_primary_context()
    context.push()
    try:
        kernels = PyCudaKernels()
        import fa_verify

        _send(outbox, ("ready", kernels.arch, kernels.device_name, kernels.shared_limit,
                       str(Path(fa_verify.__file__).parent)))
        while True:
            try:
                request = _receive(inbox)
            except EOFError:
                return
            try:
                if request[0] == "compile":
                    kernels.module(FAMILIES[request[1]])
                    _send(outbox, ("ok",))
                    continue
                family_name, launch, q, k, v = request
                o, lse = kernels.run_numpy(FAMILIES[family_name], launch, q, k, v)
                _send(outbox, ("ok", o, lse))
            except Exception as exc:
                recoverable = isinstance(exc, _RECOVERABLE)
                _send(outbox, ("error", type(exc).__name__, str(exc), recoverable))
                if not recoverable:  # a CUDA error may leave the context unusable
                    return
    finally:
        context.pop()


def _package_root() -> str:
    """The folder holding this fa_verify package, so the worker imports the same one."""
    return str(Path(__file__).resolve().parent.parent.parent)


class PyCudaWorker:
    """A worker process owning the selected device's context; restarted after an unrecoverable failure."""

    #: The worker's command line, to which the two pipe descriptors are appended; tests substitute
    #: a fake worker that speaks the same protocol.
    COMMAND = (sys.executable, "-c", "import sys; from fa_verify.kernels.pycuda_runner import worker_main; "
                                     "worker_main(int(sys.argv[1]), int(sys.argv[2]))")

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, command=None):
        self.timeout = timeout
        self.command = list(command or self.COMMAND)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.arch = self.device_name = self.package = None
        self.starts = 0
        self._compiled: set[str] = set()  # families this worker has compiled

    def _start(self) -> None:
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty worker never blocks
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_package_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        try:
            self._proc = subprocess.Popen(self.command + [str(to_worker_r), str(from_worker_w)],
                                          pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL,
                                          stdout=self._log, stderr=self._log, env=env)
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self._to, self._from = os.fdopen(to_worker_w, "wb"), os.fdopen(from_worker_r, "rb")
        self.starts += 1
        self._compiled = set()
        reply = self._call(None, timeout=3 * self.timeout, startup=True)
        _, self.arch, self.device_name, self.shared_limit, self.package = reply

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            self._to.close()
            self._from.close()

    def log(self) -> str:
        """What the worker wrote to stdout and stderr (device printf, warnings), last 4000 characters."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:].strip()

    def _call(self, request, timeout: float, startup: bool = False):
        """Send a request (None at startup) and wait for the reply within `timeout` seconds."""
        to, frm = self._to, self._from
        result: list = []

        def exchange():
            try:
                if request is not None:
                    _send(to, request)
                result.append(_receive(frm))
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
            code = self._proc.wait()
            stderr = self.log()
            self._stop()
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
            _, kind, message, recoverable = reply
            if not recoverable:
                self._stop()  # the context may be poisoned
            raise _worker_error(kind, message, launch, self.device_name, self.log())

    def close(self) -> None:
        with self._lock:
            self._stop()


def _worker_error(kind: str, message: str, launch: Launch, device: str, log: str) -> FaVerifyError:
    """The exception for the worker's ("error", kind, message) reply; `log`: what the worker printed."""
    from fa_verify.kernels.nvcc import NvccNotFoundError

    by_kind = {cls.__name__: cls for cls in (NvccNotFoundError, BackendUnavailableError, InvalidArgumentError)}
    if kind in by_kind:
        return by_kind[kind](message)
    if kind == "KernelBuildError":
        return KernelBuildError(message, log=message)
    return KernelRunError(f"{launch.entry} failed on {device}: {kind}: {message}", detail=log)


_WORKER: PyCudaWorker | None = None


def shared_worker() -> PyCudaWorker:
    global _WORKER
    if _WORKER is None:
        _WORKER = PyCudaWorker()
    return _WORKER
