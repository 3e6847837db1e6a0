"""`fa_verify bench runner`: the CUDA-on-CPU runner's time per example, against the oracle.

The Hypothesis budget of a kernel checked through the CPU runner is set by this ratio: each
example costs one kernel run plus one certified reference, both timed here in one run. With
`racecheck`, the race detector's build of each kernel is timed on the same problems too.
"""

from __future__ import annotations

import numpy as np

from fa_verify.backends.cuda_kernels import CpuKernelBackend
from fa_verify.bench.timing import best_times
from fa_verify.oracle import reference
from fa_verify.problem import AttentionProblem


def _problem(n: int, head_dim: int, dtype: str, seed: int) -> AttentionProblem:
    rng = np.random.default_rng(seed)
    shape = (1, 2, n, head_dim)
    return AttentionProblem.from_float(*(rng.standard_normal(shape) for _ in range(3)), dtype,
                                       causal=True)


def run(families=("fa2", "wmma"), sizes=(64, 256, 1024), head_dim: int = 64, dtype: str = "fp16",
        repeats: int = 2, seed: int = 0, racecheck: bool = False, progress=None) -> dict:
    """Time each kernel family through the CPU runner (and its race detector build, with
    `racecheck`) and the certified reference per size."""
    backends = [CpuKernelBackend(family) for family in families]
    rows = []
    for n in sizes:
        problem = _problem(n, head_dim, dtype, seed)
        functions = {"reference": lambda: reference(problem)}
        for backend in backends:
            if progress:
                progress(f"runner bench: {backend.name} N={n} D={head_dim} {dtype}")
            backend.run(problem)  # build and warm the worker outside the timing
            functions[backend.name] = lambda backend=backend: backend.run(problem)
            if racecheck:
                backend.run_racecheck(problem)
                functions[backend.name + " racecheck"] = lambda backend=backend: backend.run_racecheck(problem)
        times = best_times(functions, repeats)
        for backend in backends:
            rows.append({"backend": backend.name, "n": n, "head_dim": head_dim, "dtype": dtype,
                         "batch": 1, "heads": 2, "causal": True,
                         "runner_s": times[backend.name], "reference_s": times["reference"],
                         "ratio": times[backend.name] / times["reference"]})
            if racecheck:
                rows[-1]["racecheck_s"] = times[backend.name + " racecheck"]
    return {"benchmark": "runner", "rows": rows}


def format_text(result: dict) -> str:
    racecheck = any("racecheck_s" in r for r in result["rows"])
    lines = [f"{'backend':<10} {'N':>6} {'D':>4}  {'CPU runner':>10}  {'reference':>10}  {'ratio':>7}"
             + (f"  {'racecheck':>10}  {'x runner':>8}" if racecheck else "")]
    for r in result["rows"]:
        lines.append(f"{r['backend']:<10} {r['n']:>6} {r['head_dim']:>4}  {r['runner_s']:>9.4f}s  "
                     f"{r['reference_s']:>9.4f}s  {r['ratio']:>7.1f}"
                     + (f"  {r['racecheck_s']:>9.4f}s  {r['racecheck_s'] / r['runner_s']:>8.1f}" if racecheck else ""))
    lines.append("(B=1, H=2, causal, per example; reference = the certified oracle)")
    return "\n".join(lines)
