"""One test per documented edge case, each with a target that gets exactly that case wrong:
  * the merge law's chunks with fully masked rows (docs/properties.md: their state must be
    (0, -inf)): a kernel whose fully masked rows return LSE 0;
  * the race detector's plain access racing an atomic one (docs/cuda-on-cpu.md: only atomics on
    both sides are free of a race): small kernels of tests/cuda_cpu_kernels/atomic_races.cu;
  * the spec expressions' constants (docs/targets.md: numbers, names and arithmetic only):
    strings, booleans, None and the other non-numbers are refused, naming the constant.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.backends.cuda_kernels import cpu_runner_availability
from fa_verify.errors import InvalidArgumentError, KernelRaceError
from fa_verify.kernels import expressions
from fa_verify.properties import check_merge_law, check_oracle_agreement
from fa_verify.properties.online_softmax import chunk_pieces
from fa_verify.strategies import make_problem

# --- the merge law: chunks' fully masked rows ------------------------------------------------------

def _lse_zero_on_masked_rows(problem):
    """numpy-tiled, except that rows that see no key return LSE 0 (a row sum floored at 1, log 1)
    instead of -inf; their O stays 0. Right on every problem without fully masked rows."""
    out, lse = get_backend("numpy-tiled").run(problem)
    lse = np.where(problem.masked_rows[None, None, :], np.float32(0), lse)
    return out, lse


def test_merge_law_fails_a_kernel_that_gets_only_the_chunks_fully_masked_rows_wrong():
    # Nq = Nk, causal bottom-right: the whole problem has no fully masked row, so the kernel is
    # right on it; the merge law's causal chunk pieces start at row 0, and rows above the chunk's
    # first key see none of its keys.
    problem = make_problem("normal", (1, 2, 1, 16, 16, 16), "fp16", 0, causal=True)
    assert not problem.masked_rows.any()
    assert check_oracle_agreement(_lse_zero_on_masked_rows, problem).passed
    for seed in range(3):
        assert check_merge_law(get_backend("numpy-tiled"), problem, seed=seed).passed
        result = check_merge_law(_lse_zero_on_masked_rows, problem, seed=seed)
        assert result.failed, (seed, result.message())
        assert "causal bottom-right" in result.detail and "merged" in result.detail
    pieces = [piece for a in range(1, 16) for piece in chunk_pieces(problem, a, 16)]
    assert all(piece.rows.start == 0 for piece in pieces if piece.problem(problem).causal)
    assert all(piece.problem(problem).masked_rows.sum() == a for a in range(1, 16)
               for piece in chunk_pieces(problem, a, 16))  # chunk a:16's rows 0..a-1 see none of its keys


# --- the race detector: a plain access racing an atomic one ----------------------------------------

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
ATOMIC_SOURCE = KERNELS / "atomic_races.cu"
ATOMIC_ENTRIES = {
    "store_races_atomic_add": ["ptr"],
    "atomic_add_races_store": ["ptr"],
    "load_races_atomic_add": ["ptr", "ptr"],
    "block_store_then_atomic_add": ["ptr", "int"],
}
CPU = cpu_runner_availability()
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)


@pytest.fixture(scope="module")
def atomic_races():
    from fa_verify.cuda_cpu import CpuKernelModule
    return CpuKernelModule(ATOMIC_SOURCE, ATOMIC_ENTRIES, racecheck=True)


def _line(text: str) -> str:
    lines = ATOMIC_SOURCE.read_text().splitlines()
    return f"{ATOMIC_SOURCE.resolve()}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def _races(module, name, grid, block, args):
    with pytest.raises(KernelRaceError) as info:
        module.launch(name, grid, block, 0, args)
    return info.value.races


@needs_cpu_runner
@pytest.mark.parametrize("name, plain", [("store_races_atomic_add", "write"), ("atomic_add_races_store", "write"),
                                         ("load_races_atomic_add", "read")])
def test_a_plain_access_racing_an_atomic_one_between_blocks_is_a_race(atomic_races, name, plain):
    args = [np.zeros(1, np.float32)] + ([np.zeros(1, np.float32)] if name.startswith("load") else [])
    races = _races(atomic_races, name, 3, 32, args)
    kinds = [{race.first.kind, race.second.kind} for race in races]
    assert {plain, "atomic"} in kinds, kinds
    race = races[kinds.index({plain, "atomic"})]
    assert race.first.block != race.second.block and "different blocks" in race.why
    assert race.memory.startswith("global memory, argument 0")
    assert _line("atomicAdd(out, 1.0f);") in {race.first.location, race.second.location}


@needs_cpu_runner
def test_a_plain_store_and_atomics_in_one_block_race_unless_a_barrier_separates_them(atomic_races):
    races = _races(atomic_races, "block_store_then_atomic_add", 1, 64, [np.zeros(1, np.float32), 0])
    assert {"write", "atomic"} in [{race.first.kind, race.second.kind} for race in races]
    out = np.zeros(1, np.float32)
    atomic_races.launch("block_store_then_atomic_add", 1, 64, 0, [out, 1])  # with the barrier: clean
    assert out[0] == 100 + 63


# --- the spec expressions: constants other than numbers are refused ----------------------------------

NAMES = {"B", "H", "Nq", "Nk", "D", "causal"}


@pytest.mark.parametrize("text, constant", [("'abc'", "'abc'"), ("D * 'x'", "'x'"), ("True", "True"),
                                            ("Nq + False", "False"), ("None", "None"), ("D if None else 1", "None"),
                                            ("b'64'", "b'64'"), ("2j", "2j"), ("...", "Ellipsis")])
def test_spec_expressions_refuse_every_constant_but_numbers_naming_it(text, constant):
    with pytest.raises(InvalidArgumentError) as info:
        expressions.parse(text, "grid[0]", NAMES)
    message = str(info.value)
    assert message.startswith(f"grid[0]={text!r}") and f"constant {constant}" in message, message
    assert "only int and float numbers" in message, message


@pytest.mark.parametrize("value", [True, False, None, b"64", [64], 2j])
def test_spec_expressions_refuse_non_numbers_given_as_values(value):
    with pytest.raises(InvalidArgumentError, match="must be a number or an expression string"):
        expressions.parse(value, "block", NAMES)


def test_spec_expressions_still_take_numbers_and_names():
    for text, want in (("64", 64), (64, 64), (0.5, 0.5), ("1e-3 * D", 0.064), ("-D // 3", -22), ("cdiv(Nq, 64)", 2)):
        tree = expressions.parse(text, "x", NAMES)
        assert expressions.evaluate(tree, {"D": 64, "Nq": 65}, "x") == pytest.approx(want)


def test_a_tree_built_by_hand_with_a_string_constant_is_refused_when_evaluated():
    import ast

    tree = ast.BinOp(ast.Name("D", ast.Load()), ast.Mult(), ast.Constant("x"))  # parse returns trees as they are
    assert expressions.parse(tree, "x", NAMES) is tree
    with pytest.raises(InvalidArgumentError, match="constant 'x' is not a number"):
        expressions.evaluate(tree, {"D": 64}, "x")
