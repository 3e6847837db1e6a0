"""MODULE:FUNC targets run in a worker process: a crash, a hang or a runaway allocation is a
failing example that says what happened, the worker restarts and the run goes on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fa_verify.backends import CallableBackend, load_callable
from fa_verify.cli.main import main
from fa_verify.errors import BackendOutputError, InvalidArgumentError, KernelCrashError
from fa_verify.isolation import parse_size
from fa_verify.strategies import make_problem

FIXTURES = Path(__file__).parent / "fixtures"
#: Two cheap properties: enough to see that the run goes on after the first one's failure.
PROPERTIES = ("--property", "constant_v", "--property", "convex_hull", "--dtype", "fp32")
#: One, where the run going on is not the point.
ONE = ("--property", "constant_v", "--dtype", "fp32")


@pytest.fixture
def fixtures_dir(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    monkeypatch.syspath_prepend(str(FIXTURES))


def check(capsys, target, *options, properties=PROPERTIES):
    code = main(["check", f"misbehaving_kernels:{target}", *properties, *options])
    out = capsys.readouterr().out
    return code, [line for line in out.splitlines() if "the target raised" in line], out


def test_a_segfault_fails_each_property_with_the_signal(fixtures_dir, capsys):
    code, failures, out = check(capsys, "segfaults")
    assert code == 1 and "0 passed, 2 failed" in out
    assert len(failures) == 2
    assert all("KernelCrashError: misbehaving_kernels:segfaults crashed the worker process: SIGSEGV" in line
               for line in failures)


def test_a_hang_fails_each_property_with_the_seconds_and_where_it_hung(fixtures_dir, capsys):
    code, failures, out = check(capsys, "hangs", "--timeout", "0.5")
    assert code == 1 and "0 passed, 2 failed" in out
    assert len(failures) == 2
    assert all("did not return within 0.5 s" in line and "misbehaving_kernels.py:" in line for line in failures)
    # One example each: a hang is not shrunk (every smaller try would wait the whole limit again).
    assert out.count("not shrunk: each smaller try would wait the whole time limit again") == 2
    assert out.count("FAILED after 1 examples") == 2


def test_40_gb_fails_with_the_bytes_and_the_limit(fixtures_dir, capsys):
    # One property: that the run goes on after a worker dies is the segfault test's.
    code, failures, out = check(capsys, "allocates_40_gb", "--memory-limit", "4GiB", properties=ONE)
    assert code == 1 and "0 passed, 1 failed" in out
    assert len(failures) == 1
    assert all("MemoryError: Unable to allocate 37.3 GiB" in line and "memory limit: 4 GiB" in line
               for line in failures)


def test_the_limit_refuses_what_the_machine_would_grant(fixtures_dir, capsys):
    # 3 GB untouched is granted by any machine that overcommits; only the 2 GiB limit refuses it.
    code, failures, _ = check(capsys, "allocates_3_gb", "--memory-limit", "2GiB", properties=ONE)
    assert code == 1 and failures and all("memory limit: 2 GiB" in line for line in failures)


def test_system_exit_in_the_target_is_a_failing_example(fixtures_dir, capsys):
    code, failures, _ = check(capsys, "exits")
    assert code == 1 and len(failures) == 2 and all("SystemExit(3): it called sys.exit(3)" in line for line in failures)


def test_one_worker_serves_every_example_and_no_isolate_runs_in_process(fixtures_dir, capsys, tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    monkeypatch.setenv("FA_VERIFY_TEST_PID_FILE", str(pids))
    assert main(["check", "misbehaving_kernels:worker_pid", *PROPERTIES]) == 0
    isolated = set(pids.read_text().split())
    assert len(isolated) == 1 and str(os.getpid()) not in isolated
    pids.unlink()
    assert main(["check", "misbehaving_kernels:worker_pid", *PROPERTIES, "--no-isolate"]) == 0
    assert set(pids.read_text().split()) == {str(os.getpid())}


def _backend(target, **kwargs):
    name = f"misbehaving_kernels:{target}"
    return CallableBackend(load_callable(name), name=name, isolate=True, **kwargs)


def test_the_worker_restarts_after_a_crash(fixtures_dir):
    backend = _backend("segfaults_when_nq_is_3")
    fine, crash = (make_problem("normal", (1, 1, 1, nq, 4, 8), "fp32", 0) for nq in (2, 3))
    backend.run(fine)
    with pytest.raises(KernelCrashError, match="SIGSEGV"):
        backend.run(crash)
    backend.run(fine)
    assert backend._worker.process.starts == 2


def test_input_and_output_buffer_checks_run_in_the_worker(fixtures_dir):
    p = make_problem("normal", (1, 2, 1, 5, 7, 8), "fp16", 1)
    with pytest.raises(BackendOutputError, match=r"wrote into its input v"):
        _backend("writes_into_v").run(p)
    with pytest.raises(BackendOutputError, match=r"out: 16 / 80 elements never written \(first at \[0, 0, 1, 0\]"):
        _backend("skips_row_1").run(p)


def test_isolation_needs_an_importable_function_and_sane_limits(fixtures_dir):
    with pytest.raises(InvalidArgumentError, match="cannot be isolated.*isolate=False"):
        CallableBackend(lambda q, k, v, *, causal, scale: q, isolate=True)
    for bad in (dict(timeout=0), dict(timeout=float("inf")), dict(memory_limit="lots"), dict(memory_limit=-1)):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            CallableBackend(load_callable("misbehaving_kernels:exits"), isolate=True, **bad)
    assert parse_size("4GiB") == parse_size("4g") == 4 * 2**30 and parse_size("none") is None
    assert 0 < parse_size("50%") <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_bad_limit_on_the_command_line_exits_2(fixtures_dir, capsys):
    for option in (["--memory-limit", "lots"], ["--timeout", "0"], ["--memory-limit", "lots", "--no-isolate"]):
        assert main(["check", "misbehaving_kernels:exits", *option]) == 2
        assert option[1] in capsys.readouterr().err
    # A limit no worker starts under is a usage error, not a crash of the target in every example
    # (it said "the worker's memory limit: no limit" before).
    assert main(["check", "misbehaving_kernels:exits", "--memory-limit", "1B"]) == 2
    assert "memory_limit=1 bytes is below the 256 MiB a worker process needs to start" in capsys.readouterr().err
    assert main(["check", "naive", "--no-isolate"]) == 2  # a built-in backend: the option is for MODULE:FUNC
    assert "--no-isolate applies to MODULE:FUNC targets only" in capsys.readouterr().err


pytest_plugins = ["pytester"]


def test_the_plugin_isolates_and_fa_no_isolate_does_not(pytester, monkeypatch):
    import shutil

    for name in ("misbehaving_kernels.py", "user_kernels.py"):
        shutil.copy(FIXTURES / name, pytester.path)
    monkeypatch.setenv("FA_VERIFY_TEST_PID_FILE", str(pytester.path / "pids"))
    monkeypatch.syspath_prepend(str(pytester.path))  # for the run in this process
    pytester.makepyfile(test_kernel="""
        import os

        def test_constant_v(fa_backend, fa_search):
            fa_search(fa_backend, "constant_v")
            pids = set(open(os.environ["FA_VERIFY_TEST_PID_FILE"]).read().split())
            print("ran in this process:", pids == {str(os.getpid())})
    """)
    result = pytester.runpytest_subprocess("--fa-backend", "misbehaving_kernels:hangs", "--fa-timeout", "0.5",
                                           "--fa-backend", "misbehaving_kernels:allocates_3_gb",
                                           "--fa-memory-limit", "2GiB", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*did not return within 0.5 s*"])
    result.stdout.fnmatch_lines(["*memory limit: 2 GiB*"])
    result = pytester.runpytest_inprocess("--fa-backend", "misbehaving_kernels:worker_pid", "--fa-no-isolate",
                                          "-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*ran in this process: True*"])
