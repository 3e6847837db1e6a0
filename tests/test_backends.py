"""Backends against a float64 reference, with tolerances derived from each one's precision model."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fa_verify import AttentionProblem, PrecisionModel
from fa_verify.backends import (
    Availability,
    CallableBackend,
    NaiveBackend,
    NumpyTiledBackend,
    TorchSdpaBackend,
    backend_table,
    builtin_backends,
    get_backend,
    load_callable,
    naive_attention,
    tiled_attention,
)
from fa_verify.dtypes import DTYPE_NAMES, round_to, ulp, unit_roundoff
from fa_verify.errors import BackendOutputError, BackendUnavailableError, InvalidArgumentError

U32 = unit_roundoff("fp32")

# --- reference and tolerance ------------------------------------------------------------------


def reference64(problem):
    """float64 attention: out, lse, row scale sum_j p_ij |v_jc|, and max |scaled score| per row."""
    q = problem.q64()
    k, v = problem.kv64()
    s = np.where(problem.mask, q @ np.swapaxes(k, -1, -2) * problem.scale_value, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = e.sum(axis=-1, keepdims=True)
    l_safe = np.where(l > 0, l, 1)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(l_safe), -np.inf)[..., 0]
    t_max = np.abs(np.where(problem.mask, s, 0)).max(axis=-1)
    return e @ v / l_safe, lse, e @ np.abs(v) / l_safe, t_max


def tolerances(problem, precision, ref, exp_error=0.0):
    """First-order error bounds of `precision` on `problem`, times a safety factor of 2.

    A score error δ moves a softmax output by at most 2·max|δ|·row_scale and the LSE by max|δ|;
    a relative error ε on every p (exp, P rounding) moves them by 2ε·row_scale and ε; sums of n
    fp32 terms add n·u32; roundings of acc, l, O add u_pv and u_out of |O|; LSE is stored in fp32.
    """
    out, lse, row_scale, t_max = ref
    u = {stage: unit_roundoff(getattr(precision, stage)) for stage in
         ("score_accumulation", "p_rounding", "pv_accumulation", "output")}
    u_s = u["score_accumulation"]
    # Rounding S, the scale, scale·S and S - max (|S - max| <= 2 t_max), plus fp32 dot products.
    delta = 5 * u_s * t_max + problem.head_dim * U32 * (1 + t_max)
    eps_p = u_s + u["p_rounding"] + exp_error + (problem.nk + problem.head_dim) * U32
    out_tol = 2 * ((2 * delta + 2 * eps_p + 3 * u["pv_accumulation"])[..., None] * row_scale
                   + u["output"] * np.abs(out))
    finite = np.isfinite(lse)
    lse_tol = 2 * (delta + eps_p + 2 * u["pv_accumulation"] + U32 * np.abs(np.where(finite, lse, 0)))
    return out_tol, lse_tol


#: Measured deviations the precision model cannot express (see torch_sdpa's docstring):
#: torch's CPU flash kernel uses an exp with relative error up to ~1.1e-4 for fp16/bf16 inputs,
#: and gives LSE 0 (not -inf) for fully masked rows.
EXP_ERROR = {("torch-sdpa-flash-cpu", "fp16"): 2**-13, ("torch-sdpa-flash-cpu", "bf16"): 2**-13}
MASKED_ROW_LSE = {"torch-sdpa-flash-cpu": 0.0}


def check_against_reference(backend, problem, out, lse):
    assert not np.isnan(out.astype(np.float32)).any(), "NaN in out"
    ref = reference64(problem)
    out_tol, lse_tol = tolerances(problem, backend.precision(problem.dtype), ref,
                                  EXP_ERROR.get((backend.name, problem.dtype), 0.0))
    masked = problem.masked_rows
    assert (out[:, :, masked] == 0).all(), "fully masked rows must be 0"
    err = np.abs(out.astype(np.float64) - ref[0])
    worst = np.unravel_index(np.argmax(err - out_tol), err.shape)
    assert (err <= out_tol).all(), f"out error {err[worst]:.3g} > tolerance {out_tol[worst]:.3g} at {worst}"
    if lse is None:
        return
    assert not np.isnan(lse).any(), "NaN in lse"
    assert (lse[:, :, masked] == MASKED_ROW_LSE.get(backend.name, -np.inf)).all()
    lse_err, lse_tol = np.abs(lse[:, :, ~masked] - ref[1][:, :, ~masked]), lse_tol[:, :, ~masked]
    worst = np.unravel_index(np.argmax(lse_err - lse_tol), lse_err.shape)
    assert (lse_err <= lse_tol).all(), f"lse error {lse_err[worst]:.3g} > tolerance {lse_tol[worst]:.3g}"


# --- problems ---------------------------------------------------------------------------------

CASES = {
    # name: (B, H, Hkv, Nq, Nk, D, causal alignment or None, scale)
    "non-causal Nq<Nk": (2, 2, 2, 37, 45, 16, None, None),
    "non-causal Nq>Nk": (1, 2, 2, 45, 20, 16, None, None),
    "causal square, partial tiles": (1, 2, 2, 70, 70, 16, "bottom-right", None),
    "bottom-right Nq<Nk": (1, 2, 2, 20, 45, 16, "bottom-right", None),
    "bottom-right Nq>Nk (masked rows)": (2, 2, 2, 45, 20, 16, "bottom-right", None),
    "top-left Nq<Nk": (1, 2, 2, 20, 45, 16, "top-left", None),
    "top-left Nq>Nk": (1, 2, 2, 45, 20, 16, "top-left", None),
    "gqa causal": (1, 4, 2, 33, 33, 16, "bottom-right", None),
    "gqa bottom-right Nq>Nk": (1, 4, 2, 33, 20, 16, "bottom-right", None),
    "mqa, one query, odd D, given scale": (2, 3, 1, 1, 17, 5, None, 0.3),
}


def make_problem(case, dtype, seed=0):
    B, H, Hkv, Nq, Nk, D, alignment, scale = CASES[case]
    rng = np.random.default_rng(seed)
    return AttentionProblem.from_float(
        rng.standard_normal((B, H, Nq, D)), rng.standard_normal((B, Hkv, Nk, D)),
        rng.standard_normal((B, Hkv, Nk, D)), dtype, causal=alignment is not None,
        causal_alignment=alignment or "bottom-right", scale=scale)


BACKENDS = [NumpyTiledBackend(), NumpyTiledBackend(16, 8), NaiveBackend("same-precision"),
            NaiveBackend("fp32"), TorchSdpaBackend("math"), TorchSdpaBackend("flash-cpu")]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_backend_matches_float64_reference(backend, dtype, case):
    if not backend.availability().available:
        pytest.skip(backend.availability().reason)
    problem = make_problem(case, dtype)
    assert backend.supports(problem) is None
    out, lse = backend.run(problem)
    check_against_reference(backend, problem, out, lse)


def test_case_with_masked_rows_has_them():
    assert make_problem("bottom-right Nq>Nk (masked rows)", "fp32").masked_rows.sum() == 25


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_tiled_model_is_insensitive_to_tile_sizes(dtype):
    problem = make_problem("bottom-right Nq>Nk (masked rows)", dtype, seed=3)
    precision = PrecisionModel.flash(dtype)
    out_tol, lse_tol = tolerances(problem, precision, reference64(problem))
    base_out, base_lse = tiled_attention(problem, precision, 64, 64)
    for block_q, block_k in [(1, 1), (16, 8), (7, 128), (45, 3)]:
        out, lse = tiled_attention(problem, precision, block_q, block_k)
        assert (np.abs(out.astype(np.float64) - base_out.astype(np.float64)) <= 2 * out_tol).all()
        finite = np.isfinite(base_lse)
        assert (np.isfinite(lse) == finite).all()
        assert (np.abs(lse[finite] - base_lse[finite]) <= 2 * lse_tol[finite]).all()


def test_tiled_with_one_key_tile_agrees_with_naive():
    # With one key tile there is no rescaling: only the fp32 summation order differs from
    # naive, which moves each sum of Nk terms by at most ~Nk·u32 of its magnitude.
    problem = make_problem("causal square, partial tiles", "fp32")
    out, lse = tiled_attention(problem, PrecisionModel.flash("fp32"), 128, 128)
    ref_out, ref_lse = naive_attention(problem, PrecisionModel.flash("fp32"))
    scale = reference64(problem)[2]
    assert (np.abs(out - ref_out) <= 4 * problem.nk * U32 * scale).all()
    assert np.allclose(lse, ref_lse, rtol=4 * U32, atol=0)


@pytest.mark.parametrize("kwargs", [{"block_q": 0}, {"block_k": -1}, {"block_q": 2.5},
                                    {"block_k": True}, {"precision": "same-precision"},
                                    {"precision": "nonsense"}])
def test_tiled_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        NumpyTiledBackend(**kwargs)


def test_naive_rejects_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="compute="):
        NaiveBackend("fp64")
    with pytest.raises(InvalidArgumentError, match="does not match"):
        naive_attention(make_problem("gqa causal", "fp16"), PrecisionModel.flash("bf16"))


def test_naive_same_precision_is_less_accurate_than_fp32():
    problem = AttentionProblem.from_float(*(4 * np.random.default_rng(1).standard_normal((3, 1, 2, 64, 32))),
                                          "fp16")
    ref = reference64(problem)[0]
    same = np.abs(naive_attention(problem, PrecisionModel.same_precision("fp16"))[0] - ref).max()
    fp32 = np.abs(naive_attention(problem, PrecisionModel.fp32_accumulate("fp16"))[0] - ref).max()
    assert same > 4 * fp32


# --- output validation and the callable adaptor ---------------------------------------------------


def naive_fn(q, k, v, *, causal, scale):
    """A protocol function (numpy, bhsd, bottom-right) built on naive_attention."""
    problem = AttentionProblem(q, k, v, causal=causal, scale=scale)
    return naive_attention(problem, PrecisionModel.flash(problem.dtype))


def test_callable_returning_wrong_shape_names_the_backend():
    backend = CallableBackend(lambda q, k, v, **kw: q[:, :, :-1], name="my-kernel")
    expected = r"'my-kernel' returned out with shape=\(2, 3, 0, 5\).*expected shape=\(2, 3, 1, 5\)"
    with pytest.raises(BackendOutputError, match=expected):
        backend.run(make_problem("mqa, one query, odd D, given scale", "fp16"))


@pytest.mark.parametrize("fn, match", [
    (lambda q, k, v, **kw: q.astype(np.float32), r"dtype=fp32; expected .* dtype=fp16"),
    (lambda q, k, v, **kw: (q, np.zeros(q.shape[:3])), r"lse .* dtype=fp64; expected .* dtype=fp32"),
    (lambda q, k, v, **kw: (q, np.zeros(q.shape[:2], np.float32)), r"lse with shape=\(1, 4\)"),
    (lambda q, k, v, **kw: (q, None, None), "3 items"),
    (lambda q, k, v, **kw: q.tolist(), "out of type list"),
])
def test_callable_output_errors(fn, match):
    with pytest.raises(BackendOutputError, match=match):
        CallableBackend(fn, name="bad").run(make_problem("gqa causal", "fp16"))


def test_callable_name_defaults_to_module_and_qualname():
    assert CallableBackend(naive_fn).name == f"{__name__}:naive_fn"


def _bshd(fn):
    def wrapped(q, k, v, *, causal, scale):
        assert q.shape[2] == 4 and k.shape[2] == 2  # [B, N, H, D], k/v with Hkv heads
        out, lse = fn(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal=causal, scale=scale)
        return out.transpose(0, 2, 1, 3), lse
    return wrapped


def _torch_arrays(fn):
    torch = pytest.importorskip("torch")

    def wrapped(q, k, v, *, causal, scale):
        dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[q.dtype]
        # Through fp32, which holds every fp16/bf16 value: independent of the adaptor's bf16 path.
        out, lse = fn(*(round_to(x.float().numpy(), dtype) for x in (q, k, v)), causal=causal, scale=scale)
        return torch.from_numpy(out.astype(np.float32)).to(q.dtype), torch.from_numpy(lse)
    return wrapped


@pytest.mark.parametrize("array", ["numpy", "torch"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_callable_adaptors_reproduce_naive_bitwise(layout, array, dtype):
    fn = _bshd(naive_fn) if layout == "bshd" else naive_fn
    fn = _torch_arrays(fn) if array == "torch" else fn
    backend = CallableBackend(fn, name=f"naive-{layout}-{array}", layout=layout, array=array)
    problem = make_problem("gqa bottom-right Nq>Nk", dtype)
    out, lse = backend.run(problem)
    ref_out, ref_lse = naive_attention(problem, PrecisionModel.flash(dtype))
    assert out.dtype == ref_out.dtype and out.flags.c_contiguous
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)


def test_callable_gets_copies_of_the_inputs_and_writing_into_them_is_reported():
    def scribbles(q, k, v, *, causal, scale):
        out = naive_fn(q, k, v, causal=causal, scale=scale)
        q[...] = 0
        return out
    problem = make_problem("gqa causal", "fp32")
    before = problem.q.copy()
    with pytest.raises(BackendOutputError, match=r"wrote into its input q: .* first at \[0, 0, 0, 0\]"):
        CallableBackend(scribbles).run(problem)
    np.testing.assert_array_equal(problem.q, before)


def test_callable_causal_alignment_is_declined_only_where_it_matters():
    backend = CallableBackend(naive_fn, name="tl", causal_alignment="top-left")
    reason = backend.supports(make_problem("bottom-right Nq<Nk", "fp16"))
    assert "top-left" in reason and "bottom-right" in reason
    assert backend.supports(make_problem("causal square, partial tiles", "fp16")) is None
    assert backend.supports(make_problem("non-causal Nq<Nk", "fp16")) is None
    with pytest.raises(InvalidArgumentError, match="cannot run"):
        backend.run(make_problem("bottom-right Nq<Nk", "fp16"))


def test_callable_precision_and_dtypes():
    assert CallableBackend(naive_fn).precision("bf16") == PrecisionModel.flash("bf16")
    assert CallableBackend(naive_fn, precision="fp32-accumulate").precision("fp16") == \
        PrecisionModel.fp32_accumulate("fp16")
    fixed = CallableBackend(naive_fn, precision=PrecisionModel.same_precision("fp16"))
    assert fixed.dtypes == ("fp16",)
    assert "dtype=fp32" in fixed.supports(make_problem("gqa causal", "fp32"))
    with pytest.raises(InvalidArgumentError, match="dtypes="):
        CallableBackend(naive_fn, precision=PrecisionModel.flash("fp16"), dtypes=("fp16", "bf16"))
    with pytest.raises(InvalidArgumentError, match="precision="):
        CallableBackend(naive_fn, precision="score=fp7")
    for kwargs in ({"layout": "sbhd"}, {"array": "jax"}, {"causal_alignment": "left"},
                   {"dtypes": ("fp64",)}, {"dtypes": ()}, {"precision": 3}):
        with pytest.raises(InvalidArgumentError):
            CallableBackend(naive_fn, **kwargs)
    with pytest.raises(InvalidArgumentError, match="not callable"):
        CallableBackend(42)


def test_load_callable():
    assert load_callable("fa_verify.backends.naive:naive_attention") is naive_attention
    assert load_callable("fa_verify.backends.naive:NaiveBackend.precision") is NaiveBackend.precision
    for spec, match in [("naive_attention", "must look like 'MODULE:FUNC'"),
                        (":f", "must look like"),
                        ("no_such_module_fa:f", "cannot import module 'no_such_module_fa'.*ModuleNotFoundError"),
                        ("fa_verify.backends.naive:nope", "has no attribute 'nope'"),
                        ("fa_verify.backends.naive:__doc__", "names a str, which is not callable"),
                        ("no/such/file_fa.py:f", "names the file 'no/such/file_fa.py', which does not exist")]:
        with pytest.raises(InvalidArgumentError, match=match):
            load_callable(spec)


def test_load_callable_from_a_file(tmp_path, monkeypatch):
    """'path/to/file.py:FUNC', as a newcomer writes it: the file's folder is on sys.path for its
    own imports, and loading it twice gives the same function."""
    (tmp_path / "helper_fa_neighbour.py").write_text("SCALE = 2\n")
    (tmp_path / "my_attention_fa.py").write_text("from helper_fa_neighbour import SCALE\n"
                                                 "def forward(q, k, v, *, causal, scale):\n    return SCALE\n")
    monkeypatch.chdir(tmp_path.parent)
    spec = f"{tmp_path.name}/my_attention_fa.py:forward"
    fn = load_callable(spec)
    assert fn(None, None, None, causal=False, scale=1.0) == 2 and load_callable(spec) is fn
    (tmp_path / "broken_fa.py").write_text("raise RuntimeError('at import')\n")
    with pytest.raises(InvalidArgumentError, match="cannot import module .*broken_fa.py.*RuntimeError: at import"):
        load_callable(f"{tmp_path.name}/broken_fa.py:forward")


# --- torch ------------------------------------------------------------------------------------


def test_torch_unavailable_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    backend = TorchSdpaBackend("math")
    availability = backend.availability()
    assert availability == Availability(False, "torch is not installed (pip install 'fa-verify[torch]')")
    with pytest.raises(BackendUnavailableError, match="torch-sdpa-math.*pip install"):
        backend.run(make_problem("gqa causal", "fp16"))
    assert not CallableBackend(naive_fn, array="torch").availability().available
    rows = {row["name"]: row for row in backend_table()}
    assert not rows["torch-sdpa-flash-cpu"]["available"] and rows["numpy-tiled"]["available"]


def test_backends_import_without_torch():
    code = "import sys; import fa_verify.backends; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_flash_cpu_rounds_p_to_the_input_dtype():
    """Keys whose exp(score) rounds down in fp16 (+1 in v) against keys with p = 1 (-1 in v): the
    output then shows P rounding as a bias far above fp16's resolution near 0."""
    pytest.importorskip("torch")
    k = -np.arange(1, 4000) * 2.0**-14
    k = k.astype(np.float16).astype(np.float64)
    p = np.exp(k.astype(np.float32)).astype(np.float64)
    k = k[((p - p.astype(np.float16)) / 2.0**-11 > 0.3)][:100]
    keys = np.concatenate([k, np.zeros(len(k))])
    values = np.concatenate([np.ones(len(k)), -np.ones(len(k))])
    problem = AttentionProblem.from_float(np.ones((1, 1, 1, 1)), keys.reshape(1, 1, -1, 1),
                                          values.reshape(1, 1, -1, 1), "fp16", scale=1.0)
    # One key tile, so the model's P is relative to the global max, as in torch's kernel.
    flash = float(tiled_attention(problem, PrecisionModel.flash("fp16"), 1, 1024)[0].item())
    fp32 = float(naive_attention(problem, PrecisionModel.fp32_accumulate("fp16"))[0].item())
    one_ulp = float(ulp(fp32, "fp16"))
    assert abs(flash - fp32) > 5 * one_ulp
    # Within an ulp rather than equal: torch's approximate exp may move a rounding.
    assert abs(float(TorchSdpaBackend("flash-cpu").run(problem)[0].item()) - flash) <= one_ulp
    assert abs(float(TorchSdpaBackend("math").run(problem)[0].item()) - fp32) <= one_ulp


def test_torch_math_keeps_fp32_when_reduced_precision_is_allowed():
    torch = pytest.importorskip("torch")
    problem = AttentionProblem.from_float(*(4 * np.random.default_rng(1).standard_normal((3, 1, 2, 64, 32))),
                                          "bf16")
    backend = TorchSdpaBackend("math")
    expected, _ = backend.run(problem)
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        np.testing.assert_array_equal(backend.run(problem)[0], expected)
        assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)


# --- registry ---------------------------------------------------------------------------------


def test_registry():
    names = [backend.name for backend in builtin_backends()]
    assert names[:5] == ["numpy-tiled", "naive-same-precision", "naive-fp32", "torch-sdpa-math",
                         "torch-sdpa-flash-cpu"]
    kernels = {f"{family}-{runner}" for family in ("fa2", "wmma", "mma-ptx", "naive-cuda", "naive16-cuda", "fa3-fp8")
               for runner in ("cpu", "pycuda")}
    ragged = {"numpy-ragged-varlen", "numpy-ragged-paged", *(f"split-kv{layout}-{runner}" for layout in ("", "-varlen")
                                                               for runner in ("cpu", "pycuda"))}
    backward = {"numpy-fa2-backward", "fa2-bwd-cpu", "fa2-bwd-det-cpu", "fa2-bwd-pycuda"}
    assert set(names[5:]) == kernels | ragged | backward | {"numpy-fa3-fp8", "numpy-paged-fp8"}
    assert isinstance(get_backend("naive-fp32"), NaiveBackend)
    with pytest.raises(InvalidArgumentError, match="unknown; built-in backends: numpy-tiled, "):
        get_backend("cuda-fa2")
    table = json.loads(json.dumps(backend_table()))
    row = table[names.index("naive-same-precision")]
    assert set(row) == {"name", "available", "reason", "kinds", "layout", "dtypes", "precision", "features", "splits",
                        "notes"}
    assert row["kinds"] == ["dense"] and table[names.index("split-kv-cpu")]["kinds"] == ["paged", "paged-fp8"]
    assert table[names.index("split-kv-varlen-cpu")]["kinds"] == ["varlen"]
    fp8 = table[names.index("numpy-fa3-fp8")]
    assert fp8["kinds"] == ["fp8"] and fp8["precision"]["e4m3"] == PrecisionModel.fa3_fp8("e4m3").as_dict()
    paged_fp8 = table[names.index("numpy-paged-fp8")]
    assert paged_fp8["kinds"] == ["paged-fp8"] and paged_fp8["dtypes"] == ["e4m3", "e5m2"]
    for runner in ("cpu", "pycuda"):  # our FP8 kernel, judged under the same model
        kernel = table[names.index(f"fa3-fp8-{runner}")]
        assert kernel["kinds"] == ["fp8"] and kernel["precision"] == fp8["precision"]
    assert row["precision"]["bf16"] == PrecisionModel.same_precision("bf16").as_dict()
