"""The backward pass's identities as properties (fa_verify.properties.gradient_identities): honest
FA2 backwards pass them, a backward with one bug class fails the identity that names it, and each
tolerance is neither 4x too loose (a violation of twice the tolerance fails) nor 4x too tight (an
honest target on a problem where the error model's coherent terms add up reaches > 1/4 of it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fa_verify import strategies as fst
from fa_verify.backends.numpy_backward import NumpyBackwardBackend
from fa_verify.backward import BackwardProblem
from fa_verify.backward_emulation import fa2_backward
from fa_verify.dtypes import numpy_dtype
from fa_verify.oracle import reference
from fa_verify.problem import AttentionProblem
from fa_verify.properties import Selection, search_property
from fa_verify.properties import gradient_identities as gi
from fa_verify.properties.backward import _named, check_gradient_agreement

HONEST = NumpyBackwardBackend()
CHECKS = {"gradient_key_sum": gi.check_gradient_key_sum, "gradient_value_sum": gi.check_gradient_value_sum,
          "gradient_gqa_group_sum": gi.check_gradient_gqa_group_sum, "gradient_adjoint": gi.check_gradient_adjoint,
          "gradient_linearity": gi.check_gradient_linearity, "gradient_key_shift": gi.check_gradient_key_shift,
          "gradient_permutation": gi.check_gradient_permutation}
#: (property, problem) pairs an identity does not hold on, by a word of the reason it gives.
NOT_APPLICABLE = {("gradient_key_sum", "fp16-softcap-window"): "1 - tanh^2",
                  ("gradient_key_shift", "fp16-softcap-window"): "softcap",
                  ("gradient_key_shift", "bf16-sinks-dlse"): "sink",
                  ("gradient_key_shift", "bf16-alibi-sinks"): "sink",
                  ("gradient_permutation", "fp16"): "causal", ("gradient_permutation", "bf16-sinks-dlse"): "causal",
                  ("gradient_permutation", "fp32-dlse"): "causal", ("gradient_permutation", "bf16-tiles"): "causal",
                  ("gradient_permutation", "fp16-softcap-window"): "window",
                  ("gradient_permutation", "bf16-alibi-sinks"): "causal",
                  ("gradient_key_sum", "fp16-noncausal-softcap-sinks-dlse"): "1 - tanh^2",
                  ("gradient_key_shift", "fp16-noncausal-softcap-sinks-dlse"): "softcap"}


def _problem(dtype="bf16", sinks=False, dlse=False, shape=(2, 4, 2, 5, 7, 8), seed=1, causal=True, **variants):
    forward = fst.make_problem("normal", fst.Shape(*shape), dtype, seed=seed, causal=causal)
    if sinks:
        forward = forward.replace(sinks=np.linspace(-1, 1, forward.heads, dtype=np.float32))
    if variants:
        forward = forward.replace(**variants)
    rng = np.random.default_rng(seed)
    return BackwardProblem.of(forward, rng.standard_normal(forward.out_shape),
                              rng.standard_normal(forward.lse_shape) if dlse else None)


class Bugged(NumpyBackwardBackend):
    """FA2's numpy backward with `bug(problem) -> (dq, dk, dv, dsinks)` in place of it."""

    def __init__(self, bug, name):
        super().__init__()
        self.bug, self.name = bug, name

    def _run(self, problem):
        dq, dk, dv, dsinks = self.bug(problem)
        return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def _fa2(problem, **changes):
    args = dict(out=problem.out, lse=problem.lse, dout=problem.dout, dlse=problem.dlse)
    args.update(changes)
    forward = args.pop("forward", problem.forward)
    return fa2_backward(forward, args["out"], args["lse"], args["dout"], args["dlse"])


def _in(x, like):
    return x.astype(np.float64).astype(like.dtype)


def no_delta(problem):
    """dS = P dP: D_i = dO_i . O_i taken as 0 (out read as zeros)."""
    return _fa2(problem, out=np.zeros_like(problem.out))


def gqa_one_head(problem):
    """A kv head's dK, dV from the first query head of its group only."""
    dq, _, _, dsinks = _fa2(problem)
    first = slice(None, None, problem.group_size)
    forward = problem.forward.replace(q=problem.q[:, first], sinks=None if problem.sinks is None
                                      else problem.sinks[first])
    one = _fa2(problem, forward=forward, out=problem.out[:, first], lse=problem.lse[:, first],
               dout=problem.dout[:, first], dlse=None if problem.dlse is None else problem.dlse[:, first])
    return dq, one[1], one[2], dsinks


def unnormalised_p(problem):
    """P = exp(z - LSE) from an LSE off by log 2: every probability halved."""
    return _fa2(problem, lse=(problem.lse.astype(np.float64) + np.log(2.0)).astype(np.float32))


def dk_negated(problem):
    """dK with the wrong sign (dS^T Q subtracted)."""
    dq, dk, dv, dsinks = _fa2(problem)
    return dq, _in(-dk.astype(np.float64), dk), dv, dsinks


def dk_rolled(problem):
    """dK of key j written at key j + 1 (mod Nk): a gradient written to another row."""
    dq, dk, dv, dsinks = _fa2(problem)
    return dq, np.roll(dk, 1, axis=2), dv, dsinks


def no_dsink(problem):
    """dsinks left at zero (fa2-bwd-no-dsink's bug class)."""
    dq, dk, dv, dsinks = _fa2(problem)
    return dq, dk, dv, np.zeros_like(dsinks)


def affine_dv(problem):
    """dV from dout + 2^-6: affine in dout, not linear."""
    dq, dk, _, dsinks = _fa2(problem)
    _, _, dv, _ = _fa2(problem, dout=_in(problem.dout.astype(np.float64) + 2.0 ** -6, problem.dout))
    return dq, dk, dv, dsinks


HONEST_PROBLEMS = {
    "fp16": _problem("fp16"),
    "bf16-sinks-dlse": _problem("bf16", sinks=True, dlse=True),
    "fp32-dlse": _problem("fp32", dlse=True),
    "fp16-softcap-window": _problem("fp16", causal=False, softcap=5.0, window_size=(3, 1)),
    "bf16-alibi-sinks": _problem("bf16", sinks=True, alibi_slopes=np.linspace(0.1, 1, 4, dtype=np.float32)),
    "bf16-tiles": _problem("bf16", shape=(1, 6, 2, 70, 130, 40)),
    "fp16-noncausal-softcap-sinks-dlse": _problem("fp16", causal=False, softcap=5.0, sinks=True, dlse=True),
}


@pytest.mark.parametrize("name", HONEST_PROBLEMS)
@pytest.mark.parametrize("prop", CHECKS)
def test_an_honest_fa2_backward_passes_every_identity(prop, name):
    result = CHECKS[prop](HONEST, HONEST_PROBLEMS[name])
    if (prop, name) in NOT_APPLICABLE:
        assert not result.applicable and NOT_APPLICABLE[prop, name] in result.detail, result.message()
    else:
        assert result.passed, result.message()


@pytest.mark.parametrize("bug, prop, says", [
    (no_delta, "gradient_key_sum", ["sum_j dK_j", "0 without sinks and dlse: the D term is missing?"]),
    (gqa_one_head, "gradient_gqa_group_sum", ["dk ([batch, kv head, key, column])", "one head taken"]),
    (gqa_one_head, "gradient_value_sum", ["sum_j dV_j ([batch, kv head, column])"]),
    (unnormalised_p, "gradient_value_sum", ["sum_j dV_j", "P not normalised by the LSE"]),
    (dk_negated, "gradient_adjoint", ["<dk, direction> ([batch, head])", "the adjoint identity"]),
    (affine_dv, "gradient_linearity", ["did not scale the gradients by exactly 2^", "dv:"]),
    (no_delta, "gradient_key_shift", ["dq ([batch, head, query, column])", "every key shifted by c on coordinates",
                                      "the D term wrong?"]),
    (dk_rolled, "gradient_permutation", ["dk ([batch, kv head, key, column]) with the keys permuted",
                                         "a gradient written to another row"]),
    (no_dsink, "gradient_adjoint", ["<dsinks, direction> ([head])", "the adjoint identity"]),
])
def test_a_bug_fails_the_identity_that_names_it(bug, prop, says):
    result = CHECKS[prop](Bugged(bug, bug.__name__), _problem("bf16", causal=prop != "gradient_permutation",
                                                              sinks=bug is no_dsink))
    assert result.failed, result.message()
    assert all(s in result.detail for s in says), result.detail
    assert "exceed the tolerance; worst at [" in result.detail or "differ; first at [" in result.detail


def test_the_search_kills_a_missing_d_term_on_its_first_examples():
    outcome = search_property(Bugged(no_delta, "no_delta"), "gradient_key_sum", Selection(max_examples=10, shrink=False))
    assert outcome.status == "failed" and outcome.examples_to_failure <= 3, outcome.message()
    assert "the D term is missing?" in outcome.message()


def test_identities_that_a_bug_keeps_pass_it():
    """Localisation: a negated dK still sums to 0 over keys; a GQA one-head dK too."""
    for bug in (dk_negated, gqa_one_head):
        assert gi.check_gradient_key_sum(Bugged(bug, bug.__name__), _problem("bf16")).passed


def test_softcap_makes_the_key_sum_not_applicable_with_the_reason():
    result = gi.check_gradient_key_sum(HONEST, HONEST_PROBLEMS["fp16-softcap-window"])
    assert not result.applicable and "1 - tanh^2" in result.detail


def test_an_mha_problem_has_no_group_to_sum():
    result = gi.check_gradient_gqa_group_sum(HONEST, _problem("bf16", shape=(1, 2, 2, 5, 7, 8)))
    assert not result.applicable and "no group to sum" in result.detail


# --- tolerances: neither 4x too loose nor 4x too tight -------------------------------------------

def coherent_d_problem(dtype, seed=0, sinks=False):
    """Values nearly equal (dP ~ D, so dS is small) and dout the sign of the given out's rounding
    error: D from the rounded out is off by sum_c |O_given - O| in every row, which shifts every
    dS_ij of the row alike, with positive q: the error model's given_out term, summed, is reached."""
    rng = np.random.default_rng(seed)
    t = numpy_dtype(dtype)
    q = rng.uniform(0.5, 1, (1, 1, 4, 8)).astype(t)
    k = rng.standard_normal((1, 1, 8, 8)).astype(t)
    v = (1 + 2.0 ** -8 * rng.standard_normal((1, 1, 8, 8))).astype(t)
    forward = AttentionProblem(q, k, v, causal=False, sinks=np.zeros(1, np.float32) if sinks else None)
    exact = reference(forward).out
    return BackwardProblem.of(forward, np.sign(exact.astype(t).astype(np.float64) - exact))


def uniform_problem(dtype, nk, dout):
    """Every key alike (k = 0): P = 1/Nk, rounded alike for every key, and every dV_j the same
    value, rounded alike: P's and dV's roundings add up in sum_j dV_j."""
    t = numpy_dtype(dtype)
    forward = AttentionProblem(np.ones((1, 1, 1, 8), t), np.zeros((1, 1, nk, 8), t),
                               np.random.default_rng(0).standard_normal((1, 1, nk, 8)).astype(t), causal=False)
    return BackwardProblem.of(forward, np.full((1, 1, 1, 8), dout))


def _law(law, problem, grads=None, *args):
    grads = grads or _named(problem, HONEST, HONEST.run(problem))
    return law(problem, grads, *gi._bounded(HONEST, problem), *args)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_an_honest_target_reaches_over_a_quarter_of_the_key_sum_tolerance(dtype):
    got, expected, tol = _law(gi.key_sum_law, coherent_d_problem(dtype))
    ratio = float((np.abs(got - expected) / tol).max())
    assert 0.25 < ratio <= 1  # measured 0.99 (fp16), 0.98 (bf16): a 4x tighter tolerance fails it


@pytest.mark.parametrize("dtype, nk, dout", [("fp16", 11, 1.9375), ("bf16", 13, 1.25)])
def test_an_honest_target_reaches_over_a_quarter_of_the_value_sum_tolerance(dtype, nk, dout):
    got, expected, tol = _law(gi.value_sum_law, uniform_problem(dtype, nk, dout))
    ratio = float((np.abs(got - expected) / tol).max())
    assert 0.25 < ratio <= 1  # measured 0.75 (fp16), 0.84 (bf16)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_an_honest_target_reaches_over_a_quarter_of_the_adjoint_tolerance(dtype):
    """Along the direction of dK's own error (its sign), <dK_hat - dK, b> = sum |error|."""
    problem = coherent_d_problem(dtype)
    grads = _named(problem, HONEST, HONEST.run(problem))
    ref, _ = gi._bounded(HONEST, problem)
    b = np.sign(grads["dk"].astype(np.float64) - ref.dk)
    direction = (np.zeros(problem.q.shape), b, np.zeros(problem.v.shape))
    got, expected, tol = _law(gi.adjoint_law, problem, grads, direction)["dk"]
    ratio = float((np.abs(got - expected) / tol).max())
    assert 0.25 < ratio <= 1  # measured 0.99 (fp16), 0.98 (bf16)


class Perturbed(NumpyBackwardBackend):
    """The honest backward with `delta` (tensor -> float64 array) added to its gradients, on the
    problems `applies(problem)` picks (default: all)."""

    def __init__(self, delta, applies=lambda problem: True):
        super().__init__()
        self.delta, self.applies, self.name = delta, applies, "perturbed"

    def _run(self, problem):
        grads = super()._run(problem)
        if not self.applies(problem):
            return grads
        names = ("dq", "dk", "dv", "dsinks")
        return tuple(_in(g.astype(np.float64) + self.delta.get(n, 0.0), g) if n in self.delta else g
                     for n, g in zip(names, grads))


def _one_element(shape, index, value):
    delta = np.zeros(shape)
    delta[index] = value
    return delta


@pytest.mark.parametrize("prop, law, tensor", [
    ("gradient_key_sum", gi.key_sum_law, "dk"),
    ("gradient_value_sum", gi.value_sum_law, "dv"),
])
def test_a_sum_off_by_twice_its_tolerance_fails(prop, law, tensor):
    problem = _problem("bf16", causal=False)
    _, _, tol = _law(law, problem)
    shape = getattr(problem, tensor[1]).shape
    result = CHECKS[prop](Perturbed({tensor: _one_element(shape, (1, 0, 3, 2), 2 * tol[1, 0, 2])}), problem)
    assert result.failed and 1.5 < result.worst_ratio < 2.5, result.message()  # a 4x looser tolerance passes it
    assert "at [1, 0, 2]" in result.detail


def test_an_adjoint_off_by_twice_its_tolerance_fails():
    problem = _problem("bf16", causal=False)
    direction = gi.random_direction(problem, 0)
    _, _, tol = _law(gi.adjoint_law, problem, None, direction)["dv"]
    c = direction[2]
    # along c, a change of dV_j at one element moves <dV, c> by c_j times it
    index = (0, 1, 4, 5)
    delta = _one_element(problem.v.shape, index, 2 * tol[0, 1] / c[index])
    result = gi.check_gradient_adjoint(Perturbed({"dv": delta}), problem, seed=0)
    assert result.failed and 1.5 < result.worst_ratio < 2.5 and "<dv, direction>" in result.detail, result.message()


def test_a_gqa_gradient_off_by_twice_its_tolerance_fails():
    problem = _problem("bf16")
    twin = gi.mha_twin(problem)
    _, bound = gi._bounded(HONEST, problem)
    _, twin_bound = gi._bounded(HONEST, twin)
    index = (1, 1, 3, 2)
    tol = bound.dk[index] + twin_bound.dk[1, 2:4, 3, 2].sum()
    result = gi.check_gradient_gqa_group_sum(Perturbed({"dk": _one_element(problem.k.shape, index, 2 * tol)},
                                                       applies=lambda p: p.group_size > 1), problem)
    assert result.failed and 1.5 < result.worst_ratio < 2.5 and "at [1, 1, 3, 2]" in result.detail, result.message()


def test_linearity_in_fp16_off_by_twice_its_tolerance_fails():
    """fp16: judged within the error model (each run within its bound of the exact, scaled gradients)."""
    problem = _problem("fp16")
    seed = 0
    k = int(np.random.default_rng(seed).choice(gi.LINEARITY_EXPONENTS))
    ref, bound = gi._bounded(HONEST, problem)
    scaled = gi._scaled(problem, k)
    _, scaled_bound = gi._bounded(HONEST, scaled)
    index = (0, 3, 2, 1)
    tol = scaled_bound.dq[index] + 2.0 ** k * bound.dq[index]
    result = gi.check_gradient_linearity(Perturbed({"dq": _one_element(problem.q.shape, index, 2 * tol)},
                                                   applies=lambda p: p is not problem), problem, seed=seed)
    assert result.failed and 1.5 < result.worst_ratio < 2.5 and "dq:" in result.detail, result.message()
    assert gi.check_gradient_linearity(HONEST, problem, seed=seed).note.startswith("not bitwise: fp16")


def test_linearity_is_bitwise_in_bf16_and_fp32_where_every_stage_stays_normal():
    for dtype in ("bf16", "fp32"):
        problem = _problem(dtype, dlse=True)
        ref, _ = gi._bounded(HONEST, problem)
        assert gi.bitwise_linearity(problem, ref, -2) is None
        for seed in range(4):  # every exponent
            assert gi.check_gradient_linearity(HONEST, problem, seed=seed).note == ""
    tiny = _problem("bf16")
    tiny = tiny.replace(dout=(tiny.dout.astype(np.float32) * 2.0 ** -20).astype(tiny.dout.dtype))
    assert "below 2^-16" in gi.bitwise_linearity(tiny, gi._bounded(HONEST, tiny)[0], 1)


# --- key shift, permutations, dsinks: the two-run tolerances ------------------------------------

class WithinModel(NumpyBackwardBackend):
    """A target the error model accepts whose errors change sign between problems: the exact
    gradients plus sign(problem) times half their bound, rounded to the output dtype (a 4x tighter
    two-run tolerance would fail it)."""

    def __init__(self, sign):
        super().__init__()
        self.sign, self.name = sign, "within-model"

    def _run(self, problem):
        ref, bound = gi._bounded(HONEST, problem)
        names = ("dq", "dk", "dv", "dsinks")
        return tuple(_in(getattr(ref, n) + self.sign(problem) * 0.5 * bound.bound(n), g)
                     for n, g in zip(names, super()._run(problem)))


def _flipping(check, problem, first):
    """check on the within-model target that errs by +beta/2 on `first(p)` problems, -beta/2 on
    the others; each run must pass gradient_agreement (the target is honest by the model)."""
    target = WithinModel(lambda p: 1.0 if first(p) else -1.0)
    result = check(target, problem, seed=0)
    return target, result


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_key_shift_tolerance_is_reached_and_a_violation_of_twice_it_fails(dtype):
    problem = _problem(dtype, causal=False, dlse=True)
    grid, moved, c = gi.key_shift_problems(problem, 0)
    on_grid = lambda p: np.array_equal(p.k, grid.k)  # noqa: E731
    # the honest FA2 backward reaches over 1/4 of dQ's (the moved keys' dS rounding times |c|)
    grads, moved_grads = (_named(p, HONEST, HONEST.run(p)) for p in (grid, moved))
    law = gi.key_shift_law(grid, moved, c, grads, moved_grads, gi._bounded(HONEST, grid)[1],
                           gi._bounded(HONEST, moved)[1])
    got, expected, tol = law["dq"]
    assert 0.25 < float((np.abs(got - expected) / tol).max()) <= 1  # measured 0.5-0.7
    # a target within the error model on each problem reaches over 1/4 of every tensor's
    target, result = _flipping(gi.check_gradient_key_shift, problem, on_grid)
    assert result.passed and 0.25 < result.worst_ratio <= 1, result.message()
    assert all(check_gradient_agreement(target, p).passed for p in (grid, moved))
    # twice the tolerance at one element of the moved problem's dk or dq fails, naming it
    for tensor, index in (("dk", (1, 0, 3, 2)), ("dq", (1, 3, 4, 2))):
        delta = _one_element(getattr(problem, tensor[1]).shape, index, 2 * law[tensor][2][index])
        result = gi.check_gradient_key_shift(Perturbed({tensor: delta}, applies=lambda p: not on_grid(p)), problem)
        assert result.failed and 1.5 < result.worst_ratio < 2.5 and f"{tensor} ([batch, " in result.detail, \
            result.message()
        assert f"at {list(index)}" in result.detail and "1 / " in result.detail


def test_the_permutation_tolerance_is_reached_and_a_violation_of_twice_it_fails():
    problem = _problem("bf16", causal=False, sinks=True, dlse=True)
    target, result = _flipping(gi.check_gradient_permutation, problem, lambda p: p is problem)
    assert result.passed and 0.25 < result.worst_ratio <= 1, result.message()  # a 4x tighter one fails it
    rng = np.random.default_rng(0)
    key_perm, query_perm = rng.permutation(problem.nk), rng.permutation(problem.nq)
    keys, queries = gi.permuted_problems(problem, key_perm, query_perm)
    assert all(check_gradient_agreement(target, p).passed for p in (problem, keys, queries))
    # twice the tolerance at one row of dQ of the query-permuted problem
    _, bound = gi._bounded(HONEST, problem)
    _, query_bound = gi._bounded(HONEST, queries)
    index = (1, 2, 4, 3)
    tol = bound.dq[1, 2, query_perm[4], 3] + query_bound.dq[index]
    bugged = Perturbed({"dq": _one_element(problem.q.shape, index, 2 * tol)},
                       applies=lambda p: np.array_equal(p.q, queries.q) and p is not problem)
    result = gi.check_gradient_permutation(bugged, problem, seed=0)
    assert result.failed and 1.5 < result.worst_ratio < 2.5, result.message()
    assert "dq ([batch, head, query, column]) with the queries permuted: 1 / " in result.detail
    assert "at [1, 2, 4, 3]" in result.detail


def test_the_dsinks_adjoint_tolerance_is_reached_and_a_violation_of_twice_it_fails():
    """D from the rounded out is off alike in every row (coherent_d_problem): dsinks' error
    sum_i Ps_i (D_hat_i - D_i) adds up, as the error model's given_out term does."""
    for dtype in ("fp16", "bf16"):
        problem = coherent_d_problem(dtype, sinks=True)
        direction = gi.random_direction(problem, 0)
        got, expected, tol = _law(gi.adjoint_law, problem, None, direction)["dsinks"]
        assert 0.25 < float((np.abs(got - expected) / tol).max()) <= 1  # measured 0.9x
    problem = _problem("bf16", sinks=True)
    direction = gi.random_direction(problem, 0)
    _, _, tol = _law(gi.adjoint_law, problem, None, direction)["dsinks"]
    e = direction[3]
    result = gi.check_gradient_adjoint(Perturbed({"dsinks": _one_element((4,), 2, 2 * tol[2] / e[2])}), problem)
    assert result.failed and 1.5 < result.worst_ratio < 2.5 and "<dsinks, direction> ([head])" in result.detail
    assert "at [2]" in result.detail, result.message()


def test_the_identities_draw_the_variants_they_hold_under_and_plain_problems():
    from hypothesis import Phase, find, settings
    from hypothesis.errors import NoSuchExample

    from fa_verify.properties import draw, get_property
    from fa_verify.properties.draw_backward import as_backward
    from fa_verify.properties.selection import Selection

    caps = draw.capabilities(HONEST, as_backward)
    assert set(caps.features) == {"window", "softcap", "alibi", "sinks"}
    few = settings(max_examples=25, database=None, derandomize=True, phases=[Phase.generate])
    small = Selection(max_seq=16, max_work=4096, typical_seq=None)
    key_sum = draw.problem_strategy(get_property("gradient_key_sum"), caps, small)
    assert find(key_sum, lambda p: "sinks" in p.features and "window" in p.features, settings=few)
    assert find(key_sum, lambda p: not p.features, settings=few)  # and plain problems
    with pytest.raises(NoSuchExample):
        find(key_sum, lambda p: "softcap" in p.features, settings=few)  # it does not hold under a softcap
    plain = draw.problem_strategy(get_property("gradient_key_sum"), dataclasses.replace(caps, features=()),
                                  small)
    with pytest.raises(NoSuchExample):
        find(plain, lambda p: bool(p.features), settings=few)  # a target with no variant: plain problems
