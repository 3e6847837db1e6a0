"""Judging the FP8 suite on the bugs reported in FP8 paths (tests/fixtures/fp8_mutants.py): each
mutant killed, FlashAttention-3's FP8 kernel never failed, and side by side, unit-descale testing
(FP8 agreement on the same inputs with every descale 1, as the tests of those FP8 paths ran)
blind to every descale bug.

The 20-seed campaign is slow (about 5 minutes on 2 shared cores):
    PYTHONPATH=. python3 -m pytest -n 0 -m slow tests/test_fp8_judge.py -s
Measured (20 examples a property, seeds 0-19): every mutant killed on 20 / 20 seeds by the
suite, at the 1st example (the fixed edge cases run first); the honest kernel failed on 0 / 20;
unit-descale testing killed lse_without_compensation on 20 / 20, p_without_offset on 4 / 20 and
none of the five descale mutants on any seed (docs/numerics.md, "FP8 attention").
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
from fp8_mutants import DESCALE_MUTANTS, MUTANTS, MutantFP8Backend, campaign, drawn_problems, unit_descales  # noqa: E402


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


@pytest.mark.slow
def test_every_mutant_is_killed_on_20_seeds_with_no_false_positive_and_unit_descales_miss_the_descale_bugs():
    table = campaign(range(20), examples=20)
    for name, row in table.items():
        print(f"{name:26s} suite {len(row['suite']):2d}/20 (examples to kill <= {max(row['examples'], default=0)})"
              f"  unit descales {len(row['unit descales']):2d}/20")
    assert table["honest"] == {"suite": [], "unit descales": [], "examples": []}
    for name in MUTANTS:
        assert len(table[name]["suite"]) == 20, name
    for name in DESCALE_MUTANTS:
        assert table[name]["unit descales"] == [], name
