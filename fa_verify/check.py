"""Oracle agreement of a backend over Hypothesis-generated problems.

Each example: a problem from `fa_verify.strategies`, the backend's (out, lse), and the
verdict of the error model against the certified reference. On failure Hypothesis shrinks
to a minimal problem; the outcome carries it with a reproducer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import seed as hypothesis_seed

from fa_verify import strategies as fst
from fa_verify.backends import Backend
from fa_verify.errors import AttentionMismatch, BackendOutputError, FaVerifyError
from fa_verify.problem import CAUSAL_ALIGNMENTS, AttentionProblem
from fa_verify.verdict import check_attention


#: Edge cases run before the random search, so that the classes of bug they expose are always
#: looked for: (batch, heads, kv_heads, Nq, Nk, D) and a value distribution.
EDGE_CASES = (
    ((1, 1, 1, 1, 1, 8), "normal"),               # a single query and key
    ((1, 2, 1, 5, 2, 16), "normal"),              # Nq > Nk: fully masked rows under bottom-right
    ((1, 2, 2, 3, 17, 16), "normal"),             # Nq < Nk
    ((2, 4, 2, 65, 63, 32), "fa3_outliers"),      # tile +- 1, GQA, outliers
    ((1, 3, 1, 13, 31, 96), "large_logits"),      # primes, MQA, D = 96, logits in the hundreds
)


def edge_problems(dtypes, causal) -> list[AttentionProblem]:
    """The edge cases for each dtype and causal mode selected."""
    modes = [(False, "bottom-right")] * (False in causal) + \
        [(True, a) for a in CAUSAL_ALIGNMENTS] * (True in causal)
    return [fst.make_problem(dist, shape, dtype, seed=0, causal=c, causal_alignment=a)
            for shape, dist in EDGE_CASES for dtype in dtypes for c, a in modes]


class _Abort(Exception):
    """Stops Hypothesis after a setup error, which is re-raised as itself."""


@dataclass
class CheckOutcome:
    backend: str
    examples: int = 0
    seconds: float = 0.0
    #: Largest error / bound seen per dtype (error-model rule), over passing and failing examples.
    worst_ratio: dict = field(default_factory=dict)
    #: Message of the minimal failing example, with its reproducer; None when all passed.
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def as_dict(self) -> dict:
        return {"backend": self.backend, "passed": self.passed, "examples": self.examples,
                "seconds": self.seconds, "worst_ratio": self.worst_ratio, "failure": self.failure}


def reproducer(backend_name: str, problem: AttentionProblem) -> str:
    """A one-line shell command that rebuilds `problem` from its tags and checks it again."""
    tags = dict(problem.tags)
    shape = (problem.batch, problem.heads, problem.kv_heads, problem.nq, problem.nk, problem.head_dim)
    call = (f"make_problem({tags.get('distribution')!r}, {shape}, {problem.dtype!r}, "
            f"{tags.get('seed')}, causal={problem.causal}, "
            f"causal_alignment={problem.causal_alignment!r}, scale={problem.scale!r})")
    return (f"python -c \"from fa_verify.strategies import make_problem; "
            f"from fa_verify.backends import get_backend; from fa_verify.verdict import "
            f"assert_attention_close as a; b = get_backend({backend_name!r}); p = {call}; "
            f"o, l = b.run(p); a(o, p, lse=l, precision=b.precision(p.dtype))\"")


def check_backend(backend: Backend, *, dtypes=("fp16", "bf16", "fp32"), causal=(False, True),
                  max_examples: int = 100, seed: int = 0, max_seq: int = 64,
                  progress=None) -> CheckOutcome:
    """Run oracle agreement over the edge cases and `max_examples` generated problems.

    A mismatch is reported in the outcome; setup errors (FaVerifyError) are raised."""
    outcome = CheckOutcome(backend=backend.name)
    last_failure: list = []
    setup_error: list = []
    causal_strategy = fst.causal_modes(non_causal=False in causal,
                                       alignments=CAUSAL_ALIGNMENTS if True in causal else ())
    strategy = fst.problems(shapes=fst.shapes(max_seq=max_seq), dtypes=fst.dtypes(dtypes),
                            causal=causal_strategy)

    def with_edge_cases(test):
        for problem in edge_problems(dtypes, causal):
            test = example(problem)(test)
        return test

    @hypothesis_seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, print_blob=False,
              report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @with_edge_cases
    @given(strategy)
    def agreement(problem):
        if backend.supports(problem) is not None:
            reject()
        try:
            out, lse = backend.run(problem)
        except BackendOutputError as exc:  # the kernel broke the protocol: a failing example
            last_failure[:] = [problem, exc]
            raise AttentionMismatch(str(exc)) from None
        except FaVerifyError as exc:  # misuse or setup: stop, and report it as such
            setup_error[:] = [exc]
            raise _Abort from None
        verdict = check_attention(out, problem, lse=lse, precision=backend.precision(problem.dtype))
        outcome.examples += 1
        ratio = verdict.bound_ratio
        if not math.isnan(ratio):
            outcome.worst_ratio[problem.dtype] = max(ratio, outcome.worst_ratio.get(problem.dtype, 0.0))
        if progress and outcome.examples % 10 == 0:
            progress(f"{backend.name}: {outcome.examples} examples")
        if not verdict.passed:
            last_failure[:] = [problem, verdict]
            raise AttentionMismatch(verdict.message(), verdict)

    start = time.perf_counter()
    try:
        agreement()
    except _Abort:
        raise setup_error[0] from None
    except AttentionMismatch:
        # Hypothesis replays the minimal example last, so it is the one recorded.
        problem, finding = last_failure
        message = finding.message() if hasattr(finding, "message") else str(finding)
        outcome.failure = (f"minimal failing problem: {problem.describe()} "
                           f"tags={dict(problem.tags)}\n{message}\n"
                           f"reproduce: {reproducer(backend.name, problem)}")
    outcome.seconds = time.perf_counter() - start
    return outcome
