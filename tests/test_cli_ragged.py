"""`fa_verify check MODULE:FUNC --layout varlen|paged`: flash-attn-style varlen and paged functions
(tests/fixtures/ragged_kernels.py) checked with the ragged properties; exit 0 for correct ones,
1 for a buggy one, 2 for misuse."""

import json
from pathlib import Path

import pytest
from test_cli_errors import run_cli

from fa_verify.backends.ragged_callable import RaggedCallableBackend
from fa_verify.properties import Selection
from fa_verify.properties import search_property

FIXTURES = Path(__file__).parent / "fixtures"
QUICK = ("--max-examples", "5", "--dtype", "fp16")


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


@pytest.mark.parametrize("target, layout, applicable, searched", [
    ("ragged_kernels:varlen_attention", "varlen", 4, 5),  # agreement, alone, independence, splits
    ("ragged_kernels:paged_attention", "paged", 6, 8),     # ... and the 3 about pages: placement, twin, unused cache
])
def test_correct_varlen_and_paged_functions_pass(capsys, target, layout, applicable, searched):
    code, out, err = run_cli(capsys, "check", target, "--layout", layout, *QUICK)
    assert code == 0, out + err
    assert f"PASS {target}: {applicable} passed, 0 failed, {searched - applicable} not applicable" in out
    assert "PASS ragged_agreement: passed, 5 examples" in out


def test_a_builtin_ragged_backend_is_checked_by_name(capsys):
    """Our split-KV kernel on the CPU runner, paged, against its varlen twin among the rest."""
    code, out, err = run_cli(capsys, "check", "split-kv-cpu", *QUICK)
    assert code == 0, out + err
    assert "PASS paged_contiguous: passed" in out
    # 8 properties of paged batches and 2 of its FP8 KV cache (fp8_agreement, kv_scale_sensitivity)
    assert "PASS split-kv-cpu: 10 passed, 0 failed, 0 not applicable" in out
    assert "PASS kv_scale_sensitivity: passed" in out


def test_a_buggy_varlen_function_fails_naming_the_sequence(capsys):
    code, out, _ = run_cli(capsys, "check", "ragged_kernels:varlen_global_seqlen_k", "--layout", "varlen", *QUICK,
                        "--property", "ragged_agreement", "--json")
    assert code == 1
    (prop,) = json.loads(out)["targets"][0]["properties"]
    assert prop["status"] == "failed" and "sequence 0 of" in prop["failure"]


def test_paged_page_sizes_are_declared_limits(capsys):
    code, out, err = run_cli(capsys, "check", "ragged_kernels:paged_page_boundary", "--layout", "paged", *QUICK,
                          "--property", "unused_cache", "--page-sizes", "16")
    assert code == 1, out + err
    assert "page_size=16" in out and "page_size=1 " not in out


@pytest.mark.parametrize("argv, message", [
    (("naive-fp32", "--layout", "varlen"), "--layout applies to MODULE:FUNC targets only"),
    (("ragged_kernels:paged_attention", "--layout", "paged", "--causal-alignment", "top-left"),
     "--causal-alignment top-left cannot be used with --layout paged"),
    (("ragged_kernels:varlen_attention", "--layout", "varlen", "--page-sizes", "16"), "give --layout paged (not varlen)"),
    (("ragged_kernels:varlen_attention", "--page-sizes", "16"), "give --layout paged (not bhsd)"),
    (("ragged_kernels:paged_attention", "--layout", "paged", "--page-sizes", "0"), "--page-sizes='0' is not valid"),
    (("ragged_kernels:paged_attention", "--layout", "paged", "--property", "oracle_agreement"),
     "a property of dense problems; ragged_kernels:paged_attention runs paged problems"),
    (("numpy-ragged-varlen", "--property", "oracle_agreement"), "a property of dense problems"),
    (("numpy-tiled", "--property", "ragged_agreement"), "a property of varlen and paged problems"),
])
def test_misuse_exits_2_naming_the_option(capsys, argv, message):
    code, _, err = run_cli(capsys, "check", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_help_describes_the_ragged_layouts(capsys):
    code, out, _ = run_cli(capsys, "check", "--help")
    assert code == 0
    for words in ("cu_seqlens_q", "flash_attn_with_kvcache", "--page-sizes", "softmax_scale"):
        assert words in out.replace("\n", " ").replace("  ", " ") or words in out


def test_a_function_writing_into_its_input_fails(capsys):
    code, out, err = run_cli(capsys, "check", "ragged_kernels:varlen_writes_into_q", "--layout", "varlen", *QUICK,
                             "--property", "ragged_agreement")
    assert code == 1, out + err
    assert "FAIL ragged_agreement" in out and "wrote into its input q" in out


def test_ragged_functions_run_isolated_a_crash_fails_the_example():
    import ragged_kernels

    backend = RaggedCallableBackend(ragged_kernels.paged_crashes, "paged", name="ragged_kernels:paged_crashes",
                                    isolate=True)
    outcome = search_property(backend, "ragged_agreement", Selection(max_examples=1, shrink=False))
    assert outcome.status == "failed" and "crashed the worker process: SIGSEGV" in outcome.failure.detail


def test_a_declared_lse_base_is_judged_per_sequence(capsys):
    argv = ("check", "ragged_kernels:varlen_lse_base2", "--layout", "varlen", *QUICK, "--property", "ragged_agreement")
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and "FAIL ragged_agreement" in out, out + err
    code, out, err = run_cli(capsys, *argv, "--lse-base", "2")
    assert code == 0 and "PASS ragged_agreement" in out and "judged under: LSE base 2" in out, out + err


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_results_and_a_shape_budget_work_for_a_builtin_ragged_backend(capsys, tmp_path):
    """One search for every kind: records (one per sequence, naming it) and the shape budget."""
    results = tmp_path / "r.jsonl"
    code, out, err = run_cli(capsys, "check", "split-kv-cpu", "--results", str(results), "--shapes", "2",
                             "--max-examples", "4", "--dtype", "fp16", "--property", "ragged_agreement")
    assert code == 0, out + err
    assert "--shapes 2: drawn from 2 shapes" in out
    records = _records(results)
    assert records and all(r["extra"]["kind"] == "paged" and r["problem"]["batch"] == 1 for r in records)
    assert {r["extra"]["part"] for r in records} == set(range(max(r["extra"]["parts"] for r in records)))
    assert all(r["extra"]["where"].startswith(f"sequence {r['extra']['part']} of ") for r in records)
    # the budget: at most 2 distinct batches (lengths, pages, splits), values drawn afresh
    batches = {(r["extra"]["parts"], r["extra"]["where"].split("(")[1]) for r in records if r["extra"]["part"] == 0}
    assert 1 <= len({b[0] for b in batches}) <= 2


def test_a_paged_function_takes_results_shapes_and_scale_precision(capsys, tmp_path):
    results = tmp_path / "r.jsonl"
    code, out, err = run_cli(capsys, "check", "ragged_kernels:paged_attention", "--layout", "paged", *QUICK,
                             "--results", str(results), "--shapes", "3", "--scale-precision", "input",
                             "--property", "ragged_agreement", "--no-isolate")
    assert code == 0, out + err
    assert "judged under: scale in the input dtype" in out or "scale" in out.split("judged under:")[1].splitlines()[0]
    assert _records(results)[0]["extra"]["target"]["kind"] == "ragged"


def test_a_ragged_failure_record_names_its_sequence(capsys, tmp_path):
    results = tmp_path / "r.jsonl"
    code, out, err = run_cli(capsys, "check", "ragged_kernels:varlen_global_seqlen_k", "--layout", "varlen", *QUICK,
                             "--property", "ragged_agreement", "--results", str(results), "--no-isolate")
    assert code == 1, out + err
    failing = [r for r in _records(results) if not r["passed"]]
    assert failing and all("sequence" in r["extra"]["where"] for r in failing)
