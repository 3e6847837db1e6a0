"""Judging the harness: the mutants, the suite as a mutant killer, false positives, other rules.

The bounded CI subset of `fa_verify mutants` (the full run is one documented command, docs/results.md,
"Judging the harness"): every mutant once through the property suite with a small example
budget (first kill only), one extra Hypothesis seed of the suite on each unmutated kernel, and
the other rules on a few mutants with reduced grids. About 2 minutes on 2 cores once the
mutants are built (the runner caches builds).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fa_verify.backends.cuda_kernels import CpuKernelBackend, cpu_runner_availability
from fa_verify.judge import (
    AssertCloseRule,
    Case,
    FlashAttentionRule,
    KernelBenchRule,
    MutantBackend,
    judge_mutant,
    run_suite,
)
from fa_verify.kernels.catalogue import FAMILIES
from fa_verify.kernels.mutants import load_mutants, mutable_kernels
from fa_verify.problem import AttentionProblem
from fa_verify.properties import Selection

CPU = cpu_runner_availability()
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)

#: The forward kernels' mutants: the backward kernel's (Mutant.backward) have tests/test_backward_kernel.py.
MUTANTS = [m for m in load_mutants() if not m.backward]
BY_NAME = {m.name: m for m in MUTANTS}
#: Issue 5's bug classes, then issue 15's for fa2's variants, as mutants.toml names them: each must have a mutant.
REQUIRED_CLASSES = (
    "causal off-by-one", "causal alignment", "missing rescale of the accumulator",
    "missing rescale of the running sum", "running max initialised to 0", "scale applied twice",
    "scale not applied", "scale 1/D", "last partial K/V tile dropped", "last K/V tile read out of bounds",
    "padding not masked", "P·V accumulated in fp16/bf16", "S computed in fp16/bf16", "LSE wrong",
    "wrong batch/head/GQA offset", "missing __syncthreads", "fully masked rows give NaN",
    "output rounded toward zero",
    "window edge off by one", "window without the Nk - Nq offset", "softcap before the scale",
    "ALiBi sign flipped", "ALiBi head index wrong", "sink counted in the numerator",
)
#: A small budget: CI runs every mutant once; the full campaign uses the ci profile's 20. No
#: shrinking: a kill, its property and its examples are the same without it, and shrinking (each
#: step runs the mutant and its control) took nearly all of a kill's time (split-kv-global-seqlen:
#: 27 s -> 0.1 s). `fa_verify mutants` shrinks its kills (tests/test_cli_exit_codes.py runs one).
SMALL = Selection.from_profile("ci", max_examples=8, shrink=False)


# --- the mutants file ------------------------------------------------------------------------------


def test_mutants_cover_the_bug_classes_and_apply_once(tmp_path):
    assert len(MUTANTS) >= 14
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert set(REQUIRED_CLASSES) <= {m.bug_class for m in MUTANTS}
    assert {"fa2", "wmma"} <= {m.family for m in MUTANTS}
    for m in MUTANTS:
        assert m.family in mutable_kernels() and m.description and m.bug_class
        assert m.caught_by in ("oracle", "sanitizer", "property", "race")
        original = m.kernel_family.source_path.read_text()
        assert original.count(m.find) == 1, m.name  # one textual edit of the current source
        assert m.materialise(tmp_path / m.name).read_text() != original


def test_a_mutant_is_written_once_where_every_process_finds_it(tmp_path, monkeypatch):
    """A fixed folder per mutant and text: the build cache, whose units name their source, then
    serves every process and run."""
    from fa_verify.judge.mutants import mutant_source

    monkeypatch.setenv("FA_VERIFY_CACHE", str(tmp_path))
    m = BY_NAME["fa2-scale-twice"]
    path = mutant_source(m)
    assert mutant_source(m) == path and path.is_relative_to(tmp_path) and m.name in path.parent.name
    assert path.read_text() == m.mutate(m.kernel_family.source_path.read_text())
    assert (path.parent / "fa_common.cuh").is_file()
    assert [p.name for p in path.parent.parent.iterdir()] == [path.parent.name]  # nothing left aside


def test_selecting_mutants_by_family_and_name():
    assert {m.family for m in load_mutants(families=["wmma"])} == {"wmma"}
    assert [m.name for m in load_mutants(names=["fa2-scale-twice"])] == ["fa2-scale-twice"]
    with pytest.raises(ValueError, match="unknown"):
        load_mutants(names=["no-such-mutant"])


# --- the property suite kills every mutant ----------------------------------------------------------------


#: Mutants whose kill another test below shows by the same search: their run here is slow.
#: naive16's one mutant: test_truncated_output_of_eager_attention_... searches every property on it.
KILLED_BELOW = ("naive16-output-truncated",)


#: The families whose first mutant the default run kills: one dense kernel and the ragged one (the
#: backward kernel's: tests/test_backward_judge.py); the slow run kills every mutant of every family.
DEFAULT_FAMILIES = ("fa2", "split_kv")


def _first_of_each_family(mutants) -> list:
    """Every mutant, the first of each DEFAULT_FAMILIES family in the default run (unless
    KILLED_BELOW) and the others marked slow (`python3 -m pytest -m slow`; .ci/run runs both):
    ~10 s each."""
    seen, params = set(), []
    for m in mutants:
        default = m.family in DEFAULT_FAMILIES and m.family not in seen and m.name not in KILLED_BELOW
        params.append(m.name if default else pytest.param(m.name, marks=pytest.mark.slow))
        seen.add(m.family)
    return params


@needs_cpu_runner
@pytest.mark.parametrize("name", _first_of_each_family(MUTANTS))
def test_the_suite_kills_every_mutant(name):
    verdict = judge_mutant(BY_NAME[name], SMALL, stop_at_first=True)
    assert verdict.killed, f"{name} ({verdict.description}) survived the property suite"
    kill = verdict.kill
    assert kill.examples_to_kill >= 1 and kill.seconds_to_kill >= 0
    assert kill.counterexample is not None
    if BY_NAME[name].caught_by == "sanitizer" and not verdict.plain.killed:
        assert kill.killed_by_kind == "sanitizer", kill.detail


@needs_cpu_runner
def test_truncated_output_of_eager_attention_is_found_by_the_rounding_statistic_alone():
    """Its error stays within the (same-precision) bounds: only unbiased_rounding sees it. The
    default run's kill of the naive16 family (KILLED_BELOW)."""
    run = run_suite(MutantBackend(BY_NAME["naive16-output-truncated"]), SMALL)
    assert run.killers == ["unbiased_rounding"], run.killers


def test_a_failure_that_does_not_replay_still_kills():
    """A nondeterministic target (one reading uninitialised memory, say) fails once and passes
    when Hypothesis replays the example: the search reports it as a failure, still a kill."""
    import itertools

    from fa_verify.backends.naive import naive_attention
    from fa_verify.precision import PrecisionModel
    from fa_verify.properties import as_backend

    calls = itertools.count()

    def run(problem):
        out, lse = naive_attention(problem, PrecisionModel.fp32_accumulate(problem.dtype))
        return (out + 1000 if next(calls) == 2 else out), lse  # far outside the hull of V, once

    suite = run_suite(as_backend(run, name="flaky"), SMALL, properties=["convex_hull"])
    assert suite.killed and suite.killer == "convex_hull" and suite.examples_to_kill == 2
    assert "did not repeat" in suite.detail


def test_a_kill_counts_only_on_an_example_the_unmutated_kernel_passes():
    """A target failing where its control (the unmutated kernel) fails too is not killed there:
    the example is set aside and the search goes on; a correct control lets the kill count."""
    from fa_verify.backends.naive import naive_attention
    from fa_verify.precision import PrecisionModel
    from fa_verify.properties import as_backend

    def correct(problem):
        return naive_attention(problem, PrecisionModel.fp32_accumulate(problem.dtype))

    def shifted(problem):  # outside the convex hull of V on every example
        out, lse = correct(problem)
        return out + 1000, lse

    bug, control = as_backend(shifted, name="bug"), as_backend(correct, name="control")
    killed = run_suite(bug, SMALL, properties=["convex_hull"], control=control)
    assert killed.killed and killed.killer == "convex_hull" and killed.examples_to_kill == 1
    assert not killed.shared_failures
    shared = run_suite(bug, SMALL, properties=["convex_hull"], control=as_backend(shifted, name="also-bug"))
    assert not shared.killed and shared.properties[0]["status"] != "failed"
    assert len(shared.shared_failures) >= 1 and "convex_hull" in shared.shared_failures[0]
    assert shared.as_dict()["shared_failures"] == shared.shared_failures


@needs_cpu_runner
@pytest.mark.parametrize("family", [f if f == "fa2" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_no_false_positive_on_the_unmutated_kernels(family):
    """One seed besides the profile's (the campaign runs 20). fa2 in the default run, whose
    properties/ suite searches the profile's seed on every kernel; the others marked slow."""
    run = run_suite(CpuKernelBackend(family), Selection.from_profile("ci", max_examples=10, seed=1))
    assert not run.killed, f"{family}: {run.killer}: {run.detail}"


# --- the other rules ----------------------------------------------------------------------------------------


def _case():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 1, 8, 16)), rng.standard_normal((1, 1, 8, 16)), rng.standard_normal((1, 1, 8, 16))
    return Case("tiny", AttentionProblem.from_float(q, k, v, "fp16"))


def test_flash_attention_rule_judges_against_twice_the_baseline_error_plus_its_floor():
    from fa_verify.backends.naive import naive_attention
    from fa_verify.precision import PrecisionModel

    rule, case = FlashAttentionRule(), _case()
    ref, _ = naive_attention(case.problem, PrecisionModel.fp32_accumulate("fp16"))
    assert rule.judge(ref, case) is None
    bad = ref.copy()
    bad[0, 0, 3, 5] += np.float16(0.25)
    assert "max|out - out_ref|" in rule.judge(bad, case)
    bad[0, 0, 3, 5] = np.nan
    assert rule.judge(bad, case) is not None  # NaN fails, as NaN <= x is False in the test


def test_the_rules_look_only_at_the_output():
    case = _case()
    from fa_verify.backends.naive import naive_attention
    from fa_verify.precision import PrecisionModel

    ref, _ = naive_attention(case.problem, PrecisionModel.fp32_accumulate("fp16"))
    for rule in (FlashAttentionRule(), KernelBenchRule(), AssertCloseRule()):
        assert rule.judge(ref, case) is None, rule.name


@needs_cpu_runner
def test_other_rules_on_a_few_mutants():
    fa = FlashAttentionRule(seqlens=((113, 203),), head_dims=(64,))
    causal_bug = fa.run(MutantBackend(BY_NAME["fa2-causal-off-by-one"]))
    assert causal_bug.killed and "causal" in causal_bug.failure
    lse_bug = fa.run(MutantBackend(BY_NAME["fa2-lse-without-max"]))
    assert not lse_bug.killed and lse_bug.cases == lse_bug.total_cases == 12  # O is right: it passes
    assert not fa.run(CpuKernelBackend("fa2")).killed

    kb = KernelBenchRule(shape=(1, 2, 2, 64, 64, 64), trials=2)
    assert kb.run(MutantBackend(BY_NAME["fa2-missing-syncthreads"])).killed
    assert not kb.run(CpuKernelBackend("fa2")).killed

    ac = AssertCloseRule(shape=(1, 2, 2, 64, 64, 64), seeds=(0,))
    assert ac.run(MutantBackend(BY_NAME["wmma-no-scale"])).killed
    assert not ac.run(CpuKernelBackend("naive")).killed  # fp32 throughout: within the defaults


@needs_cpu_runner
def test_assert_close_defaults_reject_a_correct_fp16_flash_kernel():
    """P rounded to fp16 before P·V (FlashAttention-2's precision) moves some outputs by more
    than fp16's default rtol of 1e-3 from the exactly rounded result."""
    outcome = AssertCloseRule(seeds=(0,)).run(CpuKernelBackend("fa2"))
    assert outcome.killed and outcome.failure.startswith("fp16")


# --- the command --------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_cpu_runner
def test_mutants_command_json(capsys, tmp_path):
    from fa_verify.cli.main import main

    markdown = tmp_path / "tables.md"
    code = main(["mutants", "--mutant", "fa2-scale-twice", "--mutant", "naive-lse-log2", "--seeds", "1",
                 "--max-examples", "5", "--rule", "assert_close", "--json", "--markdown", str(markdown)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["passed"]
    assert [m["name"] for m in doc["mutants"]] == ["fa2-scale-twice", "naive-lse-log2"]
    assert all(m["killed"] for m in doc["mutants"])
    assert doc["mutants"][1]["killed_by"] == "lse_agreement"
    ours, ac = doc["summary"]
    assert ours["rule"] == "fa_verify" and ours["kill_rate"] == 1.0 and ours["false_positives"] == 0
    assert ac["rule"] == "assert_close" and ac["killed"] == 1  # the LSE bug is invisible to it
    assert doc["false_positives"]["runs"] == 2  # fa2 and naive, one seed each
    tables = markdown.read_text().splitlines()
    assert tables[0].startswith("| mutant | bug class | killed by |") and tables[0].endswith("| assert_close |")
    assert tables[2].startswith("| `fa2-scale-twice` |") and "| lse_agreement" in tables[3]
    assert "| fa_verify | 2/2 (100%) | 0 of 2 suite runs |" in markdown.read_text()


def test_mutants_command_usage_errors(capsys, monkeypatch):
    from fa_verify.backends.base import Availability
    from fa_verify.cli.main import main

    assert main(["mutants", "--mutant", "no-such-mutant"]) == 2
    assert main(["mutants", "--family", "nope"]) == 2
    with pytest.raises(SystemExit) as exit_info:  # checked by argparse, before anything runs
        main(["mutants", "--seeds", "-1"])
    assert exit_info.value.code == 2
    capsys.readouterr()
    monkeypatch.setattr("fa_verify.backends.cuda_kernels.cpu_runner_availability",
                        lambda: Availability(False, "g++ is not installed"))
    assert main(["mutants", "--mutant", "fa2-scale-twice"]) == 2
    assert "CUDA-on-CPU runner: g++ is not installed" in capsys.readouterr().err
