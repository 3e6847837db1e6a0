"""Third-party attention through fa_verify's adapters, as a user names them: JAX's
`jax.nn.dot_product_attention` (the `jax` extra), torch's `flex_attention` and MLX's
`mx.fast.scaled_dot_product_attention` (the `mlx` extra), each through a short `fa_verify check`
under the shape budget."""

import pytest

from fa_verify.cli.main import main

#: A short check: a few examples of the properties that exercise values, the LSE and masking
#: (in this process: a worker would import jax or torch again).
SHORT = ("--dtype", "fp32", "--max-examples", "3", "--shapes", "2", "--no-isolate",
         "--property", "oracle_agreement", "--property", "lse_agreement",
         "--property", "masked_key_independence")


def _check(capsys, target, *options):
    code = main(["check", target, *SHORT, *options])
    return code, capsys.readouterr().out


def test_jax_dot_product_attention_passes_a_short_check(capsys):
    pytest.importorskip("jax", reason="jax is not installed (pip install 'fa-verify[jax]')")
    # BTNH is fa_verify's bshd; JAX's is_causal is top-left. fp32 only: on the CPU, XLA runs
    # no fp16 or bf16 dot with fp32 accumulation (it raises; docs/targets.md says so).
    code, out = _check(capsys, "fa_verify.adapters.jax_attention:attention",
                       "--layout", "bshd", "--causal-alignment", "top-left")
    assert code == 0, out
    assert "PASS lse_agreement" in out and "PASS masked_key_independence" in out
    assert "--shapes 2: drawn from 2 shapes" in out


def test_flex_attention_eager_passes_a_short_check(capsys):
    pytest.importorskip("torch.nn.attention.flex_attention",
                        reason="torch with flex_attention is not installed (pip install 'fa-verify[torch]')")
    code, out = _check(capsys, "fa_verify.adapters.flex_attention:attention", "--array", "torch",
                       "--property", "fully_masked_rows")
    assert code == 0, out
    assert "PASS fully_masked_rows" in out and "PASS lse_agreement" in out


def test_mlx_passes_only_under_the_conventions_it_has(capsys):
    """On the CPU, MLX computes scores in the input dtype and gives fully masked rows the mean of V:
    fa_verify's defaults fail it for both, and declaring the two passes it."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'fa-verify[mlx]')")
    options = ("--dtype", "fp16", "--max-examples", "10", "--no-isolate", "--property", "oracle_agreement",
               "--property", "fully_masked_rows")
    target = "fa_verify.adapters.mlx_attention:attention"
    code, out = main(["check", target, *options]), capsys.readouterr().out
    assert code == 1 and "FAIL fully_masked_rows" in out and "FAIL oracle_agreement" in out, out
    code = main(["check", target, *options, "--precision", "input-scores", "--masked-rows", "uniform"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "judged under: precision input-scores, fully masked rows uniform" in out
