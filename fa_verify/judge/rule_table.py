"""The rules of the side-by-side, in table order: the forward's (fa_verify.judge.rules), the
gradients' (fa_verify.judge.gradient_rules), then the FP8 gates (fa_verify.judge.fp8_rules);
each judges the targets of its `kind`."""

from __future__ import annotations

from fa_verify.errors import InvalidArgumentError
from fa_verify.judge.fp8_rules import FP8_RULES
from fa_verify.judge.gradient_rules import GRADIENT_RULES
from fa_verify.judge.rules import FORWARD_RULES

RULES = (*FORWARD_RULES, *GRADIENT_RULES, *FP8_RULES)
RULE_NAMES = tuple(r.name for r in RULES)


def get_rule(name: str):
    for rule in RULES:
        if rule.name == name:
            return rule
    raise InvalidArgumentError(f"rule={name!r} is unknown; rules: {', '.join(RULE_NAMES)}")
