"""What a property check returns: passed, failed (with where and by how much), uninformative
(passed, but so would a trivial output: `fa_verify.null_model`), or not applicable."""

from __future__ import annotations

from dataclasses import dataclass

from fa_verify.errors import AttentionMismatch

PASSED, FAILED, NOT_APPLICABLE = "passed", "failed", "not applicable"
#: the target passed, but a trivial output passes the same tolerance: neither a pass nor a fail
UNINFORMATIVE = "uninformative"


@dataclass(frozen=True)
class PropertyResult:
    """The outcome of one property on one problem.

    `detail` says what differed, where, and the error against the tolerance (failed), or why
    the property cannot judge this target or problem (not applicable). `note` qualifies a
    pass (e.g. "no LSE returned: only the output was checked"). `verdicts` are the oracle
    verdicts the check produced, for results stores.
    """

    name: str
    status: str
    problem: str
    detail: str = ""
    note: str = ""
    #: largest error / tolerance seen (tolerance-based checks), None otherwise
    worst_ratio: float | None = None
    verdicts: tuple = ()
    #: the seed a seeded property drew its own choices from (set by search_property)
    seed: int | None = None
    #: whether the null-model guard found the example informative; None where it does not apply
    #: (bitwise and statistical checks, failures)
    informative: bool | None = None
    #: for a problem of several parts (a ragged batch's sequences): the part each verdict is
    #: about, and the part where the check failed (None: the whole problem)
    verdict_parts: tuple = ()
    part: int | None = None
    #: the trivial outputs of the null-model guard that the tolerance rejected on this example
    #: (its power: what a pass rules out); () where the guard does not apply
    null_rejected: tuple = ()

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @property
    def applicable(self) -> bool:
        return self.status != NOT_APPLICABLE

    def message(self) -> str:
        head = f"property {self.name!r} {self.status} ({self.problem})"
        return "\n".join(part for part in (head, self.detail, self.note) if part)

    def raise_for_failure(self) -> "PropertyResult":
        """Raise PropertyFailure if the property failed; return self otherwise."""
        if self.failed:
            raise PropertyFailure(self)
        return self


class PropertyFailure(AttentionMismatch):
    """A property does not hold; `result` is the PropertyResult with the details."""

    def __init__(self, result: PropertyResult):
        super().__init__(result.message())
        self.result = result


def passed(name: str, problem, note: str = "", worst_ratio=None, verdicts=(), guard=None,
           verdict_parts=()) -> PropertyResult:
    """A pass; uninformative instead when the null-model `guard` (a NullGuard) says a trivial
    output passes too."""
    if guard is not None and not guard.informative:
        return PropertyResult(name, UNINFORMATIVE, problem.describe(), detail=guard.describe(), note=note,
                              worst_ratio=worst_ratio, verdicts=tuple(verdicts), informative=False,
                              verdict_parts=tuple(verdict_parts))
    return PropertyResult(name, PASSED, problem.describe(), note=note, worst_ratio=worst_ratio,
                          verdicts=tuple(verdicts), informative=None if guard is None else True,
                          verdict_parts=tuple(verdict_parts), null_rejected=() if guard is None else guard.tried)


def failed(name: str, problem, detail: str, worst_ratio=None, verdicts=(), part=None,
           verdict_parts=()) -> PropertyResult:
    return PropertyResult(name, FAILED, problem.describe(), detail=detail, worst_ratio=worst_ratio,
                          verdicts=tuple(verdicts), part=part, verdict_parts=tuple(verdict_parts))


def not_applicable(name: str, problem, reason: str) -> PropertyResult:
    return PropertyResult(name, NOT_APPLICABLE, problem.describe(), detail=reason)
