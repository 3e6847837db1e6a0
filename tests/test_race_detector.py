"""The race detector of the CUDA-on-CPU runner (racecheck builds) and the `races` property.

The kernels are in tests/cuda_cpu_kernels/races.cu; each racy one has a race-free twin.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.backends.cuda_kernels import CpuKernelBackend, cpu_runner_availability
from fa_verify.cuda_cpu import CpuKernelModule
from fa_verify.errors import InvalidArgumentError, KernelRaceError
from fa_verify.kernels import FAMILIES
from fa_verify.kernels.mutants import load_mutants
from fa_verify.properties import Selection, check_races, search_property
from fa_verify.strategies import make_problem
from fa_verify.verdict import check_attention

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
SOURCE = KERNELS / "races.cu"
ENTRIES = {
    "warp_sum_unsynced": ["ptr", "ptr"],
    "warp_sum_synced": ["ptr", "ptr"],
    "reverse_through_shared": ["ptr", "ptr", "int"],
    "blocks_store_one_address": ["ptr"],
    "blocks_add_one_address": ["ptr"],
    "blocks_read_neighbour": ["ptr", "ptr"],
}
CPU = cpu_runner_availability()
pytestmark = pytest.mark.skipif(not CPU.available, reason=CPU.reason)


@pytest.fixture(scope="module")
def races():
    return CpuKernelModule(SOURCE, ENTRIES, racecheck=True)


def where(text: str) -> str:
    """path:line of the line of races.cu that holds `text`."""
    lines = SOURCE.read_text().splitlines()
    return f"{SOURCE.resolve()}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def raised(module, name, grid, block, shared, args) -> KernelRaceError:
    with pytest.raises(KernelRaceError) as info:
        module.launch(name, grid, block, shared, args)
    return info.value


def test_a_warp_synchronous_reduction_without_syncwarp_is_a_race_reported_with_both_lines(races):
    error = raised(races, "warp_sum_unsynced", 1, 32, 0, [np.arange(32, dtype=np.float32), np.zeros(1, np.float32)])
    store, step = where("partial[t] = x[t];"), where("partial[t] += partial[t + 16];")
    race = next(r for r in error.races if {r.first.location, r.second.location} == {store, step})
    assert {race.first.kind, race.second.kind} == {"read", "write"} and race.same_warp
    assert race.first.thread != race.second.thread and race.first.block == race.second.block == (0, 0, 0)
    assert "static __shared__ 'warp_sum_unsynced::partial'" in race.memory
    message = str(error)
    assert store in message and "no __syncthreads or __syncwarp between them" in message
    assert "thread (0,0,0) of block (0,0,0)" in message


def test_the_same_reduction_with_syncwarp_is_clean(races):
    out = np.zeros(1, np.float32)
    races.launch("warp_sum_synced", 1, 32, 0, [np.arange(32, dtype=np.float32), out])
    assert out[0] == sum(range(32))


def test_a_missing_syncthreads_between_a_write_and_another_threads_read_is_a_race(races):
    x, y = np.arange(128, dtype=np.float32), np.zeros(128, np.float32)
    error = raised(races, "reverse_through_shared", 2, 64, 256, [x, y, 0])
    (race,) = error.races  # one pair of instructions, seen in both blocks
    assert {race.first.location, race.second.location} == {where("tile[t] = x["), where("= tile[n - 1 - t];")}
    assert race.memory.startswith("dynamic shared memory") and not race.same_warp
    assert race.first.thread[0] // 32 != race.second.thread[0] // 32 and "no __syncthreads" in race.why
    races.launch("reverse_through_shared", 2, 64, 256, [x, y, 1])  # with the barrier: clean
    assert (y == np.concatenate([x[63::-1], x[:63:-1]])).all()


def test_global_memory_stored_by_two_blocks_is_a_race_unless_atomic(races):
    out = np.zeros(1, np.float32)
    error = raised(races, "blocks_store_one_address", 3, 32, 0, [out])
    (race,) = error.races
    assert race.first.kind == race.second.kind == "write" and race.first.block != race.second.block
    assert race.memory == "global memory, argument 0 (float32[1], 4 bytes), byte 0 (element 0)"
    assert "different blocks" in str(error) and where("out[0] = static_cast<float>(blockIdx.x);") in str(error)
    out[0] = 0.0
    races.launch("blocks_add_one_address", 3, 32, 0, [out])
    assert out[0] == 3.0


def test_a_read_of_another_blocks_write_is_a_race(races):
    data, out = np.zeros(4, np.float32), np.zeros(4, np.float32)
    error = raised(races, "blocks_read_neighbour", 4, 32, 0, [data, out])
    assert {r.first.kind for r in error.races} | {r.second.kind for r in error.races} == {"read", "write"}
    assert all(r.memory.startswith("global memory, argument 0") for r in error.races)


def test_in_process_launches_check_global_memory_too():
    module = CpuKernelModule(SOURCE, ENTRIES, racecheck=True, isolated=False)
    error = raised(module, "blocks_store_one_address", 2, 32, 0, [np.zeros(1, np.float32)])
    assert error.races[0].memory.startswith("global memory, argument 0")


def test_a_build_is_either_sanitized_or_race_checked():
    with pytest.raises(InvalidArgumentError, match="racecheck"):
        CpuKernelModule(SOURCE, ENTRIES, sanitize=True, racecheck=True)


# --- our kernels, a seeded race, and the property ---------------------------------------------------------

#: two query tiles and five key tiles (fa2, wmma), three blocks per head (naive), GQA, causal
RACE_SHAPES = [(1, 2, 1, 70, 130, 32), (2, 2, 2, 33, 40, 64)]


@pytest.mark.parametrize("family", [name for name, f in FAMILIES.items() if f.kind == "dense"])  # FP8: test_fp8_kernel.py
def test_our_kernels_have_no_race(family):
    backend = CpuKernelBackend(family)
    for shape in RACE_SHAPES:
        problem = make_problem("normal", shape, backend.dtypes[0], 3, causal=True)
        backend.run_racecheck(problem)
        if backend.features:  # key tiles skipped by a window, every variant on
            backend.run_racecheck(problem.replace(window_size=(40, -1), softcap=3.0, alibi_slopes=np.full(
                shape[1], 0.25, np.float32), sinks=np.ones(shape[1], np.float32)))


class OneEntry(CpuKernelBackend):
    """A kernel family's backend built from another source with only the entries it needs (fast)."""

    def __init__(self, family: str, source: Path, entry: str):
        super().__init__(family)
        self.source, self.entries = source, {entry: list(self.family.signature)}

    def module(self, racecheck: bool = False):
        return CpuKernelModule(self.source, self.entries, include_dirs=[self.source.parent], racecheck=racecheck)


def test_a_race_between_blocks_that_the_runner_s_numbers_hide_fails_races_alone(tmp_path):
    """The naive kernel with every block's S in the same scratch rows: right on the CPU runner,
    which runs blocks one after another; on a GPU blocks overwrite each other's S and P."""
    (mutant,) = load_mutants(names=["naive-scratch-shared-by-blocks"])
    problem = make_problem("normal", RACE_SHAPES[0], "fp32", 3, causal=True)
    backend = OneEntry("naive", mutant.materialise(tmp_path), "naive_fp32_d32")
    out, lse = backend.run(problem)
    assert check_attention(out, problem, lse=lse, precision=backend.precision("fp32")).passed
    result = check_races(backend, problem)
    assert result.failed and "different blocks" in result.detail and "naive.cu:" in result.detail
    assert check_races(CpuKernelBackend("naive"), problem).passed


def test_races_is_not_applicable_to_other_targets_and_searches_a_bounded_number_of_examples():
    outcome = search_property(get_backend("numpy-tiled"), "races", Selection(max_examples=5))
    assert outcome.status == "not applicable" and outcome.examples == 0
    assert "not a CUDA kernel run by the CUDA-on-CPU runner" in outcome.reason
    outcome = search_property(CpuKernelBackend("fa2"), "races", Selection(max_examples=20, dtypes=("fp32",)))
    assert outcome.passed and outcome.examples == 5
    assert "at most 5 examples (the race detector checks every memory access" in outcome.message()
