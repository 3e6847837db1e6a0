"""`fa_verify check TARGET`: oracle agreement of a backend or a user callable."""

from __future__ import annotations

import json
import os
import sys

_CAUSAL = {"yes": (True,), "no": (False,), "both": (False, True)}


def add_parser(sub) -> None:
    cmd = sub.add_parser(
        "check", help="check a backend or MODULE:FUNC against the certified oracle",
        description="Generates attention problems with Hypothesis (shapes with N=1, primes, "
                    "tile+-1, Nq!=Nk, GQA/MQA, odd D; normal, FA3-outlier, large-logit, tie, "
                    "dominant-key and extreme values), runs TARGET on each and judges its output "
                    "and LSE against the certified reference with the error model of its "
                    "precision. On failure, prints the minimal failing problem and a reproducer. "
                    "Exit 0: all passed; 1: a check failed; 2: usage or setup error.")
    cmd.add_argument("target", metavar="TARGET",
                     help="a backend name (see 'fa_verify backends'), 'all' for every available "
                          "backend, or MODULE:FUNC with fn(q, k, v, *, causal, scale) -> out | (out, lse)")
    cmd.add_argument("--dtype", action="append", choices=("fp16", "bf16", "fp32"),
                     help="dtype to check (repeatable; default: every dtype the target runs)")
    cmd.add_argument("--causal", choices=tuple(_CAUSAL), default="both",
                     help="causal problems, non-causal ones, or both (default)")
    cmd.add_argument("--max-examples", type=int, default=100,
                     help="generated examples per target, after the fixed edge cases (default 100)")
    cmd.add_argument("--max-seq", type=int, default=64, help="largest Nq or Nk generated (default 64)")
    cmd.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
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


def _run(args) -> int:
    from fa_verify.check import check_backend

    outcomes = []
    for backend in _targets(args):
        dtypes = [d for d in (args.dtype or backend.dtypes) if d in backend.dtypes]
        if not dtypes:
            continue
        print(f"checking {backend.name} ({', '.join(dtypes)}) ...", file=sys.stderr, flush=True)
        outcome = check_backend(backend, dtypes=dtypes, causal=_CAUSAL[args.causal],
                                max_examples=args.max_examples, seed=args.seed,
                                max_seq=args.max_seq,
                                progress=lambda msg: print(msg, file=sys.stderr, flush=True))
        outcomes.append(outcome)
        if not args.json:
            ratios = ", ".join(f"{d} {r:.3g}" for d, r in sorted(outcome.worst_ratio.items()))
            status = "PASS" if outcome.passed else "FAIL"
            print(f"{status} {backend.name}: {outcome.examples} examples in {outcome.seconds:.1f}s; "
                  f"worst error/bound: {ratios or 'n/a'}")
            if outcome.failure:
                print(outcome.failure)
    if args.json:
        print(json.dumps({"passed": all(o.passed for o in outcomes),
                          "targets": [o.as_dict() for o in outcomes]}, indent=2))
    return 0 if all(o.passed for o in outcomes) else 1
