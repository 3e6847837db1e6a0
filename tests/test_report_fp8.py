"""`fa_verify report --sweep fp8`: the FP8 sweep's points, its problems, and its figures
recomputed here independently from the backend's outputs by plain loops over the true inputs
(stored value x descale): each run's errors, the floor (the exact output rounded to bf16, by
hand: round half to even at bf16's spacing), the exactly rounded count, and the error-vs-N curves
(one per descale range, each with its floor). Units restated, not imported: bf16 keeps 8
significant bits, its smallest normal is 2^-126.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.report import write_report
from fa_verify.report.runner import run_sweep
from fa_verify.report.yardsticks import EXACTLY_ROUNDED_KEY
from fa_verify.results import EXACTLY_ROUNDED, ResultsStore
from fa_verify.strategies import make_descaled_problem, make_problem
from fa_verify.sweeps import FP8_DESCALE_RANGES, FP8_LENGTHS, SWEEPS, Sweep, grid

RANGES = ((1 / 64, 1 / 16), (16.0, 64.0))
SWEEP = Sweep("fp8-small", "two lengths, two descale ranges",
              grid([(1, 2, 2, n, n, 16) for n in (8, 12)], dtypes=("e4m3",), descales=RANGES), budget_s=60.0,
              kind="fp8")


def test_the_fp8_sweep_runs_every_length_range_and_causal_mode_with_gqa_and_a_decode_step():
    sweep = SWEEPS["fp8"]
    assert sweep.kind == "fp8" and {p.dtype for p in sweep.points} == {"e4m3"}
    assert FP8_LENGTHS == (16, 32, 64, 128, 256, 512)
    assert FP8_DESCALE_RANGES == ((1 / 64, 1 / 16), (0.5, 2.0), (16.0, 64.0))
    curve = {(p.shape.nq, p.causal, p.descales) for p in sweep.points
             if p.shape.nq == p.shape.nk and p.shape.heads == p.shape.kv_heads and p.shape.head_dim == 64}
    assert curve == {(n, c, r) for n in FP8_LENGTHS for c in (False, True) for r in FP8_DESCALE_RANGES}
    assert any(p.shape.kv_heads < p.shape.heads and p.shape.head_dim == 128 for p in sweep.points)
    assert any(p.shape.nq == 1 and p.shape.kv_heads == 1 for p in sweep.points)


@pytest.mark.parametrize("descales", FP8_DESCALE_RANGES)
def test_a_descaled_problem_stores_the_dense_values_under_descales_of_its_range(descales):
    shape = (2, 4, 2, 8, 8, 16)
    problem = make_descaled_problem("normal", shape, "e4m3", 3, descales)
    dense = make_problem("normal", shape, "fp32", 3)
    lo, hi = descales
    drawn = [np.asarray(getattr(problem, n), np.float64) for n in ("q_descale", "k_descale", "v_descale")]
    assert all(d.shape == (2, 2) and (d >= lo * (1 - 1e-7)).all() and (d <= hi * (1 + 1e-7)).all() for d in drawn)
    assert len({float(x) for d in drawn for x in d.ravel()}) == 12  # distinct across tensors and heads
    true_q = problem.q.astype(np.float64) * np.repeat(drawn[0], 2, axis=1)[..., None, None]
    true_k = problem.k.astype(np.float64) * drawn[1][..., None, None]
    # e4m3 keeps 4 significant bits: relative error 2^-4 (subnormals: 2^-10 absolute, times the descale)
    for true, x, d in ((true_q, dense.q, np.repeat(drawn[0], 2, axis=1)), (true_k, dense.k, drawn[1])):
        x = x.astype(np.float64)
        allowed = np.abs(x) * 2.0 ** -4 + 2.0 ** -10 * d[..., None, None]
        assert (np.abs(true - np.clip(x, -448 * d[..., None, None], 448 * d[..., None, None])) <= allowed).all()
    assert dict(problem.tags)["descales"] == descales and problem.output_dtype == "bf16"


def _bf16(x: float) -> float:
    """x rounded to bf16, half to even (8 significant bits)."""
    if x == 0:
        return 0.0
    exponent = max(math.frexp(abs(x))[1] - 1, -126)
    spacing = 2.0 ** (exponent - 7)
    return round(x / spacing) * spacing


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    store = ResultsStore(out / "results.jsonl")
    info = run_sweep(SWEEP, [get_backend("numpy-fa3-fp8")], store, out_dir=out)
    records = store.read()
    return records, write_report(records, out, run=info)


def _recompute(record):
    problem = record.problem.rebuild()
    out, _ = get_backend(record.backend).run(problem)
    G = problem.heads // problem.kv_heads
    dq, dk, dv = (np.asarray(getattr(problem, n), np.float64) for n in ("q_descale", "k_descale", "v_descale"))
    q, k, v = (x.astype(np.float64) for x in (problem.q, problem.k, problem.v))
    scale = 1 / math.sqrt(problem.head_dim)
    f = defaultdict(list)
    for b, h, i in np.ndindex(*problem.out_shape[:3]):
        kh = h // G
        keys = [j for j in range(problem.nk) if not problem.causal or j <= i + problem.nk - problem.nq]
        s = {j: scale * dq[b, kh] * dk[b, kh] * math.fsum(q[b, h, i] * k[b, kh, j]) for j in keys}
        m = max(s.values())
        w = {j: math.exp(s[j] - m) for j in keys}
        total = math.fsum(w.values())
        for c in range(problem.head_dim):
            o = math.fsum(w[j] * v[b, kh, j, c] * dv[b, kh] for j in keys) / total
            row_scale = math.fsum(w[j] * abs(v[b, kh, j, c] * dv[b, kh]) for j in keys) / total
            got, rounded = float(out[b, h, i, c]), _bf16(o)
            f["err"].append(abs(got - o))
            f["normalised"].append(abs(got - o) / row_scale if row_scale else 0.0)
            f["rounded_err"].append(abs(rounded - o))
            f["rounded_normalised"].append(abs(rounded - o) / row_scale if row_scale else 0.0)
            f["exact"].append(got == rounded)
    return f


def test_each_fp8_runs_figures_and_its_floor_recomputed_independently(swept):
    records, _ = swept
    assert len(records) == len(SWEEP.points) and all(r.passed for r in records)
    for r in records:
        f = _recompute(r)
        e, floor = r.out_errors, r.comparisons[EXACTLY_ROUNDED]
        assert e["abs"]["max"] == pytest.approx(max(f["err"]), rel=1e-7)
        assert e["normalised"]["max"] == pytest.approx(max(f["normalised"]), rel=1e-7)
        assert floor["abs"]["max"] == pytest.approx(max(f["rounded_err"]), rel=1e-7)
        assert floor["normalised"]["max"] == pytest.approx(max(f["rounded_normalised"]), rel=1e-7)
        assert r.extra[EXACTLY_ROUNDED_KEY] == {"count": sum(f["exact"]), "of": len(f["exact"])}
        assert r.problem.descales in RANGES and r.problem.kind == "fp8"


def test_the_curves_are_one_per_descale_range_each_with_its_floor(swept):
    records, data = swept
    assert len(data.curves) == len(RANGES)
    by_key = {(r.problem.descales, r.problem.causal, r.problem.nq): _recompute(r) for r in records}
    for curve, (lo, hi) in zip(data.curves, RANGES):
        assert curve.dtype == "e4m3" and f"descales {lo:g}–{hi:g}" in curve.shape_family
        for s in curve.series:
            key = "normalised" if s.kind == "backend" else "rounded_normalised"
            assert s.kind in ("backend", "floor")
            for n, value in s.points:
                assert value == pytest.approx(max(by_key[(lo, hi), s.causal, n][key]), rel=1e-7)
    labels = [row.bucket.label for section in data.sections for row in section.rows]
    assert sorted(labels) == sorted(f"descales {lo:g}–{hi:g} · N 1–16 · D 1–32 · MHA" for lo, hi in RANGES)
