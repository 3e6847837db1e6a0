"""Measure how a correct backward pass's error compares with the honest backward ensemble's (the
gradient verdict's "ensemble" rule), to choose and check its factor K. Not a test: a documented
command (docs/numerics.md, "The backward's ensemble rule"); run it under several BLAS
configurations, e.g.

    OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=1 python3 tests/measure_backward_ensemble_ratios.py --seeds 2

Honest targets: numpy-fa2-backward (`backward_emulation` with float32 BLAS GEMMs), the emulation
with its other parameters (tiles, tile and dQ orders, D from P∘dP, GQA reduced in fp32), torch's
SDPA math backward (autograd in fp32, top-left causal) when torch imports, and our CUDA kernel on
the CPU runner (fa2-bwd-cpu; slow: `--kernel-examples` examples). Each runs the
`gradient_agreement` and `gradient_variant_agreement` properties (their fixed edge cases, then the profile's Hypothesis examples of
`strategies.backward_problems`: anti-aligned rows with LSE ~ -100, dlse, every dout distribution)
and, per judged example and tensor, records r = the target's max normalised error / E and the
smallest K the example needs (`_k_needed`). Prints the distribution per target, tensor and dtype,
the examples failing any rule, and a JSON line with everything when --json is given.
"""

import argparse
import os
import time

import numpy as np

from measure_ensemble_ratios import finish  # noqa: E402 - this folder is sys.path[0] when run

from fa_verify.backends.numpy_backward import NumpyBackwardBackend
from fa_verify.backward_emulation import fa2_backward
from fa_verify.backward_ensemble import gradient_ensemble_errors
from fa_verify.backward_verdict import check_gradients
from fa_verify.oracle.backward import gradient_reference
from fa_verify.properties import Selection, search_property

#: numpy-fa2-backward's emulation with the parameters where correct kernels differ.
EMULATIONS = {
    "emulation:n32-m16-desc-pdp": dict(block_n=32, block_m=16, order="descending", d_from="p_dp"),
    "emulation:n128-m128-dq-desc-fp32gqa": dict(block_n=128, block_m=128, dq_order="descending", gqa_reduce="fp32"),
    "emulation:n16-m64-dq-shuffled": dict(block_n=16, block_m=64, dq_order="shuffled", seed=3),
}


class _Emulation(NumpyBackwardBackend):
    def __init__(self, name, params):
        super().__init__()
        self.name, self.params = name, params

    def _run(self, problem):
        dq, dk, dv, dsinks = fa2_backward(problem.forward, problem.out, problem.lse, problem.dout, problem.dlse,
                                          precision=self.precision(problem.dtype), **self.params)
        return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def targets(names, kernel: bool):
    found = [NumpyBackwardBackend()] + [_Emulation(n, p) for n, p in EMULATIONS.items()]
    try:
        import torch  # noqa: F401
        from fa_verify.targets import build_targets
        found += build_targets(["fa_verify.adapters.torch_sdpa_backward:math_backward"],
                               {"causal_alignment": "top-left"})
    except ImportError:
        print("torch not importable: torch's math backward not measured")
    if kernel:
        from fa_verify.backends.backward_kernel import BackwardKernelBackend
        backend = BackwardKernelBackend("cpu")
        why = backend.availability()
        if why.available:
            found.append(backend)
        else:
            print(f"fa2-bwd-cpu not available: {why}")
    return [b for b in found if not names or b.name in names]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-examples", type=int, default=None)
    parser.add_argument("--kernel-examples", type=int, default=6, help="examples per seed for fa2-bwd-cpu (0: skip it)")
    parser.add_argument("--target", action="append", default=[])
    parser.add_argument("--json", default=None, help="append one JSON line with every ratio to this file")
    args = parser.parse_args(argv)
    config = {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS")}
    rows, failures = [], []
    started = time.perf_counter()
    for backend in targets(args.target, args.kernel_examples > 0):
        last = []
        backend.run = _recording(backend.run, last)
        examples = args.kernel_examples if backend.name.startswith("fa2-bwd") else args.max_examples
        for seed in range(args.seeds):
            selection = Selection.from_profile(args.profile, seed=seed, max_examples=examples, shrink=False)

            def collect(problem, result, seconds, backend=backend):
                if not last or last[0][0] is not problem:
                    return
                grads = {o.name: x for o, x in zip(problem.outputs(backend.precision(problem.dtype)), last[0][1])}
                ref = gradient_reference(problem.forward, problem.dout, problem.dlse)
                ensemble = gradient_ensemble_errors(problem.forward, problem.dout, backend.precision(problem.dtype), ref,
                                                    out_given=problem.out, lse_given=problem.lse, dlse=problem.dlse)
                v = check_gradients(grads, problem.forward, problem.dout, out_given=problem.out, lse_given=problem.lse,
                                    dlse=problem.dlse, precision=backend.precision(problem.dtype), reference=ref,
                                    ensemble=ensemble)
                if not v.passed:
                    failures.append((backend.name, seed, v.rule, v.message().splitlines()[:3]))
                for name, c in v.ensemble.items():
                    if c.member is None:
                        continue
                    r = c.normalised_error / c.ensemble_error if c.ensemble_error > 0 else float("inf")
                    rows.append({"target": backend.name, "dtype": problem.dtype, "tensor": name, "r": r,
                                 "k_needed": _k_needed(c, grads[name], ref.tensors()[name][0],
                                                                       ensemble.magnitudes.of(name)), "E": c.ensemble_error,
                                 "used": c.ratio, "bound": v.tensors[name].ratio, "member": c.member,
                                 "problem": problem.describe()})

            for prop in ("gradient_agreement", "gradient_variant_agreement"):  # the variants: dsinks, softcap
                search_property(backend, prop, selection, on_result=collect)
        del backend.run
    seconds = time.perf_counter() - started
    print(f"config {config}, profile {args.profile}, {args.seeds} seeds, {len(rows)} tensor verdicts, {seconds:.0f}s")
    print(f"{'target':44s} {'n':>5s} {'r max':>8s} {'r p99':>8s} {'r med':>8s} {'K need':>8s} {'used max':>9s} "
          f"{'bound max':>9s}")
    for name in dict.fromkeys(r["target"] for r in rows):
        _line(name, [r for r in rows if r["target"] == name])
    _line("ALL", rows)
    for key, values in (("dtype", ("fp32", "fp16", "bf16")), ("tensor", ("dq", "dk", "dv", "dsinks"))):
        for value in values:
            _line(f"ALL {value}", [r for r in rows if r[key] == value])
    finish(rows, failures, args, config)


def _recording(run, last):
    def recorded(problem):
        result = run(problem)
        last[:] = [(problem, result)]
        return result
    return recorded


def _k_needed(check, got, ref, magnitude) -> float:
    """The smallest K with which this gradient passes the ensemble rule: max over its elements of
    (error - floor * magnitude - absolute floor) / (E * magnitude), 0 where the floors cover it."""
    err = np.abs(np.asarray(got, np.float64) - ref)
    spare = err - check.floor * magnitude - check.absolute_floor
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(spare > 0, spare / (check.ensemble_error * magnitude), 0.0)
    return float(np.max(k, initial=0.0))


def _line(name, rows):
    r = np.array([x["r"] for x in rows if np.isfinite(x["r"])])
    if not r.size:
        return
    used = max(x["used"] for x in rows)
    needed = max(x["k_needed"] for x in rows)
    bound = max((x["bound"] for x in rows if x["bound"] == x["bound"]), default=float("nan"))
    print(f"{name:44s} {len(rows):5d} {r.max():8.3g} {np.quantile(r, 0.99):8.3f} {np.median(r):8.3f} "
          f"{needed:8.3f} {used:9.3f} {bound:9.3f}")


if __name__ == "__main__":
    main()
