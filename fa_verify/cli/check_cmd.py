"""`fa_verify check TARGET`: the property suite against a backend or a user callable."""

from __future__ import annotations

import json
import os
import sys

from fa_verify.profiles import DEFAULT_PROFILE, PROFILES

_CAUSAL = {"yes": (True,), "no": (False,), "both": (False, True)}

#: Options `fa_verify check` shares with the pytest plugin (--fa-<name> there): name -> kwargs.
SHARED_OPTIONS = {
    "profile": dict(default=None, choices=tuple(PROFILES),
                    help=f"search profile: examples per property and problem sizes (default: {DEFAULT_PROFILE})"),
    "results": dict(default=None, metavar="FILE",
                    help="append every oracle comparison's metrics to FILE (JSON lines), for "
                         "'fa_verify report'"),
}


def add_parser(sub) -> None:
    cmd = sub.add_parser(
        "check", help="run the property suite against a backend or MODULE:FUNC",
        description="Runs fa_verify's property suite against TARGET: agreement of O and LSE with "
                    "the certified oracle under the error model (fixed edge cases first), the "
                    "online-softmax merge law, convex hull, constant V, V-affinity, permutations, "
                    "score shift, batch/head and masked-key independence, fully masked rows, "
                    "NaN-padded inputs, determinism and unbiased rounding, each over Hypothesis "
                    "problems. Prints per property: passed, failed (examples to failure, the "
                    "minimal counterexample, a reproducer) or not applicable. Exit 0: no property "
                    "failed; 1: one failed; 2: usage or setup error.")
    cmd.add_argument("target", metavar="TARGET",
                     help="a backend name (see 'fa_verify backends'), 'all' for every available "
                          "backend, or MODULE:FUNC with fn(q, k, v, *, causal, scale) -> out | (out, lse)")
    cmd.add_argument("--dtype", action="append", choices=("fp16", "bf16", "fp32"),
                     help="dtype to check (repeatable; default: every dtype the target runs)")
    cmd.add_argument("--causal", choices=tuple(_CAUSAL), default="both",
                     help="causal problems, non-causal ones, or both (default)")
    cmd.add_argument("--property", action="append", dest="properties", metavar="NAME",
                     help="run only this property (repeatable; default: all)")
    cmd.add_argument("--max-examples", type=int, default=None,
                     help="examples per property (default: the profile's; ci: 20)")
    cmd.add_argument("--max-seq", type=int, default=None,
                     help="largest Nq or Nk drawn (default: the profile's; ci: 64)")
    cmd.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
    for name, kwargs in SHARED_OPTIONS.items():
        cmd.add_argument(f"--{name}", **kwargs)
    cmd.add_argument("--json", action="store_true", help="print one JSON document")
    callable_opts = cmd.add_argument_group("MODULE:FUNC targets (the callable protocol)")
    callable_opts.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                               help="tensor layout: bhsd [B,H,N,D] (default) or bshd [B,N,H,D] "
                                    "as flash_attn_func")
    callable_opts.add_argument("--array", choices=("numpy", "torch"), default="numpy",
                               help="pass numpy arrays (default) or CPU torch tensors")
    callable_opts.add_argument("--causal-alignment", choices=("bottom-right", "top-left"),
                               default="bottom-right",
                               help="causal alignment the callable implements (default bottom-right; "
                                    "torch SDPA's is_causal is top-left)")
    callable_opts.add_argument("--precision", default=None,
                               help="precision model: a preset (flash, fp32-accumulate, "
                                    "same-precision) or 'score=fp32,p=bf16,pv=fp32,out=bf16'; "
                                    "default: flash, the most lenient legitimate model")
    cmd.set_defaults(handler=_run)


def _targets(args):
    from fa_verify.backends import CallableBackend, builtin_backends, get_backend, load_callable
    from fa_verify.errors import BackendUnavailableError

    if ":" in args.target:
        sys.path.insert(0, os.getcwd())  # MODULE is looked up where the user runs the command
        fn = load_callable(args.target)
        return [CallableBackend(fn, name=args.target, layout=args.layout, array=args.array,
                                causal_alignment=args.causal_alignment,
                                precision=args.precision)]
    if args.target == "all":
        return [b for b in builtin_backends() if b.availability().available]
    backend = get_backend(args.target)
    availability = backend.availability()
    if not availability.available:
        raise BackendUnavailableError(f"backend {backend.name!r} is unavailable: {availability.reason}")
    return [backend]


def _print_property(outcome) -> None:
    label = {"passed": "PASS", "failed": "FAIL", "not applicable": "N/A "}[outcome.status]
    print(f"  {label} " + outcome.message().replace("\n", "\n       "), flush=True)


def _run(args) -> int:
    from fa_verify.check import check_backend, results_recorder
    from fa_verify.properties import Selection, get_property

    for name in args.properties or ():
        get_property(name)  # an unknown name is a usage error before anything runs
    outcomes = []
    for backend in _targets(args):
        dtypes = tuple(d for d in (args.dtype or backend.dtypes) if d in backend.dtypes)
        if not dtypes:
            continue
        selection = Selection.from_profile(args.profile or DEFAULT_PROFILE, dtypes=dtypes,
                                           causal=_CAUSAL[args.causal], max_examples=args.max_examples,
                                           max_seq=args.max_seq, seed=args.seed)
        record = results_recorder(args.results, backend, "check") if args.results else None
        print(f"checking {backend.name} ({', '.join(dtypes)}) ...", file=sys.stderr, flush=True)
        if not args.json:
            print(backend.name)
        outcome = check_backend(backend, selection, properties=args.properties, on_result=record,
                                progress=None if args.json else _print_property)
        outcomes.append(outcome)
        if not args.json:
            counts = outcome.counts()
            print(f"{'PASS' if outcome.passed else 'FAIL'} {backend.name}: {counts['passed']} passed, "
                  f"{counts['failed']} failed, {counts['not applicable']} not applicable; "
                  f"{outcome.examples} examples in {outcome.seconds:.1f}s")
    if args.json:
        print(json.dumps({"passed": all(o.passed for o in outcomes),
                          "targets": [o.as_dict() for o in outcomes]}, indent=2))
    return 0 if all(o.passed for o in outcomes) else 1
