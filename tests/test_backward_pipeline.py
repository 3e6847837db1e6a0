"""The backward pass as a kind of problem in the one pipeline: BackwardProblem, what a backward
run returns, its strategies and edge cases, the backward callable protocol, `fa_verify check
MODULE:bwd` (exit 0 for a right backward, 1 for a wrong one, naming the tensor), reproducers."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from test_cli_errors import run_cli

from fa_verify import strategies as fst
from fa_verify.backends.backward_callable import BackwardCallableBackend, is_backward
from fa_verify.backends.numpy_backward import NumpyBackwardBackend
from fa_verify.backward import BackwardProblem
from fa_verify.dtypes import finfo
from fa_verify.errors import BackendOutputError, InvalidArgumentError, InvalidProblemError
from fa_verify.oracle import reference
from fa_verify.oracle.backward import gradient_reference
from fa_verify.properties import Selection, search_property
from fa_verify.properties.draw_backward import EDGE_CASES, edge_problems
from fa_verify.properties.registry import get_property, properties_for
from fa_verify.strategies._backward import (
    ANTI_ALIGNED_LOGIT,
    ANTI_ALIGNED_SHARE,
    DLSE_SHARE,
    GRADIENT_HEADROOM,
    fitting,
)

FIXTURES = Path(__file__).parent / "fixtures"
QUICK = ("--max-examples", "8", "--dtype", "fp16", "--no-isolate")
sys.path.insert(0, str(FIXTURES))
import backward_kernels  # noqa: E402


def _problem(dtype="bf16", sinks=False, dlse=False, shape=(2, 4, 2, 5, 7, 8), seed=1, causal=True):
    forward = fst.make_problem("normal", fst.Shape(*shape), dtype, seed=seed, causal=causal)
    if sinks:
        forward = forward.replace(sinks=np.linspace(-1, 1, forward.heads, dtype=np.float32))
    rng = np.random.default_rng(seed)
    return BackwardProblem.of(forward, rng.standard_normal(forward.out_shape),
                              rng.standard_normal(forward.lse_shape) if dlse else None, tags=(("dout", "normal"),))


# --- the problem type -----------------------------------------------------------------------------

def test_a_backward_problem_is_its_forward_plus_the_upstream_gradient():
    p = _problem()
    ref = reference(p.forward)
    assert p.kind == "backward" and p.heads == 4 and p.nk == 7 and p.causal
    assert p.out.dtype == p.q.dtype and p.lse.dtype == np.float32
    assert np.array_equal(p.lse, ref.lse.astype(np.float32))  # the certified forward, rounded
    assert "out, lse from the certified forward, rounded" in p.describe() and "dout=normal" in p.describe()
    assert set(p.input_arrays()) == {"q", "k", "v", "out", "lse", "dout"}
    assert set(_problem(dlse=True).input_arrays()) == {"q", "k", "v", "out", "lse", "dout", "dlse"}


@pytest.mark.parametrize("dtype, sinks, dlse", [("bf16", True, True), ("fp16", False, False), ("fp32", True, False)])
def test_saved_and_pickled_problems_come_back_bit_for_bit(dtype, sinks, dlse):
    p = _problem(dtype, sinks, dlse)
    parameters, arrays = p.saved()
    for again in (BackwardProblem.from_saved(parameters, arrays), pickle.loads(pickle.dumps(p))):
        assert again.describe() == p.describe()
        for name in ("q", "k", "v", "dout", "out", "lse"):
            assert getattr(again, name).tobytes() == getattr(p, name).tobytes(), name
        assert (again.dlse is None) == (not dlse)


@pytest.mark.parametrize("change, named", [
    (dict(dout=np.zeros((2, 4, 5, 3), np.float32)), "dout"),
    (dict(lse=np.zeros((2, 4, 5), np.float64)), "lse"),
    (dict(dlse=np.full((2, 4, 5), np.nan, np.float32)), "dlse"),
])
def test_a_wrong_array_is_refused_by_name(change, named):
    p = _problem("fp32")
    with pytest.raises(InvalidProblemError, match=named):
        p.replace(**change)


# --- what a run returns -----------------------------------------------------------------------------

@pytest.mark.parametrize("fn, match", [
    (lambda q, k, v, out, lse, dout, **kw: (q, k), r"returned 2 items; expected \(dq, dk, dv\)"),
    (lambda q, k, v, out, lse, dout, **kw: (q, k, v[:, :, :1]), r"returned dv with shape=\(2, 2, 1, 8\)"),
    (lambda q, k, v, out, lse, dout, **kw: (q.astype(np.float32), k, v), r"returned dq .* dtype=fp32; expected"),
])
def test_a_backward_returning_the_wrong_arrays_is_told_what_was_expected(fn, match):
    with pytest.raises(BackendOutputError, match=match):
        BackwardCallableBackend(fn, name="bad").run(_problem())


def test_with_sinks_a_backward_returns_dsinks_too():
    backend = BackwardCallableBackend(backward_kernels.bwd_variants)
    problem = _problem("fp32", sinks=True)
    assert [x.shape for x in backend.run(problem)] == [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), (4,)]
    with pytest.raises(BackendOutputError, match=r"expected \(dq, dk, dv, dsinks\)"):
        BackwardCallableBackend(lambda q, k, v, out, lse, dout, *, causal, scale, sinks=None: backward_kernels.bwd(
            q, k, v, out, lse, dout, causal=causal, scale=scale), name="no-dsinks").run(problem)


def test_a_function_naming_dout_is_a_backward_and_is_checked_with_the_backward_properties():
    assert is_backward(backward_kernels.bwd) and not is_backward(lambda q, k, v, *, causal, scale: q)
    names = [p.name for p in properties_for(BackwardCallableBackend(backward_kernels.bwd))]
    assert names == ["races", "address_sanitizer", "gradient_agreement", "gradient_variant_agreement",
                     "gradient_determinism", "gradient_strided_dout", "gradient_nan_padding", "gradient_key_sum",
                     "gradient_value_sum", "gradient_gqa_group_sum", "gradient_adjoint", "gradient_linearity",
                     "gradient_key_shift", "gradient_permutation"]


# --- strategies and edge cases -----------------------------------------------------------------------

def test_anti_aligned_rows_have_a_very_negative_lse_and_the_others_keep_their_softmax():
    forward = fst.make_problem("normal", fst.Shape(1, 2, 1, 6, 65, 16), "fp16", seed=3)
    rows = [0, 4]
    moved = fst.anti_aligned(forward, rows)
    lse = reference(moved).lse
    assert (lse[:, :, rows] < -ANTI_ALIGNED_LOGIT + np.log(65) + 15).all()
    others = [1, 2, 3, 5]
    assert (lse[:, :, others] > -20).all()


def test_fitting_keeps_the_exact_gradients_below_the_dtype_with_headroom():
    forward = fst.make_problem("fp16_extremes", fst.Shape(1, 2, 1, 9, 9, 4), "fp16", seed=0)
    dout = np.random.default_rng(0).standard_normal(forward.out_shape) * 2.0**12
    fitted, _ = fitting(forward, dout, None)
    factor = fitted.reshape(-1)[0] / dout.reshape(-1)[0]
    assert factor < 1 and np.log2(factor) == round(np.log2(factor))  # a power of two: exact
    ref = gradient_reference(forward, fitted)
    largest = max(np.abs(g).max() for g in (ref.dq, ref.dk, ref.dv))
    assert largest <= float(finfo(np.float16).max) / GRADIENT_HEADROOM
    # and a gradient that fits is left alone
    assert fitting(forward, dout * 2.0**-40, None)[0] is not None
    assert np.array_equal(fitting(forward, dout * 2.0**-40, None)[0], dout * 2.0**-40)


def _drawn(seed: int, n: int = 100) -> list:
    """(dout distribution, anti-aligned, with dlse) of n fresh draws (no shrinking) under `seed`."""
    found = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fst.backward_problems(fst.problems(shapes=fst.shapes(max_seq=16)), with_dlse=True))
    def collect(problem):
        tags = dict(problem.tags)
        found.append((tags["dout"], "anti_aligned_rows" in tags, problem.dlse is not None))

    hypothesis_seed(seed)(collect)()
    return found


def test_the_drawn_shares():
    """Every dout distribution; 1 in 4 with anti-aligned rows and with dlse, of 500 fresh draws (5 seeds)."""
    draws = [d for seed in range(5) for d in _drawn(seed)]
    assert {d for d, _, _ in draws} == set(fst.DOUT_DISTRIBUTIONS)
    for column, share in ((1, ANTI_ALIGNED_SHARE), (2, DLSE_SHARE)):
        realised = np.mean([d[column] for d in draws])
        assert abs(realised - share) < 0.08, (column, realised)


def test_edge_cases_reach_every_tile_tail_with_very_negative_lse_rows():
    problems, _ = edge_problems(get_property("gradient_agreement"), NumpyBackwardBackend(), Selection())
    assert {p.nk for p in problems} == {case[0][4] for case in EDGE_CASES}
    assert {p.dtype for p in problems} == {"fp16", "bf16", "fp32"}
    tails = [p for p in problems if p.nk in (63, 65, 128)]
    assert tails and all(np.isfinite(p.lse).all() and p.lse.min() < -80 for p in tails)
    assert {dict(p.tags)["dout"] for p in problems} == {"normal", "uniform-positive", "loss-scaled"}


# --- searching -------------------------------------------------------------------------------------

def test_the_numpy_fa2_backward_passes_every_backward_property():
    backend = NumpyBackwardBackend()
    for prop in properties_for(backend):
        outcome = search_property(backend, prop, Selection(max_examples=15, max_edge_cases=6))
        assert outcome.status in ("passed", "not applicable"), outcome.message()
    assert search_property(backend, "gradient_agreement", Selection(max_examples=10)).passed


@pytest.mark.parametrize("target, options", [
    ("backward_kernels:bwd", ()),
    ("backward_kernels:bwd_bshd", ("--layout", "bshd")),
    ("backward_kernels:bwd_variants", ()),
])
def test_check_passes_a_right_backward(capsys, monkeypatch, target, options):
    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, err = run_cli(capsys, "check", target, *QUICK, *options)
    assert code == 0, out + err
    assert "PASS gradient_agreement: passed" in out and "PASS gradient_nan_padding: passed" in out


def test_check_passes_a_torch_backward(capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, err = run_cli(capsys, "check", "backward_kernels:bwd_torch", "--array", "torch", *QUICK)
    assert code == 0, out + err


@pytest.mark.parametrize("target, prop, says", [
    ("unscaled_dk", "gradient_agreement", "dk: "),
    ("gqa_one_head", "gradient_agreement", "dk: "),
    ("wrong_dout_sign", "gradient_agreement", "dv: "),
    ("nondeterministic_dk", "gradient_determinism", "a second identical call gave other bits"),
    ("reads_past_dout", "gradient_nan_padding", "inputs placed inside NaN-filled buffers changed the gradient"),
])
def test_check_fails_a_wrong_backward_naming_the_tensor(capsys, monkeypatch, tmp_path, target, prop, says):
    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, err = run_cli(capsys, "check", f"backward_kernels:{target}", "--property", prop, *QUICK,
                             "--repro-dir", str(tmp_path))
    assert code == 1, out + err
    assert f"FAIL {prop}" in out and says in out


def test_conventions_are_refused_for_a_backward(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, err = run_cli(capsys, "check", "backward_kernels:bwd", "--lse-base", "2")
    assert code == 2 and "is a backward" in err and "drop them" in err


def test_a_backward_failure_reproduces_from_its_script(capsys, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, _ = run_cli(capsys, "check", "backward_kernels:unscaled_dk", "--property", "gradient_agreement",
                           *QUICK, "--repro-dir", str(tmp_path))
    assert code == 1
    script = next(tmp_path.glob("*.py"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gradients failed rule 'error_bound'" in proc.stdout and "dk: " in proc.stdout


def test_a_backward_target_with_an_unknown_option_is_refused():
    with pytest.raises(InvalidArgumentError, match="layout"):
        BackwardCallableBackend(backward_kernels.bwd, layout="varlen")


# --- a differentiable forward through --grad -----------------------------------------------------------

def test_grad_checks_a_differentiable_forward_through_autograd(capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, err = run_cli(capsys, "check", "backward_kernels:torch_attention", "--grad", "--array", "torch",
                             *QUICK)
    assert code == 0, out + err
    assert "PASS gradient_agreement" in out
    assert "gradient_nan_padding: not applicable" in out  # autograd's leaves are its own: padding cannot reach it
    code, out, err = run_cli(capsys, "check", "backward_kernels:torch_attention_k_detached", "--grad", "--array",
                             "torch", "--property", "gradient_agreement", *QUICK)
    assert code == 1 and "dk: " in out and "got 0" in out


@pytest.mark.parametrize("target, options, says", [
    ("torch_attention", (), "give --array torch"),
    ("bwd", ("--array", "torch"), "is a backward (its signature names dout): drop --grad"),
    ("torch_attention", ("--array", "torch", "--lse-base", "2"), "about a forward's outputs, not its gradients"),
    ("torch_attention", ("--array", "torch", "--layout", "varlen"), "is a varlen function"),
])
def test_grad_refuses_what_it_cannot_differentiate(capsys, monkeypatch, target, options, says):
    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, err = run_cli(capsys, "check", f"backward_kernels:{target}", "--grad", *options)
    assert code == 2 and says in err
