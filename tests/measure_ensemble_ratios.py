"""Measure how a correct kernel's error compares with the honest ensemble's (the verdict's
"ensemble" rule), to choose and check its factor K. Not a test: a documented command (docs/numerics.md,
"The error model and verdicts"); run it under several BLAS configurations, e.g.

    OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=1 python3 tests/measure_ensemble_ratios.py --seeds 3

For every available built-in backend (torch-sdpa-flash-cpu's one deviation is its LSE, which
this property does not judge) and every implementation in tests/fixtures/honest_variants.py, it runs the `oracle_agreement`
property (the fixed edge cases, then Hypothesis examples of the profile) with several seeds and
records, per judged example, r = kernel's max normalised error / E (the ensemble's largest),
the smallest K the example needs (`_k_needed`), and the ensemble rule's "used" ratio. Prints the distribution per target and overall, the
examples that fail any rule, and a JSON line with everything when --json is given.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import honest_variants  # noqa: E402

from fa_verify.backends import CallableBackend  # noqa: E402
from fa_verify.backends.registry import builtin_backends  # noqa: E402
from fa_verify.oracle import reference  # noqa: E402
from fa_verify.properties import Selection, search_property  # noqa: E402

def targets(names):
    found = [b for b in builtin_backends() if b.availability().available]
    found += [CallableBackend(fn, name=f"honest_variants:{name}") for name, fn in honest_variants.VARIANTS.items()]
    return [b for b in found if not names or b.name in names]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-examples", type=int, default=None)
    parser.add_argument("--target", action="append", default=[])
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="append one JSON line with every ratio to this file")
    args = parser.parse_args(argv)
    if args.torch_threads:
        import torch
        torch.set_num_threads(args.torch_threads)
    config = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS")}
    config["torch_threads"] = args.torch_threads
    rows = []
    failures = []
    started = time.perf_counter()
    for backend in targets(args.target):
        last = []  # the output of the target's last run, which the verdict judged
        backend.run = _recording(backend.run, last)
        for seed in range(args.seeds):
            selection = Selection.from_profile(args.profile, seed=seed, max_examples=args.max_examples, shrink=False)

            def collect(problem, result, seconds, backend=backend):
                for v in result.verdicts:
                    if v.ensemble_error is None:
                        continue
                    r = v.normalised_error / v.ensemble_error if v.ensemble_error > 0 else float("inf")
                    needed = _k_needed(last[0], problem, v)
                    rows.append({"target": backend.name, "dtype": problem.dtype, "r": r, "k_needed": needed,
                                 "E": v.ensemble_error, "floor": v.ensemble_floor,
                                 "used": v.ensemble_ratio, "bound": v.bound_ratio,
                                 "member": v.ensemble_member, "problem": problem.describe(),
                                 "distribution": dict(problem.tags).get("distribution")})
                    if not v.passed:
                        failures.append((backend.name, seed, v.message().splitlines()[:2]))

            search_property(backend, "oracle_agreement", selection, on_result=collect)
        del backend.run
    seconds = time.perf_counter() - started
    print(f"config {config}, profile {args.profile}, {args.seeds} seeds, {len(rows)} verdicts, {seconds:.0f}s")
    print(f"{'target':40s} {'n':>5s} {'r max':>8s} {'r p99':>8s} {'r med':>8s} {'K need':>8s} {'used max':>9s} "
          f"{'bound max':>9s}")
    for name in dict.fromkeys(r["target"] for r in rows):
        _line(name, [r for r in rows if r["target"] == name])
    _line("ALL", rows)
    for dtype in ("fp32", "fp16", "bf16"):
        _line(f"ALL {dtype}", [r for r in rows if r["dtype"] == dtype])
    finish(rows, failures, args, config)


def finish(rows, failures, args, config):
    """The largest K needed, the failing verdicts, and the JSON line (--json)."""
    if rows:
        print(f"largest K needed: {max(rows, key=lambda r: r['k_needed'])}")
    print(f"verdicts failing any rule: {len(failures)}")
    for f in failures[:10]:
        print("  ", f)
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"config": config, "profile": args.profile, "seeds": args.seeds,
                                 "rows": rows, "failures": len(failures)}) + "\n")


def _recording(run, last):
    def recorded(problem):
        result = run(problem)
        last[:] = [result[0]]
        return result
    return recorded


def _k_needed(out, problem, verdict) -> float:
    """The smallest K with which this output passes the ensemble rule: max over the elements of
    (error - floor * row scale - absolute floor) / (E * row scale), 0 where the floors cover it."""
    ref = reference(problem)
    scale = np.broadcast_to(ref.row_scale, problem.out_shape)
    err = np.abs(np.asarray(out, np.float64) - ref.out)
    spare = err - verdict.ensemble_floor * scale - verdict.absolute_floor
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(spare > 0, spare / (verdict.ensemble_error * scale), 0.0)
    return float(np.max(k, initial=0.0))


def _line(name, rows):
    r = np.array([x["r"] for x in rows if np.isfinite(x["r"])])
    used = max((x["used"] for x in rows), default=float("nan"))
    needed = max((x["k_needed"] for x in rows), default=float("nan"))
    bound = max((x["bound"] for x in rows if x["bound"] == x["bound"]), default=float("nan"))
    if r.size:
        print(f"{name:40s} {len(rows):5d} {r.max():8.3g} {np.quantile(r, 0.99):8.3f} {np.median(r):8.3f} "
              f"{needed:8.3f} {used:9.3f} {bound:9.3f}")


if __name__ == "__main__":
    main()
