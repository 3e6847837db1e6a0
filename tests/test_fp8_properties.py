"""The FP8 kind in the one pipeline: its strategies draw where FP8 bugs live, its properties pass
FlashAttention-3's FP8 kernel and catch a target that ignores a descale, and a callable taking
FlashAttention-3's descale keywords runs FP8 problems."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends import CallableBackend
from fa_verify.backends.numpy_fp8 import NumpyFP8Backend
from fa_verify.backends.numpy_tiled import NumpyTiledBackend
from fa_verify.errors import InvalidArgumentError
from fa_verify.fp8 import DESCALES, FP8Problem
from fa_verify.properties import Selection, search_property
from fa_verify.properties.kinds import KINDS
from fa_verify.properties.registry import properties_for
from fa_verify.strategies._fp8 import OFFSET_SHARE, TILE_EDGE_KEYS, TILE_EDGE_SHARE, make_fp8_problem

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import fp8_mutants  # noqa: E402

FP8_PROPERTIES = [p.name for p in properties_for(NumpyFP8Backend())]


def test_the_fp8_kind_is_one_line_of_kinds_and_its_properties_are_its_own():
    assert KINDS["fp8"].problem_type is FP8Problem
    assert FP8_PROPERTIES == ["fp8_agreement", "descale_sensitivity", "descale_rescaling", "saturation_finite",
                              "fp8_head_independence"]
    assert not set(FP8_PROPERTIES) & {p.name for p in properties_for(NumpyTiledBackend())}


@pytest.mark.parametrize("name", FP8_PROPERTIES)
def test_fa3s_fp8_kernel_passes_every_fp8_property(name):
    outcome = search_property(NumpyFP8Backend(), name, Selection(max_examples=12))
    assert outcome.status == "passed", outcome


def test_drawn_descales_are_never_unit_never_powers_of_two_and_all_distinct():
    problems = fp8_mutants.drawn_problems(1, 60)
    for p in problems:
        values = np.concatenate([getattr(p, n).ravel() for n in DESCALES]).astype(np.float64)
        assert len(set(values)) == len(values), p.describe()
        assert not any(math.log2(x).is_integer() for x in values), p.describe()
    exponents = [math.log2(float(getattr(p, n).ravel()[0])) for p in problems for n in DESCALES]
    assert min(exponents) < -6 and max(exponents) > 6  # small and large
    shares = {"tile edge": np.mean([p.nk in TILE_EDGE_KEYS for p in problems]),
              "offset": np.mean([dict(p.tags)["offset_gap"] is not None for p in problems])}
    assert abs(shares["tile edge"] - TILE_EDGE_SHARE) < 0.2 and abs(shares["offset"] - OFFSET_SHARE) < 0.2, shares
    assert {p.dtype for p in problems} == {"e4m3", "e5m2"}
    assert any(p.q_descale.shape == (1,) for p in problems) and any(p.group_size > 1 for p in problems)


def test_drawn_values_reach_the_formats_largest_value_and_its_subnormals():
    p = make_fp8_problem((1, 2, 1, 16, 128, 32), "e4m3", 0, spread="saturating")
    v = np.abs(p.v.astype(np.float64))
    assert v.max() == 448 and v[v > 0].min() == 2.0 ** -9


def test_the_offset_profile_puts_the_others_where_only_the_offset_keeps_them():
    p = make_fp8_problem((1, 1, 1, 4, 129, 16), "e4m3", 2, offset_gap=7.3)
    from fa_verify.oracle.fp8 import reference_fp8
    lse = reference_fp8(p).lse
    # the dominant key at gap / 2, 128 others at -gap / 2 (within noise): lse = gap / 2 + log(1 + 128 e^-gap)
    assert np.all(np.abs(lse - 7.3 / 2 - np.log1p(128 * np.exp(-7.3))) < 0.05)


def _ignores(q, k, v, *, causal, scale, q_descale=None, k_descale=None, v_descale=None):
    """Takes the descales and applies only q's and k's (v's dropped)."""
    from fa_verify.fp8_emulation import fa3_fp8_forward, per_head
    from fa_verify.precision import PrecisionModel

    p = FP8Problem(q, k, v, q_descale, k_descale, v_descale, causal=causal, scale=scale)
    ones = np.ones((p.batch, p.heads), np.float32)
    return fa3_fp8_forward(p, PrecisionModel.flash(p.dtype), per_head(p, "q_descale"), per_head(p, "k_descale"), ones)


def test_a_callable_naming_the_descales_runs_fp8_problems_and_is_given_them():
    honest = CallableBackend(fp8_mutants.fa3_style, name="fp8_mutants:fa3_style")
    assert honest.kinds == ("dense", "fp8") and {"e4m3", "e5m2"} <= set(honest.dtypes)
    assert search_property(honest, "descale_sensitivity", Selection(max_examples=8)).status == "passed"
    wrong = CallableBackend(_ignores, name="v_descale_ignored")
    outcome = search_property(wrong, "descale_sensitivity", Selection(max_examples=8))
    assert outcome.status == "failed"


def test_a_callable_without_descales_runs_no_fp8_problem():
    plain = CallableBackend(lambda q, k, v, *, causal, scale: q, name="plain")
    assert plain.kinds == ("dense",)
    assert search_property(plain, "fp8_agreement", Selection()).status == "not applicable"
    with pytest.raises(InvalidArgumentError, match="q_descale, k_descale and v_descale"):
        CallableBackend(lambda q, k, v, *, causal, scale: q, dtypes=("e4m3",))


def test_fa_verify_check_exercises_fp8_with_descales_when_the_function_takes_them(monkeypatch, capsys):
    from fa_verify.cli.main import main

    monkeypatch.chdir(Path(__file__).parent / "fixtures")
    assert main(["check", "fp8_mutants:fa3_style", "--property", "descale_sensitivity", "--property",
                 "oracle_agreement", "--dtype", "e4m3", "--max-examples", "3", "--no-isolate"]) == 0
    output = capsys.readouterr().out
    assert "PASS descale_sensitivity" in output and "N/A  oracle_agreement" in output
