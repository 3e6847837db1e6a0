"""`fa_verify report`: run a sweep into OUT/results.jsonl and render OUT/index.html and summaries."""

from __future__ import annotations

import sys
from pathlib import Path

from fa_verify.arguments import not_a_folder, writable_folder

RESULTS = "results.jsonl"


def add_parser(sub) -> None:
    from fa_verify.sweeps import SWEEPS

    cmd = sub.add_parser(
        "report", help="run a sweep of every backend and write an HTML error report",
        description="Runs every selected backend over a sweep of shapes x dtype x causal, judges "
                    "each output against the certified reference (the backward sweep: each "
                    "gradient, on the backward backends; the fp8 sweep: FP8 inputs with descales, on "
                    "the FP8 backends), appends one record per run (per "
                    "gradient) to "
                    "OUT/results.jsonl as it goes, and renders OUT/index.html (self-contained), "
                    "OUT/summary.json and OUT/summary.md. The quick, default and thorough "
                    "sweeps then reproduce two published results on our own kernels "
                    "(FlashAttention-3's Table 3, Golden et al. 2024), each problem cached by its "
                    "inputs under ~/.cache/fa_verify/measurements, into OUT/published.json. "
                    "An interrupted run keeps its records "
                    "(--resume continues it; --from renders them). "
                    "Exit 0: every run passed or deviated only by a convention its backend "
                    "declares (shown as a declared deviation); 1: a run failed (or, with "
                    "--fail-on deviation, deviated); 2: usage or setup error.",
        epilog="Sweeps: " + "; ".join(f"{s.name}: {s.description} (budget {s.budget_s:g} s "
                                       "per backend)" for s in SWEEPS.values()))
    cmd.add_argument("--backend", action="append", metavar="NAME",
                     help="backend to run (repeatable; default: every available backend)")
    cmd.add_argument("--sweep", choices=tuple(SWEEPS), default="quick",
                     help="which problems to run (default quick: a few minutes on 2 CPU cores; "
                          "variants: each of window, softcap, ALiBi, sinks and all four together, "
                          "on the backends that implement them, the others listed as not "
                          "applicable, with tables and figures per feature; decode: one query "
                          "against the quick lengths of keys, error against Nk; backward: the "
                          "gradients dq, dk, dv of the backward backends, each judged by fa_verify "
                          "and by the rules others use, side by side; fp8: the FP8 backends' error per "
                          "shape and descale range, the exact output rounded to bf16 as the floor)")
    cmd.add_argument("--out", default="reports", metavar="DIR", type=writable_folder,
                     help="output directory (default reports/)")
    cmd.add_argument("--from", dest="source", metavar="RESULTS", type=not_a_folder,
                     help="render this results file (JSON lines) without running anything")
    cmd.add_argument("--resume", action="store_true",
                     help=f"keep OUT/{RESULTS} and skip the runs it already holds "
                          "(default: start it afresh, the old one renamed results.prev.jsonl)")
    cmd.add_argument("--fail-on", choices=("failure", "deviation"), default="failure",
                     help="what makes the exit code 1 (default failure; deviation: also runs "
                          "that differ only by a backend's declared conventions)")
    cmd.set_defaults(handler=_run)


def _backends(names, kind: str):
    from fa_verify.backends import builtin_backends, get_backend
    from fa_verify.errors import BackendUnavailableError

    if not names:  # the backends that run the sweep's kind of problem
        return [b for b in builtin_backends() if b.availability().available and kind in b.kinds]
    # a repeated --backend runs once (by the name it resolves to)
    backends = list({b.name: b for b in (get_backend(name) for name in names)}.values())
    for backend in backends:
        availability = backend.availability()
        if not availability.available:
            raise BackendUnavailableError(
                f"backend {backend.name!r} is unavailable: {availability.reason}")
    return backends


def _run(args) -> int:
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.report import published
    from fa_verify.report.run_info import RunInfo
    from fa_verify.report.runner import plan_sweep, run_sweep, unsupported_everywhere
    from fa_verify.results import ResultsStore
    from fa_verify.sweeps import get_sweep

    out = Path(args.out)
    if args.source:
        if args.resume or args.backend:
            raise InvalidArgumentError("--from renders a results file; it takes no --resume or --backend")
        source = Path(args.source)
        if not source.exists():
            raise InvalidArgumentError(f"--from {str(source)!r}: no such file")
        records = ResultsStore(source).read()
        if not records:  # rendering nothing would read as "all pass"
            raise InvalidArgumentError(
                f"--from {str(source)!r}: no valid record found (the file is empty, or each line "
                f"was skipped with a warning); give a results file written by 'fa_verify report', "
                f"'fa_verify check --results' or pytest --fa-results")
        return _render(records, out, RunInfo.load(source.parent), args.fail_on,
                       published.load(source.parent))

    sweep = get_sweep(args.sweep)
    backends = _backends(args.backend, sweep.kind)
    store = ResultsStore(out / RESULTS)
    previous = store.read() if args.resume else []
    done = frozenset(r.key() for r in previous)
    plan = plan_sweep(sweep, backends, done)  # a usage error here leaves the old results alone
    if not args.resume and store.path.exists():
        store.path.replace(out / "results.prev.jsonl")
    print(f"fa_verify report: sweep {sweep.name} on {', '.join(b.name for b in backends)} "
          f"-> {out}/", file=sys.stderr, flush=True)
    for name, reason in unsupported_everywhere(plan).items():  # the others run: a skip, said once
        print(f"fa_verify report: {name} runs no point of the {sweep.name} sweep ({reason}): "
              f"listed as not applicable", file=sys.stderr, flush=True)
    try:
        info = run_sweep(sweep, backends, store, out_dir=out, plan=plan,
                         history=[r for r in previous if r.source == "report"])
        # Problems measured before an interrupt stay in the measurement cache.
        reproduced = published.measure(sweep.published) if sweep.published else None
    except KeyboardInterrupt:
        # Everything recorded so far is in the store: render it, then stop as interrupted.
        _render(store.read(), out, RunInfo.load(out), args.fail_on, None)
        raise
    return _render(store.read(), out, info, args.fail_on, reproduced)


def _render(records, out: Path, run, fail_on: str, reproduced) -> int:
    from fa_verify.report import write_report

    data = write_report(records, out, run=run, published=reproduced)
    print((out / "summary.md").read_text(encoding="utf-8"))  # the CI log's summary
    totals = data.totals
    records = "" if totals.records == totals.runs else f" ({totals.records} records, one per gradient)"
    print(f"wrote {out / 'index.html'}, summary.json, summary.md: {totals.runs} runs{records}, "
          f"{totals.failed} failing, {totals.deviations} by declared conventions only",
          file=sys.stderr)
    return 1 if totals.failed or (fail_on == "deviation" and totals.deviations) else 0
