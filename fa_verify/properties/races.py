"""No data race: a CUDA kernel's threads never meet on memory without a barrier between them.

On a GPU, two accesses to one address, at least one a write, from threads that no barrier
orders give whatever result the hardware's scheduling gives: correct on one GPU or run, wrong on
the next. The CUDA-on-CPU runner runs threads in a fixed order, so its numbers can hide such a
bug; its race detector build (`CpuKernelModule(..., racecheck=True)`, runtime/race_runtime.cpp)
checks every access to shared and global memory instead: within a barrier interval of a block
(no __syncthreads between), within a warp (no __syncwarp between: warp-synchronous code races
since Volta) and across blocks (which nothing orders; atomics excepted).

How the property reaches a target: a backend that defines `run_racecheck(problem)`, running the
problem on its kernel's race detector build and raising KernelRaceError for a race (our kernels
on the CPU runner, and their mutants, do). Any other target is not a CUDA kernel on the runner:
the property is not applicable to it.
"""

from __future__ import annotations

from fa_verify.errors import KernelRaceError
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, missing_runner_hook

#: Examples a search runs at most: every access of the kernel is checked, several times slower.
RACE_EXAMPLES = 5


def not_checkable(backend) -> str | None:
    """Why the race detector cannot check `backend` (None: it can)."""
    return missing_runner_hook(backend, "run_racecheck",
                               "the race detector checks the memory accesses of a kernel it compiles")


def check_races(backend, problem) -> PropertyResult:
    """No data race on shared or global memory (CUDA kernels on the CUDA-on-CPU runner's race detector)."""
    backend = as_backend(backend)
    reason = not_checkable(backend)
    if reason is not None:
        return not_applicable("races", problem, reason)
    try:
        backend.run_racecheck(problem)
    except KernelRaceError as exc:
        return failed("races", problem, str(exc))
    return passed("races", problem)
