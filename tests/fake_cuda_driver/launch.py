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
import struct
import sys

import numpy as np

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_LAUNCH_TIMEOUT = 702
CUDA_ERROR_MISALIGNED_ADDRESS = 716
CUDA_ERROR_LAUNCH_FAILED = 719

#: (struct code, size) of each parameter kind of the catalogue's signatures; native alignment.
_KINDS = {"ptr": "P", "int": "i", "float": "f"}


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
    element = np.uint16 if dtype in ("fp16", "bf16") else np.float32
    scratch = (np.float32 if family.scratch == "fp32" else element,) if family.scratch else ()
    variants = (np.float32, np.float32) if family.features else ()  # ALiBi slopes, sinks
    return (cpu_module(family), entry, family.signature,
            (element, element, element, element, np.float32) + scratch + variants)


def _split_kv_entry(entry: str):
    """(CPU module, entry, signature, pointer dtypes) of an entry of split_kv.cu, or None."""
    from fa_verify.backends.split_kv import cpu_module
    from fa_verify.kernels import split_kv

    signature = split_kv.signatures().get(entry)
    if signature is None:
        return None
    element = np.float32 if entry.rsplit("_", 2)[1] == "fp32" else np.uint16
    if entry.startswith(f"{split_kv.NAME}_combine_"):  # o_partial, lse_partial, o, lse, cu_seqlens_q, sinks
        pointers = (np.float32, np.float32, element, np.float32, np.int32, np.float32)
    else:  # q, k, v, o_partial, lse_partial, cu_seqlens_q, seqlens_k, block_table, alibi_slopes (null: unused)
        pointers = (element,) * 3 + (np.float32, np.float32, np.int32, np.int32, np.int32, np.float32)
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

    A template entry arrives by its mangled name, as a cubin names it; pointers are passed as bytes."""
    if not os.environ.get(SPEC_ENV):
        return None
    from fa_verify.backends.spec_pycuda import entry_names
    from fa_verify.errors import KernelBuildError

    backend = _spec_backend(os.environ[SPEC_ENV])
    for dtype, d in backend.spec.entries():
        entry = backend.spec.entry_for(dtype, d or 0)
        try:
            if entry_names([symbol], [entry])[entry] == symbol:
                return backend.module(), entry, backend.spec.signature(), _spec_pointer_dtypes(backend, dtype)
        except KernelBuildError:  # the symbol is another instantiation
            continue
    return None


def _spec_pointer_dtypes(backend, dtype: str) -> list:
    """The element type of each pointer parameter of the spec's `dtype` instantiation (None: its null)."""
    from fa_verify.dtypes import numpy_dtype
    from fa_verify.kernels.spec import NULL

    kinds = {"o": backend.precision(dtype).output, "lse": "fp32"}
    kinds.update({name: backend.spec.types.get(name, "input") for name in "qkv"})
    found = []
    for param in backend.spec.params:
        if param == NULL:
            found.append(None)
        elif isinstance(param, str):
            element = numpy_dtype(dtype if kinds[param] == "input" else kinds[param])
            found.append(np.uint16 if element.itemsize == 2 else element)
    return found


@functools.lru_cache(maxsize=None)
def _spec_backend(setting: str):
    from fa_verify.backends.spec_kernel import SpecKernelBackend

    source, spec = setting.split(os.pathsep)
    return SpecKernelBackend(source, spec)


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
    layout = "".join(_KINDS[kind] for kind in signature)
    if struct.calcsize(layout) != len(params):
        _say(f"{entry} takes {struct.calcsize(layout)} bytes of parameters ({layout}); the launch packed {len(params)}")
        return CUDA_ERROR_INVALID_VALUE
    values = list(struct.unpack(layout, params))
    pointers = [i for i, kind in enumerate(signature) if kind == "ptr"]
    for index, dtype_of in zip(pointers, pointer_dtypes):
        if values[index] == 0:  # a null pointer reaches the kernel as null, as on a GPU
            values[index] = None
            continue
        view = _view(values[index], dtype_of or np.uint8)
        if isinstance(view, int):
            return view
        values[index] = view
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
