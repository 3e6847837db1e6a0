"""The results store: records round-trip, appends survive interruption and concurrency."""

from __future__ import annotations

import json
import math
import multiprocessing

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import AttentionProblem
from fa_verify.results import (
    FORMAT_VERSION,
    RUN_ERROR,
    ProblemDescriptor,
    Record,
    ResultsStore,
    ResultsWarning,
    record_from_error,
    record_from_verdict,
)
from fa_verify.strategies import make_problem
from fa_verify.verdict import check_attention


def _record(seed=0, backend="numpy-tiled", dtype="bf16", causal=True, **kwargs) -> Record:
    problem = make_problem("fa3_outliers", (1, 2, 1, 9, 12, 16), dtype, seed, causal=causal)
    b = get_backend(backend)
    out, lse = b.run(problem)
    verdict = check_attention(out, problem, lse=lse, precision=b.precision(dtype))
    return record_from_verdict(problem, b.name, b.precision(dtype), verdict,
                               {"run": 0.5, "check": 0.25}, "check", **kwargs)


def test_record_carries_the_problem_the_verdict_and_round_trips():
    record = _record(seed=3, extra={"test": "t::x"}, sweep="quick")
    p = record.problem
    assert (p.batch, p.heads, p.kv_heads, p.nq, p.nk, p.head_dim) == (1, 2, 1, 9, 12, 16)
    assert (p.dtype, p.causal, p.causal_alignment, p.scale) == ("bf16", True, "bottom-right", None)
    assert (p.distribution, p.seed) == ("fa3_outliers", 3)
    assert record.precision["p_rounding"] == "bf16"
    assert set(record.out_errors) == {"dtype", "abs", "normalised", "ulp", "worst_index"}
    assert set(record.out_errors["ulp"]) == {"max", "p99", "median", "rmse", "mean", "count"}
    assert record.lse_errors["count"] == 2 * 9
    assert record.passed and record.rule is None and 0 < record.bound_ratio < 1
    assert record.seconds == {"run": 0.5, "check": 0.25}
    assert record.format_version == FORMAT_VERSION
    line = record.to_json()
    assert "\n" not in line
    assert Record.from_json(line) == record
    assert p.rebuild().q.tobytes() == make_problem(
        "fa3_outliers", p.shape, "bf16", 3, causal=True).q.tobytes()


def test_record_from_error_is_a_failure_with_the_message():
    problem = make_problem("normal", (1, 1, 1, 4, 4, 8), "fp16", 0)
    b = get_backend("numpy-tiled")
    record = record_from_error(problem, b.name, b.precision("fp16"), RuntimeError("boom <x>"), 1.5, "report")
    assert not record.passed and record.rule == RUN_ERROR
    assert record.extra["error"] == "RuntimeError: boom <x>" and record.seconds == {"run": 1.5}
    assert Record.from_json(record.to_json()) == record


def test_unknown_source_is_rejected():
    problem = make_problem("normal", (1, 1, 1, 2, 2, 8), "fp32", 0)
    with pytest.raises(InvalidArgumentError, match="source='ci'"):
        record_from_error(problem, "x", {}, ValueError(), 0, "ci")


def test_store_appends_reads_and_lists_keys(tmp_path):
    store = ResultsStore(tmp_path / "sub" / "results.jsonl")
    assert store.read() == [] and store.keys() == set()
    a, b = _record(seed=1), _record(seed=2, sweep="quick")
    store.append(a)
    store.append(b)
    assert store.read() == [a, b]
    assert store.keys() == {a.key(), b.key()}
    assert store.keys(sweep="quick") == {b.key()}
    assert a.key() == ("numpy-tiled", a.problem.key())


def test_truncated_last_line_is_skipped_and_the_next_append_starts_a_new_line(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    a = _record(seed=1)
    store.append(a)
    with open(store.path, "a") as f:
        f.write(a.to_json()[:50])  # an interrupted writer
    with pytest.warns(ResultsWarning, match="truncated last line"):
        assert store.read() == [a]
    store.append(a)
    with pytest.warns(ResultsWarning, match="unreadable line"):
        assert store.read() == [a, a]


def test_records_of_another_format_version_are_skipped_with_a_warning(tmp_path):
    store = ResultsStore(tmp_path / "results.jsonl")
    a = _record()
    future = json.loads(a.to_json()) | {"format_version": FORMAT_VERSION + 1, "new": 1}
    store.path.write_text(json.dumps(future) + "\n" + a.to_json() + "\n")
    with pytest.warns(ResultsWarning, match=f"format_version={FORMAT_VERSION + 1}"):
        assert store.read() == [a]


def test_non_finite_errors_survive_the_round_trip():
    record = _record()
    worse = Record.from_json(record.to_json().replace(
        f'"bound_ratio":{record.bound_ratio!r}', '"bound_ratio":Infinity'))
    assert math.isinf(worse.bound_ratio)


def _append_many(path, line_json, count):
    store = ResultsStore(path)
    record = Record.from_json(line_json)
    for i in range(count):
        store.append(Record(**{**record.__dict__, "extra": {"i": i, "pad": "x" * 5000}}))


def test_concurrent_appenders_never_interleave(tmp_path):
    path = tmp_path / "results.jsonl"
    line = _record().to_json()
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_append_many, args=(path, line, 40)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 160
    records = [Record.from_json(x) for x in lines]  # every line is one whole record
    assert sorted(r.extra["i"] for r in records) == sorted(list(range(40)) * 4)


def test_descriptor_of_a_problem_without_tags_cannot_be_rebuilt():
    q = np.ones((1, 1, 2, 4), np.float32)
    descriptor = ProblemDescriptor.of(AttentionProblem(q, q, q))
    assert descriptor.distribution is None
    with pytest.raises(InvalidArgumentError, match="cannot be rebuilt"):
        descriptor.rebuild()
