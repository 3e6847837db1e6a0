"""The CUDA-on-CPU runner behaves like a GPU where that hides or invents bugs: shared memory of
templates and inline functions starts as NaN in every block, dynamic shared memory is held to the
48 KiB default and the arch's maximum unless opted in, arguments sit between NaN-filled guards.
Kernels: tests/cuda_cpu_kernels/fidelity.cu."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fa_verify.cuda_cpu import CpuKernelModule
from fa_verify.errors import InvalidArgumentError, KernelLaunchError, KernelRunError

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
ENTRIES = {
    "stale_template_shared<32>": ["ptr"],
    "inline_shared": ["ptr"],
    "use_dynamic_shared": ["ptr", "int"],
    "read_one_past": ["ptr", "ptr", "int"],
    "stale_template_dynamic<float>": ["ptr"],
}


@pytest.fixture(scope="module")
def fidelity():
    return CpuKernelModule(KERNELS / "fidelity.cu", ENTRIES)


def test_template_shared_memory_starts_as_nan_in_every_block(fidelity):
    out = np.zeros(3 * 32, np.float32)
    fidelity.launch("stale_template_shared<32>", grid=3, block=32, args=[out])
    assert (out[:32] == 1).all()
    assert np.isnan(out[32:]).all()  # not block 0's ones: blocks 1 and 2 never wrote the tile


def test_template_dynamic_shared_memory_starts_as_nan_in_every_block(fidelity):
    out = np.zeros(2 * 32, np.float32)
    fidelity.launch("stale_template_dynamic<float>", grid=2, block=32, shared_bytes=32 * 4, args=[out])
    assert (out[:32] == 1).all() and np.isnan(out[32:]).all()


def test_shared_memory_of_an_inline_device_function(fidelity):
    out = np.zeros(32, np.float32)
    fidelity.launch("inline_shared", grid=2, block=32, args=[out])
    t = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(out, (31 - t) + 2 * t)


def test_more_than_48_kib_of_dynamic_shared_memory_needs_the_opt_in(fidelity):
    out = np.zeros(1, np.float32)
    bytes_ = 64 * 1024
    with pytest.raises(KernelLaunchError, match=r"cudaErrorInvalidValue \(invalid argument\).*65536 bytes.*"
                                                r"cudaFuncAttributeMaxDynamicSharedMemorySize"):
        fidelity.launch("use_dynamic_shared", grid=1, block=128, shared_bytes=bytes_, args=[out, bytes_])
    fidelity.launch("use_dynamic_shared", grid=1, block=128, shared_bytes=bytes_, args=[out, bytes_],
                    shared_opt_in=bytes_)
    assert out[0] == bytes_ // 4 - 1
    fidelity.launch("use_dynamic_shared", grid=1, block=128, shared_bytes=48 * 1024, args=[out, 48 * 1024])


def test_the_arch_maximum_holds_with_the_opt_in():
    sm86 = CpuKernelModule(KERNELS / "fidelity.cu", ENTRIES, arch=86)
    out = np.zeros(1, np.float32)
    with pytest.raises(KernelLaunchError, match=r"sm_86 allows at most 101376 bytes \(99 KiB\)"):
        sm86.launch("use_dynamic_shared", grid=1, block=128, shared_bytes=100 * 1024, args=[out, 100 * 1024],
                    shared_opt_in=100 * 1024)
    sm86.launch("use_dynamic_shared", grid=1, block=128, shared_bytes=99 * 1024, args=[out, 99 * 1024],
                shared_opt_in=99 * 1024)
    with pytest.raises(InvalidArgumentError, match="arch=sm_81"):
        CpuKernelModule(KERNELS / "fidelity.cu", ENTRIES, arch=81)


def test_a_read_past_an_argument_reads_nan(fidelity):
    data = np.arange(16, dtype=np.float32)
    out = np.zeros(16, np.float32)
    fidelity.launch("read_one_past", grid=1, block=16, args=[data, out, 16])
    np.testing.assert_array_equal(out[:15], data[1:])
    assert np.isnan(out[15])  # the guard region after `data`


def test_a_write_past_an_argument_is_reported(fidelity):
    data = np.arange(16, dtype=np.float32)
    small = np.zeros(8, np.float32)
    # Threads 8..15 write past `small`; the last writes NaN bits equal to the guard's, so 7 floats show.
    with pytest.raises(KernelRunError, match=r"wrote out of bounds.*28 bytes changed outside argument 1 "
                                             r"\(float32\[8\], 32 bytes\), the first 0 bytes past its end"):
        fidelity.launch("read_one_past", grid=1, block=16, args=[data, small, 16])
