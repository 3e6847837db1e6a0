"""Kernel specs of FP8 CUDA kernels (issue 23): the descale pointers (q_descale, k_descale,
v_descale, or an FP8 KV cache's per-tensor k_scale / v_scale) are spec buffers, validated with
errors that name the key and the fix, and `fa_verify check kernel.cu --spec` runs the FP8 suite on
tests/cuda_cpu_kernels/fp8_rows.cu (one thread per row, cuda_fp8.h's types) on the CUDA-on-CPU
runner; spec mistakes (descales swapped, a key past the end, blocks overlapping) fail it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fa_verify.backends.spec_kernel import SpecKernelBackend
from fa_verify.cli.main import main
from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels.spec import KernelSpec
from fa_verify.properties import Selection, search_property
from fa_verify.properties.fp8 import check_fp8_agreement
from fa_verify.strategies._fp8 import make_fp8_problem

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
SOURCE = KERNELS / "fp8_rows.cu"
SPEC = KERNELS / "fp8_rows.toml"
TABLE = tomllib.loads(SPEC.read_text())
PARAMS = TABLE["params"]


def _spec(**changes) -> KernelSpec:
    return KernelSpec.from_dict({**TABLE, **changes}, origin="fp8.toml")


def _with(params_changes: dict, **changes) -> KernelSpec:
    return _spec(params=[params_changes.get(p, p) for p in PARAMS], **changes)


def test_an_fp8_spec_runs_fp8_problems_with_the_formats_c_types_and_one_byte_items():
    spec = _spec()
    assert spec.kinds == ("fp8",) and spec.descales_passed() == {n: n for n in ("q_descale", "k_descale", "v_descale")}
    launch = spec.launch[0]
    assert [launch.entry_for({}, d) for d in ("e4m3", "e5m2")] == ["fp8_rows_fwd<__nv_fp8_e4m3>",
                                                                   "fp8_rows_fwd<__nv_fp8_e5m2>"]
    assert spec.names((1, 2, 1, 4, 4, 8), "e4m3")["itemsize"] == 1
    assert spec.names((1, 2, 1, 4, 4, 8), "bf16")["itemsize"] == 2
    kv = KernelSpec.from_toml(KERNELS / "fp8_rows_kv_scale.toml")
    assert kv.descales_passed() == {"q_descale": "q_descale", "k_scale": "k_descale", "v_scale": "v_descale"}


@pytest.mark.parametrize("changes, message", [
    (dict(params={"q_descale": "null"}), r"fp8.toml: params has no 'q_descale': an FP8 kernel is given each "
                                         r"descale \(true value = stored value x descale\); pass 'q_descale' "
                                         r"\(float32 \[B, Hkv\]\)"),
    (dict(params={"v_descale": "null"}), r"params has no 'v_descale'.*pass 'v_descale' \(float32 \[B, Hkv\], or "
                                         r"'v_scale': float32 \[1\], per tensor\)"),
    (dict(params={"H": "k_scale"}), r"params passes both 'k_descale' and 'k_scale': one descale per tensor"),
    (dict(limits={"dtype": ["fp16"]}), r"params passes 'q_descale', a descale of FP8 inputs, but "
                                       r"limits.dtype=\['fp16'\]; declare \[limits\] dtype = \['e4m3'\]"),
    (dict(limits={"dtype": ["e4m3", "fp16"]}), r"limits.dtype=\['e4m3', 'fp16'\] mixes FP8 formats with fp16: .* "
                                               r"write one spec per kind"),
    (dict(types={"o": "fp32"}), r"types.o='fp32': an FP8 kernel's problems have a bf16 output"),
    (dict(params={"q_descale": "q_scale"}), r"params\[3\]='q_scale' is no buffer \(q, k, v, o, lse, null\), struct or "
                                            r"problem name: .*; an FP8 kernel's descales are q_descale, k_descale, "
                                            r"v_descale, k_scale, v_scale"),
    (dict(scratch={"k_scale": {"size": 1}}), r"scratch.k_scale: name it with an identifier that is not a buffer "
                                             r"\(q, k, v, o, lse, q_descale, k_descale, v_descale, k_scale, v_scale\)"),
])
def test_descale_mistakes_in_a_spec_name_the_key_and_the_fix(changes, message):
    params = changes.pop("params", {})
    with pytest.raises(InvalidArgumentError, match=message):
        _with(params, **changes)


def test_a_struct_may_carry_the_descale_pointers():
    structs = {"descales": {"fields": [["q", "const float*", "q_descale"], ["k", "const float*", "k_descale"],
                                       ["v", "const float*", "v_descale"]]}}
    spec = _spec(params=["q", "k", "v", "descales", "o", "lse", "H", "Hkv", "Nq", "Nk", "D", "scale", "causal",
                         "causal_offset"], structs=structs)
    assert spec.kinds == ("fp8",) and set(spec.descales_passed()) == {"q_descale", "k_descale", "v_descale"}


def test_the_kernel_agrees_in_both_formats_and_gets_the_descales_as_the_convention_says():
    backend = SpecKernelBackend(SOURCE, SPEC)
    for fmt, causal in (("e4m3", True), ("e5m2", False)):
        assert check_fp8_agreement(backend, make_fp8_problem((2, 4, 2, 5, 20, 16), fmt, 3, causal=causal)).passed
    per_tensor = make_fp8_problem((2, 4, 2, 5, 20, 16), "e4m3", 4, per_tensor=True)  # [1] given as [B, Hkv]
    assert check_fp8_agreement(backend, per_tensor).passed


def test_a_kv_cache_kernel_takes_k_scale_and_v_scale_per_tensor_only():
    backend = SpecKernelBackend(SOURCE, KERNELS / "fp8_rows_kv_scale.toml")
    per_head = make_fp8_problem((2, 4, 2, 5, 20, 16), "e4m3", 0)
    assert backend.supports(per_head) == ("fp8_rows takes k_scale (one descale per tensor): the problem's k_descale "
                                          "is per (batch, kv head), shape [2, 2]")
    assert check_fp8_agreement(backend, make_fp8_problem((2, 4, 2, 5, 20, 16), "e4m3", 0, per_tensor=True)).passed


@pytest.mark.parametrize("spec, code", [(SPEC, 0), ("swapped", 1)])
def test_fa_verify_check_runs_the_fp8_suite_on_a_cu_file_with_its_spec(spec, code, tmp_path, capsys):
    if spec == "swapped":  # the spec passes v's descale where the kernel reads k's, and k's for v's
        spec = tmp_path / "swapped.toml"
        spec.write_text(SPEC.read_text().replace('"k_descale", "v_descale"', '"v_descale", "k_descale"'))
    properties = ["fp8_agreement"] + (["descale_sensitivity", "key_permutation", "masked_key_independence"]
                                      if code == 0 else [])
    argv = ["check", str(SOURCE), "--spec", str(spec), "--max-examples", "3"]
    assert main([*argv, *(a for p in properties for a in ("--property", p))]) == code
    output = capsys.readouterr().out
    if code == 0:
        assert all(f"PASS {p}" in output for p in properties), output
    else:  # (shrinking a failure of the CLI's search takes seconds: one property there)
        assert "FAIL fp8_agreement" in output, output
        outcome = search_property(SpecKernelBackend(SOURCE, spec), "descale_sensitivity",
                                  Selection(max_examples=5, shrink=False))
        assert outcome.status == "failed", outcome


@pytest.mark.parametrize("changes, prop", [
    # blocks of 32 threads 16 rows apart: neighbouring blocks write the same rows
    ((("cdiv(Nq, 32)", "cdiv(Nq, 16)"), ("block = 32", "block = 32\ndefines = { ROWS_PER_BLOCK = 16 }")), "races"),
    ((('"Nk", "D"', '"Nk + 1", "D"'),), "address_sanitizer"),  # one key past the end
])
def test_the_runners_checks_catch_an_fp8_kernels_memory_bugs(changes, prop, tmp_path):
    text = SPEC.read_text()
    for old, new in changes:
        assert old in text
        text = text.replace(old, new)
    spec = tmp_path / "mutant.toml"
    spec.write_text(text)
    assert search_property(SpecKernelBackend(SOURCE, SPEC), prop, Selection(max_examples=2)).status == "passed"
    outcome = search_property(SpecKernelBackend(SOURCE, spec), prop, Selection(max_examples=10, shrink=False))
    assert outcome.status == "failed", outcome


@pytest.mark.slow
def test_fa_verify_check_passes_the_whole_fp8_suite_on_the_kernel(capsys):
    assert main(["check", str(SOURCE), "--spec", str(SPEC), "--max-examples", "5"]) == 0
    output = capsys.readouterr().out
    assert "PASS fp8_rows: 15 passed, 0 failed, 0 not applicable" in output, output


def test_fp8_problems_are_drawn_within_the_declared_head_dims_and_sequence_multiple():
    from hypothesis import given, settings

    from fa_verify.properties.draw_fp8 import fp8_strategy
    from fa_verify.properties.registry import get_property

    limits = {"dtype": ["e4m3"], "head-dims": [128], "causal": "yes", "seq-multiple": 2}
    backend = SpecKernelBackend(SOURCE, _spec(limits=limits))  # (never run: the kernel holds D <= 64)
    strategy = fp8_strategy(get_property("masked_key_independence"), backend, Selection())
    drawn = []

    @settings(max_examples=5, database=None, deadline=None)
    @given(strategy)
    def collect(problem):
        drawn.append(problem)

    collect()
    assert drawn and all(p.head_dim == 128 and p.causal and p.nq % 2 == p.nk % 2 == 0 for p in drawn)
