"""Mutation testing of fa_verify's numerics core with mutmut. Not part of the test suite:

    pip install mutmut                        # 3.8.1 when this was written
    python3 tests/mutation/run_mutation.py    # the whole core; --module PATH for one file

Mutated: the certified oracle (fa_verify/oracle/), the error model (error_model.py), the
honest-ensemble rule (honest_ensemble.py), the verdict (verdict.py) and the null-model guard
(null_model.py); the FP8 oracle (oracle/fp8.py) in a second session against its own test file
(SESSIONS). Each mutant (an operator, a constant, a comparison changed in one place) is
run against the fast tests that cover those modules (TESTS below); a mutant that no test fails
"survived". The work happens in a copy (.mutation/ in the repository, git-ignored, kept between
runs so that a rerun only redoes what changed; --fresh starts over), so the working tree and
its editable install are never touched. mutmut keeps a survivor's verdict when only the tests
change: --recheck survived reruns the survivors against the tests as they are now.

Timeouts: mutmut stops a mutant after a CPU-time limit and calls that a kill, but a busy
machine can push an honest mutant over it. Every timeout is therefore run again by name
(--recheck timeout, on by default); only a mutant that times out again counts as killed, and
those are listed apart (timeouts_confirmed) to be looked at: where every test reaches the
mutated function, mutmut's CPU limit (from the traced test times) can be too short even for a
mutant that cannot loop.

Equivalent mutants (tests/mutation/equivalent.toml: the mutant, the line it writes and why no
test can tell it from the original) are taken out of the score; an entry whose mutant no longer
writes that line (the source moved) is reported as stale and not taken out.

Writes OUT (default .mutation/mutation-results.json): the score per module and overall
(killed / (checked - equivalent); "no tests" counts as survived), every survivor's name and
diff, the equivalents, the timeouts, the mutants not yet run, and the run's wall time; prints a
summary.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ["fa_verify/oracle/*", "fa_verify/error_model.py", "fa_verify/honest_ensemble.py", "fa_verify/verdict.py",
        "fa_verify/null_model.py"]
#: The fast tests that cover the core: 203 tests, 16 s in all (measured, one process), so that a
#: mutant of a function every test calls (check_attention, error_bound) costs seconds, not
#: minutes. Left out: the tests that start subprocesses (they would import the unmutated
#: package), the property searches, and the long parametrised runs of correct kernels and of
#: seeded bugs through whole kernels (minutes; they judge kernels, the tests here judge the
#: numbers).
TESTS = ["tests/test_tightness.py", "tests/test_oracle.py", "tests/test_oracle_variants.py", "tests/test_oracle_ragged.py",
         "tests/test_backward_oracle.py",
         "tests/test_verdict.py", "tests/test_null_model.py", "tests/test_honest_ensemble.py",
         "tests/test_error_model.py"]
DESELECT = ["tests/test_honest_ensemble.py::test_members_give_the_same_bits_under_every_blas_configuration",
            "tests/test_honest_ensemble.py::test_honest_variants_pass_the_verdict",
            "tests/test_error_model.py::test_correct_implementations_stay_inside_the_bound",
            "tests/test_error_model.py::test_every_strategy_distribution_stays_inside_the_bound",
            "tests/test_error_model.py::test_cost_stays_reasonable_at_4096",
            "tests/test_error_model.py::test_probabilistic_mode_is_tighter_only_for_long_accumulations_and_still_holds",
            "tests/test_verdict.py::test_correct_kernels_pass_with_margin",
            "tests/test_verdict.py::test_seeded_bugs_fail",
            "tests/test_verdict.py::test_causal_mask_off_by_one_fails",
            "tests/test_verdict.py::test_16bit_accumulation_of_16bit_inputs_fails_on_long_outlier_rows",
            "tests/test_null_model.py::test_check_json_carries_the_counts",
            "tests/test_null_model.py::test_search_counts_informative_examples_and_fails_a_property_with_none",
            "tests/test_null_model.py::test_a_trivial_target_never_passes_unless_it_is_the_right_answer"]
#: The FP8 oracle has its own fast test file; its mutants run in a second mutmut session (a
#: session has one test selection, and adding a file to TESTS would make mutmut redo every mutant).
FP8 = ["fa_verify/oracle/fp8.py"]
FP8_TESTS = ["tests/test_fp8_oracle.py"]
#: (name, modules, tests, modules left out, work folder under the main one or "" for itself)
SESSIONS = [("core", CORE, TESTS, FP8, ""), ("fp8", FP8, FP8_TESTS, [], "fp8")]
KILLED = {"killed", "caught by type check", "segfault"}
EQUIVALENTS = Path(__file__).with_name("equivalent.toml")
NOT_CHECKED = {"skipped", "not checked", "check was interrupted by user"}


def _quoted(items) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _config(modules, tests, skip=()) -> str:
    quoted = _quoted
    deselect = [arg for test in DESELECT for arg in ("--deselect", test)]
    return "\n".join([
        "[tool.pytest.ini_options]",
        'markers = ["slow: minutes each"]',
        "",
        "[tool.mutmut]",
        'source_paths = ["fa_verify"]',
        f"only_mutate = {quoted(modules)}",
        f"do_not_mutate = {quoted(skip)}",
        f"pytest_add_cli_args_test_selection = {quoted(tests)}",
        f"pytest_add_cli_args = {quoted(['-p', 'no:cacheprovider', '-m', 'not slow', *deselect])}",
        "",
    ])


def _prepare(work: Path, modules, tests, skip, fresh: bool) -> None:
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for folder in ("fa_verify", "tests"):  # a changed source is copied again; mutmut redoes its mutants
        shutil.copytree(ROOT / folder, work / folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "mutation"))
    (work / "pyproject.toml").write_text(_config(modules, tests, skip))
    # mutmut puts mutants/ first on sys.path; it must exist before Python starts, or the import
    # system caches it as missing and the editable install's fa_verify is imported instead.
    (work / "mutants").mkdir(exist_ok=True)


def _mutmut(work: Path, *args, capture=False):
    # the mutated copy, never the editable install; one thread per worker: mutmut forks each
    # mutant's run from a process that has run the tests, and torch's OpenMP pool, started there,
    # deadlocks in the forked child (the worker then idles until mutmut's wall timeout)
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env = {**os.environ, **threads, "PYTHONPATH": str(work / "mutants")}
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=work, env=env, text=True,
                          capture_output=capture, check=not capture)


#: Run in the work folder: every mutant's name, status and (survivors) diff, through mutmut's own
#: functions in one process (`mutmut show` per survivor starts one process each).
_LISTING = """
import json, sys
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files
found = []
for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    for name, code in data.exit_code_by_key.items():
        status = status_by_exit_code[code]
        diff = get_diff_for_mutant(name, path=path) if status in ("survived", "no tests") else ""
        found.append([name, status, diff])
json.dump(found, sys.stdout)
"""


def _listing(work: Path) -> list:
    env = {**os.environ, "PYTHONPATH": str(work / "mutants")}
    done = subprocess.run([sys.executable, "-c", _LISTING], cwd=work, env=env, text=True, capture_output=True,
                          check=False)
    if done.returncode == 0:
        return json.loads(done.stdout)
    # another mutmut version: its command line, one `mutmut show` per survivor
    listing = _mutmut(work, "results", "--all", "true", capture=True).stdout
    found = []
    for name, status in re.findall(r"^\s+(\S+__mutmut_\d+): (.+)$", listing, flags=re.MULTILINE):
        diff = _mutmut(work, "show", name, capture=True).stdout if status in ("survived", "no tests") else ""
        found.append([name, status, diff])
    return found


def _equivalents(path: Path) -> dict:
    """{mutant name: (the line it writes, why it is equivalent)} from the maintained list."""
    if not path.exists():
        return {}
    return {e["mutant"]: (e["line"], e["reason"]) for e in tomllib.loads(path.read_text()).get("equivalent", [])}


def _written_line(diff: str) -> str:
    return "\n".join(line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++"))


def _results(works, equivalents: dict) -> dict:
    """Scores over the mutants of every work folder in `works` (each module is in one)."""
    per_module: dict = defaultdict(Counter)
    survivors, equivalent, stale, timeouts, not_run = [], [], [], [], []
    listed = sorted(m for work in works for m in _listing(work))
    names = {name for name, _, _ in listed}
    for name, status, diff in listed:
        module = re.split(r"\.x(?:_|ǁ)", name)[0]
        if status in ("survived", "no tests") and name in equivalents:
            line, reason = equivalents[name]
            if line.strip() in _written_line(diff).splitlines():
                per_module[module]["equivalent"] += 1
                equivalent.append({"name": name, "line": line, "reason": reason})
                continue
            stale.append({"name": name, "listed_line": line, "diff": diff})
        per_module[module][status] += 1
        if status in ("survived", "no tests"):
            survivors.append({"name": name, "status": status, "diff": diff})
        elif status == "timeout":
            timeouts.append(name)
        elif status in NOT_CHECKED:
            not_run.append(name)
    modules = {re.split(r"\.x(?:_|ǁ)", name)[0] for name in names}  # entries of other sessions' modules: not here
    stale += [{"name": name, "listed_line": line, "diff": "(no such mutant, or killed)"}
              for name, (line, _) in equivalents.items()
              if name not in names and re.split(r"\.x(?:_|ǁ)", name)[0] in modules]

    def score(counts):
        checked = sum(n for s, n in counts.items() if s not in NOT_CHECKED and s != "equivalent")
        killed = sum(n for s, n in counts.items() if s in KILLED or s == "timeout")
        return {"killed": killed, "checked": checked, "score": round(100 * killed / checked, 1) if checked else None,
                "equivalent": counts["equivalent"], "timeouts": counts["timeout"],
                "not_run": sum(n for s, n in counts.items() if s in NOT_CHECKED), "by_status": dict(counts)}

    total = sum(per_module.values(), Counter())
    return {"overall": score(total), "modules": {m: score(c) for m, c in sorted(per_module.items())},
            "survivors": survivors, "equivalent": equivalent, "stale_equivalents": stale,
            "timeouts_confirmed": timeouts, "not_run": not_run}


def _statuses(work: Path, wanted) -> list:
    return [name for name, status, _ in _listing(work) if status in wanted]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", help="a file or glob under fa_verify/ to mutate "
                        "(repeatable; default: the numerics core)")
    parser.add_argument("--test", action="append", help="a test file or node id to run (repeatable; default: TESTS)")
    parser.add_argument("--work", type=Path, default=ROOT / ".mutation", help="work folder (default .mutation/)")
    parser.add_argument("--out", type=Path, help="results file (default WORK/mutation-results.json)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--fresh", action="store_true", help="forget earlier results")
    parser.add_argument("--recheck", action="append", choices=["timeout", "survived", "no tests"],
                        help="run the mutants of this status again, by name, after the run (repeatable; "
                        "default: timeout; 'survived' after the tests changed, since mutmut keeps old verdicts)")
    parser.add_argument("--recheck-in", action="append", metavar="PATTERN",
                        help="recheck only the mutants of this module (fa_verify.null_model) or whose name "
                        "matches this glob (fa_verify.verdict.x__pct*); repeatable")
    parser.add_argument("--no-run", action="store_true", help="only the rechecks and the results file")
    parser.add_argument("--equivalents", type=Path, default=EQUIVALENTS, help="the list of equivalent mutants")
    args = parser.parse_args(argv)
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print("mutmut is not installed: pip install mutmut", file=sys.stderr)
        return 2
    main_work = args.work.resolve()
    sessions = ([("custom", args.module or CORE, args.test or TESTS, [], "")] if args.module or args.test
                else SESSIONS)
    equivalents = _equivalents(args.equivalents)  # no recheck: no test can kill them
    start = time.perf_counter()
    works, rechecked, run_seconds = [], 0, 0.0
    for name, modules, tests, skip, folder in sessions:
        work = main_work / folder if folder else main_work
        works.append(work)
        _prepare(work, modules, tests, skip, args.fresh and not folder)
        begun = time.perf_counter()
        if not args.no_run:
            print(f"session {name}: {', '.join(modules)} against {len(tests)} test files")
            _mutmut(work, "run", "--max-children", str(args.max_children))
        run_seconds += time.perf_counter() - begun
        recheck = set(args.recheck or ["timeout"])
        again = [m for m in _statuses(work, recheck) if m not in equivalents and (
            not args.recheck_in or any(m.startswith(p + ".x") or fnmatch.fnmatch(m, p) for p in args.recheck_in))]
        if again:  # by name: mutmut reruns a named mutant whatever its old verdict
            print(f"rechecking {len(again)} mutants ({', '.join(sorted(recheck))})")
            _mutmut(work, "run", "--max-children", str(args.max_children), *again)
            rechecked += len(again)
    seconds = time.perf_counter() - start
    results = {"seconds": round(seconds, 1), "run_seconds": round(run_seconds, 1), "rechecked": rechecked,
               "max_children": args.max_children, **_results(works, equivalents)}
    work = main_work
    out = args.out or work / "mutation-results.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    overall = results["overall"]
    print(f"mutation score {overall['score']}% ({overall['killed']} of {overall['checked']} mutants killed, "
          f"{overall['equivalent']} equivalent left out, {overall['timeouts']} confirmed timeouts among the killed, "
          f"{overall['not_run']} not run) in {seconds / 60:.1f} min with {args.max_children} workers")
    for module, s in results["modules"].items():
        print(f"  {module}: {s['score']}% ({s['killed']} / {s['checked']}; {s['equivalent']} equivalent, "
              f"{s['timeouts']} timeouts, {s['not_run']} not run)")
    print(f"{len(results['survivors'])} survivors with their diffs in {out}")
    if results["stale_equivalents"]:
        print(f"{len(results['stale_equivalents'])} entries of {args.equivalents.name} no longer match their "
              f"mutant: update them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
