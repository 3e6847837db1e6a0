"""`fa_verify check TARGET`: the property suite against a backend or a user callable."""

from __future__ import annotations

import functools
import json
import sys
import time

from fa_verify.arguments import positive_float, positive_int
from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES
from fa_verify.errors import InvalidArgumentError
from fa_verify.guards import DEFAULT as DEFAULT_FORBID
from fa_verify.limits import CAUSAL_CHOICES
from fa_verify.profiles import DEFAULT_PROFILE
from fa_verify.targets import (
    RANDOM_SEED,
    SEARCH_OPTIONS,
    SEED_HELP,
    SELECTION_LIMITS,
    add_isolation_options,
    build_targets,
    callable_arguments,
    parse_seed,
    resolve_seed,
)


def add_parser(sub) -> None:
    cmd = sub.add_parser(
        "check", help="run the property suite against a backend or MODULE:FUNC",
        description="Runs fa_verify's property suite against TARGET: agreement of O and LSE with "
                    "the certified oracle under the error model (fixed edge cases first), the "
                    "online-softmax merge law, convex hull, constant V, V-affinity, permutations, "
                    "score shift, batch/head and masked-key independence, fully masked rows, "
                    "NaN-padded inputs, determinism, unbiased rounding and data races (CUDA kernels on "
                    "the CPU runner's race detector, at most 5 examples), each over Hypothesis "
                    "problems. Prints per property: passed (and how many examples were informative: "
                    "a trivial output such as zeros fails their tolerance), failed (examples to "
                    "failure, the minimal counterexample, a reproducer script; or no informative example) "
                    "or not applicable. Exit 0: no property "
                    "failed; 1: one failed; 2: usage or setup error.")
    cmd.add_argument("target", metavar="TARGET",
                     help="a backend name (see 'fa_verify backends'), 'all' for every available "
                          "backend, MODULE:FUNC (or path/to/file.py:FUNC) with fn(q, k, v, *, causal, scale) -> "
                          "out | (out, lse) "
                          "(--layout varlen / paged: flash-attn's varlen and kvcache signatures), "
                          "a CUDA file (kernel.cu) with --spec, or a KernelBench-format file (problem.py with "
                          "Model, ModelNew, get_inputs: ModelNew checked under what probing Model infers)")
    cmd.add_argument("--dtype", action="append", choices=DTYPE_NAMES + FP8_DTYPES,
                     help="dtype to check (repeatable; default: every dtype the target runs; e4m3 and e5m2: FP8 "
                          "problems, for targets that take q_descale, k_descale, v_descale)")
    cmd.add_argument("--causal", choices=tuple(CAUSAL_CHOICES), default=None,
                     help="causal problems, non-causal ones, or both (default)")
    cmd.add_argument("--property", action="append", dest="properties", metavar="NAME",
                     help="run only this property (repeatable; default: all)")
    cmd.add_argument("--max-examples", type=positive_int, default=None, metavar="N",
                     help="examples Hypothesis draws per property (default: the profile's; ci: 20); the agreement "
                          "properties first run fixed edge cases besides them (tens: each edge shape in every dtype "
                          "and causal mode), at most N of them when --max-examples is given; the summary line "
                          "counts both")
    cmd.add_argument("--max-seq", type=positive_int, default=None, metavar="N",
                     help="largest Nq or Nk drawn (default: the profile's; ci: 257, most examples <= 64; the "
                          "agreement properties' share of long keys, a few rows over thousands of keys: up to "
                          "4096 unless N is given)")
    cmd.add_argument("--seed", type=parse_seed, default=None, metavar="N|random",
                     help=SEED_HELP + " (default 0; with --grading: random, printed after the verdict)")
    for name, kwargs in SEARCH_OPTIONS.items():
        cmd.add_argument(f"--{name}", **kwargs)
    cmd.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout (progress goes to stderr)")
    cmd.add_argument("--grading", action="store_true",
                     help="grading mode for kernel-generation pipelines (docs/grading.md): a seed drawn at run time "
                          "and printed after the verdict, the frameworks' attention, softmax and matmul entry points "
                          "forbidden (--forbid default, for MODULE:FUNC), and a versioned JSON verdict on stdout "
                          "(format fa_verify-grading/1) that fails closed: a property the --budget cut short "
                          "before it judged enough examples is not passed")
    cmd.add_argument("--budget", type=positive_float, default=None, metavar="SECONDS",
                     help="time budget per target: once spent, searches stop drawing (and say so; the properties "
                          "not yet started are not run); default: none")
    cmd.add_argument("-v", "--verbose", action="store_true",
                     help="print every distinct failure of a property in full (default: the first in full, the "
                          "others one line each; --json always has them in full)")
    cuda_opts = cmd.add_argument_group(
        "CUDA files (kernel.cu --spec kernel.toml)",
        "A published .cu file, host code and all, run on the CUDA-on-CPU runner as its kernel spec "
        "says (the README's 'Check your CUDA kernel without a GPU' gives the format).")
    cuda_opts.add_argument("--spec", default=None, metavar="FILE",
                           help="the kernel spec (TOML): parameters, entry, launch, limits")
    cuda_opts.add_argument("--runner", choices=("auto", "cpu", "pycuda"), default="auto",
                           help="where the spec's launches run: 'pycuda' on a GPU, 'cpu' on the CUDA-on-CPU "
                                "runner (default auto: PyCUDA where it finds a driver and a device, else the CPU)")
    cuda_opts.add_argument("--arch", default=None, metavar="sm_XY",
                           help="GPU architecture whose shared-memory limits launches are held to and "
                                "__CUDA_ARCH__ (default: the spec's, else sm_80)")
    callable_opts = cmd.add_argument_group(
        "MODULE:FUNC targets (the callable protocol)",
        "These describe a callable; a built-in backend declares its own, so giving one with a "
        "backend name is a usage error (exit 2).")
    # Defaults are None so that an option given with a built-in backend can be told from one
    # left out; fa_verify.targets fills them in.
    for name, kwargs in callable_arguments(skip=SELECTION_LIMITS).items():
        callable_opts.add_argument(f"--{name}", **kwargs)
    add_isolation_options(callable_opts.add_argument)
    cmd.set_defaults(handler=_run)


def _targets(args) -> list:
    values = {name: getattr(args, name) for name in vars(args)}
    if args.grading and values.get("forbid") is None and ":" in args.target:
        values["forbid"] = [DEFAULT_FORBID]  # a MODULE:FUNC target under grading
    return build_targets([args.target], values, spec=args.spec, runner=args.runner, arch=args.arch,
                         shared=SELECTION_LIMITS)


def _judged_under(backend) -> str:
    """The conventions and, for a callable, the precision preset it is judged under, in words."""
    precision = getattr(backend, "_precision", None)
    named = f"precision {precision}" if isinstance(precision, str) and precision != "flash" else ""
    if not backend.judged_under.declared:
        return ", ".join(filter(None, [named, "fa_verify's conventions"]))
    return ", ".join(filter(None, [named, backend.judged_under.describe()]))


def _print_property(outcome, file=None, verbose: bool = False) -> None:
    label = {"passed": "PASS", "failed": "FAIL", "not applicable": "N/A "}[outcome.status]
    print(f"  {label} " + outcome.message(verbose).replace("\n", "\n       "), flush=True, file=file)


def _verdict(outcome) -> str:
    if not outcome.checked:
        return "NOTHING CHECKED"
    return "PASS" if outcome.passed else "FAIL"


def _run(args) -> int:
    from fa_verify.check import check_backend, results_recorder
    from fa_verify.properties import Selection, get_property
    from fa_verify.properties.reproduce import default_folder

    if args.grading and args.target == "all":
        raise InvalidArgumentError("--grading grades one target: name it (MODULE:FUNC, a backend, or a CUDA file "
                                   "with --spec), not 'all'")
    targets = _targets(args)
    for name in args.properties or ():
        get_property(name)  # an unknown name is a usage error before anything runs
    seed, drawn = resolve_seed(args.seed if args.seed is not None else RANDOM_SEED if args.grading else 0)
    json_out = args.json or args.grading
    if drawn and not args.grading:  # first, so that even a run that dies later can be replayed
        print(f"seed {seed} (--seed random; replay with --seed {seed})", flush=True,
              file=sys.stderr if json_out else sys.stdout)
    outcomes, documents, skipped = [], [], []
    for backend in targets:
        dtypes = tuple(d for d in (args.dtype or backend.dtypes) if d in backend.dtypes)
        if not dtypes:
            skipped.append(f"{backend.name} runs {', '.join(backend.dtypes)}, not --dtype {', '.join(args.dtype)}")
            continue
        selection = Selection.from_profile(args.profile or DEFAULT_PROFILE, dtypes=dtypes,
                                           causal=CAUSAL_CHOICES[args.causal or "both"],
                                           max_examples=args.max_examples, max_edge_cases=args.max_examples,
                                           max_seq=args.max_seq, max_long_keys=args.max_seq,
                                           seed=seed, shapes=args.shapes,
                                           stop_at=None if args.budget is None else time.monotonic() + args.budget)
        record = results_recorder(args.results, backend, "check", seed=seed) if args.results else None
        print(f"checking {backend.name} ({', '.join(dtypes)}) ...", file=sys.stderr, flush=True)
        if not json_out:
            print(backend.name)
            if getattr(backend, "inferred", None) is not None:  # a KernelBench file: what its Model computes
                print(f"  inferred from Model: {backend.inferred.describe()}")
            print(f"  limits: {backend.limits.describe()}")
            print(f"  judged under: {_judged_under(backend)}")
        # With --json, stdout holds only the document: progress goes to stderr as it comes.
        progress = functools.partial(_print_property, file=sys.stderr if json_out else sys.stdout,
                                     verbose=args.verbose)
        outcome = check_backend(backend, selection, properties=args.properties, on_result=record,
                                progress=progress, repro_dir=args.repro_dir or default_folder())
        outcomes.append(outcome)
        inferred = getattr(backend, "inferred", None)
        documents.append({**outcome.as_dict(), **({"inferred": inferred.describe()} if inferred else {}),
                          "limits": backend.limits.as_dict(),
                          "conventions": backend.judged_under.as_dict(), "judged_under": _judged_under(backend)})
        if not json_out:
            counts = outcome.counts()
            print(f"{_verdict(outcome)} {backend.name}: {counts['passed']} passed, "
                  f"{counts['failed']} failed, {counts['not applicable']} not applicable; "
                  f"{outcome.examples} examples in {outcome.seconds:.1f}s")
            for line in [outcome.precision_hint(), *(p.message() for p in outcome.preconditions())]:
                if line:
                    print(f"  {line}")
    # Nothing judged is no pass: say why and exit 2 (a usage error: the selection is empty).
    error = None if any(o.checked for o in outcomes) else _nothing_checked(outcomes, skipped)
    for reason in skipped if error is None else ():
        print(f"skipped {reason}", file=sys.stderr)
    if json_out:
        document = {"passed": error is None and all(o.passed for o in outcomes), "seed": seed,
                    "seed_drawn": drawn, "targets": documents}
        if error is not None:
            document["error"] = error
        if args.grading:
            return _grade(args, document, targets, error, seed, drawn)
        print(json.dumps(document, indent=2))
    if error is not None:
        print(f"fa_verify check: error: {error}", file=sys.stderr)
        return 2
    return 0 if all(o.passed for o in outcomes) else 1


def _grade(args, document: dict, targets: list, error, seed: int, drawn: bool) -> int:
    """Print the grading document (stdout), then the verdict line and only then the seed (stderr)."""
    from fa_verify import grading
    from fa_verify.properties import Selection

    forbid = getattr(targets[0], "forbid", ()) if targets else ()
    max_examples = args.max_examples or Selection.from_profile(args.profile or DEFAULT_PROFILE).max_examples
    graded = grading.document(document, budget=args.budget, forbid=forbid, max_examples=max_examples)
    print(grading.verdict_line(graded), file=sys.stderr, flush=True)
    print(f"seed {seed} ({'drawn at run time' if drawn else 'given'}; replay with --seed {seed})", file=sys.stderr,
          flush=True)
    print(json.dumps(graded, indent=2), flush=True)
    if error is not None and not graded["budget"]["spent"]:  # nothing judged, and not for want of time
        print(f"fa_verify check: error: {error}", file=sys.stderr)
        return 2
    return 0 if graded["passed"] else 1  # a budget spent before enough was judged fails closed


def _nothing_checked(outcomes, skipped) -> str:
    """Why no example was judged: targets without the dtypes asked for, properties not applicable."""
    reasons = list(skipped)
    for outcome in outcomes:
        why = sorted({p.reason for p in outcome.properties if p.reason})
        reasons.append(f"{outcome.backend}: every property was not applicable ({'; '.join(why) or 'none ran'})")
    return "nothing to check: " + ("; ".join(reasons) or "no target selected")
