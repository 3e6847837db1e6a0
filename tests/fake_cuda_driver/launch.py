"""The fake CUDA driver's launches (test support): one cuLaunchKernel run on the CUDA-on-CPU runner.

fake_driver.c calls `run` with the GIL held, in the process that loaded the fake driver. The
entry name says the kernel family, dtype and head dimension (`<family>_<dtype>_d<D>`, the
catalogue's naming); the parameter buffer is unpacked by the catalogue's signature, each
pointer becomes a numpy view of the fake device allocation it points into (a null one stays null), and the same
entry of a CPU build of the same .cu (`fa_verify.backends.cuda_kernels.cpu_module`, which
reads kernels_dir() as PyCUDA's compile did) runs the launch; split_kv.cu's and fa2_bwd.cu's
entries (their own ABIs: fa_verify.kernels.split_kv, fa_verify.kernels.backward) likewise. What the kernel prints goes to
file descriptor 1, as a driver flushes device printf. Returns a CUresult.
"""

from __future__ import annotations

import contextlib
import functools
import ctypes
import io
import os
import sys

import numpy as np

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_LAUNCH_TIMEOUT = 702
CUDA_ERROR_MISALIGNED_ADDRESS = 716
CUDA_ERROR_LAUNCH_FAILED = 719

def _allocation(address: int) -> tuple[int, int] | None:
    driver = ctypes.CDLL("libcuda.so.1")  # already loaded: the fake driver itself
    base, size = ctypes.c_size_t(), ctypes.c_size_t()
    found = driver.fa_fake_cuda_allocation(ctypes.c_size_t(address), ctypes.byref(base), ctypes.byref(size))
    return (base.value, size.value) if found else None


def _say(message: str) -> None:
    print(f"fake CUDA driver: {message}", file=sys.stderr, flush=True)


def _view(address: int, dtype) -> np.ndarray | int:
    """The allocation from `address` to its end as an array, or a CUresult when it is not one."""
    found = _allocation(address)
    if found is None:
        _say(f"pointer {address:#x} is not in any allocation")
        return CUDA_ERROR_ILLEGAL_ADDRESS
    base, size = found
    itemsize = np.dtype(dtype).itemsize
    if (address - base) % itemsize:
        return CUDA_ERROR_MISALIGNED_ADDRESS
    count = (base + size - address) // itemsize
    memory = (ctypes.c_char * (count * itemsize)).from_address(address)
    return np.frombuffer(memory, dtype=dtype)


#: "kernel.cu" + os.pathsep + "kernel.toml": a published file whose spec'd entries the fake driver also runs
SPEC_ENV = "FA_FAKE_CUDA_SPEC"


def _catalogued(entry: str):
    """(CPU module, entry, signature, pointer dtypes) of a catalogued entry (`<family>_<dtype>_d<D>`), or None."""
    from fa_verify.backends.cuda_kernels import cpu_module
    from fa_verify.kernels.catalogue import FAMILIES

    family_name, dtype, _ = entry.rsplit("_", 2) if entry.count("_") >= 2 else (entry, "", "")
    family = FAMILIES.get(family_name)
    if family is None or entry not in family.entries():
        return None
    bits = {"fp16": np.uint16, "bf16": np.uint16, "e4m3": np.uint8, "e5m2": np.uint8}
    element, out = bits.get(dtype, np.float32), bits.get(family.output_dtype(dtype), np.float32)
    scratch = (np.float32 if family.scratch == "fp32" else element,) if family.scratch else ()
    trailing = ((np.float32, np.float32) if family.features  # ALiBi slopes, sinks
                else (np.float32,) * 3 if family.kind == "fp8" else ())  # the descales
    return (cpu_module(family), entry, family.signature,
            (element, element, element, out, np.float32) + scratch + trailing)


def _split_kv_entry(entry: str):
    """(CPU module, entry, signature, pointer dtypes) of an entry of split_kv.cu, or None."""
    from fa_verify.backends.split_kv import cpu_module
    from fa_verify.kernels import split_kv

    signature = split_kv.signatures().get(entry)
    if signature is None:
        return None
    dtype = entry.rsplit("_", 2)[1]
    element = {"fp32": np.float32, **{d: np.uint8 for d in split_kv.FP8_DTYPES}}.get(dtype, np.uint16)
    if entry.startswith(f"{split_kv.NAME}_combine_"):  # o_partial, lse_partial, o, lse, cu_seqlens_q, sinks
        output = np.uint16 if dtype in split_kv.FP8_DTYPES else element  # an FP8 cache's output: bf16
        pointers = (np.float32, np.float32, output, np.float32, np.int32, np.float32)
    else:  # q, k, v, o_partial, lse_partial, cu_seqlens_q, seqlens_k, block_table, alibi_slopes, the three
        # descales (null: unused)
        pointers = (element,) * 3 + (np.float32, np.float32, np.int32, np.int32, np.int32, np.float32) + (np.float32,) * 3
    return cpu_module(), entry, signature, pointers


def _backward_entry(entry: str):
    """(CPU module, entry, signature, pointer dtypes) of an entry of fa2_bwd.cu, or None."""
    from fa_verify.backends.cuda_kernels import cpu_module
    from fa_verify.kernels import backward

    signature = backward.signatures().get(entry)
    if signature is None:
        return None
    element = np.float32 if entry.rsplit("_", 2)[1] == "fp32" else np.uint16
    pointers = tuple(element if kind == "input" else np.float32 for kind in backward.pointer_kinds(entry))
    return cpu_module(backward.FA2_BWD), entry, signature, pointers


def _spec_entry(symbol: str):
    """(CPU module, entry, signature, pointer dtypes) of an entry of $FA_FAKE_CUDA_SPEC's kernel, or None.

    A template entry arrives by its mangled name, as a cubin names it; it is built for the CPU as the
    demangled name spells it (an entry over a drawn dimension has no spelling known in advance).
    Pointers are passed as bytes."""
    if not os.environ.get(SPEC_ENV):
        return None
    import re
    import subprocess
    from types import SimpleNamespace

    from fa_verify.backends.spec_pycuda import _demangler

    backend = _spec_backend(os.environ[SPEC_ENV])
    demangled = subprocess.run(_demangler(), input=symbol, capture_output=True, text=True, check=True).stdout.strip()
    entry = re.sub(r"^void\s+", "", demangled.split("(")[0]).strip()
    for launch in backend.spec.launch:
        if re.split(r"[<(\s]", launch.entry.strip(), maxsplit=1)[0] == re.split(r"[<\s]", entry, maxsplit=1)[0]:
            signature = backend.spec.signature(launch)
            dtype = next((d for d in backend.spec.limits.dtypes if _dtype_in(entry, d)), backend.spec.limits.dtypes[0])
            module = backend.module(launch=SimpleNamespace(entry=entry, signature=signature))
            return module, entry, signature, _spec_pointer_dtypes(backend, launch, dtype)
    return None


def _dtype_in(entry: str, dtype: str) -> bool:
    """Whether a demangled instantiation is the `dtype` one (its C element type among its arguments)."""
    from fa_verify.kernels.spec import C_TYPES

    return C_TYPES[dtype] in entry or not any(t in entry for t in C_TYPES.values())


def _spec_pointer_dtypes(backend, launch, dtype: str) -> list:
    """The element type of each pointer of `launch`'s `dtype` instantiation, struct fields included
    (None: a null pointer)."""
    from fa_verify.dtypes import numpy_dtype
    from fa_verify.kernels.spec import DESCALE_BUFFERS, NULL

    kinds = {"o": backend.precision(dtype).output, "lse": "fp32", **{name: "fp32" for name in DESCALE_BUFFERS}}
    kinds.update({name: backend.spec.types.get(name, "input") for name in "qkv"})
    kinds.update({name: scratch.dtype for name, scratch in backend.spec.scratch.items()})
    found = []
    for param in launch.params:
        names = ([v for v in backend.spec.structs[param][1] if isinstance(v, str)] if param in backend.spec.structs
                 else [param] if isinstance(param, str) else [])
        for name in names:
            if name == NULL:
                found.append(None)
                continue
            element = numpy_dtype(dtype if kinds[name] == "input" else kinds[name]) if kinds[name] in (
                "input", "fp16", "bf16", "fp32") else np.dtype(kinds[name])
            found.append({2: np.uint16, 1: np.uint8}.get(element.itemsize, element))  # 16-bit and FP8 as their bits
    return found


@functools.lru_cache(maxsize=None)
def _spec_backend(setting: str):
    from fa_verify.backends.spec_kernel import SpecKernelBackend

    source, spec = setting.split(os.pathsep)
    return SpecKernelBackend(source, spec)


class _Fault(Exception):
    """A parameter that is no device pointer: its CUresult."""


def run(entry: str, grid, block, shared: int, params: bytes, device: int) -> int:
    from fa_verify.errors import (
        FaVerifyError,
        InvalidArgumentError,
        KernelCrashError,
        KernelDeadlockError,
        KernelTimeoutError,
    )
    target = _catalogued(entry) or _split_kv_entry(entry) or _backward_entry(entry) or _spec_entry(entry)
    if target is None:
        _say(f"{entry} is not a catalogued kernel entry, a split_kv.cu or fa2_bwd.cu entry nor one of ${SPEC_ENV}'s; "
             "the fake driver runs only those")
        return CUDA_ERROR_NOT_SUPPORTED
    module, name, signature, pointer_dtypes = target
    from fa_verify.errors import InvalidArgumentError as BadParameters
    from fa_verify.kernels.abi import unpack_parameters

    try:
        values = unpack_parameters(list(signature), params)
    except BadParameters as exc:
        _say(f"{entry}: {exc}")
        return CUDA_ERROR_INVALID_VALUE
    dtypes = iter(pointer_dtypes)

    def pointer(address):
        """The allocation `address` points into, as an array of the parameter's element type."""
        dtype_of = next(dtypes, None)
        if address == 0:  # a null pointer reaches the kernel as null, as on a GPU
            return None
        view = _view(address, dtype_of or np.uint8)
        if isinstance(view, int):
            raise _Fault(view)
        return view

    try:
        for index, kind in enumerate(signature):
            if kind == "ptr":
                values[index] = pointer(values[index])
            elif not isinstance(kind, str):  # a struct: its pointer fields
                values[index] = [pointer(v) if f.kind == "ptr" else v for f, v in zip(kind.fields, values[index])]
    except _Fault as fault:
        return fault.args[0]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            # fake_driver.c has held the launch to the function's MAX_DYNAMIC_SHARED_SIZE_BYTES already
            module.launch(name, tuple(grid), tuple(block), shared, values, shared_opt_in=shared)
    except (KernelTimeoutError, KernelDeadlockError) as exc:
        _say(str(exc))
        return CUDA_ERROR_LAUNCH_TIMEOUT
    except KernelCrashError as exc:
        _say(str(exc))
        return CUDA_ERROR_ILLEGAL_ADDRESS
    except InvalidArgumentError as exc:
        _say(str(exc))
        return CUDA_ERROR_INVALID_VALUE
    except FaVerifyError as exc:  # a sanitizer report, a build error
        _say(str(exc))
        return CUDA_ERROR_LAUNCH_FAILED
    finally:
        if module.last_output:
            os.write(1, module.last_output.encode())  # device printf reaches the process's stdout
    return CUDA_SUCCESS
