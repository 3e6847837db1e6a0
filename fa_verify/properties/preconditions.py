"""Precondition discovery: when a target fails only on part of the shape space, say which part.

A kernel that reads whole tiles of 32 keys fails for every Nk that is not a multiple of 32 and
passes everywhere else; its author left the precondition in the launcher (``TORCH_CHECK(N % 32
== 0)``) or in nobody's head. Reported as a wrong result, that reads as a bug in the kernel;
reported as "fails for every drawn Nk with Nk % 32 ≠ 0; passes all 41 drawn multiples of 32",
with the `[limits]` line that declares it, it reads as what it is, and the author can decide.

From the examples one property judged (`PropertyOutcome.seen`, every kind of target alike), each
candidate limit is tried in turn — sequence lengths a multiple of a power of two (Nk, Nq or
both), head dims, Nq = Nk, a minimum length, causal or not, dtypes, MHA only — and one is
reported only when it separates exactly: every failure outside the region it allows, every pass
inside, and at least MIN_PASSES passes. Failing properties that the same limit explains are
reported together, their examples counted together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import gcd

#: Passes inside a limit's region needed before the limit is suggested.
MIN_PASSES = 3
_MULTIPLES = (256, 128, 64, 32, 16, 8, 4, 2)


@dataclass(frozen=True)
class Seen:
    """The shape of one judged example, and whether it failed."""

    nq: int
    nk: int
    head_dim: int
    dtype: str
    causal: bool
    mha: bool
    failed: bool

    @classmethod
    def of(cls, problem, failed: bool) -> "Seen | None":
        """None for a problem of several sequences (varlen, paged): no one Nq and Nk to reason on."""
        if getattr(problem, "nq", None) is None:
            return None
        return cls(problem.nq, problem.nk, problem.head_dim, problem.dtype, bool(problem.causal),
                   problem.heads == problem.kv_heads, bool(failed))


@dataclass(frozen=True)
class Limit:
    """A candidate precondition: the region it allows, in words, and its `[limits]` line."""

    allows: Callable[[Seen], bool]
    failing: str  # "Nk with Nk % 32 ≠ 0"
    passing: str  # "multiples of 32"
    line: str  # "seq-multiple = 32"
    option: str  # "--seq-multiple 32"


@dataclass(frozen=True)
class Precondition:
    """A limit that explains the failures of `properties`, with the examples counted."""

    limit: Limit
    properties: tuple
    failed: int
    passed: int

    def message(self) -> str:
        one = len(self.properties) == 1
        names = ", ".join(self.properties) if len(self.properties) <= 3 else f"all {len(self.properties)} failing properties"
        return (f"precondition? {names} fail{'s' if one else ''} for every drawn {self.limit.failing} "
                f"({self.failed} examples) and pass{'es' if one else ''} all {self.passed} drawn {self.limit.passing}: "
                f"if the kernel requires it, declare it in [limits]: {self.limit.line} ({self.limit.option})")


def candidates(seen: list[Seen]) -> list[Limit]:
    """The limits worth trying on these examples, the most specific first."""
    passes = [s for s in seen if not s.failed]
    limits = []
    for length, failing in ((lambda s: s.nk, "Nk with Nk % {m} ≠ 0"), (lambda s: s.nq, "Nq with Nq % {m} ≠ 0"),
                            (lambda s: gcd(s.nq, s.nk), "shape with Nq or Nk not a multiple of {m}")):
        # The largest power of two that every passing length is a multiple of: the tightest region.
        m = next((m for m in _MULTIPLES if passes and all(length(s) % m == 0 for s in passes)), None)
        if m is not None:
            limits.append(Limit(lambda s, m=m, length=length: length(s) % m == 0, failing.format(m=m),
                                f"multiples of {m}", f"seq-multiple = {m}", f"--seq-multiple {m}"))
    dims = sorted({s.head_dim for s in passes})
    limits.append(Limit(lambda s: s.head_dim in dims, "D outside {" + ", ".join(map(str, dims)) + "}",
                        "D in {" + ", ".join(map(str, dims)) + "}", f"head-dims = {dims}",
                        "--head-dims " + ",".join(map(str, dims))))
    limits.append(Limit(lambda s: s.nq == s.nk, "Nq ≠ Nk", "Nq = Nk", "equal-seq = true", "--equal-seq"))
    shortest = min((min(s.nq, s.nk) for s in passes), default=1)
    if shortest > 1:
        limits.append(Limit(lambda s: min(s.nq, s.nk) >= shortest, f"N < {shortest}", f"N ≥ {shortest}",
                            f"seq-min = {shortest}", f"--seq-min {shortest}"))
    for causal, word in ((False, "no"), (True, "yes")):
        limits.append(Limit(lambda s, c=causal: s.causal == c, "causal" if not causal else "non-causal",
                            "non-causal" if not causal else "causal", f'causal = "{word}"', f"--causal {word}"))
    dtypes = sorted({s.dtype for s in passes})
    limits.append(Limit(lambda s: s.dtype in dtypes, "dtype outside " + ", ".join(dtypes), " or ".join(dtypes),
                        f"dtype = {dtypes}", "--dtype " + ",".join(dtypes)))
    limits.append(Limit(lambda s: s.mha, "GQA or MQA", "MHA", 'heads = ["mha"]', "--heads mha"))
    return limits


def explaining(seen: list[Seen]) -> tuple[Limit, int, int] | None:
    """The first candidate limit that separates `seen` exactly: (limit, failures, passes)."""
    failures = sum(s.failed for s in seen)
    if not failures:
        return None
    for limit in candidates(seen):
        inside = [s for s in seen if limit.allows(s)]
        if len(inside) >= MIN_PASSES and not any(s.failed for s in inside) and len(inside) + failures == len(seen):
            return limit, failures, len(inside)
    return None


def run_preconditions(outcomes) -> list[Precondition]:
    """The preconditions that explain failing `PropertyOutcome`s: one limit for all of them when
    their examples together separate (a search stops early after a failure, so each property alone
    may have too few passes), else one per limit over the properties it explains alone."""
    failing = [o for o in outcomes if o.status == "failed" and o.seen]
    together = explaining([s for o in failing for s in o.seen])
    if together is not None:
        limit, failed, passed = together
        return [Precondition(limit, tuple(o.property for o in failing), failed, passed)]
    found: dict[str, list] = {}
    for outcome in failing:
        explained = explaining(outcome.seen)
        if explained is not None:
            limit, failed, passed = explained
            entry = found.setdefault(limit.line, [limit, [], 0, 0])
            entry[1].append(outcome.property)
            entry[2] += failed
            entry[3] += passed
    return [Precondition(limit, tuple(names), failed, passed) for limit, names, failed, passed in found.values()]
