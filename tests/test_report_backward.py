"""`fa_verify report --sweep backward`: backward sweep points through the one runner, store and
report — a record per gradient, labelled with its tensor, errors recomputed here independently
(the mpmath gradient oracle, loops), the rules others use per record, --resume."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.judge.gradient_rules import TritonTutorialRule
from fa_verify.oracle.backward import gradient_reference
from fa_verify.report import write_report
from fa_verify.report.gradients import RULES_KEY
from fa_verify.report.runner import plan_sweep, run_sweep
from fa_verify.results import ProblemDescriptor, Record, ResultsStore
from fa_verify.sweeps import SWEEPS, Sweep, SweepPoint, grid

GRADIENTS = ("dq", "dk", "dv")
#: GQA with Nq != Nk: dq [1, 2, 5, 8] and dk, dv [1, 1, 3, 8] differ in shape, so a record of one
#: tensor labelled as another cannot match its shape or its errors.
SHAPES = [(1, 2, 1, 5, 3, 8), (1, 2, 2, 6, 6, 8)]


def _sweep(shapes=SHAPES, dtypes=("fp16", "fp32")) -> Sweep:
    return Sweep("backward", "test", grid(shapes, dtypes=dtypes, douts=("normal",)), budget_s=60.0,
                 kind="backward")


class _DkScaled:
    """numpy-fa2-backward with dk multiplied by 1.25 (a wrong scale on dK alone)."""

    name = "dk-scaled"

    def __init__(self):
        self.inner = get_backend("numpy-fa2-backward")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, problem):
        dq, dk, dv = self.inner.run(problem)
        return dq, (dk.astype(np.float64) * 1.25).astype(dk.dtype), dv


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The tiny sweep on numpy-fa2-backward and the dk-scaled one, and its rendered report."""
    out = tmp_path_factory.mktemp("backward")
    store = ResultsStore(out / "results.jsonl")
    info = run_sweep(_sweep(), [get_backend("numpy-fa2-backward"), _DkScaled()], store, out_dir=out)
    records = store.read()
    return out, records, write_report(records, out, run=info)


def test_every_point_records_each_gradient_once(swept):
    _, records, _ = swept
    points = _sweep().ordered()
    seen = Counter((r.backend, r.problem.key(), r.tensor) for r in records)
    assert set(seen.values()) == {1}
    for backend in ("numpy-fa2-backward", "dk-scaled"):
        for point in points:
            key = ProblemDescriptor.of(point.problem()).key()
            assert {t for b, k, t in seen if b == backend and k == key} == set(GRADIENTS)
    assert len(records) == 2 * len(points) * len(GRADIENTS)
    assert {r.problem.kind for r in records} == {"backward"} and {r.problem.dout for r in records} == {"normal"}


def test_a_record_rebuilds_its_points_problem():
    point = SweepPoint(SHAPES[0], "bf16", True, "normal", 3, dout="sparse")
    problem = point.problem()
    rebuilt = ProblemDescriptor.of(problem).rebuild()
    assert rebuilt.kind == "backward" and rebuilt.describe() == problem.describe()
    for name in ("q", "k", "v", "dout", "out", "lse"):
        np.testing.assert_array_equal(getattr(rebuilt, name), getattr(problem, name))
    # the seed picks dout: another seed, another dout (q, k, v drawn apart from it)
    other = SweepPoint(SHAPES[0], "bf16", True, "normal", 4, dout="sparse").problem()
    assert not np.array_equal(other.dout, problem.dout)


def _independent_magnitudes(problem):
    """dq, dk, dv's normalising magnitudes by loops over the definition, exact LSE from mpmath."""
    f = problem.forward
    q, k, v = (x.astype(np.float64) for x in (f.q, f.k, f.v))
    do = problem.dout.astype(np.float64)
    ref = gradient_reference(f, problem.dout, method="mpmath")
    B, H, Nq, D = f.out_shape
    Hkv, Nk = f.kv_heads, f.nk
    scales = {"dq": np.zeros(q.shape), "dk": np.zeros(k.shape), "dv": np.zeros(v.shape)}
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Nq):
                delta = sum(do[b, h, i, c] * ref.out[b, h, i, c] for c in range(D))
                for j in range(Nk):
                    if not f.mask[i, j]:
                        continue
                    p = math.exp(f.scale_value * float(q[b, h, i] @ k[b, g, j]) - ref.lse[b, h, i])
                    ds = p * (abs(float(do[b, h, i] @ v[b, g, j])) + abs(delta))
                    scales["dq"][b, h, i] += f.scale_value * ds * np.abs(k[b, g, j])
                    scales["dk"][b, g, j] += f.scale_value * ds * np.abs(q[b, h, i])
                    scales["dv"][b, g, j] += p * np.abs(do[b, h, i])
    return ref, scales


def test_each_gradients_errors_recomputed_independently(swept):
    """abs and normalised errors of every gradient of one run, from the mpmath oracle and loops:
    a record of dk holding dq's errors (or dk's errors under another normaliser) fails."""
    _, records, _ = swept
    point = next(p for p in _sweep().ordered() if p.shape.kv_heads == 1 and p.dtype == "fp16" and p.causal)
    problem = point.problem()
    key = ProblemDescriptor.of(problem).key()
    mine = {r.tensor: r for r in records if r.backend == "numpy-fa2-backward" and r.problem.key() == key}
    got = dict(zip(GRADIENTS, get_backend("numpy-fa2-backward").run(problem)))
    ref, scales = _independent_magnitudes(problem)
    exact = {"dq": ref.dq, "dk": ref.dk, "dv": ref.dv}
    for name in GRADIENTS:
        record = mine[name]
        err = np.abs(got[name].astype(np.float64) - exact[name])
        assert record.out_errors["abs"]["max"] == pytest.approx(err.max(), rel=1e-9, abs=1e-300)
        with np.errstate(invalid="ignore", divide="ignore"):
            normalised = np.where(err == 0, 0.0, err / scales[name])
        assert record.out_errors["normalised"]["max"] == pytest.approx(normalised.max(), rel=1e-6)
        worst = tuple(record.out_errors["worst_index"])
        assert len(worst) == 4 and all(i < n for i, n in zip(worst, exact[name].shape))
        assert normalised[worst] == pytest.approx(normalised.max(), rel=1e-6)
    # the three differ, so a swapped label would show above
    assert len({mine[n].out_errors["abs"]["max"] for n in GRADIENTS}) == 3


def test_a_wrong_gradient_fails_alone_and_each_rule_is_recorded(swept):
    _, records, _ = swept
    scaled = [r for r in records if r.backend == "dk-scaled"]
    assert {r.tensor for r in scaled if not r.passed} == {"dk"}
    assert {r.rule for r in scaled if r.tensor == "dk"} == {"error_bound"}
    assert all(r.extra["failure"]["tensor"] == "dk" for r in scaled if r.tensor == "dk")
    assert all(r.bound_ratio > 1 for r in scaled if r.tensor == "dk")
    # the Triton tutorial's rule, recomputed: accepts iff max |g - exact rounded| <= 1e-2
    rule = TritonTutorialRule()
    for r in scaled:
        problem = r.problem.rebuild()
        got = dict(zip(GRADIENTS, _DkScaled().run(problem)))[r.tensor].astype(np.float64)
        exact = getattr(gradient_reference(problem.forward, problem.dout), r.tensor)
        rounded = exact.astype(np.float16 if problem.dtype == "fp16" else np.float32).astype(np.float64)
        accepts = np.abs(got - rounded).max() <= 1e-2
        assert (r.extra[RULES_KEY][rule.name] is None) == accepts, (r.tensor, r.problem.dtype)
        assert set(r.extra[RULES_KEY]) == {"flash-attention-bwd", "torch-fudge-5", "jax-0.2", "triton-tutorial"}


def test_the_report_shows_a_row_per_gradient_and_each_rules_verdict(swept):
    out, records, data = swept
    html = (out / "index.html").read_text(encoding="utf-8")
    assert html.count("data-rules=") == len(records)
    for tensor in GRADIENTS:
        assert f"· MHA · {tensor}|" in html and f"· MQA · {tensor}|" in html
    assert html.count('data-accepts="no"') == sum(
        why is not None for r in records for why in r.extra[RULES_KEY].values())
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    totals = {(t["backend"], t["tensor"]): t for t in summary["gradient_rules"]["totals"]}
    dk = totals["dk-scaled", "dk"]
    assert dk["records"] == len(_sweep().points) and dk["fa_verify"] == 0
    assert totals["numpy-fa2-backward", "dq"]["fa_verify"] == len(_sweep().points)
    assert {c["tensor"] for c in summary["curves"]} <= set(GRADIENTS)
    md = (out / "summary.md").read_text(encoding="utf-8")
    assert "## Gradients: the rules others use" in md
    # a run is counted once, its gradients as records
    runs = 2 * len(_sweep().points)  # two backends
    assert summary["totals"]["runs"] == runs and summary["totals"]["records"] == len(records) == 3 * runs
    assert f"{runs} runs ({len(records)} records, one per gradient) of 2 backends" in md


def test_resume_reruns_nothing_and_loses_no_gradient(tmp_path):
    sweep = _sweep(SHAPES[:1], ("fp32",))
    store = ResultsStore(tmp_path / "results.jsonl")
    backend = get_backend("numpy-fa2-backward")
    first = Sweep("backward", "half", sweep.points[:1], 60.0, kind="backward")
    run_sweep(first, [backend], store)
    done = store.keys()
    plan = plan_sweep(sweep, [backend], done)
    assert sum(todo[backend.name] is None for _, _, todo in plan) == len(sweep.points) - 1
    run_sweep(sweep, [backend], store, plan=plan)
    seen = Counter((r.problem.key(), r.tensor) for r in store.read())
    assert set(seen.values()) == {1} and len(seen) == len(sweep.points) * len(GRADIENTS)


def test_a_format_2_record_reads_as_a_forward_one():
    line = json.dumps({**json.loads(_forward_record().to_json()), "format_version": 2})
    data = json.loads(line)
    del data["tensor"], data["problem"]["dout"], data["problem"]["dout_seed"]
    record = Record.from_json(json.dumps(data))
    assert record.tensor == "out" and record.problem.kind == "dense"


def _forward_record() -> Record:
    from fa_verify.results import record_from_failure
    from fa_verify.strategies import make_problem

    problem = make_problem("normal", (1, 1, 1, 4, 4, 8), "fp32", 0)
    return record_from_failure(problem, "x", get_backend("numpy-tiled").precision("fp32"), "run_error", "boom", 0.0,
                               "report")


def test_the_backward_sweep_is_of_backward_points():
    sweep = SWEEPS["backward"]
    assert sweep.kind == "backward" and all(p.kind == "backward" for p in sweep.points)
    assert {p.dtype for p in sweep.points} == {"fp16", "bf16", "fp32"}
    with pytest.raises(ValueError, match="kind"):
        Sweep("mixed", "", sweep.points[:1] + SWEEPS["quick"].points[:1], 1.0, kind="backward")
