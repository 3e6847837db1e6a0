"""Judging the harness itself: seeded kernel bugs (mutants), false positives, other checking rules.

    from fa_verify.judge import MutantBackend, judge_mutant, run_campaign, RULES

`fa_verify.kernels.mutants.load_mutants()` reads kernels/mutants/mutants.toml;
`MutantBackend(mutant)` runs a mutated kernel through the CUDA-on-CPU runner as
`CpuKernelBackend` runs the original; `judge_mutant` runs the property suite on it (then its
AddressSanitizer build if no property kills it); `false_positive_runs` runs the suite on the
unmutated kernels over many seeds; `RULES` are the checking rules others use (flash-attention's tests, KernelBench's, `torch.testing.assert_close`
defaults); `run_campaign` does all of it and makes the table `fa_verify mutants` prints.

Modules: mutants (building a mutant, its backend), campaign (the suite as a mutant killer),
rules (the other rules), report (the whole campaign and its table); for FP8: fp8_mutants (the
emulated FP8 mutants), fp8_rules (the FP8 gates others use), over_seeds (the campaign once per
seed: the FP8 judging table of `fa_verify mutants --fp8`).
"""

from fa_verify.judge.campaign import (
    BY_PROPERTY,
    BY_SANITIZER,
    Counterexample,
    FalsePositiveReport,
    MutantVerdict,
    SuiteRun,
    false_positive_runs,
    judge_mutant,
    run_suite,
)
from fa_verify.judge.mutants import MutantBackend, mutant_module
from fa_verify.judge.report import STATISTICAL_PROPERTIES, CampaignReport, RuleResults, run_campaign
from fa_verify.judge.rule_table import RULE_NAMES, RULES, get_rule
from fa_verify.judge.rules import (
    AssertCloseRule,
    Case,
    FlashAttentionRule,
    KernelBenchRule,
    Rule,
    RuleOutcome,
)

__all__ = [
    "BY_PROPERTY",
    "BY_SANITIZER",
    "RULES",
    "RULE_NAMES",
    "STATISTICAL_PROPERTIES",
    "AssertCloseRule",
    "CampaignReport",
    "Case",
    "Counterexample",
    "FalsePositiveReport",
    "FlashAttentionRule",
    "KernelBenchRule",
    "MutantBackend",
    "MutantVerdict",
    "Rule",
    "RuleOutcome",
    "RuleResults",
    "SuiteRun",
    "false_positive_runs",
    "get_rule",
    "judge_mutant",
    "mutant_module",
    "run_campaign",
    "run_suite",
]
