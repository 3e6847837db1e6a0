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
from fa_verify.strategies._fp8 import HEAD_DIMS, OFFSET_SHARE, TILE_EDGE_KEYS, TILE_EDGE_SHARE, make_fp8_problem

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import fp8_mutants  # noqa: E402

FP8_PROPERTIES = [p.name for p in properties_for(NumpyFP8Backend())]


#: The dense properties that also run on FP8 problems (registry.DENSE_AND_FP8), in the suite's order.
SHARED = ["key_permutation", "query_permutation", "batch_head_independence", "masked_key_independence",
          "fully_masked_rows", "nan_padding", "determinism", "reused_buffers"]
#: The CUDA-on-CPU runner's checks, for FP8 kernels too (tests/test_fp8_kernel_spec.py runs them).
RUNNER_CHECKS = ["races", "address_sanitizer"]


def test_the_fp8_kind_is_one_line_of_kinds_and_shares_the_dense_properties_that_hold_on_it():
    assert KINDS["fp8"].problem_type is FP8Problem
    assert FP8_PROPERTIES == SHARED + RUNNER_CHECKS + ["fp8_agreement", "descale_sensitivity", "descale_rescaling",
                                                       "saturation_finite", "fp8_head_independence"]
    assert set(FP8_PROPERTIES) & {p.name for p in properties_for(NumpyTiledBackend())} == set(SHARED + RUNNER_CHECKS)


#: FA3's FP8 kernel as a callable of FP8 problems only: nan_padding reaches a callable's arguments
#: (the numpy backend copies its arrays: not applicable to it).
FA3_CALLABLE = CallableBackend(fp8_mutants.fa3_style, name="fp8_mutants:fa3_style", dtypes=("e4m3", "e5m2"))


@pytest.mark.parametrize("name", [p for p in FP8_PROPERTIES if p not in RUNNER_CHECKS])
def test_fa3s_fp8_kernel_passes_every_fp8_property(name):
    backend = FA3_CALLABLE if name == "nan_padding" else NumpyFP8Backend()
    outcome = search_property(backend, name, Selection(max_examples=12))
    assert outcome.status == "passed", outcome
    if name in ("key_permutation", "query_permutation"):  # judged within bounds: the null-model guard ran
        assert outcome.informative > 0, outcome


@pytest.mark.parametrize("mutant, name", [(m, p) for m, (_, props) in fp8_mutants.SUITE_MUTANTS.items()
                                          for p in props])
def test_each_shared_property_fails_the_fp8_bug_it_is_there_to_catch(mutant, name):
    outcome = search_property(fp8_mutants.SuiteMutantFP8Backend(mutant), name, Selection(max_examples=20))
    assert outcome.status == "failed", outcome
    if mutant == "zeros":  # every example uninformative: zeros pass a relation between two runs
        assert outcome.uninformative_only, outcome


def test_nan_padding_catches_an_fp8_callable_that_reads_past_its_keys():
    reads_past = CallableBackend(fp8_mutants.fa3_style_reads_past_k, name="fp8_mutants:fa3_style_reads_past_k",
                                 dtypes=("e4m3",))
    outcome = search_property(reads_past, "nan_padding", Selection(max_examples=5))
    assert outcome.status == "failed" and "reads outside its inputs" in outcome.failure.detail, outcome


def test_the_fp8_null_outputs_are_the_groups_trivial_outputs_times_their_v_descale():
    from fa_verify.null_model import fp8_null_outputs
    from fa_verify.oracle.fp8 import reference_fp8

    p = make_fp8_problem((2, 2, 1, 3, 6, 8), "e4m3", 0)
    nulls = {n.name: n for n in fp8_null_outputs(p, reference_fp8(p), "fp32")}
    assert set(nulls) == {"zeros", "uniform attention", "queries shifted by one row", "another q"}
    v_true = p.v.astype(np.float64) * p.descale("v_descale")[:, :, None, None]
    mean = np.repeat(v_true.mean(axis=2, keepdims=True), p.group_size, axis=1)
    np.testing.assert_allclose(nulls["uniform attention"].out, np.broadcast_to(mean, p.out_shape), rtol=2e-7)
    assert not any(n.exact_out for n in nulls.values())


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
    assert {p.head_dim for p in problems} == set(HEAD_DIMS)  # a target declaring none gets these
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


def test_the_relations_judge_each_kind_by_its_own_reference_bound_and_null_outputs():
    from fa_verify.error_model import error_bound
    from fa_verify.fp8_error_model import fp8_error_bound
    from fa_verify.oracle import reference
    from fa_verify.oracle.fp8 import reference_fp8
    from fa_verify.references import JUDGING, judging

    fp8 = make_fp8_problem((1, 2, 1, 3, 5, 8), "e4m3", 0)
    assert (judging(fp8).reference, judging(fp8).error_bound) == (reference_fp8, fp8_error_bound)
    assert (judging(fp8.stored).reference, judging(fp8.stored).error_bound) == (reference, error_bound)
    assert set(JUDGING) == {"dense", "fp8"}
    nulls = judging(fp8).null_outputs(fp8, reference_fp8(fp8), NumpyFP8Backend().precision("e4m3"))
    assert {n.out.dtype.name for n in nulls} == {"bfloat16"}  # the FP8 problem's output dtype
    ragged = type("Ragged", (), {"kind": "varlen"})()
    with pytest.raises(InvalidArgumentError, match="no reference and error bound for varlen problems here "
                                                   r"\(kinds: dense, fp8\)"):
        judging(ragged)
