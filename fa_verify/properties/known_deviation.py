"""A known deviation: how a target's known failure of a property looks, so that a test expects
that failure and no other.

A deviation is declared by the verdict rules its failures fail by (`rules`: e.g. "finite"),
or by a backend's declared deviations (`fa_verify.backends.base.Deviation`) that, put back, leave
the property passing (`deviations`: the same search is run again on the target with fa_verify's
convention restored, so any other failure still shows). The pytest plugin's `fa_search` reads it
from the `fa_known_deviation` marker (properties/conftest.py sets it from KNOWN_DEVIATIONS): a
failure it explains is an expected failure, any other failure fails the test, and a deviation
declared `always` fails the test when it no longer shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa_verify.backends.base import Backend
from fa_verify.errors import InvalidArgumentError
from fa_verify.properties.search import failure_kind
from fa_verify.report.deviations import restored_lse


@dataclass(frozen=True)
class KnownDeviation:
    """What a known failure of one property on one target looks like."""

    #: why it fails, in words (the expected failure's reason)
    reason: str
    #: the verdict rules its failures fail by; a check without a verdict fails by its property's name
    rules: tuple = ()
    #: declared deviations it fails by: with fa_verify's convention put back, the property must pass
    deviations: tuple = ()
    #: every search shows it (the ci profile's edge cases draw it): a pass means it is out of date
    always: bool = False

    def __post_init__(self):
        if bool(self.rules) == bool(self.deviations):
            raise InvalidArgumentError("KnownDeviation: give rules=(verdict rules, ...) or deviations=(Deviation, "
                                       "...), one of them")

    def unexplained(self, backend, outcome, search) -> str:
        """What in the failed `outcome` of `backend` this deviation does not explain ("" when it
        explains all of it). search(target) runs the same search on another target."""
        if outcome.failure is None:  # no example failed (e.g. none was informative)
            return outcome.message()
        if self.rules:
            failures = [(outcome.problem, outcome.failure)] + [(p, r) for p, _, r in outcome.other_failures]
            others = sorted({failure_kind(p, r)[0] for p, r in failures} - set(self.rules))
            return f"it fails by {', '.join(others)}, not by {', '.join(self.rules)} only:\n{outcome.message()}" \
                if others else ""
        restored = search(DeviationsRestored(backend, self.deviations))
        # Not applicable is no pass either: the restored target lacks hooks the target has (run_padded...).
        return "" if restored.passed else (
            f"with fa_verify's convention put back where the declared ones stand, it does not pass:\n"
            f"{restored.message()}")


class DeviationsRestored(Backend):
    """`inner` with fa_verify's convention put back where a declared one stands (the LSE of
    fully masked rows): what is left failing is not the declared deviation."""

    def __init__(self, inner: Backend, conventions):
        self.inner, self.restored = inner, conventions
        # Its own name: a search's example database is keyed by it, and the target's is left as it is.
        self.name = f"{inner.name} with fa_verify's conventions put back"
        self.dtypes, self.limits, self.features = inner.dtypes, inner.limits, inner.features
        self.judged_under = inner.judged_under

    def precision(self, dtype):
        return self.inner.precision(dtype)

    def availability(self):
        return self.inner.availability()

    def supports(self, problem):
        return self.inner.supports(problem)

    def _run(self, problem):  # as returned: `run` checks it and applies the judged-under conventions once
        out, lse = self.inner._run(problem)
        return out, None if lse is None else restored_lse(problem, lse, self.restored)[0]
