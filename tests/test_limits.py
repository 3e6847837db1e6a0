"""Declared limits: one parser for the CLI, the pytest plugin, TOML and the API; drawing within
the limits; the probe, edge cases and derived problems respecting them; and the issue's kernel
(fp16, D in {64, 128}, N a multiple of 64, Nq = Nk, MHA, causal only) checked in one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from fa_verify import strategies as fst
from fa_verify.backends import CallableBackend, get_backend
from fa_verify.cli.main import main
from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import Limits, limits_from_options, parse_limits
from fa_verify.properties import PROPERTIES, Selection, get_property
from fa_verify.properties.draw import capabilities, edge_problems, problem_strategy
from fa_verify.properties.masking import check_fully_masked_rows
from fa_verify.properties.online_softmax import check_merge_law

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))
from feature_kernels import correct as with_variants  # noqa: E402
from user_kernels import float64_then_round, limited_fp16_causal  # noqa: E402

pytest_plugins = ["pytester"]

#: The issue's kernel, declared as on the command line.
KERNEL_OPTIONS = ("--dtype", "fp16", "--head-dims", "64,128", "--seq-multiple", "64", "--equal-seq",
                  "--heads", "mha", "--causal", "yes")
KERNEL_LIMITS = Limits(dtypes=("fp16",), head_dims=(64, 128), seq_multiple=64, equal_seq=True, heads=("mha",),
                       causal=(True,))


def test_one_parser_reads_strings_toml_values_and_keywords_alike(tmp_path):
    from_strings = parse_limits({"dtype": "fp16", "head-dims": "128,64", "seq-multiple": "64",
                                 "equal-seq": "yes", "heads": "MHA", "causal": "yes"})
    from_values = parse_limits({"dtype": ["fp16"], "head_dims": [64, 128], "seq_multiple": 64,
                                "equal_seq": True, "heads": ["mha"], "causal": "yes"}, prefix="")
    toml = tmp_path / "limits.toml"
    toml.write_text('dtype = "fp16"\nhead-dims = [64, 128]\nseq-multiple = 64\nequal-seq = true\n'
                    'heads = ["mha"]\ncausal = "yes"\n')
    assert from_strings == from_values == limits_from_options({}, toml) == KERNEL_LIMITS
    # an option given wins over the file
    assert limits_from_options({"seq-multiple": "32"}, toml).seq_multiple == 32
    assert KERNEL_LIMITS.describe() == "fp16; D in {64, 128}; N a multiple of 64; Nq = Nk; MHA; causal only"
    assert Limits().describe() == "none declared" and not Limits().declared


@pytest.mark.parametrize("values, named, fix", [
    ({"head-dims": "64,x"}, "--head-dims='64,x'", "--head-dims 64,128"),
    ({"head-dims": "0"}, "--head-dims='0'", "--head-dims 64,128"),
    ({"seq-multiple": "-64"}, "--seq-multiple='-64'", "--seq-multiple 64"),
    ({"equal-seq": "maybe"}, "--equal-seq='maybe'", "--equal-seq yes"),
    ({"heads": "mha,moe"}, "--heads='mha,moe'", "--heads mha,gqa"),
    ({"causal": "sometimes"}, "--causal='sometimes'", "--causal yes"),
    ({"group-sizes": "2,0"}, "--group-sizes='2,0'", "--group-sizes 1,2,4,8"),
    ({"group-sizes": "1", "heads": "gqa,mqa"}, "allow no head layout", "add to --group-sizes"),
    ({"dtype": "fp8"}, "--dtype='fp8'", "--dtype fp16,bf16"),
    ({"tile": "64"}, "--tile is not a limit", "--seq-multiple"),
    ({"seq-min": "100", "seq-max": "120", "seq-multiple": "64"}, "allow no sequence length", "raise --seq-max"),
])
def test_bad_limit_values_name_the_option_and_the_fix(values, named, fix):
    with pytest.raises(InvalidArgumentError) as exc:
        parse_limits(values)
    assert named in str(exc.value) and fix in str(exc.value)


def test_bad_limits_are_usage_errors_in_the_cli(capsys, tmp_path):
    def usage_error(*argv):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        return err

    target = "user_kernels:float64_then_round"
    assert "--head-dims='64;128'" in usage_error("check", target, "--head-dims", "64;128")
    assert "--group-sizes='two'" in usage_error("check", target, "--group-sizes", "two")
    assert "limits are their own" in usage_error("check", "numpy-tiled", "--seq-multiple", "64")
    bad = tmp_path / "bad.toml"
    bad.write_text("head-dims = [64, 'x']\n")
    assert f"--limits {bad}: head-dims=" in usage_error("check", target, "--limits", bad)
    assert "cannot read it" in usage_error("check", target, "--limits", tmp_path / "missing.toml")


def test_the_api_takes_limits_or_a_dict_of_the_same_keys():
    backend = CallableBackend(limited_fp16_causal, limits={"dtype": "fp16", "head_dims": [64, 128],
                                                           "seq_multiple": 64, "equal_seq": True, "heads": "mha",
                                                           "causal": "yes"})
    assert backend.limits == KERNEL_LIMITS and backend.dtypes == ("fp16",)
    with pytest.raises(InvalidArgumentError, match=r"limits.head-dims='x' is not valid.*limits.head-dims=64,128"):
        CallableBackend(limited_fp16_causal, limits={"head_dims": "x"})


def test_check_and_adapt():
    problem = fst.make_problem("normal", (1, 2, 1, 64, 128, 64), "fp16", 0, causal=True)
    reason = KERNEL_LIMITS.check(problem)
    assert "Nq=64 != Nk=128 (declared by --equal-seq)" in reason and "MQA (H=2, Hkv=1) (declared by --heads)" in reason
    assert KERNEL_LIMITS.check(fst.make_problem("normal", (1, 2, 2, 128, 128, 64), "fp16", 0, causal=True)) is None
    # N = tile - 1, tile + 1 become the nearest allowed lengths; Nq follows Nk under Nq = Nk
    assert KERNEL_LIMITS.adapt(fst.Shape(2, 4, 2, 65, 63, 32)) == fst.Shape(2, 4, 4, 64, 64, 64)
    assert KERNEL_LIMITS.adapt(fst.Shape(1, 2, 1, 127, 129, 96)) == fst.Shape(1, 2, 2, 128, 128, 64)
    assert KERNEL_LIMITS.adapt(fst.Shape(1, 1, 1, 1, 1, 8)) == fst.Shape(1, 1, 1, 64, 64, 64)
    # H/Hkv moves to an allowed group size: MQA with the one nearest H, GQA with the smallest
    grouped = parse_limits({"group-sizes": "4,8"})
    assert grouped.adapt(fst.Shape(1, 2, 2, 8, 8, 8)) == fst.Shape(1, 4, 1, 8, 8, 8)
    assert grouped.adapt(fst.Shape(1, 7, 1, 8, 8, 8)) == fst.Shape(1, 8, 1, 8, 8, 8)
    assert parse_limits({"group-sizes": "4,8", "heads": "gqa"}).adapt(fst.Shape(1, 2, 1, 8, 8, 8)) == fst.Shape(
        1, 8, 2, 8, 8, 8)
    assert "H/Hkv=2 (H=4, Hkv=2) (declared by --group-sizes)" in grouped.check(
        fst.make_problem("normal", (1, 4, 2, 8, 8, 8), "fp32", 0))
    assert "no sequence length" in Limits(seq_min=300, seq_max=400, seq_multiple=512).adapt(fst.Shape(1, 1, 1, 1, 1, 8))


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(fst.shapes(max_seq=257, typical_seq=64, max_work=2_000_000, max_head_dim=128, head_dims=(64, 128),
                  seq_multiple=32, seq_min=64, head_layouts=("gqa", "mqa")))
def test_shapes_are_drawn_within_the_limits(shape):
    assert shape.nq % 32 == 0 and shape.nk % 32 == 0 and min(shape.nq, shape.nk) >= 64
    assert shape.head_dim in (64, 128) and shape.kv_heads < shape.heads and shape.work <= 2_000_000


class OnlySixtyFour(CallableBackend):
    """A backend whose own supports() accepts N = 64 only and raises on D > 128."""

    def supports(self, problem):
        if problem.head_dim > 128:
            raise RuntimeError("no such instantiation")
        return super().supports(problem) or (None if problem.nq == problem.nk == 64 else "N must be 64")


def test_the_probe_never_raises_and_respects_the_limits():
    backend = OnlySixtyFour(float64_then_round, limits=Limits(seq_multiple=64, equal_seq=True))
    caps = capabilities(backend)  # probes N = 64 (not 1 or 2), survives the raising supports()
    assert caps.head_dims == tuple(range(1, 129)) and caps.alignments and caps.returns_lse is False
    assert "declares Nq = Nk" in problem_strategy(get_property("fully_masked_rows"), caps, Selection())
    problems, notes = edge_problems(get_property("oracle_agreement"), backend, Selection(dtypes=("fp32",)))
    assert problems and all(p.nq == p.nk == 64 for p in problems)
    assert "moved to" in notes[-1]


def test_derived_problems_stay_within_the_limits():
    """merge_law cuts keys at multiples of 16 and fully_masked_rows keeps a multiple of 16 keys:
    a kernel that raises on anything else passes both."""
    def multiples_of_16(q, k, v, *, causal, scale):
        assert q.shape[2] % 16 == 0 and k.shape[2] % 16 == 0, (q.shape, k.shape)
        s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) * scale
        nq, nk = s.shape[-2:]
        if causal:
            s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0))
        l = p.sum(-1)
        out = np.where(l[..., None] > 0, p @ v.astype(np.float64) / np.where(l > 0, l, 1)[..., None], 0)
        lse = np.where(l > 0, np.log(np.where(l > 0, l, 1)) + np.where(np.isfinite(m[..., 0]), m[..., 0], 0), -np.inf)
        return out.astype(q.dtype), lse.astype(np.float32)

    backend = CallableBackend(multiples_of_16, limits=Limits(seq_multiple=16))
    for seed in range(6):
        problem = fst.make_problem("normal", (1, 2, 2, 48, 64, 16), "fp32", seed, causal=seed % 2 == 0)
        assert check_merge_law(backend, problem, seed=seed).status == "passed"
        assert check_fully_masked_rows(backend, problem, seed=seed).status == "passed"
    short = fst.make_problem("normal", (1, 1, 1, 16, 16, 16), "fp32", 0, causal=True)
    assert "cannot be split into key chunks within the declared limits" in check_merge_law(backend, short).detail
    assert "no key count below it" in check_fully_masked_rows(backend, short).detail


def test_a_built_in_backend_keeps_its_own_limits():
    assert get_backend("numpy-tiled").limits == Limits(head_dims_v="any")  # its own: any D_v


def _statuses(document) -> dict:
    return {p["property"]: (p["status"], p["reason"]) for p in document["targets"][0]["properties"]}


def test_the_issue_kernel_is_checked_in_one_command_line():
    """The callable raises on any problem outside its limits, so a pass means none was drawn."""
    proc = subprocess.run([sys.executable, "-m", "fa_verify", "check", "user_kernels:limited_fp16_causal",
                           *KERNEL_OPTIONS, "--max-examples", "5", "--json"],
                          capture_output=True, text=True, cwd=FIXTURES, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    document = json.loads(proc.stdout)
    assert document["targets"][0]["limits"] == {
        "dtype": ["fp16"], "head-dims": [64, 128], "head-dims-v": None, "seq-multiple": 64, "seq-min": 1, "seq-max": None,
        "equal-seq": True, "heads": ["mha"], "group-sizes": None, "causal": "yes", "lse": None}
    statuses = _statuses(document)
    not_applicable = {name: reason for name, (status, reason) in statuses.items() if status == "not applicable"}
    variants = {"variant_agreement", "feature_sensitivity", "wide_window", "softcap_limit", "window_independence"}
    assert set(not_applicable) == {"merge_law", "fully_masked_rows", "key_permutation", "query_permutation",
                                "races", "address_sanitizer"} | variants
    assert "declares Nq = Nk" in not_applicable["merge_law"] and "declares Nq = Nk" in not_applicable["fully_masked_rows"]
    assert "declares causal only" in not_applicable["key_permutation"]
    assert all(status == "passed" for name, (status, _) in statuses.items() if name not in not_applicable)
    agreement = next(p for p in document["targets"][0]["properties"] if p["property"] == "oracle_agreement")
    assert agreement["examples"] > 5 and any("edge cases moved to" in n for n in agreement["notes"])


def test_without_limits_the_kernel_fails_as_before(capsys, monkeypatch):
    """The control: the same kernel with no limits declared raises on the problems drawn."""
    monkeypatch.chdir(FIXTURES)
    code = main(["check", "user_kernels:limited_fp16_causal", "--property", "oracle_agreement",
                 "--max-examples", "3"])
    assert code == 1 and "unsupported problem" in capsys.readouterr().out


def test_a_gqa_kernel_passes_within_its_group_sizes_and_fails_without_them(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    argv = ["check", "user_kernels:grouped_2_or_4", "--property", "oracle_agreement", "--max-examples", "5"]
    assert main(argv) == 1 and "unsupported group size" in capsys.readouterr().out
    assert main([*argv, "--group-sizes", "2,4"]) == 0
    assert "limits: H/Hkv in {2, 4}" in capsys.readouterr().out


def test_the_pytest_plugin_takes_the_same_limits(pytester):
    shutil.copy(FIXTURES / "user_kernels.py", pytester.path)
    pytester.makepyfile(test_kernel="""
        def test_determinism(fa_backend, fa_search):  # the kernel raises outside its limits
            fa_search(fa_backend, "determinism")

        def test_merge(fa_backend, fa_search):
            fa_search(fa_backend, "merge_law")
    """)
    options = [o.replace("--", "--fa-", 1) if o.startswith("--") else o for o in KERNEL_OPTIONS]
    result = pytester.runpytest_subprocess("--fa-backend", "user_kernels:limited_fp16_causal", *options, "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*merge_law: not applicable (needs key chunks*declares Nq = Nk*"])


@pytest.mark.parametrize("options", [
    {"seq-min": "100", "seq-max": "200", "heads": "gqa"},
    {"seq-multiple": "16", "seq-max": "48", "heads": "mqa,mha", "causal": "no", "dtype": "bf16"},
    {"head-dims": "96", "seq-multiple": "128", "equal-seq": "yes", "lse": "no"},
    {"group-sizes": "2,8", "heads": "gqa,mqa", "seq-multiple": "16"},
])
@pytest.mark.parametrize("fn", [float64_then_round, with_variants])
def test_every_property_draws_within_the_limits(options, fn):
    limits = parse_limits(options)
    caps = capabilities(CallableBackend(fn, limits=limits))
    for prop in PROPERTIES:
        strategy = problem_strategy(prop, caps, Selection())
        if isinstance(strategy, str):
            variants_missing = fn is float64_then_round and "does not implement" in strategy
            assert "declares" in strategy or "returns no LSE" in strategy or variants_missing, strategy
            continue

        @settings(max_examples=15, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(strategy)
        def within(problem):
            assert limits.check(problem) is None, (prop.name, problem.describe())

        within()


def test_a_reproducer_rebuilds_the_declared_limits():
    from fa_verify.properties.reproduce import callable_options

    backend = CallableBackend(limited_fp16_causal, limits=KERNEL_LIMITS)
    options = callable_options(backend, "fp16")
    assert CallableBackend(limited_fp16_causal, limits=options["limits"]).limits == KERNEL_LIMITS
