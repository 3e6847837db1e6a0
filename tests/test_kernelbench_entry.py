"""KernelBench-format problems: what probing the reference Model infers (layout, scale,
causality, alignment, GQA, dtype), refusals when it cannot tell, and `fa_verify check
problem.py` passing a correct ModelNew and failing a wrong one."""

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="KernelBench-format problems are torch modules")
F = torch.nn.functional

from fa_verify.adapters.kernelbench import infer  # noqa: E402
from fa_verify.cli.main import main  # noqa: E402
from fa_verify.errors import InvalidArgumentError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "kernelbench"


def _say(names):
    return ", ".join("--" + n.replace("_", "-") for n in names)


def _problem(forward, *shapes, dtype=torch.float32):
    """A module-like KernelBench problem whose Model runs `forward(Q, K, V)`."""
    model = type("Model", (torch.nn.Module,), {"forward": lambda self, q, k, v: forward(q, k, v)})
    return SimpleNamespace(Model=model, ModelNew=model, get_init_inputs=lambda: [],
                           get_inputs=lambda: [torch.rand(s, dtype=dtype) for s in shapes])


def _infer(forward, *shapes, declared=None, **kwargs):
    return infer(_problem(forward, *shapes, **kwargs), "problem.py", declared or {}, _say)


def _explicit(q, k, v, scale, mask=None):
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_sdpa_bhsd_default_scale_not_causal():
    found = _infer(F.scaled_dot_product_attention, *[(2, 4, 32, 16)] * 3, dtype=torch.float16)
    assert (found.layout, found.scale, found.causal, found.dtype) == ("bhsd", None, False, "fp16")
    assert (found.heads, found.kv_heads, found.head_dims, found.equal_seq) == (4, 4, None, False)
    assert found.describe() == "layout bhsd, scale 1/sqrt(D), causal no, dtype fp16"


def test_bshd_is_told_by_which_outputs_a_value_changes():
    def bshd(q, k, v):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)

    found = _infer(bshd, *[(2, 32, 4, 16)] * 3)  # [B, N, H, D]
    assert (found.layout, found.heads, found.scale, found.causal) == ("bshd", 4, None, False)
    # The same sizes read as bhsd would be H=32 heads of 4 queries: the probe tells them apart.
    assert _infer(F.scaled_dot_product_attention, *[(2, 32, 4, 16)] * 3).layout == "bhsd"


def test_a_constant_scale_is_read_and_told_from_one_over_sqrt_d():
    found = _infer(lambda q, k, v: _explicit(q, k, v, 0.1), *[(1, 2, 16, 64)] * 3)
    assert (found.scale, found.head_dims) == (0.1, None)
    assert "scale 0.1," in found.describe()
    # 0.125 is 1/sqrt(64), but a constant: at another head dim it stays 0.125.
    assert _infer(lambda q, k, v: _explicit(q, k, v, 0.125), *[(1, 2, 16, 64)] * 3).scale == 0.125
    assert _infer(lambda q, k, v: _explicit(q, k, v, q.shape[-1] ** -0.5), *[(1, 2, 16, 64)] * 3).scale is None


def test_a_model_that_runs_one_head_dim_limits_the_check_to_it():
    def fixed_d(q, k, v):
        assert q.shape[-1] == 64
        return _explicit(q, k, v, 0.125)

    found = _infer(fixed_d, *[(1, 2, 16, 64)] * 3)
    assert (found.scale, found.head_dims) == (None, (64,))
    assert "scale 1/sqrt(D) (0.125 at D=64)" in found.describe()


def test_causal_top_left_bottom_right_and_square_masks():
    sdpa_causal = _infer(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         *[(1, 2, 16, 8)] * 3)
    assert (sdpa_causal.causal, sdpa_causal.causal_alignment, sdpa_causal.equal_seq) == (True, "top-left", False)
    assert "causal yes (top-left)" in sdpa_causal.describe()

    def bottom_right(q, k, v):
        nq, nk = q.shape[-2], k.shape[-2]
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        return _explicit(q, k, v, q.shape[-1] ** -0.5, mask)

    found = _infer(bottom_right, *[(1, 2, 16, 8)] * 3)
    assert (found.causal, found.causal_alignment) == (True, "bottom-right")

    def square(q, k, v):  # a mask built from Q's length only: Nq != Nk does not run
        n = q.shape[-2]
        return _explicit(q, k, v, q.shape[-1] ** -0.5, torch.ones(n, n, dtype=torch.bool).tril())

    found = _infer(square, *[(1, 2, 16, 8)] * 3)
    assert (found.causal, found.equal_seq) == (True, True)
    assert found.describe().endswith("Nq = Nk only")


def test_gqa_from_the_head_counts_of_get_inputs():
    def gqa(q, k, v):
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))

    found = _infer(gqa, (1, 4, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8))
    assert (found.layout, found.heads, found.kv_heads) == ("bhsd", 4, 2)
    assert "GQA 4 query heads over 2 K/V heads" in found.describe()


def test_inconclusive_probes_are_refused_naming_what_and_how_to_declare_it():
    def windowed(q, k, v):  # a sliding window: key 0 reaches neither whole axis
        n = q.shape[-2]
        i = torch.arange(n)
        return _explicit(q, k, v, q.shape[-1] ** -0.5, (i[:, None] - i[None, :]).abs() <= 1)

    with pytest.raises(InvalidArgumentError, match=r"cannot infer the layout .* fits neither layout; "
                                                    r"declare it with --layout bhsd or --layout bshd"):
        _infer(windowed, *[(1, 2, 16, 8)] * 3)
    found = _infer(windowed, *[(1, 2, 16, 8)] * 3, declared={"layout": "bhsd", "causal": False,
                                                           "scale": "default"})
    assert (found.layout, found.causal, found.scale, found.declared) == ("bhsd", False, None,
                                                                        ("layout", "causal", "scale"))
    assert "layout bhsd (declared)" in found.describe()


def _check(capsys, monkeypatch, *argv):
    monkeypatch.chdir(ROOT)
    code = main(["check", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_example_passes_a_short_check(capsys, monkeypatch):
    code, out, _ = _check(capsys, monkeypatch, "examples/kernelbench_attention.py", "--max-examples", "3",
                          "--property", "oracle_agreement", "--property", "key_permutation")
    assert code == 0, out
    assert "inferred from Model: layout bhsd, scale 1/sqrt(D), causal no, dtype fp16" in out
    assert "PASS oracle_agreement" in out and "PASS key_permutation" in out


def test_the_buggy_solution_fails(capsys, monkeypatch):
    code, out, _ = _check(capsys, monkeypatch, str(FIXTURES / "buggy_attention.py"), "--max-examples", "3",
                          "--property", "oracle_agreement")
    assert code == 1, out
    assert "FAIL oracle_agreement" in out


def test_a_fixed_scale_is_judged_as_the_models(capsys, monkeypatch, tmp_path):
    """Model and ModelNew at scale 0.3: passes judged under the Model's scale; a ModelNew at
    1/sqrt(D) fails it."""
    source = textwrap.dedent('''
        import torch

        class Model(torch.nn.Module):
            def forward(self, Q, K, V):
                return torch.softmax(Q @ K.transpose(-1, -2) * 0.3, dim=-1) @ V

        class ModelNew(torch.nn.Module):
            def forward(self, Q, K, V):
                return torch.softmax(Q @ K.transpose(-1, -2) * SCALE, dim=-1) @ V

        def get_inputs():
            return [torch.rand(1, 2, 16, 8) for _ in range(3)]
        ''')
    right, wrong = tmp_path / "fixed_scale.py", tmp_path / "default_scale.py"
    right.write_text(source.replace("SCALE", "0.3"))
    wrong.write_text(source.replace("SCALE", "Q.shape[-1] ** -0.5"))
    options = ("--max-examples", "3", "--property", "oracle_agreement")
    code, out, _ = _check(capsys, monkeypatch, str(right), *options)
    assert code == 0, out
    assert "judged under: scale 0.3 (the Model's)" in out and "scale 0.3, causal no, dtype fp32" in out
    code, out, _ = _check(capsys, monkeypatch, str(wrong), *options)
    assert code == 1, out


def test_a_model_no_scale_explains_exits_2_naming_the_option(capsys, monkeypatch):
    code, out, err = _check(capsys, monkeypatch, str(FIXTURES / "softcapped_attention.py"))
    assert code == 2
    assert "cannot infer the scale from Model by probing: the output is not softmax(scale * Q K^T) V" in err
    assert "declare it with --model-scale VALUE (or --model-scale default for 1/sqrt(D))" in err


def test_a_python_file_without_model_new_is_refused(capsys, monkeypatch, tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("def attention(q, k, v, *, causal, scale):\n    return q\n")
    code, _, err = _check(capsys, monkeypatch, str(plain))
    assert code == 2
    assert "is not a KernelBench-format module: it lacks Model, ModelNew, get_inputs" in err
    assert "FILE.py:FUNC" in err


def test_the_task_shape_and_shapes_around_it_are_edge_cases(capsys, monkeypatch, tmp_path):
    """A ModelNew right at get_inputs()'s sequence length (N = 40) and the mean of V at every other
    fails on the shapes drawn around it, with a reproducer; the task's own shape is checked first
    (one batch, one K/V head), and the correct ModelNew passes."""
    from fa_verify.properties import get_property
    from fa_verify.properties.draw import AROUND, AROUND_REACH, edge_problems
    from fa_verify.properties.selection import Selection
    from fa_verify.targets import build_targets

    source = textwrap.dedent('''
        import torch
        import torch.nn.functional as F

        class Model(torch.nn.Module):
            def forward(self, Q, K, V):
                return F.scaled_dot_product_attention(Q, K, V)

        class ModelNew(torch.nn.Module):
            def forward(self, Q, K, V):
                if ONLY_AT_TASK and Q.shape[-2] != 40:
                    return V.mean(dim=-2, keepdim=True).expand(Q.shape[:-1] + V.shape[-1:])
                s = torch.softmax((Q.float() @ K.float().transpose(-1, -2)) * Q.shape[-1] ** -0.5, dim=-1)
                return (s @ V.float()).to(Q.dtype)

        def get_inputs():
            return [torch.rand(3, 4, 40, 16) for _ in range(3)]
        ''')
    honest, special = tmp_path / "honest.py", tmp_path / "special.py"
    honest.write_text(source.replace("ONLY_AT_TASK", "False"))
    special.write_text(source.replace("ONLY_AT_TASK", "True"))
    [backend] = build_targets([str(honest)], {})
    assert backend.task_shapes == ((3, 4, 4, 40, 40, 16),)
    edges, _ = edge_problems(get_property("oracle_agreement"), backend, Selection(seed=5))
    around = [(p.batch, p.heads, p.kv_heads, p.nq, p.nk, p.head_dim) for p in edges[:AROUND + 1]]
    assert around[0] == (1, 1, 1, 40, 40, 16)  # one batch, one K/V head and its group (MHA: one head)
    assert all(p[:3] == (1, 1, 1) and all(1 <= abs(n - 40) <= AROUND_REACH for n in p[3:5]) for p in around[1:]), around
    options = ("--max-examples", "2", "--property", "oracle_agreement")
    assert _check(capsys, monkeypatch, str(honest), *options)[0] == 0
    monkeypatch.setenv("FA_VERIFY_REPRO_DIR", str(tmp_path / "repro"))
    code, out, _ = _check(capsys, monkeypatch, str(special), *options)
    assert code == 1 and "FAIL oracle_agreement" in out
    # its reproducer rebuilds the target from the file, with what was inferred declared
    [script] = (tmp_path / "repro").glob("repro_oracle_agreement_*.py")
    assert "build_targets([" in script.read_text() and "'model_scale': 'default'" in script.read_text()
    rerun = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert rerun.returncode == 1 and "error-model bound" in rerun.stdout, rerun.stdout + rerun.stderr
