"""Kernels in the styles published kernels are written in, each run from its spec with no Python.

Kernels (our own, in tests/cuda_cpu_kernels/, each with its .toml beside it): fa1_global_stats.cu
(FA1: running max and sum in global scratch filled by the host, o zeroed), struct_args.cu (one
struct passed by value), template_seq.cu (a template over the key count), split_combine.cu (a
split launch and a combine launch sharing two workspaces), causal_only.cu (always causal, no
causal parameter), fp16_inputs.cu (fp32 in and out, q, k, v rounded to fp16 inside). Each passes
from its spec, and a wrong spec or a buggy variant fails as it should.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends.spec_kernel import SpecKernelBackend
from fa_verify.cli.main import main
from fa_verify.errors import BackendOutputError
from fa_verify.kernels.abi import StructLayout, pack_parameters, parameter_offsets, unpack_parameters
from fa_verify.kernels.spec import KernelSpec
from fa_verify.problem import AttentionProblem
from fa_verify.verdict import check_attention

KERNELS = Path(__file__).parent / "cuda_cpu_kernels"
FEW = ("--max-examples", "2")


def _check(capsys, tmp_path, stem: str, *options, spec: Path | None = None):
    """`fa_verify check KERNEL.cu --spec KERNEL.toml OPTIONS...`: (exit code, stdout + stderr)."""
    capsys.readouterr()
    code = main(["check", str(KERNELS / f"{stem}.cu"), "--spec", str(spec or KERNELS / f"{stem}.toml"),
                 "--repro-dir", str(tmp_path / "repro"), *options])
    out, err = capsys.readouterr()
    return code, out + err


def _changed(tmp_path, stem: str, old: str, new: str) -> Path:
    """The spec of `stem` with `old` replaced by `new`, beside the test's other files."""
    text = (KERNELS / f"{stem}.toml").read_text()
    assert old in text
    spec = tmp_path / f"{stem}.toml"
    spec.write_text(text.replace(old, new))
    return spec


def _problem(shape, dtype="fp32", causal=False, seed=3):
    B, H, Nq, Nk, D = shape
    rng = np.random.default_rng(seed)
    return AttentionProblem.from_float(rng.standard_normal((B, H, Nq, D)), rng.standard_normal((B, H, Nk, D)),
                                       rng.standard_normal((B, H, Nk, D)), dtype, causal=causal)


def test_fa1_kernel_with_global_running_max_and_sum(capsys, tmp_path):
    code, out = _check(capsys, tmp_path, "fa1_global_stats", "--property", "oracle_agreement", *FEW)
    assert code == 0 and "PASS oracle_agreement" in out, out
    # Without o-fill the kernel reads the output before writing it: NaN, as cudaMalloc'd memory may be
    spec = _changed(tmp_path, "fa1_global_stats", "o-fill = 0\n", "")
    code, out = _check(capsys, tmp_path, "fa1_global_stats", "--property", "oracle_agreement", *FEW, spec=spec)
    assert code == 1 and "FAIL oracle_agreement" in out, out


def test_a_struct_argument_is_laid_out_as_the_compiler_lays_it_out(capsys, tmp_path):
    code, out = _check(capsys, tmp_path, "struct_args", "--property", "oracle_agreement", "--property",
                       "lse_agreement", *FEW)
    assert code == 0 and "PASS oracle_agreement" in out and "PASS lse_agreement" in out, out
    spec = _changed(tmp_path, "struct_args", '["batch", "int", "B"], ', "")  # a field left out
    code, out = _check(capsys, tmp_path, "struct_args", *FEW, spec=spec)
    assert code == 2 and "struct_args.toml: structs.args: list every field" in out, out
    assert "field q of the struct parameter 0 of kernel attention_struct is not at byte 0" in out


def test_struct_layout_follows_the_c_abi():
    layout = KernelSpec.from_toml(KERNELS / "struct_args.toml").structs["args"][0]
    assert [f.offset for f in layout.fields] == [0, 8, 16, 24, 32, 40, 48, 52, 56, 60, 64, 68, 72]
    assert (layout.size, layout.align) == (80, 8)  # the bool's padding to the pointers' alignment
    aligned = StructLayout.of([("x", "float"), ("y", "float")], "s", align=16)
    assert (aligned.size, aligned.align) == (16, 16)
    kinds = ["int", aligned, "ptr"]
    assert parameter_offsets(kinds) == ([0, 16, 32], 40)
    packed = pack_parameters(kinds, [7, [1.5, -2.0], 0xDEADBEEF])
    assert unpack_parameters(kinds, packed) == [7, [1.5, -2.0], 0xDEADBEEF]


def test_a_template_over_the_key_count_builds_once_per_drawn_value(capsys, tmp_path):
    code, out = _check(capsys, tmp_path, "template_seq", "--property", "oracle_agreement", *FEW)
    assert code == 0 and "PASS oracle_agreement" in out, out
    backend = SpecKernelBackend(KERNELS / "template_seq.cu", KERNELS / "template_seq.toml")
    assert backend.build() is None  # nothing is known to build before a problem is drawn
    for nk in (16, 32, 16):
        problem = _problem((1, 2, 32, nk, 16))
        assert check_attention(backend.run(problem)[0], problem).passed
    assert sorted(e for _, e in backend._modules) == ["attention_fixed_keys<16, 16>", "attention_fixed_keys<32, 16>"]
    # a spec that instantiates one head dim whatever D is drawn
    wrong = SpecKernelBackend(KERNELS / "template_seq.cu", _changed(tmp_path, "template_seq", "{D}", "16"))
    problem = _problem((1, 1, 16, 16, 32))
    with pytest.raises(BackendOutputError, match="never written"):
        wrong.run(problem)


def test_a_split_and_a_combine_launch_share_their_workspaces(capsys, tmp_path):
    code, out = _check(capsys, tmp_path, "split_combine", "--property", "oracle_agreement", "--property",
                       "lse_agreement", *FEW)
    assert code == 0 and "PASS oracle_agreement" in out and "PASS lse_agreement" in out, out
    # workspaces sized for one split where the kernel writes two: the write past the end is caught
    spec = _changed(tmp_path, "split_combine", 'scratch.lse_part = {size = "(4 if Nk >= 256 else 2) * B * H * Nq"',
                    'scratch.lse_part = {size = "B * H * Nq"')
    code, out = _check(capsys, tmp_path, "split_combine", "--property", "oracle_agreement", *FEW, spec=spec)
    assert code == 1 and "FAIL oracle_agreement" in out and "wrote out of bounds" in out, out
    # a combine that drops the first split's weight from the normaliser
    source = (KERNELS / "split_combine.cu").read_text()
    assert "for (int s = 0; s < n_splits; ++s) total +=" in source
    mutant = tmp_path / "split_combine.cu"
    mutant.write_text(source.replace("for (int s = 0; s < n_splits; ++s) total +=",
                                     "for (int s = 1; s < n_splits; ++s) total +="))
    capsys.readouterr()
    code = main(["check", str(mutant), "--spec", str(KERNELS / "split_combine.toml"), "--property",
                 "oracle_agreement", *FEW, "--repro-dir", str(tmp_path / "repro")])
    assert code == 1 and "FAIL oracle_agreement" in capsys.readouterr().out


def test_a_causal_only_kernel_needs_no_causal_parameter(capsys, tmp_path):
    code, out = _check(capsys, tmp_path, "causal_only", "--property", "oracle_agreement", *FEW)
    assert code == 0 and "PASS oracle_agreement" in out and "causal only" in out, out
    spec = _changed(tmp_path, "causal_only", 'causal = "yes"', 'causal = "both"')
    code, out = _check(capsys, tmp_path, "causal_only", *FEW, spec=spec)
    assert code == 2 and "no parameter passes causal" in out and "causal = 'yes' (always causal)" in out, out


def test_a_kernel_rounding_its_inputs_is_judged_with_the_input_term(capsys, tmp_path):
    options = ("--property", "oracle_agreement", "--property", "lse_agreement", *FEW)
    code, out = _check(capsys, tmp_path, "fp16_inputs", *options, "--property", "constant_v")
    assert code == 0 and "PASS oracle_agreement" in out and "PASS lse_agreement" in out, out
    assert "PASS constant_v" in out, out  # V rounded to fp16 is still the constant row, within u_fp16
    spec = _changed(tmp_path, "fp16_inputs", "fp32-accumulate,inputs=fp16", "fp32-accumulate")
    code, out = _check(capsys, tmp_path, "fp16_inputs", *options, spec=spec)
    assert code == 1 and "FAIL oracle_agreement" in out, out
    # inputs beyond fp16's range are outside what the kernel can take, not a wrong result
    backend = SpecKernelBackend(KERNELS / "fp16_inputs.cu", KERNELS / "fp16_inputs.toml")
    big = _problem((1, 1, 4, 4, 64)).replace(v=np.full((1, 1, 4, 64), 7e4, np.float32))
    assert "exceed fp16's range" in backend.supports(big)


@pytest.mark.parametrize("stem", ["fa1_global_stats", "struct_args", "template_seq", "split_combine",
                                  "causal_only", "fp16_inputs", "latent_dims"])
def test_style_specs_stay_short(stem):
    """Lines of spec (keys and tables, no comments or blanks) each style needs: docs/targets.md lists them."""
    lines = [line for line in (KERNELS / f"{stem}.toml").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    tomllib.loads("\n".join(lines))
    assert len(lines) <= 20, len(lines)


def test_a_kernel_with_its_own_value_head_dim_is_told_dv(capsys, tmp_path):
    """latent_dims.cu takes D and D_v as template arguments ({D}, {Dv}); with head-dims-v declared,
    problems with D_v != D are drawn and pass, and the same kernel told D for D_v fails on them."""
    backend = SpecKernelBackend(KERNELS / "latent_dims.cu", KERNELS / "latent_dims.toml")
    assert set(backend.spec.instantiations()) == {"latent_attention<64, 64>", "latent_attention<64, 32>"}
    q, k = (np.random.default_rng(1).standard_normal((1, 2, n, 64)).astype(np.float16) for n in (5, 9))
    v = np.random.default_rng(2).standard_normal((1, 2, 9, 32)).astype(np.float16)
    out, lse = backend.run(AttentionProblem(q, k, v, causal=True))
    assert out.shape == (1, 2, 5, 32)
    assert check_attention(out, AttentionProblem(q, k, v, causal=True), precision=backend.precision("fp16"),
                           lse=lse).passed
    options = ("--property", "oracle_agreement", "--max-examples", "6")
    code, out = _check(capsys, tmp_path, "latent_dims", *options)
    assert code == 0 and "PASS oracle_agreement" in out, out
    spec = _changed(tmp_path, "latent_dims", "<{D}, {Dv}>", "<{D}, {D if Dv == D else 48}>")  # D_v told wrong
    code, out = _check(capsys, tmp_path, "latent_dims", *options, spec=spec)
    assert code == 1 and "FAIL oracle_agreement" in out and " Dv=32 " in out, out
    # declared, but nothing passes D_v to the kernel: refused, naming the fix
    spec = _changed(tmp_path, "latent_dims", "<{D}, {Dv}>", "<{D}, {D}>")
    code, out = _check(capsys, tmp_path, "latent_dims", *options, spec=spec)
    assert code == 2 and "no parameter or entry reads Dv" in out, out
