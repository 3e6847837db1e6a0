"""D_v != D_qk (FlashAttention-3's 192/128, MLA's 576/512): v and the output have their own head dim.

The problem model, the oracle against mpmath, the error model and the ensemble, the limit that
declares it (--head-dims-v), the strategies and edge cases that draw it, every dense property
and variant on it, a callable taking it, and fa2's 192/128 entry with its D_v mutant.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_verify import strategies as fst
from fa_verify.backends import NumpyTiledBackend, get_backend
from fa_verify.backends.cuda_kernels import cpu_runner_availability, run_on_cpu
from fa_verify.backends.user_callable import CallableBackend
from fa_verify.backward import BackwardProblem
from fa_verify.errors import BackendOutputError, InvalidArgumentError, InvalidProblemError
from fa_verify.honest_ensemble import ensemble_errors
from fa_verify.kernels.mutants import load_mutants
from fa_verify.kernels.spec import KernelSpec
from fa_verify.limits import Limits, parse_limits
from fa_verify.oracle import reference
from fa_verify.problem import AttentionProblem
from fa_verify.properties.draw import capabilities, edge_problems, problem_strategy
from fa_verify.properties.registry import PROPERTIES, get_property
from fa_verify.properties.reproduce import load_problem, save_problem
from fa_verify.properties.selection import Selection
from fa_verify.ragged import RaggedProblem
from fa_verify.verdict import check_attention

CPU = cpu_runner_availability()


def _problem(d=24, dv=8, dtype="fp16", nq=5, nk=7, heads=2, kv_heads=1, seed=0, **options):
    return fst.make_problem("normal", (1, heads, kv_heads, nq, nk, d, dv), dtype, seed, **options)


# --- the problem model -------------------------------------------------------------------------------


def test_v_and_the_output_have_their_own_head_dim_and_the_scale_keeps_q_and_k_s():
    p = _problem(d=24, dv=8)
    assert (p.head_dim, p.head_dim_v, p.out_shape, p.v.shape) == (24, 8, (1, 2, 5, 8), (1, 1, 7, 8))
    assert p.scale_value == 1 / np.sqrt(24)
    assert "D=24 Dv=8" in p.describe() and "Dv" not in _problem(dv=24).describe()
    assert fst.Shape.of(p) == fst.Shape.coerce((1, 2, 1, 5, 7, 24, 8)) == fst.Shape(1, 2, 1, 5, 7, 24, head_dim_v=8)
    assert fst.Shape(1, 1, 1, 1, 1, 4).head_dim_v == 4


def test_inconsistent_shapes_are_refused_naming_the_argument():
    p = _problem()
    with pytest.raises(InvalidProblemError, match=r"v.shape=\(1, 1, 6, 8\) must agree on \[B, Hkv, Nk\]"):
        AttentionProblem(p.q, p.k, p.v[:, :, :6])
    with pytest.raises(InvalidProblemError, match=r"k.shape=\(1, 1, 7, 8\): its head dim D=8 must be q's D=24"):
        AttentionProblem(p.q, p.k[..., :8], p.v)
    with pytest.raises(InvalidProblemError, match="the backward pass needs D_v = D"):
        BackwardProblem.of(p, np.zeros(p.out_shape, p.q.dtype))


def test_reproducers_and_ragged_batches_keep_d_v(tmp_path):
    p = _problem(causal=True)
    save_problem(p, tmp_path / "dv.npz")
    again = load_problem(tmp_path / "dv.npz")
    assert again.v.shape == p.v.shape and np.array_equal(again.v, p.v)
    batch = RaggedProblem.from_varlen(np.concatenate([p.q[0].transpose(1, 0, 2)] * 2),
                                      np.concatenate([p.k[0].transpose(1, 0, 2)] * 2),
                                      np.concatenate([p.v[0].transpose(1, 0, 2)] * 2), [0, 5, 10], [0, 7, 14])
    assert batch.head_dim_v == 8 and batch.out_shape == (10, 2, 8)


# --- oracle, error model, ensemble -------------------------------------------------------------------


@pytest.mark.parametrize("d, dv, options", [(24, 8, dict(causal=True)), (3, 40, dict()),
                                            (16, 5, dict(softcap=2.0, sinks=np.array([0.5, -1.0])))])
def test_the_certified_oracle_is_within_its_bound_of_mpmath(d, dv, options):
    p = _problem(d, dv, "bf16").replace(**options)
    fast, exact = reference(p), reference(p, method="mpmath")
    assert fast.out.shape == fast.out_bound.shape == fast.row_scale.shape == (1, 2, 5, dv)
    assert (np.abs(fast.out - exact.out) <= fast.out_bound + exact.out_bound).all()
    live = np.isfinite(exact.lse)
    assert (np.abs(fast.lse - exact.lse)[live] <= (fast.lse_bound + exact.lse_bound)[live]).all()


@pytest.mark.parametrize("name", ["numpy-tiled", "naive-same-precision", "torch-sdpa-math"])
def test_correct_backends_pass_the_error_model_and_the_ensemble(name):
    backend = get_backend(name)
    for seed, (d, dv) in enumerate([(192, 128), (576, 512), (8, 64)]):
        p = _problem(d, dv, "bf16", nq=3, nk=9, seed=seed, causal=seed % 2 == 1)
        out, lse = backend.run(p)
        verdict = check_attention(out, p, lse=lse, precision=backend.precision("bf16"))
        assert verdict.passed, verdict.message()


def test_the_ensemble_members_output_d_v_columns():
    p = _problem(d=24, dv=8)
    errors = ensemble_errors(p, get_backend("numpy-tiled").precision("fp16"), reference(p))
    assert 0 < max(errors.errors.values()) < 2e-3


# --- limits and strategies ---------------------------------------------------------------------------


def test_the_limit_is_spelled_as_the_other_head_dims():
    assert parse_limits({"head-dims-v": "512,128"}).head_dims_v == (128, 512)
    assert parse_limits({"head_dims_v": "ANY"}).head_dims_v == "any"
    with pytest.raises(InvalidArgumentError, match="--head-dims-v=.*'any'"):
        parse_limits({"head-dims-v": "many"})
    limits = Limits(head_dims_v=(128,))
    assert limits.check(_problem(192, 128)) is None and limits.check(_problem(64, 64)) is None
    assert "D_v=8 != D=24 (declared by --head-dims-v)" in Limits().check(_problem())
    assert "D_v = D or in {128}" in limits.describe() and not limits.declared
    assert limits.adapt(fst.Shape(1, 1, 1, 3, 3, 192, head_dim_v=512)).head_dim_v == 192
    assert Limits(head_dims_v="any").as_dict()["head-dims-v"] == "any"


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_shapes_draw_d_v_only_where_allowed(data):
    plain = data.draw(fst.shapes())
    assert plain.head_dim_v == plain.head_dim
    pair = data.draw(fst.shapes(head_dims=(64,), max_head_dim=256, head_dims_v=((192, 128),)))
    assert (pair.head_dim, pair.head_dim_v) in ((64, 64), (192, 128)) and pair.work <= fst.DEFAULT_MAX_WORK


def test_any_d_v_is_drawn_independently_and_shrinks_to_d():
    seen = set()

    @settings(max_examples=150, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(fst.shapes(head_dims_v="any"))
    def draw(shape):
        seen.add(shape.head_dim_v == shape.head_dim)
        assert shape.work <= fst.DEFAULT_MAX_WORK

    draw()
    assert seen == {True, False}
    with pytest.raises(InvalidArgumentError, match="head_dims_v="):
        fst.shapes(head_dims_v=(128,))


def test_targets_declaring_d_v_get_its_edge_cases_and_others_none():
    selection = Selection(dtypes=("bf16",), causal=(False,))
    prop = get_property("oracle_agreement")

    def pairs(name):
        problems, _ = edge_problems(prop, get_backend(name), selection)
        return {(p.head_dim, p.head_dim_v) for p in problems if p.head_dim_v != p.head_dim}

    assert pairs("numpy-tiled") == {(192, 128), (576, 512)}
    assert pairs("torch-sdpa-flash-cpu") == set()
    assert capabilities(get_backend("torch-sdpa-flash-cpu")).head_dims_v is None
    if CPU.available:
        assert capabilities(get_backend("fa2-cpu")).head_dims_v == ((192, 128),)
        assert pairs("fa2-cpu") == {(192, 128)}


# --- properties and targets --------------------------------------------------------------------------


def _dense_properties():
    """(target, property, D, D_v) for every dense property a target of ours is checked by:
    numpy-tiled (any D_v) at 24/8 and fa2 on the CPU runner at its 192/128 entry."""
    cases = []
    for prop in PROPERTIES:
        if "dense" in prop.kinds and prop.target_reason is None:
            cases.append(pytest.param("numpy-tiled", prop, 24, 8, id=f"numpy-tiled-{prop.name}"))
            cases.append(pytest.param("fa2-cpu", prop, 192, 128, id=f"fa2-cpu-{prop.name}",
                                      marks=pytest.mark.skipif(not CPU.available, reason=CPU.reason)))
    return cases


@pytest.mark.parametrize("name, prop, d, dv", _dense_properties())
def test_every_dense_property_and_variant_holds_on_d_v_problems(name, prop, d, dv):
    backend = get_backend(name)
    features = dict(window_size=(3, 1), softcap=3.0, alibi_slopes=np.array([0.25, 0.5], np.float32),
                    sinks=np.array([0.5, -0.5], np.float32)) if prop.features else {}
    shape = (2, 2, 1, 48, 40, d, dv) if prop.large else (1, 2, 1, 9, 12, d, dv)
    problem = fst.make_problem("normal", shape, "fp32", 3, causal=prop.masking == "causal").replace(**features)
    result = prop(backend, problem, seed=1)
    # numpy-tiled copies its inputs (NaN padding cannot reach it); a statistic may find too few rows
    expected = ("passed", "not applicable") if prop.large or (prop.name, name) == ("nan_padding", "numpy-tiled") \
        else ("passed",)
    assert result.status in expected, result.detail


def _bshd_attention(q, k, v, *, causal, scale):
    """Attention in flash_attn_func's layout, v with its own last dim."""
    q, k, v = (x.astype(np.float64).transpose(0, 2, 1, 3) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
    s = scale * q @ k.swapaxes(-1, -2)
    if causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.arange(nk) <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p @ v / p.sum(axis=-1, keepdims=True)).transpose(0, 2, 1, 3).astype(np.float32)


def test_a_callable_takes_v_with_its_own_dim_when_it_declares_it():
    problem = _problem(192, 128, "fp32", nq=4, nk=6)
    plain = CallableBackend(_bshd_attention, layout="bshd", isolate=False)
    assert "--head-dims-v" in plain.supports(problem)
    declared = CallableBackend(_bshd_attention, layout="bshd", isolate=False, limits={"head-dims-v": "any"})
    out, _ = declared.run(problem)
    assert out.shape == (1, 2, 4, 128) and check_attention(out, problem, precision=declared.precision("fp32")).passed


# --- our kernel --------------------------------------------------------------------------------------


@pytest.mark.skipif(not CPU.available, reason=CPU.reason)
def test_the_d_v_mutant_writes_outside_its_output_and_only_at_192_128():
    from fa_verify.judge.mutants import mutant_module

    mutant = next(m for m in load_mutants() if m.name == "fa2-dv-output-stride")
    module = mutant_module(mutant)
    equal = _problem(64, 64, nq=40, nk=33)
    out, _ = run_on_cpu(mutant.kernel_family, equal, module=module)
    assert out.shape == (1, 2, 40, 64)
    with pytest.raises(BackendOutputError, match="written past its end|never written"):
        run_on_cpu(mutant.kernel_family, _problem(192, 128, nq=40, nk=33), module=module)


def test_a_kernel_spec_refuses_d_v_until_its_expressions_name_it():
    table = tomllib.loads((Path(__file__).parent / "cuda_cpu_kernels" / "published_flash.toml").read_text())
    table["limits"]["head-dims-v"] = [32]
    with pytest.raises(InvalidArgumentError, match="limits.head-dims-v declares D_v != D but no parameter or entry "
                                                   "reads Dv"):
        KernelSpec.from_dict(table, origin="published_flash.toml")


class _Instantiated(NumpyTiledBackend):
    """A kernel instantiated for D = 64 and for D = 192 with D_v = 128 only (as a catalogue family)."""

    name = "instantiated-64-and-192-128"
    limits = Limits(head_dims_v=(128,))

    def supports(self, problem):
        dims = (problem.head_dim, problem.head_dim_v)
        return super().supports(problem) or (None if dims in ((64, 64), (192, 128)) else f"no entry for {dims}")


def test_a_pair_wider_than_every_plain_head_dim_is_still_drawn():
    caps = capabilities(_Instantiated())
    assert caps.head_dims == (64,) and caps.head_dims_v == ((192, 128),)
    strategy = problem_strategy(get_property("convex_hull"), caps, Selection(dtypes=("fp32",)))
    seen = set()

    @settings(max_examples=60, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(problem):
        seen.add((problem.head_dim, problem.head_dim_v))

    draw()
    assert seen == {(64, 64), (192, 128)}


def test_the_quick_and_default_sweeps_run_192_128_on_the_backends_declaring_it():
    """The report's default (quick) sweep and the default sweep have D = 192 with D_v = 128 for
    every dtype and causal mode; a backend whose Limits declare the pair runs it, the others
    list it as unsupported."""
    from fa_verify.backends.naive import NaiveBackend
    from fa_verify.backends.torch_sdpa import TorchSdpaBackend
    from fa_verify.report.runner import plan_sweep
    from fa_verify.sweeps import CAUSAL, DTYPES, SWEEPS, Sweep

    for name in ("quick", "default"):
        points = [p for p in SWEEPS[name].points if p.shape.head_dim_v != p.shape.head_dim]
        assert {(p.shape.head_dim, p.shape.head_dim_v) for p in points} == {(192, 128)}, name
        assert {(p.dtype, p.causal) for p in points} == {(d, c) for d in DTYPES for c in CAUSAL}, name
    points = tuple(p for p in SWEEPS["quick"].points if p.shape.head_dim_v != p.shape.head_dim)
    declares, does_not = NaiveBackend("same-precision"), TorchSdpaBackend("flash-cpu")
    plan = plan_sweep(Sweep("dv", "", points, 1.0), [declares, does_not])
    assert all(todo[declares.name] is None for _, _, todo in plan)
    assert all("D_v=128 != D=192" in todo[does_not.name] for _, _, todo in plan)
