"""`fa_verify bench runner`: the CUDA-on-CPU runner's time per example, against the oracle.

The Hypothesis budget of a kernel checked through the CPU runner is set by this ratio: each
example costs one kernel run plus one certified reference, both timed here in one run. With
`racecheck`, the race detector's build of each kernel is timed on the same problems too.

`run_ci` times each kernel style on the problems `fa_verify check TARGET --property
oracle_agreement` judges under the ci profile (edge cases and draws; ragged_agreement and
gradient_agreement for a paged and a backward kernel): it runs that check once to collect them, then times the runner and the oracle
on each, interleaved, and reports examples per second of both and of the whole check.
"""

from __future__ import annotations

import numpy as np

from fa_verify.backends.cuda_kernels import CpuKernelBackend
from fa_verify.bench.timing import best_times
from fa_verify.oracle import reference
from fa_verify.oracle.backward import gradient_reference
from fa_verify.oracle.ragged import reference_ragged
from fa_verify.problem import AttentionProblem

#: each kind of problem's agreement property with the oracle
_AGREEMENT = {"dense": "oracle_agreement", "paged": "ragged_agreement", "varlen": "ragged_agreement",
              "backward": "gradient_agreement"}
#: the certified oracle of each kind of problem, as the agreement properties call it
_ORACLES = {"dense": reference, "paged": reference_ragged, "varlen": reference_ragged,
            "backward": lambda p: gradient_reference(p.forward, p.dout, p.dlse)}


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


def _ci_problems(backend, max_examples: int) -> tuple[list, object]:
    """The problems `check` judges for the agreement property under the ci profile, and the
    check's outcome (its examples and seconds)."""
    from fa_verify.properties.search import search_property
    from fa_verify.properties.selection import Selection

    prop = _AGREEMENT[backend.kinds[0]]
    selection = Selection.from_profile("ci", dtypes=backend.dtypes, max_examples=max_examples,
                                       max_edge_cases=max_examples)
    problems = []

    def keep(problem, result, seconds):
        if result.applicable:
            problems.append(problem)

    return problems, search_property(backend, prop, selection, on_result=keep)


def run_ci(backends: dict, max_examples: int = 20, repeats: int = 1, progress=None) -> dict:
    """Per style (name -> Backend): the ci problems' runner and oracle seconds, interleaved
    problem by problem (best of `repeats`), and the collecting check's own seconds."""
    rows = []
    for style, backend in backends.items():
        if progress:
            progress(f"runner bench: collecting the ci problems of {backend.name}")
        problems, outcome = _ci_problems(backend, max_examples)
        runner_s = oracle_s = 0.0
        for problem in problems:
            times = best_times({"runner": lambda: backend.run(problem),
                                "oracle": lambda: _ORACLES[problem.kind](problem)}, repeats)
            runner_s += times["runner"]
            oracle_s += times["oracle"]
        rows.append({"style": style, "backend": backend.name, "examples": len(problems),
                     "runner_s": runner_s, "oracle_s": oracle_s, "check_examples": outcome.examples,
                     "check_s": outcome.seconds, "check_status": outcome.status})
    return {"benchmark": "runner-ci", "max_examples": max_examples, "rows": rows}


def format_ci_text(result: dict) -> str:
    style = max([len("style")] + [len(r["style"]) for r in result["rows"]])
    width = max([len("backend")] + [len(r["backend"]) for r in result["rows"]])
    lines = [f"{'style':<{style}} {'backend':<{width}} {'examples':>8}  {'runner ex/s':>11}  {'oracle ex/s':>11}  "
             f"{'ratio':>6}  {'both ex/s':>9}  {'check ex/s':>10}"]
    for r in result["rows"]:
        n = r["examples"]
        lines.append(f"{r['style']:<{style}} {r['backend']:<{width}} {n:>8}  {n / r['runner_s']:>11.1f}  "
                     f"{n / r['oracle_s']:>11.1f}  {r['runner_s'] / r['oracle_s']:>6.2f}  "
                     f"{n / (r['runner_s'] + r['oracle_s']):>9.1f}  {r['check_examples'] / r['check_s']:>10.1f}")
    lines.append(f"(the problems `fa_verify check TARGET --property oracle_agreement --max-examples "
                 f"{result['max_examples']}` judges under the ci profile, ragged_ and gradient_agreement for "
                 "paged and backward kernels; ratio = runner time / oracle time; both = one run and one oracle per example; "
                 "check = the whole check, error model and Hypothesis included)")
    return "\n".join(lines)


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
