"""`fa_verify bench oracle`: print timing ratios measured in one run."""

from __future__ import annotations

import json
import sys

from fa_verify.arguments import positive_int

#: kernel style -> its CPU runner backend (`bench runner --ci`)
CI_STYLES = {"fa2": "fa2-cpu", "wmma": "wmma-cpu", "mma_ptx": "mma-ptx-cpu", "naive": "naive-cuda-cpu",
             "naive16": "naive16-cuda-cpu", "split_kv": "split-kv-cpu", "fa2_bwd": "fa2-bwd-cpu"}


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks, as ratios against a baseline in the same run",
                           description="Benchmarks. Every figure is a ratio against a baseline "
                                       "timed in the same run (shared machines are noisy). Exit 0: "
                                       "done (and within target, for oracle); 1: oracle missed its "
                                       "target; 2: usage or setup error.")
    targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
    oracle = targets.add_parser(
        "oracle", help="certified reference vs plain float64 numpy attention",
        description="Times the certified reference against plain float64 numpy attention "
                    "(B=H=1, D=128, fp16 inputs), prints the ratio and the largest certified "
                    "bound relative to the row scale, and the pure-mpmath time at a small N. "
                    "Exit 0: within target; 1: the ratio exceeds 1.5 or a bound exceeds 1e-12; 2: usage "
                    "or setup error.")
    oracle.add_argument("--sizes", type=positive_int, nargs="+", default=[1024, 4096], metavar="N",
                        help="sequence lengths (Nq = Nk) to time (default: 1024 4096)")
    oracle.add_argument("--head-dim", type=positive_int, default=128, help="head dimension (default 128)")
    oracle.add_argument("--repeats", type=positive_int, default=5, help="best of this many runs (default 5)")
    oracle.add_argument("--mpmath-n", type=positive_int, default=64,
                        help="N for the pure-mpmath timing (default 64)")
    oracle.add_argument("--json", action="store_true", help="print JSON instead of a table")
    oracle.set_defaults(handler=_run_oracle)
    runner = targets.add_parser(
        "runner", help="our kernels through the CUDA-on-CPU runner vs the certified oracle",
        description="Times each kernel family through the CUDA-on-CPU runner and the certified "
                    "reference on the same problems (B=1, H=2, causal), and prints the time per "
                    "example and the ratio, to plan a Hypothesis budget. With --ci: each kernel style "
                    "on the problems the ci profile's check judges, in examples per second of the "
                    "runner, the oracle and the whole check. Exit 0: done; 2: usage or "
                    "setup error (a kernel that does not build or run).")
    runner.add_argument("--kernel", action="append", choices=tuple(CI_STYLES),
                        help="kernel family (repeatable; default fa2 and wmma, with --ci every style; "
                             "split_kv and fa2_bwd with --ci only)")
    runner.add_argument("--ci", action="store_true",
                        help="time the problems `check TARGET --property oracle_agreement` judges under "
                             "the ci profile (ragged_agreement, gradient_agreement for split_kv, fa2_bwd) instead of --sizes")
    runner.add_argument("--max-examples", type=positive_int, default=20,
                        help="with --ci: the check's --max-examples (default 20)")
    runner.add_argument("--cu", metavar="KERNEL.cu", help="with --ci: also a CUDA file, run from its --spec")
    runner.add_argument("--spec", metavar="KERNEL.toml", help="the kernel spec of --cu")
    runner.add_argument("--sizes", type=positive_int, nargs="+", default=[64, 256, 1024], metavar="N",
                        help="sequence lengths (default: 64 256 1024)")
    runner.add_argument("--head-dim", type=positive_int, default=64, help="head dimension (default 64)")
    runner.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    runner.add_argument("--repeats", type=positive_int, default=2, help="best of this many runs (default 2)")
    runner.add_argument("--racecheck", action="store_true",
                        help="also time each kernel's race detector build (the 'races' property's run)")
    runner.add_argument("--json", action="store_true", help="print JSON instead of a table")
    runner.set_defaults(handler=_run_runner)


def _run_oracle(args) -> int:
    from fa_verify.bench import oracle

    result = oracle.run(sizes=args.sizes, head_dim=args.head_dim, repeats=args.repeats,
                        mpmath_n=args.mpmath_n,
                        progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else oracle.format_text(result))
    return 0 if result["meets_target"] else 1


def _run_runner(args) -> int:
    from fa_verify.bench import runner

    if args.ci:
        return _run_runner_ci(args)
    if args.cu or set(args.kernel or ()) - {"fa2", "wmma", "mma_ptx", "naive", "naive16"}:
        print("fa_verify bench runner: error: --cu and the styles split_kv and fa2_bwd need --ci",
              file=sys.stderr)
        return 2
    result = runner.run(families=args.kernel or ("fa2", "wmma"), sizes=args.sizes,
                        head_dim=args.head_dim, dtype=args.dtype, repeats=args.repeats,
                        racecheck=args.racecheck, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else runner.format_text(result))
    return 0


def _run_runner_ci(args) -> int:
    from fa_verify.backends.registry import get_backend
    from fa_verify.bench import runner

    if bool(args.cu) != bool(args.spec):
        print("fa_verify bench runner: error: --cu and --spec go together (a CUDA file and its kernel spec)",
              file=sys.stderr)
        return 2
    backends = {style: get_backend(CI_STYLES[style]) for style in args.kernel or CI_STYLES}
    if args.cu:
        from pathlib import Path

        from fa_verify.backends.spec_kernel import SpecKernelBackend

        backends[Path(args.cu).stem] = SpecKernelBackend(args.cu, args.spec)
    result = runner.run_ci(backends, max_examples=args.max_examples, repeats=args.repeats,
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else runner.format_ci_text(result))
    return 0
