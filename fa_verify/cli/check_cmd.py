"""`fa_verify check TARGET`: the property suite against a backend or a user callable."""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import sys

from fa_verify.cli.arguments import positive_int, writable_file, writable_folder
from fa_verify.conventions import convention_arguments, conventions_from_options
from fa_verify.isolation import DEFAULT_MEMORY_LIMIT, DEFAULT_TIMEOUT
from fa_verify.limits import CAUSAL_CHOICES, limit_arguments, limits_from_options
from fa_verify.profiles import DEFAULT_PROFILE, PROFILES

#: --layout's values for varlen and paged functions (fa_verify.backends.ragged_callable).
RAGGED_LAYOUTS = ("varlen", "paged")
#: Longest sequence a ragged check draws unless --max-seq says: past the second key tile of 64.
RAGGED_MAX_SEQ = 2 * 64 + 1
#: Limit options that are also `check`'s selection options (--dtype, --causal), for any target.
SELECTION_LIMITS = ("dtype", "causal")
#: The value of --seed (--fa-seed) that draws a new seed per run.
RANDOM_SEED = "random"
SEED_HELP = ("Hypothesis seed: an integer, or 'random' to draw one per run (printed first and recorded, so "
             "a CI run explores new examples each time and a failure replays with --seed N)")


def parse_seed(text: str):
    """--seed's value: an int, or RANDOM_SEED."""
    if text == RANDOM_SEED:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor {RANDOM_SEED!r}") from None


def resolve_seed(seed):
    """(the seed to search with, whether it was drawn): RANDOM_SEED draws a 32-bit one."""
    if seed == RANDOM_SEED:
        return secrets.randbelow(2**32), True
    return seed, False

#: Options `fa_verify check` shares with the pytest plugin (--fa-<name> there): name -> kwargs.
SHARED_OPTIONS = {
    "profile": dict(default=None, choices=tuple(PROFILES),
                    help=f"search profile: examples per property and problem sizes (default: {DEFAULT_PROFILE})"),
    "results": dict(default=None, metavar="FILE", type=writable_file,
                    help="append every oracle comparison's metrics to FILE (JSON lines), for "
                         "'fa_verify report'"),
    "shapes": dict(default=None, metavar="N", type=positive_int,
                   help="shape budget for JIT-compiled targets: each property draws its problems from at most N "
                        "shapes (B, H, Hkv, Nq, Nk, D, dtype, causal mode, scale; values still vary), so the "
                        "target compiles about N times per property instead of once per example "
                        "(default: no budget)"),
    "repro-dir": dict(default=None, metavar="DIR", type=writable_folder,
                      help="write each failing example's reproducer (a script and its inputs, .npz) "
                           "into DIR (default: $FA_VERIFY_REPRO_DIR, else .fa_verify/repro in the current "
                           "folder; pytest: in its rootdir); run it from any folder with the printed "
                           "'python3 ...' command"),
}


def add_isolation_options(add_argument, prefix: str = "") -> None:
    """--no-isolate, --timeout and --memory-limit (--fa-... in the pytest plugin); None when not
    given, ISOLATION_DEFAULTS then."""
    add_argument(f"--{prefix}no-isolate", dest=f"{prefix.replace('-', '_')}isolate", action="store_const",
                 const=False, default=None,
                 help="run MODULE:FUNC in this process, for a debugger (default: in a worker process, so that "
                      "a crash, a hang or a runaway allocation fails the example instead of the run)")
    add_argument(f"--{prefix}timeout", type=float, default=None, metavar="SECONDS",
                 help=f"time limit of one call of an isolated MODULE:FUNC (default {DEFAULT_TIMEOUT:g})")
    add_argument(f"--{prefix}memory-limit", default=None, metavar="SIZE",
                 help="memory an isolated MODULE:FUNC may allocate (RLIMIT_DATA): e.g. 4GiB, 50%% of the "
                      f"machine's memory, or none (default {DEFAULT_MEMORY_LIMIT.replace('%', '%%')})")


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
                          "backend, MODULE:FUNC with fn(q, k, v, *, causal, scale) -> out | (out, lse) "
                          "(--layout varlen / paged: flash-attn's varlen and kvcache signatures), "
                          "or a CUDA file (kernel.cu) with --spec")
    cmd.add_argument("--dtype", action="append", choices=("fp16", "bf16", "fp32"),
                     help="dtype to check (repeatable; default: every dtype the target runs)")
    cmd.add_argument("--causal", choices=tuple(CAUSAL_CHOICES), default=None,
                     help="causal problems, non-causal ones, or both (default)")
    cmd.add_argument("--property", action="append", dest="properties", metavar="NAME",
                     help="run only this property (repeatable; default: all)")
    cmd.add_argument("--max-examples", type=positive_int, default=None, metavar="N",
                     help="examples per property (default: the profile's; ci: 20)")
    cmd.add_argument("--max-seq", type=positive_int, default=None, metavar="N",
                     help="largest Nq or Nk drawn (default: the profile's; ci: 257, most examples <= 64)")
    cmd.add_argument("--seed", type=parse_seed, default=0, metavar="N|random", help=SEED_HELP + " (default 0)")
    for name, kwargs in SHARED_OPTIONS.items():
        cmd.add_argument(f"--{name}", **kwargs)
    cmd.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout (progress goes to stderr)")
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
    # left out; _callable_options fills them in.
    callable_opts.add_argument("--layout", choices=("bhsd", "bshd", *RAGGED_LAYOUTS), default=None,
                               help="tensor layout: bhsd [B,H,N,D] (default) or bshd [B,N,H,D] as "
                                    "flash_attn_func; varlen: fn(q, k, v, cu_seqlens_q, cu_seqlens_k, "
                                    "max_seqlen_q, max_seqlen_k, *, causal, softmax_scale, ...) with packed "
                                    "q [total_q,H,D], k, v [total_k,Hkv,D], as flash_attn_varlen_func; paged: "
                                    "fn(q, k_cache, v_cache, *, cache_seqlens, block_table, causal, "
                                    "softmax_scale, ...) with q [B,Nq,H,D], caches [num_blocks,page_size,Hkv,D], "
                                    "as flash_attn_with_kvcache. Both return out or (out, lse) (LSE [H,total_q] "
                                    "varlen, [B,H,Nq] paged) and get window_size, softcap, alibi_slopes, sinks, "
                                    "return_softmax_lse=True and num_splits when their signature names them; "
                                    "they are checked with the ragged properties")
    callable_opts.add_argument("--page-sizes", default=None, metavar="N,N,...",
                               help="declared limit of a --layout paged function: the page sizes (keys per "
                                    "page) it supports (default: any; drawn below, at and above a tile of 64)")
    callable_opts.add_argument("--array", choices=("numpy", "torch"), default=None,
                               help="pass numpy arrays (default) or CPU torch tensors")
    callable_opts.add_argument("--causal-alignment", choices=("bottom-right", "top-left"),
                               default=None,
                               help="causal alignment the callable implements (default bottom-right; "
                                    "torch SDPA's is_causal is top-left)")
    add_isolation_options(callable_opts.add_argument)
    for name, kwargs in limit_arguments(skip=SELECTION_LIMITS).items():
        callable_opts.add_argument(f"--{name}", **kwargs)
    for name, kwargs in convention_arguments().items():
        callable_opts.add_argument(f"--{name}", **kwargs)
    callable_opts.add_argument("--precision", default=None,
                               help="precision model: a preset (flash, fp32-accumulate, input-scores, "
                                    "same-precision) or 'score=fp32,p=bf16,pv=fp32,out=bf16'; "
                                    "default: flash (FlashAttention's: fp32 scores and accumulation, P in "
                                    "the input dtype); a failure says which looser preset would pass")
    cmd.set_defaults(handler=_run)


def _targets(args):
    from fa_verify.backends import CallableBackend, builtin_backends, get_backend, load_callable
    from fa_verify.backends.ragged_base import RaggedBackend
    from fa_verify.errors import BackendUnavailableError, InvalidArgumentError

    if args.spec is not None or args.target.endswith((".cu", ".cuh")):
        return [_spec_target(args)]
    if args.arch is not None:
        raise InvalidArgumentError(f"--arch applies to CUDA files checked with --spec, not to {args.target!r}")
    if args.runner != "auto":
        raise InvalidArgumentError(f"--runner applies to CUDA files checked with --spec, not to {args.target!r}")
    if args.layout in RAGGED_LAYOUTS or args.page_sizes is not None:
        return [_ragged_target(args)]
    if ":" in args.target:
        sys.path.insert(0, os.getcwd())  # MODULE is looked up where the user runs the command
        fn = load_callable(args.target)
        return [CallableBackend(fn, name=args.target, limits=_limits(args), conventions=_conventions(args),
                                **_callable_options(args))]
    given = [f"--{'no-isolate' if name == 'isolate' else name.replace('_', '-')}"
             for name in (*CALLABLE_DEFAULTS, *limit_arguments(skip=SELECTION_LIMITS), *convention_arguments())
             if getattr(args, name.replace("-", "_")) is not None]
    if given:
        raise InvalidArgumentError(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to MODULE:FUNC targets only; "
            f"{args.target!r} names built-in backends, whose layout, arrays, precision, isolation, conventions and "
            "limits are their own "
            f"(see 'fa_verify backends'): drop {' and '.join(given)}, or check your function as MODULE:FUNC")
    if args.target == "all":
        return [b for b in builtin_backends() if b.availability().available]
    backend = get_backend(args.target, ragged=True)
    given = [f"--{name}" for name in ("results", "shapes") if getattr(args, name) is not None]
    if given and isinstance(backend, RaggedBackend):
        raise InvalidArgumentError(
            f"{' and '.join(given)} cannot be used with {backend.name!r}, a {backend.layout} backend: --results records "
            "are one dense [B,H,N,D] verdict each and --shapes budgets dense shape tuples (a ragged batch draws B "
            f"lengths, pages and splits); drop {' and '.join(given)}")
    availability = backend.availability()
    if not availability.available:
        raise BackendUnavailableError(f"backend {backend.name!r} is unavailable: {availability.reason}")
    return [backend]


def _ragged_target(args):
    """The backend of `check MODULE:FUNC --layout varlen|paged`."""
    from fa_verify.backends import load_callable
    from fa_verify.backends.ragged_callable import RaggedCallableBackend
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.limits import _positive_set

    if args.layout not in RAGGED_LAYOUTS:
        raise InvalidArgumentError(f"--page-sizes declares the page sizes of a paged function: give --layout paged "
                                   f"(not {args.layout or 'bhsd'}), or drop --page-sizes")
    if ":" not in args.target:
        raise InvalidArgumentError(f"--layout {args.layout} checks a MODULE:FUNC function with flash-attn's "
                                   f"{args.layout} signature; {args.target!r} is no MODULE:FUNC")
    unsupported = {"--causal-alignment": args.causal_alignment not in (None, "bottom-right"),
                   "--page-sizes": args.page_sizes is not None and args.layout != "paged",
                   **{f"--{name}": getattr(args, name.replace("-", "_")) is not None
                      for name in ("results", "shapes", "scale-precision")}}
    given = [option for option, bad in unsupported.items() if bad]
    if given:
        raise InvalidArgumentError(
            f"{', '.join(given)} cannot be used with --layout {args.layout}: varlen and paged functions are "
            "bottom-right aligned per sequence and judged with the exact scale (--scale-precision: not yet); "
            "--results records are one "
            "dense [B,H,N,D] verdict each (a ragged batch has B lengths: not recorded yet); --shapes budgets dense "
            "shape tuples (a ragged batch draws B lengths, pages and splits, which it does not count); only a paged "
            f"one has pages; drop {' and '.join(given)}")
    try:
        page_sizes = None if args.page_sizes is None else _positive_set(args.page_sizes)
    except (ValueError, InvalidArgumentError):
        raise InvalidArgumentError(f"--page-sizes={args.page_sizes!r} is not valid: page sizes >= 1, "
                                   "e.g. --page-sizes 16,256") from None
    sys.path.insert(0, os.getcwd())  # MODULE is looked up where the user runs the command
    isolation = {name: ISOLATION_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
                 for name in ISOLATION_DEFAULTS}
    return RaggedCallableBackend(load_callable(args.target), args.layout, name=args.target, limits=_limits(args),
                                 conventions=_conventions(args),
                                 precision=args.precision, array=args.array or "numpy", page_sizes=page_sizes,
                                 **isolation)


def _spec_target(args):
    """The backend of `check kernel.cu --spec kernel.toml`."""
    from dataclasses import replace

    from fa_verify.backends.spec_kernel import SpecKernelBackend
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.kernels.spec import KernelSpec

    if args.spec is None:
        raise InvalidArgumentError(f"{args.target} is a CUDA file: give its kernel spec with --spec kernel.toml "
                                   "(which parameter is q, k, v, o, lse; the entry; grid, block, shared memory)")
    given = [f"--{name.replace('_', '-')}" for name in (*CALLABLE_DEFAULTS, *limit_arguments(skip=SELECTION_LIMITS))
             if name != "isolate" and getattr(args, name.replace("-", "_")) is not None]
    if given:
        raise InvalidArgumentError(f"{', '.join(given)}: a CUDA file's layout, precision and limits are its "
                                   f"spec's ({args.spec}); declare them there")
    spec = KernelSpec.from_toml(args.spec)
    if args.arch is not None:
        spec = replace(spec, arch=args.arch)
    runner = args.runner
    if runner == "auto":
        from fa_verify.kernels.pycuda_runner import pycuda_availability

        runner = "pycuda" if pycuda_availability().available else "cpu"
    if runner == "pycuda":
        from fa_verify.backends.spec_pycuda import SpecPyCudaBackend

        return SpecPyCudaBackend(args.target, spec)
    return SpecKernelBackend(args.target, spec)


#: The callable-protocol options and their defaults (CallableBackend's).
#: Where --no-isolate, --timeout and --memory-limit are not given (the pytest plugin's too).
ISOLATION_DEFAULTS = {"isolate": True, "timeout": DEFAULT_TIMEOUT, "memory_limit": DEFAULT_MEMORY_LIMIT}
CALLABLE_DEFAULTS = {"layout": "bhsd", "array": "numpy", "causal_alignment": "bottom-right", "precision": None,
                     **ISOLATION_DEFAULTS}


def _limits(args):
    """The callable's declared limits: --limits FILE, then the limit options given (--dtype and
    --causal included)."""
    values = {name: getattr(args, name.replace("-", "_")) for name in limit_arguments() if name != "limits"}
    return limits_from_options(values, args.limits)


def _conventions(args):
    """The callable's declared conventions: those of --limits FILE, then the options given."""
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.limits import read_limits_file

    values = {name: getattr(args, name.replace("-", "_")) for name in convention_arguments()}
    declared = None
    if args.limits is not None:
        try:
            declared = read_limits_file(args.limits)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--limits {args.limits}: {exc}") from None
    return conventions_from_options(values, declared)


def _callable_options(args) -> dict:
    """CallableBackend's keyword arguments from the options given, defaults for the others."""
    return {name: default if getattr(args, name) is None else getattr(args, name)
            for name, default in CALLABLE_DEFAULTS.items()}


def _judged_under(backend) -> str:
    """The conventions and, for a callable, the precision preset it is judged under, in words."""
    precision = getattr(backend, "_precision", None)
    named = f"precision {precision}" if isinstance(precision, str) and precision != "flash" else ""
    if not backend.judged_under.declared:
        return ", ".join(filter(None, [named, "fa_verify's conventions"]))
    return ", ".join(filter(None, [named, backend.judged_under.describe()]))


def _print_property(outcome, file=None) -> None:
    label = {"passed": "PASS", "failed": "FAIL", "not applicable": "N/A "}[outcome.status]
    print(f"  {label} " + outcome.message().replace("\n", "\n       "), flush=True, file=file)


def _verdict(outcome) -> str:
    if not outcome.checked:
        return "NOTHING CHECKED"
    return "PASS" if outcome.passed else "FAIL"


def _run(args) -> int:
    from fa_verify.check import check_backend, results_recorder
    from fa_verify.properties import Selection, get_property
    from fa_verify.properties.reproduce import default_folder

    from fa_verify.backends.ragged_base import RaggedBackend
    from fa_verify.properties.registry import get_ragged_property

    targets = _targets(args)
    for backend in targets:
        lookup = get_ragged_property if isinstance(backend, RaggedBackend) else get_property
        for name in args.properties or ():
            lookup(name)  # an unknown name is a usage error before anything runs
    seed, drawn = resolve_seed(args.seed)
    if drawn:  # first, so that even a run that dies later can be replayed
        print(f"seed {seed} (--seed random; replay with --seed {seed})", flush=True,
              file=sys.stderr if args.json else sys.stdout)
    outcomes, documents, skipped = [], [], []
    for backend in targets:
        dtypes = tuple(d for d in (args.dtype or backend.dtypes) if d in backend.dtypes)
        if not dtypes:
            skipped.append(f"{backend.name} runs {', '.join(backend.dtypes)}, not --dtype {', '.join(args.dtype)}")
            continue
        selection = Selection.from_profile(args.profile or DEFAULT_PROFILE, dtypes=dtypes,
                                           causal=CAUSAL_CHOICES[args.causal or "both"],
                                           max_examples=args.max_examples,
                                           max_seq=args.max_seq or (RAGGED_MAX_SEQ if isinstance(backend, RaggedBackend)
                                                                    else None),
                                           seed=seed, shapes=args.shapes)
        record = results_recorder(args.results, backend, "check", seed=seed) if args.results else None
        print(f"checking {backend.name} ({', '.join(dtypes)}) ...", file=sys.stderr, flush=True)
        if not args.json:
            print(backend.name)
            print(f"  limits: {backend.limits.describe()}")
            print(f"  judged under: {_judged_under(backend)}")
        # With --json, stdout holds only the document: progress goes to stderr as it comes.
        progress = functools.partial(_print_property, file=sys.stderr if args.json else sys.stdout)
        outcome = check_backend(backend, selection, properties=args.properties, on_result=record,
                                progress=progress, repro_dir=args.repro_dir or default_folder())
        outcomes.append(outcome)
        documents.append({**outcome.as_dict(), "limits": backend.limits.as_dict(),
                          "conventions": backend.judged_under.as_dict(), "judged_under": _judged_under(backend)})
        if not args.json:
            counts = outcome.counts()
            print(f"{_verdict(outcome)} {backend.name}: {counts['passed']} passed, "
                  f"{counts['failed']} failed, {counts['not applicable']} not applicable; "
                  f"{outcome.examples} examples in {outcome.seconds:.1f}s")
    # Nothing judged is no pass: say why and exit 2 (a usage error: the selection is empty).
    error = None if any(o.checked for o in outcomes) else _nothing_checked(outcomes, skipped)
    for reason in skipped if error is None else ():
        print(f"skipped {reason}", file=sys.stderr)
    if args.json:
        document = {"passed": error is None and all(o.passed for o in outcomes), "seed": seed,
                    "seed_drawn": drawn, "targets": documents}
        if error is not None:
            document["error"] = error
        print(json.dumps(document, indent=2))
    if error is not None:
        print(f"fa_verify check: error: {error}", file=sys.stderr)
        return 2
    return 0 if all(o.passed for o in outcomes) else 1


def _nothing_checked(outcomes, skipped) -> str:
    """Why no example was judged: targets without the dtypes asked for, properties not applicable."""
    reasons = list(skipped)
    for outcome in outcomes:
        why = sorted({p.reason for p in outcome.properties if p.reason})
        reasons.append(f"{outcome.backend}: every property was not applicable ({'; '.join(why) or 'none ran'})")
    return "nothing to check: " + ("; ".join(reasons) or "no target selected")
