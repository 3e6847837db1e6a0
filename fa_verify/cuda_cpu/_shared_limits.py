"""The GPU's limits on a block's dynamic shared memory, enforced by the CPU runner at launch.

Without an opt-in a kernel gets at most 48 KiB of dynamic shared memory; a launch asking for
more fails on every GPU ("invalid argument") although the CPU, which has no such limit, would
run it. With the opt-in (`cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
bytes)`) a launch may use up to the attribute's value, which itself may not exceed the
architecture's maximum per block: the shared memory of an SM less the 1 KiB CUDA reserves per
block (CUDA C Programming Guide, "Compute Capabilities" table; Ampere/Hopper tuning guides).
Static `__shared__` arrays count against the same budget on the GPU; the runner checks the
dynamic part only (its size is what the launch states).
"""

from __future__ import annotations

from fa_verify.errors import InvalidArgumentError, KernelLaunchError

#: Dynamic shared memory a block may use without the opt-in.
DEFAULT_DYNAMIC_SHARED = 48 * 1024
#: The opt-in maximum of shared memory per block, by architecture (sm_XY -> XY), in bytes.
MAX_SHARED_PER_BLOCK = {
    70: 96 * 1024, 72: 96 * 1024, 75: 64 * 1024,
    80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
    90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024,
}  # fmt: skip


def arch_maximum(arch: int) -> int:
    """The opt-in maximum for `arch` (80 for sm_80); an unknown one is a usage error."""
    if arch not in MAX_SHARED_PER_BLOCK:
        known = ", ".join(f"sm_{a}" for a in MAX_SHARED_PER_BLOCK)
        raise InvalidArgumentError(f"arch=sm_{arch} is not one the runner knows the shared-memory limit of: {known}")
    return MAX_SHARED_PER_BLOCK[arch]


def check_dynamic_shared(kernel: str, shared_bytes: int, arch: int, opt_in: int | None) -> None:
    """Raise KernelLaunchError where a GPU of `arch` would refuse this launch.

    opt_in: the bytes given to cudaFuncAttributeMaxDynamicSharedMemorySize, None without it.
    """
    maximum = arch_maximum(arch)
    if opt_in is not None and opt_in > maximum:
        raise KernelLaunchError(
            f"cudaFuncSetAttribute({kernel}, cudaFuncAttributeMaxDynamicSharedMemorySize, {opt_in}) fails with "
            f"cudaErrorInvalidValue: sm_{arch} allows at most {maximum} bytes ({maximum // 1024} KiB) of shared "
            "memory per block")
    limit = DEFAULT_DYNAMIC_SHARED if opt_in is None else max(opt_in, DEFAULT_DYNAMIC_SHARED)
    if shared_bytes > limit:
        how = (f"without the opt-in a block gets at most {DEFAULT_DYNAMIC_SHARED} bytes (48 KiB); call "
               f"cudaFuncSetAttribute({kernel}, cudaFuncAttributeMaxDynamicSharedMemorySize, {shared_bytes}) "
               "before the launch (in a kernel spec: shared-opt-in)"
               if opt_in is None else
               f"the kernel opted in to {opt_in} bytes only")
        raise KernelLaunchError(
            f"launch of {kernel} fails on the GPU with cudaErrorInvalidValue (invalid argument): it asks for "
            f"{shared_bytes} bytes of dynamic shared memory; {how}")
