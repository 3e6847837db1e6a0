"""fa_verify's pytest plugin (entry point `pytest11`): options, fixtures and hooks only.

Options:
  --fa-backend NAME   a built-in backend, or MODULE:FUNC following the callable protocol
                      (repeatable; default: every available built-in backend)
  --fa-layout bhsd|bshd|varlen|paged   the layout the MODULE:FUNC backends take, as
                      `fa_verify check --layout`: varlen and paged are flash-attn's
                      flash_attn_varlen_func and flash_attn_with_kvcache signatures
  --fa-page-sizes SIZES   the page sizes a --fa-layout paged function runs (e.g. 16,256)
  --fa-profile NAME   ci (default), thorough or gpu: examples per property, problem sizes;
                      also loads the Hypothesis profile "fa_verify-NAME" for @given tests
  --fa-results FILE   append every oracle comparison's metrics to FILE, for `fa_verify report`
  --fa-seed N|random  the Hypothesis seed of fa_search (default: the profile's); random draws
                      one per session, printed in the header and recorded with --fa-results
  --fa-shapes N       shape budget: each property draws from at most N shapes (for JIT-compiled
                      targets, which then compile about N times per property)
  --fa-repro-dir DIR  where fa_search writes a failing example's reproducer (a script and its
                      inputs; default: $FA_VERIFY_REPRO_DIR, else ROOTDIR/.fa_verify/repro)
  --fa-no-isolate     run MODULE:FUNC backends in the test process (default: in a worker
                      process, where a crash, a hang or a runaway allocation fails the example)
  --fa-timeout S, --fa-memory-limit SIZE   limits per call of an isolated MODULE:FUNC
  --fa-array, --fa-causal-alignment, --fa-precision, the declared limits (--fa-dtype,
  --fa-head-dims, ..., --fa-limits FILE) and conventions (--fa-lse-base, ...)
                      of MODULE:FUNC backends, as `fa_verify check`'s options (`fa_verify.targets`)
Fixtures:
  fa_backend   parametrises a test over the selected backends, of every kind of problem (a
               property about another kind than a backend runs is skipped, saying so)
  fa_search    fa_search(target, property) searches one property on a target (a Backend or a
               run(problem) function): a failure fails the test with the minimal counterexample
               and the command running its reproducer script, "not applicable" skips it (a
               property about another kind of problem than the target runs, too). Under the
               marker fa_known_deviation(KnownDeviation(...)) a failure that it explains is an
               expected failure (xfail), any other still fails
  fa_oracle    the certified reference: fa_oracle.reference(problem),
               fa_oracle.assert_close(out, problem, lse=..., precision=..., name=...)
  fa_profile   the `fa_verify.profiles.Profile` in effect
"""

from __future__ import annotations

import pytest

_BACKENDS = pytest.StashKey[list]()
_SEED_DRAWN = pytest.StashKey[bool]()


def pytest_addoption(parser):
    from fa_verify.targets import SEARCH_OPTIONS, SEED_HELP, add_isolation_options, callable_arguments, parse_seed

    group = parser.getgroup("fa_verify", "fa_verify: attention kernel properties")
    group.addoption("--fa-backend", action="append", default=None, metavar="NAME",
                    help="backend to check: a built-in name or MODULE:FUNC (callable protocol); "
                         "repeatable; default: every available built-in backend")
    for name, kwargs in SEARCH_OPTIONS.items():
        group.addoption(f"--fa-{name}", **kwargs)
    group.addoption("--fa-seed", type=parse_seed, default=None, metavar="N|random",
                    help=SEED_HELP.replace("--seed", "--fa-seed") + " (default: the profile's)")
    for name, kwargs in callable_arguments().items():
        group.addoption(f"--fa-{name}", **kwargs)
    add_isolation_options(group.addoption, prefix="fa-")


def pytest_configure(config):
    from fa_verify.targets import resolve_seed

    config.addinivalue_line("markers", "fa_known_deviation(deviation): fa_search expects the failure that a "
                                       "fa_verify.properties.known_deviation.KnownDeviation describes, and no other")

    # Drawn once here: pytest-xdist hands the parsed options, this seed included, to its workers.
    config.option.fa_seed, config.stash[_SEED_DRAWN] = resolve_seed(config.getoption("fa_seed"))
    if config.getoption("fa_backend") is not None:
        _backends(config)  # a bad --fa-backend is a usage error now, not a collection error later
    profile = config.getoption("fa_profile")
    if profile is not None:  # only on request: a project's own Hypothesis profile stays otherwise
        from hypothesis import settings

        from fa_verify.profiles import hypothesis_profile_name

        settings.load_profile(hypothesis_profile_name(profile))


def _seed_line(config) -> str | None:
    seed = config.getoption("fa_seed")
    if seed is None:
        return None
    how = "drawn by --fa-seed random; " if config.stash.get(_SEED_DRAWN, False) else ""
    return f"fa_verify: Hypothesis seed {seed} ({how}replay with --fa-seed {seed})"


def pytest_report_header(config):
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter, config):
    # Again at the end for a drawn seed: the header is not shown under -q.
    if config.stash.get(_SEED_DRAWN, False):
        terminalreporter.write_line(_seed_line(config))


def _backends(config) -> list:
    """The selected backends (`fa_verify.targets.build_targets`), built once per session."""
    if _BACKENDS not in config.stash:
        from fa_verify.errors import FaVerifyError
        from fa_verify.targets import build_targets

        names = config.getoption("fa_backend")
        values = {name[3:]: value for name, value in vars(config.option).items() if name.startswith("fa_")}
        try:
            config.stash[_BACKENDS] = build_targets(names or ["all"], values, prefix="--fa-")
        except FaVerifyError as exc:
            raise pytest.UsageError(f"--fa-backend: {exc}" if names else str(exc)) from None
    return config.stash[_BACKENDS]


def pytest_generate_tests(metafunc):
    if "fa_backend" in metafunc.fixturenames:
        backends = _backends(metafunc.config)
        metafunc.parametrize("fa_backend", backends or [_skipped("no backend selected (--fa-backend)")],
                             ids=[b.name for b in backends] or ["none"], scope="session")


def _skipped(reason: str):
    return pytest.param(None, marks=pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def fa_profile(pytestconfig):
    from fa_verify.profiles import DEFAULT_PROFILE, get_profile

    return get_profile(pytestconfig.getoption("fa_profile") or DEFAULT_PROFILE)


@pytest.fixture(scope="session")
def fa_oracle(pytestconfig):
    from fa_verify.check import Oracle

    return Oracle(results=pytestconfig.getoption("fa_results"))


@pytest.fixture
def fa_search(request, fa_profile):
    from dataclasses import replace

    from hypothesis import settings

    from fa_verify.check import results_recorder
    from fa_verify.properties import FAILED, NOT_APPLICABLE, Selection, as_backend, search_property
    from fa_verify.properties.precision_hint import run_precision_hint
    from fa_verify.properties.preconditions import run_preconditions
    from fa_verify.properties.reproduce import default_folder

    results = request.config.getoption("fa_results")
    verbose = request.config.option.verbose > 0  # pytest -v: every distinct failure in full
    marker = request.node.get_closest_marker("fa_known_deviation")
    known = marker.args[0] if marker else None
    # A known failure needs no reproducer nobody sees. One declared by conventions needs no minimal
    # counterexample either (searching again with them put back tells what else fails); one
    # declared by rules does: failures of other kinds are searched for only while shrinking.
    repro_dir = None if known else (request.config.getoption("fa_repro_dir")
                                    or default_folder(request.config.rootpath))
    selection = Selection.from_profile(fa_profile.name, database=settings().database,
                                       seed=request.config.getoption("fa_seed"),
                                       shapes=request.config.getoption("fa_shapes"))
    first = selection if known is None or known.rules else replace(selection, shrink=False)

    def search(target, prop):
        backend = as_backend(target)
        record = results_recorder(results, backend, "pytest", seed=selection.seed) if results else None
        outcome = search_property(backend, prop, first, on_result=record, repro_dir=repro_dir)
        if outcome.status == NOT_APPLICABLE:
            pytest.skip(outcome.message())
        if outcome.status == FAILED:
            # Only the negative hint: the other tests' failures are unknown here (fa_verify check
            # offers a preset when every failing property passes under it).
            hints = [run_precision_hint([outcome], offer=False), *(p.message() for p in run_preconditions([outcome]))]
            unexplained = outcome.message(verbose) + "".join(f"\n{h}" for h in hints if h) if known is None else known.unexplained(
                as_backend(target), outcome, lambda other: search_property(other, prop, selection))
            if unexplained:
                pytest.fail(unexplained, pytrace=False)
            pytest.xfail(f"known deviation: {known.reason}")
        if known is not None and known.always:
            pytest.fail(f"known deviation ({known.reason}) did not show: {outcome.message()}; "
                        "its declaration is out of date", pytrace=False)
        return outcome

    return search
