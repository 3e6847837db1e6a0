"""Judging the FP8 suite on the bugs reported in FP8 paths (tests/fixtures/fp8_mutants.py): each
mutant killed, FlashAttention-3's FP8 kernel never failed, and side by side, unit-descale testing
(FP8 agreement on the same inputs with every descale 1, as the tests of those FP8 paths ran)
blind to every descale bug.

The 20-seed campaign, side by side with the FP8 gates others use, is the judging table of
docs/results.md (`fa_verify mutants --fp8 --seeds 20`; tests/test_fp8_table.py regenerates it
under -m slow).
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends.numpy_fp8 import NumpyFP8Backend
from fa_verify.properties import Selection, search_property
from fa_verify.properties.fp8 import check_fp8_agreement
from fa_verify.properties.registry import properties_for

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from fp8_mutants import DESCALE_MUTANTS, MUTANTS, MutantFP8Backend, drawn_problems, unit_descales  # noqa: E402


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_fp8_suite_kills_each_mutant(name):
    backend = MutantFP8Backend(name)
    selection = Selection(max_examples=10, seed=0, shrink=False)
    assert any(search_property(backend, prop, selection).status == "failed" for prop in properties_for(backend))


def test_unit_descale_testing_cannot_see_a_descale_bug():
    honest, problems = NumpyFP8Backend(), drawn_problems(0, 4)
    for problem in problems:
        unit = unit_descales(problem)
        right = honest.run(unit)
        assert check_fp8_agreement(honest, unit).passed
        for name in DESCALE_MUTANTS:  # bitwise the honest kernel's outputs: every check passes them
            assert all(np.array_equal(a, b) for a, b in zip(MutantFP8Backend(name).run(unit), right)), name
    # ... while the same agreement check with the drawn descales sees each of them
    for name in DESCALE_MUTANTS:
        assert any(check_fp8_agreement(MutantFP8Backend(name), p).failed for p in problems), name
