"""fa_verify's pytest plugin (entry point `pytest11`): options, fixtures and hooks only.

Options:
  --fa-backend NAME   a built-in backend, or MODULE:FUNC following the callable protocol
                      (repeatable; default: every available built-in backend)
  --fa-layout varlen|paged   the MODULE:FUNC backends take flash-attn's varlen
                      (flash_attn_varlen_func) or paged (flash_attn_with_kvcache) signature, as
                      `fa_verify check --layout`: fa_ragged_backend runs them, fa_backend's
                      (dense) tests are skipped
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
  --fa-dtype, --fa-head-dims, --fa-seq-multiple, --fa-seq-min, --fa-seq-max, --fa-equal-seq,
  --fa-heads, --fa-causal, --fa-lse, --fa-limits FILE
                      the declared limits of MODULE:FUNC backends, as `fa_verify check`'s options
  --fa-lse-base, --fa-lse-dtype, --fa-masked-rows, --fa-ftz, --fa-scale-precision
                      the declared conventions of MODULE:FUNC backends (`fa_verify.conventions`)
Fixtures:
  fa_backend   parametrises a test over the selected backends
  fa_ragged_backend   parametrises a test over the selected ragged backends: the --fa-layout
               MODULE:FUNC ones, else the built-in ones (skipped when --fa-backend selects dense ones)
  fa_search    fa_search(target, property) searches one property on a target (a Backend or a
               run(problem) function): a failure fails the test with the minimal counterexample
               and the command running its reproducer script, "not applicable" skips it; a
               RaggedBackend (varlen / paged) gets a ragged property (`search_ragged`). Under the
               marker fa_known_deviation(KnownDeviation(...)) a failure that it explains is an
               expected failure (xfail), any other still fails
  fa_oracle    the certified reference: fa_oracle.reference(problem),
               fa_oracle.assert_close(out, problem, lse=..., precision=..., name=...)
  fa_profile   the `fa_verify.profiles.Profile` in effect
"""

from __future__ import annotations

import pytest

_BACKENDS = pytest.StashKey[list]()
_RAGGED_LAYOUTS = ("varlen", "paged")
_SEED_DRAWN = pytest.StashKey[bool]()


def pytest_addoption(parser):
    from fa_verify.cli.check_cmd import SEED_HELP, SHARED_OPTIONS, add_isolation_options, parse_seed
    from fa_verify.conventions import convention_arguments
    from fa_verify.limits import limit_arguments

    group = parser.getgroup("fa_verify", "fa_verify: attention kernel properties")
    group.addoption("--fa-backend", action="append", default=None, metavar="NAME",
                    help="backend to check: a built-in name or MODULE:FUNC (callable protocol); "
                         "repeatable; default: every available built-in backend")
    for name, kwargs in SHARED_OPTIONS.items():
        group.addoption(f"--fa-{name}", **kwargs)
    group.addoption("--fa-seed", type=parse_seed, default=None, metavar="N|random",
                    help=SEED_HELP.replace("--seed", "--fa-seed") + " (default: the profile's)")
    group.addoption("--fa-layout", default=None, choices=_RAGGED_LAYOUTS,
                    help="the --fa-backend MODULE:FUNC functions take flash-attn's varlen or paged (kvcache) "
                         "signature: the ragged properties check them (fa_ragged_backend)")
    group.addoption("--fa-page-sizes", default=None, metavar="SIZES",
                    help="declared limit of a --fa-layout paged function: the page sizes it runs, e.g. 16,256")
    add_isolation_options(group.addoption, prefix="fa-")
    for name, kwargs in {**limit_arguments(), **convention_arguments()}.items():
        group.addoption(f"--fa-{name}", **kwargs)


def pytest_configure(config):
    from fa_verify.cli.check_cmd import resolve_seed

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
    """The selected backends, built once per session."""
    if _BACKENDS not in config.stash:
        from fa_verify.backends import CallableBackend, builtin_backends, get_backend, load_callable
        from fa_verify.errors import FaVerifyError
        from fa_verify.conventions import convention_arguments, conventions_from_options
        from fa_verify.limits import limit_arguments, limits_from_options, read_limits_file

        names = config.getoption("fa_backend")
        declared = {name: config.getoption(f"fa_{name.replace('-', '_')}")
                    for name in (*limit_arguments(), *convention_arguments())}
        try:
            limits = limits_from_options({n: declared[n] for n in limit_arguments() if n != "limits"},
                                         declared["limits"], "--fa-")
            from_file = None if declared["limits"] is None else read_limits_file(declared["limits"])
            conventions = conventions_from_options({n: declared[n] for n in convention_arguments()}, from_file,
                                                   "--fa-")
        except FaVerifyError as exc:
            raise pytest.UsageError(str(exc)) from None
        if any(v is not None for v in declared.values()) and not any(":" in n for n in names or ()):
            raise pytest.UsageError("--fa-dtype, --fa-head-dims, ... --fa-limits and --fa-lse-base, ... declare the "
                                    "limits and conventions of MODULE:FUNC backends only; name one with "
                                    "--fa-backend MODULE:FUNC")
        layout = config.getoption("fa_layout")
        if layout is not None or config.getoption("fa_page_sizes") is not None:
            _check_ragged_options(config, names, layout, conventions)
        try:
            if names is None:
                backends = [b for b in builtin_backends() if b.availability().available]
            else:
                from fa_verify.cli.check_cmd import ISOLATION_DEFAULTS

                given = {name: config.getoption(f"fa_{name}") for name in ISOLATION_DEFAULTS}
                isolation = {name: default if given[name] is None else given[name]
                             for name, default in ISOLATION_DEFAULTS.items()}
                if layout is not None:
                    backends = _ragged_backends(config, names, layout, limits, conventions, isolation)
                else:
                    backends = [CallableBackend(load_callable(n), name=n, limits=limits, conventions=conventions,
                                                **isolation) if ":" in n
                                else get_backend(n) for n in names]
        except FaVerifyError as exc:
            raise pytest.UsageError(f"--fa-backend: {exc}") from None
        for backend in backends:
            availability = backend.availability()
            if not availability.available:
                raise pytest.UsageError(f"--fa-backend {backend.name}: unavailable: {availability.reason}")
        config.stash[_BACKENDS] = backends
    return config.stash[_BACKENDS]


def _check_ragged_options(config, names, layout, conventions) -> None:
    """UsageError unless --fa-layout names MODULE:FUNC functions, and --fa-page-sizes a paged one."""
    from fa_verify.conventions import Conventions

    if config.getoption("fa_page_sizes") is not None and layout != "paged":
        raise pytest.UsageError(f"--fa-page-sizes declares the page sizes of a paged function: give "
                                f"--fa-layout paged (not {layout or 'no --fa-layout'}), or drop --fa-page-sizes")
    if not names or any(":" not in n for n in names):
        raise pytest.UsageError(f"--fa-layout {layout} checks MODULE:FUNC functions with flash-attn's {layout} "
                                f"signature; name them with --fa-backend MODULE:FUNC (got {names or 'none'})")
    if conventions.scale_precision != Conventions().scale_precision:
        raise pytest.UsageError(f"--fa-scale-precision cannot be used with --fa-layout {layout}: varlen and paged "
                                "functions are judged with the exact scale (not yet); drop it")


def _ragged_backends(config, names, layout, limits, conventions, isolation) -> list:
    from fa_verify.backends import load_callable
    from fa_verify.backends.ragged_callable import RaggedCallableBackend
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.limits import _positive_set

    given = config.getoption("fa_page_sizes")
    try:
        page_sizes = None if given is None else _positive_set(given)
    except (ValueError, InvalidArgumentError):
        raise pytest.UsageError(f"--fa-page-sizes={given!r} is not valid: page sizes >= 1, e.g. 16,256") from None
    return [RaggedCallableBackend(load_callable(n), layout, name=n, limits=limits, page_sizes=page_sizes,
                                  conventions=conventions, **isolation) for n in names]


def pytest_generate_tests(metafunc):
    config = metafunc.config
    ragged = config.getoption("fa_layout") is not None
    if "fa_backend" in metafunc.fixturenames:
        backends = [] if ragged else _backends(config)
        metafunc.parametrize("fa_backend", backends or [_skipped("--fa-layout selects varlen/paged functions; "
                                                                 "the dense properties do not apply")],
                             ids=[b.name for b in backends] or ["ragged-layout"], scope="session")
    if "fa_ragged_backend" in metafunc.fixturenames:
        from fa_verify.backends.ragged_base import builtin_ragged_backends

        dense = config.getoption("fa_backend") is not None and not ragged
        backends = _backends(config) if ragged else [] if dense else builtin_ragged_backends()
        metafunc.parametrize("fa_ragged_backend", backends or [_skipped(
            "--fa-backend selects dense targets; give --fa-layout varlen|paged to check varlen/paged functions")],
                             ids=[b.name for b in backends] or ["dense-targets"], scope="session")


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

    from fa_verify.backends.ragged_base import RaggedBackend
    from fa_verify.check import results_recorder
    from fa_verify.properties import FAILED, NOT_APPLICABLE, Selection, as_backend, search_property, search_ragged
    from fa_verify.properties.reproduce import default_folder

    results = request.config.getoption("fa_results")
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
        if isinstance(target, RaggedBackend):  # a varlen or paged target: the ragged properties
            outcome = search_ragged(target, prop, selection, repro_dir=repro_dir)
        else:
            backend = as_backend(target)
            record = results_recorder(results, backend, "pytest", seed=selection.seed) if results else None
            outcome = search_property(backend, prop, first, on_result=record, repro_dir=repro_dir)
        if outcome.status == NOT_APPLICABLE:
            pytest.skip(outcome.message())
        if outcome.status == FAILED:
            unexplained = outcome.message() if known is None else known.unexplained(
                as_backend(target), outcome, lambda other: search_property(other, prop, selection))
            if unexplained:
                pytest.fail(unexplained, pytrace=False)
            pytest.xfail(f"known deviation: {known.reason}")
        if known is not None and known.always:
            pytest.fail(f"known deviation ({known.reason}) did not show: {outcome.message()}; "
                        "its declaration is out of date", pytrace=False)
        return outcome

    return search
