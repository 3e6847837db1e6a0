"""Precondition discovery (fa_verify.properties.preconditions): a failure found only on part of the
shape space is told apart from a wrong result, with the [limits] line that declares it, for every
kind of target. The CUDA kernel whose launcher hides `N % 32 == 0` is in tests/test_as_published.py."""

from __future__ import annotations

from types import SimpleNamespace

from fa_verify.backends import get_backend
from fa_verify.check import check_backend
from fa_verify.properties import Selection, as_backend
from fa_verify.properties.preconditions import Seen, explaining, run_preconditions


def _seen(nk, failed, nq=None, d=64, dtype="fp16", causal=False, mha=True):
    return Seen(nq if nq is not None else nk, nk, d, dtype, causal, mha, failed)


def test_a_tile_multiple_is_the_largest_power_of_two_every_pass_shares():
    seen = [_seen(n, n % 32 != 0, nq=7) for n in (1, 31, 32, 33, 64, 65, 96, 100, 128)]
    limit, failed, passed = explaining(seen)
    assert (limit.line, failed, passed) == ("seq-multiple = 32", 5, 4)
    assert limit.failing == "Nk with Nk % 32 ≠ 0"


def test_head_dims_equal_lengths_and_dtypes_are_found_too():
    by_d = [_seen(64, d not in (64, 128), d=d) for d in (32, 64, 64, 80, 128, 128)]
    assert explaining(by_d)[0].line == "head-dims = [64, 128]"
    by_lengths = [_seen(nk, nq != nk, nq=nq) for nq, nk in ((5, 5), (7, 9), (64, 64), (3, 3), (9, 2))]
    assert explaining(by_lengths)[0].line == "equal-seq = true"
    by_dtype = [_seen(n, dtype == "bf16", dtype=dtype) for n, dtype in ((3, "fp16"), (5, "bf16"), (7, "fp16"),
                                                                          (9, "fp32"), (2, "bf16"))]
    assert explaining(by_dtype)[0].line == "dtype = ['fp16', 'fp32']"


def test_nothing_is_said_without_an_exact_separation_or_enough_passes():
    everywhere = [_seen(n, n in (33, 64)) for n in (32, 33, 64, 96, 128)]  # fails on a multiple of 32 too
    assert explaining(everywhere) is None
    few = [_seen(n, n % 32 != 0) for n in (1, 31, 32, 64)]  # 2 passes
    assert explaining(few) is None
    assert explaining([_seen(n, False) for n in (32, 64, 96)]) is None  # nothing failed


def test_properties_explained_by_one_limit_are_reported_together():
    outcomes = [SimpleNamespace(property=name, status="failed", seen=[_seen(n, n % 16 != 0) for n in lengths])
                for name, lengths in (("oracle_agreement", (1, 16, 17)), ("convex_hull", (32, 3, 48)))]
    outcomes.append(SimpleNamespace(property="determinism", status="passed", seen=[_seen(5, False)]))
    (found,) = run_preconditions(outcomes)
    assert found.properties == ("oracle_agreement", "convex_hull") and (found.failed, found.passed) == (3, 3)
    assert found.message().startswith("precondition? oracle_agreement, convex_hull fail for every drawn Nk with "
                                      "Nk % 16 ≠ 0 (3 examples) and pass all 3 drawn multiples of 16")


def test_a_run_function_wrong_only_when_nq_differs_from_nk():
    naive = get_backend("naive-fp32")

    def run(problem):
        out, lse = naive.run(problem)
        return (out * 1.5 if problem.nq != problem.nk else out), lse

    outcome = check_backend(as_backend(run, name="equal_lengths_only", dtypes=("fp32",)),
                            Selection.from_profile("ci", seed=3), properties=["oracle_agreement"])
    assert not outcome.passed
    lines = [p.message() for p in outcome.preconditions()]
    assert any("Nq ≠ Nk" in line and "equal-seq = true (--equal-seq)" in line for line in lines), lines
