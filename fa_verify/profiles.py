"""Search profiles: how many examples, how large, for the property suite and `fa_verify check`.

    ci        the default: every property on every CPU backend within the CI budget; most
              examples have Nq, Nk <= 64, a quarter reach 257 (second and third tiles of 64
              and 128) within the same work bound
    thorough  many more and larger examples, for a nightly run or before a release
    gpu       for GPU backends: long sequences, where the kernels are fast and tiles many

Each is also registered as a Hypothesis settings profile named "fa_verify-<name>", so a
project's own @given tests can `settings.load_profile("fa_verify-ci")`; the pytest plugin
loads it when --fa-profile is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings

from fa_verify.errors import InvalidArgumentError


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    #: examples per property and target
    max_examples: int
    #: largest Nq or Nk drawn
    max_seq: int
    #: bound on B*H*Nq*Nk*D of a drawn problem
    max_work: int
    #: most examples keep Nq, Nk <= typical_seq; a minority (strategies' LONG_SHARE) reach
    #: max_seq. None: every example may reach max_seq.
    typical_seq: int | None = None
    #: Hypothesis seed: a fixed one makes every run draw the same examples (CI: reproducible,
    #: known deviations fail every time); None explores new ones each run
    seed: int | None = None


PROFILES = {p.name: p for p in (
    Profile("ci", "every property on every CPU backend within the CI budget", 20, 257, 200_000,
            typical_seq=64, seed=0),
    Profile("thorough", "many more and larger examples (nightly, before a release)", 200, 256, 2_000_000),
    Profile("gpu", "long sequences for GPU backends", 100, 1024, 16_000_000),
)}
DEFAULT_PROFILE = "ci"
#: Health checks that only say "this test is slow or rejects often": attention problems are
#: large by Hypothesis' standards and a backend's unsupported shapes are rejected.
RELAXED_HEALTH_CHECKS = (HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large)


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise InvalidArgumentError(f"profile={name!r} is unknown; use one of {', '.join(PROFILES)}")
    return PROFILES[name]


def hypothesis_profile_name(name: str) -> str:
    return f"fa_verify-{get_profile(name).name}"


for _profile in PROFILES.values():
    settings.register_profile(hypothesis_profile_name(_profile.name), max_examples=_profile.max_examples,
                              deadline=None, suppress_health_check=RELAXED_HEALTH_CHECKS,
                              derandomize=_profile.seed is not None)
