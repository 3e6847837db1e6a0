"""The gradient rules side by side: for each gradient record, fa_verify's verdict and whether each
rule others use (`judge.gradient_rules`: flash-attention's 3x / causal 2x + 1e-5 the same-precision
baseline, PyTorch's fudge factor 5, JAX's 0.2, the Triton tutorial's 1e-2) accepts the same
gradient, with why not; and per backend and tensor, how many records each accepts.

The rules are judged as their tests judge (against the exact gradient rounded to the dtype, the
baseline the eager same-precision gradients), on the sweep's problems rather than their own
grids: the Triton tutorial's atol is applied to every shape and dtype, flash-attention's and
PyTorch's baselines to fp32 too, which their tests do not run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fa_verify.report.buckets import TENSORS, column_of
from fa_verify.report.gradients import RULES_KEY


@dataclass
class RuleRow:
    """One gradient record: fa_verify's verdict and each rule's."""

    backend: str
    problem: str
    column: str
    tensor: str
    #: fa_verify's: passed, the first rule failed, the largest error / bound
    passed: bool
    rule: str | None
    bound_ratio: float | None
    #: per rule of RuleTable.rules: None where it accepts, else why not
    verdicts: list


@dataclass
class RuleTotal:
    """Per backend and tensor: records, and how many fa_verify and each rule accept."""

    backend: str
    tensor: str
    records: int
    fa_verify: int
    #: per rule of RuleTable.rules
    accepted: list


@dataclass
class RuleTable:
    #: (name, title) of each rule, in table order
    rules: list
    rows: list
    totals: list


def rule_table(records, label) -> RuleTable | None:
    """The side-by-side of the records that carry the rules' verdicts (None when none does);
    `label(problem)` names a problem as the per-backend tables do."""
    from fa_verify.judge.gradient_rules import GRADIENT_RULES

    judged = sorted((r for r in records if r.extra.get(RULES_KEY)),
                    key=lambda r: (r.backend, r.problem.work, str(r.problem.key()), TENSORS.index(r.tensor)))
    if not judged:
        return None
    rules = [(rule.name, rule.title) for rule in GRADIENT_RULES]
    rows = [RuleRow(r.backend, label(r.problem), column_of(r.problem).label, r.tensor, r.passed, r.rule,
                    r.bound_ratio, [r.extra[RULES_KEY].get(name, "not judged") for name, _ in rules])
            for r in judged]
    groups = defaultdict(list)
    for row in rows:
        groups[row.backend, row.tensor].append(row)
    totals = [RuleTotal(backend, tensor, len(mine), sum(row.passed for row in mine),
                        [sum(row.verdicts[i] is None for row in mine) for i in range(len(rules))])
              for (backend, tensor), mine in sorted(groups.items(), key=lambda kv: (kv[0][0], TENSORS.index(kv[0][1])))]
    return RuleTable(rules, rows, totals)
