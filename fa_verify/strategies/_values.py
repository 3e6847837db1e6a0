"""Value distributions: named generators of q, k, v as float64 data for a shape and dtype.

Each generator is ``fn(rng, shape, dtype, scale=None) -> (q, k, v)``: `rng` a
``numpy.random.Generator``, `shape` a `Shape` (or a 6-tuple), `dtype` the problem dtype the
data will be rounded to, `scale` the softmax scale the problem will use (None: 1/sqrt(D)).
The arrays are float64, q of shape [B,H,Nq,D] and k, v of shape [B,Hkv,Nk,D], already clipped to
the dtype's finite range, so rounding them (``AttentionProblem.from_float``) never gives inf.
Distributions that need control over the scores (large_logits, dominant_key) use `dtype` and
`scale` to hit their target after rounding.

Every distribution keeps the scaled scores finite in fp32 by a wide margin: |q|, |k| stay
within fp16's range (|q|,|k| <= 1e4 where scores are steered, normal-sized elsewhere), so
max|q|·max|k|·D·scale is far below 3e38 for any scale an attention kernel would use.

The registry `DISTRIBUTIONS` maps each name to its generator and can be used without
Hypothesis: ``DISTRIBUTIONS["fa3_outliers"](np.random.default_rng(0), shape, "bf16")``.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np

from fa_verify.dtypes import finfo, round_trip
from fa_verify.strategies._shapes import Shape
from fa_verify.validation import check_dtype, check_scale

#: The largest finite fp16 value.
FP16_MAX = 65504.0
#: The smallest positive fp16 subnormal, 2^-24.
FP16_MIN_SUBNORMAL = 2.0 ** -24
#: Elements of steered inputs stay within this magnitude (far inside fp16's range).
_STEER_LIMIT = 1.0e4

#: fa3_outliers: Bernoulli rate and *standard deviation* of the outlier term (variance 100).
FA3_OUTLIER_RATE = 1e-3
FA3_OUTLIER_STD = 10.0
#: large_logits: the largest |scaled score| is drawn log-uniformly from this range.
LARGE_LOGIT_RANGE = (50.0, 500.0)
#: dominant_key: the dominant key's scaled score exceeds every other score of the row by this.
DOMINANT_MARGIN = 25.0

_REGISTRY: dict = {}


def _distribution(name: str):
    """Register a generator under `name`, wrapping it with argument checks and the final clip."""

    def register(body):
        def generator(rng, shape, dtype, scale=None):
            shape = Shape.coerce(shape)
            dtype = check_dtype("dtype", dtype)
            scale = check_scale("scale", scale)
            s = 1.0 / math.sqrt(shape.head_dim) if scale is None else scale
            q, k, v = body(rng, shape, dtype, s)
            big = float(finfo(dtype).max)
            return tuple(np.clip(np.asarray(x, dtype=np.float64), -big, big) for x in (q, k, v))

        generator.__name__ = generator.__qualname__ = name
        generator.__doc__ = body.__doc__
        generator.__wrapped__ = body
        _REGISTRY[name] = generator
        return generator

    return register


def _scores(q, k, shape: Shape, scale: float) -> np.ndarray:
    """Scaled scores in float64, [B, Hkv, group, Nq, Nk] (query head h reads kv head h // group)."""
    q5 = q.reshape(shape.batch, shape.kv_heads, shape.group_size, shape.nq, shape.head_dim)
    return scale * (q5 @ np.swapaxes(k, -1, -2)[:, :, None])


def _signs(rng, size) -> np.ndarray:
    return np.where(rng.random(size) < 0.5, -1.0, 1.0)


@_distribution("normal")
def normal(rng, shape, dtype, scale):
    """q, k, v i.i.d. N(0, 1)."""
    return (rng.standard_normal(shape.q_shape), rng.standard_normal(shape.kv_shape),
            rng.standard_normal(shape.v_shape))


@_distribution("uniform")
def uniform(rng, shape, dtype, scale):
    """q, k, v i.i.d. U(-1, 1)."""
    return (rng.uniform(-1.0, 1.0, shape.q_shape), rng.uniform(-1.0, 1.0, shape.kv_shape),
            rng.uniform(-1.0, 1.0, shape.v_shape))


def fa3_outlier_values(rng, size) -> np.ndarray:
    """N(0,1) + N(0,100)·Bernoulli(0.001), FlashAttention-3's numerics input (paper, Table 3).

    The paper writes N(0,100); we read 100 as the *variance* (standard deviation 10), the usual
    N(mean, variance) notation, so an outlier element has variance 1 + 100 and the whole
    distribution variance 1 + 0.001·100 = 1.1.
    """
    outlier = rng.random(size) < FA3_OUTLIER_RATE
    return rng.standard_normal(size) + rng.normal(0.0, FA3_OUTLIER_STD, size) * outlier


@_distribution("fa3_outliers")
def fa3_outliers(rng, shape, dtype, scale):
    """q, k, v i.i.d. N(0,1) + N(0,100)·Bernoulli(0.001), 100 read as the variance (std 10)."""
    return (fa3_outlier_values(rng, shape.q_shape), fa3_outlier_values(rng, shape.kv_shape),
            fa3_outlier_values(rng, shape.v_shape))


@_distribution("large_logits")
def large_logits(rng, shape, dtype, scale):
    """Normal q, k scaled together so that max |scaled score| is L, L log-uniform in [50, 500].

    Scores of both signs, the largest at ±L before rounding (within about 1% after rounding to
    bf16). v is N(0, 1). If the drawn q, k are so nearly orthogonal that reaching L would need
    elements beyond 1e4 (practically never), it redraws, and as a last resort uses q = k = c
    (every score exactly L: uniform attention at a huge logit).
    """
    lo, hi = LARGE_LOGIT_RANGE
    target = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    v = rng.standard_normal(shape.v_shape)
    for _ in range(8):
        q = rng.standard_normal(shape.q_shape)
        k = rng.standard_normal(shape.kv_shape)
        peak = float(np.abs(_scores(q, k, shape, scale)).max())
        if peak > 0:
            alpha = math.sqrt(target / peak)
            if alpha * max(np.abs(q).max(), np.abs(k).max()) <= _STEER_LIMIT:
                return alpha * q, alpha * k, v
    c = math.sqrt(target / (scale * shape.head_dim))
    return np.full(shape.q_shape, c), np.full(shape.kv_shape, c), v


@_distribution("ties")
def ties(rng, shape, dtype, scale):
    """Duplicate keys: key rows copied from fewer distinct rows, so scores tie exactly.

    Every row of k (per batch and kv head) is one of m < Nk prototypes when Nk >= 2 (m drawn in
    [1, max(1, Nk // 2)]; m = 1 makes every score of a row equal). Half the time q and k take
    values in {-1, 0, 1}, which makes exact ties between *different* keys common as well. v is
    N(0, 1), independent per key, so which of the tied keys is weighted how matters.
    """
    if rng.random() < 0.5:
        q = rng.standard_normal(shape.q_shape)
        base = rng.standard_normal(shape.kv_shape)
    else:
        q = rng.integers(-1, 2, shape.q_shape).astype(np.float64)
        base = rng.integers(-1, 2, shape.kv_shape).astype(np.float64)
    m = int(rng.integers(1, max(1, shape.nk // 2) + 1))
    which = rng.integers(0, m, (shape.batch, shape.kv_heads, shape.nk))
    k = np.take_along_axis(base, which[..., None], axis=2)
    return q, k, rng.standard_normal(shape.v_shape)


def _dominant_positions(rng, shape: Shape) -> np.ndarray:
    """Per (batch, kv head): the dominant key, a third each at 0, at Nk-1 and anywhere."""
    where = rng.integers(0, 3, (shape.batch, shape.kv_heads))
    anywhere = rng.integers(0, shape.nk, (shape.batch, shape.kv_heads))
    return np.select([where == 0, where == 1], [0, shape.nk - 1], anywhere)


@_distribution("dominant_key")
def dominant_key(rng, shape, dtype, scale):
    """One key per (batch, kv head) that every query of the group attends with probability ≈ 1.

    Queries are q = 2·w + η with w a random unit vector and η ⟂ w ~ N(0, 1); the dominant key is
    β·w, the others N(0, 1). β is chosen, on the values *after rounding to the dtype*, so that
    the dominant scaled score beats every other score of the row by DOMINANT_MARGIN (25), i.e.
    its probability exceeds 1 - Nk·e^-25. Its position is 0, Nk-1 or uniform (a third each):
    key 0 is visible to every causal row that sees any key; at other positions rows that
    cannot see the dominant key get an ordinary softmax. Dominance needs roughly
    scale >= 1e-2 (at smaller scales β is capped at 1e4 and the margin shrinks).
    """
    B, Hkv, g, Nq, Nk, D = (shape.batch, shape.kv_heads, shape.group_size, shape.nq, shape.nk,
                            shape.head_dim)
    gamma = 2.0
    w = rng.standard_normal((B, Hkv, D))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    eta = rng.standard_normal((B, Hkv, g, Nq, D))
    eta -= np.einsum("bkgid,bkd->bkgi", eta, w)[..., None] * w[:, :, None, None, :]
    q = round_trip((gamma * w[:, :, None, None, :] + eta).reshape(shape.q_shape), dtype)
    k = round_trip(rng.standard_normal(shape.kv_shape), dtype)
    star = _dominant_positions(rng, shape)
    is_star = np.arange(Nk)[None, None, :] == star[:, :, None]  # [B, Hkv, Nk]

    others = np.where(is_star[:, :, None, None, :], -np.inf, _scores(q, k, shape, scale))
    best_other = np.maximum(others.max(axis=(2, 3, 4)), 0.0) if Nk > 1 else np.zeros((B, Hkv))
    need = best_other + DOMINANT_MARGIN  # [B, Hkv]
    beta = need / (scale * gamma)
    cap = _STEER_LIMIT / np.abs(w).max(axis=-1)
    for _ in range(10):
        beta = np.minimum(beta, cap)
        star_rows = round_trip(beta[..., None] * w, dtype)  # [B, Hkv, D]
        q5 = q.reshape(B, Hkv, g, Nq, D)
        got = scale * np.einsum("bkgid,bkd->bkgi", q5, star_rows).min(axis=(2, 3))
        short = got < need
        if not short.any() or np.all(beta[short] >= cap[short]):
            break
        beta = np.where(short, beta * 2.0, beta)
    k[np.arange(B)[:, None], np.arange(Hkv)[None, :], star] = star_rows
    return q, k, rng.standard_normal(shape.v_shape)


@_distribution("constant_rows")
def constant_rows(rng, shape, dtype, scale):
    """Degenerate rows: v constant along keys (output = that constant), or q = 0 (uniform
    attention, output = mean of v), or both (a third each). Other tensors N(0, 1)."""
    mode = int(rng.integers(0, 3))  # 0: v constant, 1: q = 0, 2: both
    q = rng.standard_normal(shape.q_shape)
    k = rng.standard_normal(shape.kv_shape)
    v = rng.standard_normal(shape.v_shape)
    if mode in (0, 2):
        v = np.broadcast_to(v[:, :, :1, :], shape.v_shape).copy()
    if mode in (1, 2):
        q = np.zeros(shape.q_shape)
    return q, k, v


def _fp16_subnormals(rng, size) -> np.ndarray:
    """±k·2^-24, k in [1, 1023]: the fp16 subnormals (normal numbers in bf16 and fp32)."""
    return _signs(rng, size) * FP16_MIN_SUBNORMAL * rng.integers(1, 1024, size)


@_distribution("fp16_extremes")
def fp16_extremes(rng, shape, dtype, scale):
    """fp16's extremes: v mixes N(0,1), values within 1.6% of ±65504 and fp16 subnormals
    (about 40/30/30%); q and k mix N(0,1) (70%) and fp16 subnormals (30%), so the scores stay
    ordinary and only v (hence the output) is near the fp16 limit. In bf16 65504 rounds to
    65536, still finite; in fp32 the values are exact."""
    def qk(size):
        return np.where(rng.random(size) < 0.3, _fp16_subnormals(rng, size),
                        rng.standard_normal(size))

    size = shape.v_shape
    pick = rng.random(size)
    large = _signs(rng, size) * FP16_MAX * (1.0 - rng.uniform(0.0, 2.0 ** -6, size))
    v = np.select([pick < 0.3, pick < 0.6], [large, _fp16_subnormals(rng, size)],
                  rng.standard_normal(size))
    return qk(shape.q_shape), qk(shape.kv_shape), v


@_distribution("tiny")
def tiny(rng, shape, dtype, scale):
    """Subnormal-scale inputs of the dtype: ±2^-e·smallest_normal·[1, 2), e uniform in
    [-1, p+1] (p the dtype's fraction bits), so values run from just above the smallest normal
    through every subnormal binade; the smallest round to 0 or the least subnormal. Scores are
    then ≈ 0 (uniform attention) and the output is itself subnormal-scale."""
    info = finfo(dtype)
    smallest = float(info.smallest_normal)

    def draw(size):
        e = rng.uniform(-1.0, info.nmant + 1.0, size)
        return _signs(rng, size) * smallest * np.exp2(-e) * rng.uniform(1.0, 2.0, size)

    return draw(shape.q_shape), draw(shape.kv_shape), draw(shape.v_shape)


#: name -> generator ``fn(rng, shape, dtype, scale=None) -> (q, k, v)`` (read-only).
DISTRIBUTIONS = MappingProxyType(_REGISTRY)
#: The distribution names, in registry order.
DISTRIBUTION_NAMES = tuple(_REGISTRY)
