"""FP8 problems (`fa_verify.fp8`) drawn where FP8 bugs live.

* Descales are never 1 and never powers of two (a mantissa in [1.05, 1.95] times 2^e), drawn
  per (batch, kv head) independently for q, k and v, so they are distinct across tensors and
  heads (checked; redrawn otherwise): a dropped, swapped or wrongly indexed descale shows. Their
  exponents span small and large (2^-14 .. 2^10): q's is drawn freely and k's then chosen so
  that the true logits have the drawn spread (`LOGIT_SPREADS`), so large and small descales
  meet moderate logits. A share (`PER_TENSOR_SHARE`) has per-tensor descales of shape [1], as
  FP8 KV caches carry them.
* Stored values: normal with a drawn spread (`VALUE_SPREADS`: mostly subnormal in e4m3, ordinary,
  or clipped at the format's largest finite value), with a few entries set to +-max (448 in
  e4m3) and to the smallest subnormals.
* Logits where P's offset matters (`OFFSET_SHARE`): every row has one dominant key and all the
  others OFFSET_GAPS nats below it, so exp(s - m) lies below e4m3's smallest subnormal half
  (2^-10) and only FlashAttention-3's 2^8 offset keeps those probabilities.
* Key lengths at and around multiples of 128 in a fixed share (`TILE_EDGE_SHARE`): the tile
  edges of FP8 kernels (where P once exceeded 448).
`make_fp8_problem` builds one from its choices without Hypothesis (its tags name them all).
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from fa_verify.dtypes import FP8_DTYPES, finfo, round_to
from fa_verify.fp8 import DESCALES, FP8Problem

#: Head dims drawn when a target declares none.
HEAD_DIMS = (8, 16, 32, 64)
#: Key lengths at and around multiples of 128.
TILE_EDGE_KEYS = (127, 128, 129, 255, 256, 257)
TILE_EDGE_SHARE = 0.3
OFFSET_SHARE = 0.25
PER_TENSOR_SHARE = 0.2
#: Standard deviation of the true logits of a row (before the offset profile).
LOGIT_SPREADS = (0.5, 2.0, 6.0)
#: Standard deviation of the stored values, in units of the format's largest value (q, k, v).
VALUE_SPREADS = {"subnormal": 2.0 ** -8 / 448, "ordinary": 1.0 / 448, "saturating": 0.5}
#: How far below the dominant key the others sit, in nats, in the offset profile:
#: e^-7.3 = 2^-10.5 (flushed to 0 without the offset), e^-9 = 2^-13 (subnormal without it).
OFFSET_GAPS = (7.3, 9.0)
#: Share of stored entries set to +-max and to the smallest subnormals.
EXTREME_SHARE = 0.02


def _descale(rng, shape, exponent: int) -> np.ndarray:
    """float32 values m 2^(exponent + j), m in [1.05, 1.95] (never a power of two), j in {-1, 0, 1}."""
    mantissa = rng.uniform(1.05, 1.95, shape)
    return (mantissa * np.exp2(exponent + rng.integers(-1, 2, shape))).astype(np.float32)


def _stored(rng, shape, fmt: str, spread: str, extremes: bool = True) -> np.ndarray:
    info = finfo(fmt)
    top = float(info.max)
    x = np.clip(rng.standard_normal(shape) * VALUE_SPREADS[spread] * top, -top, top)
    extreme = rng.random(shape) < EXTREME_SHARE * extremes
    picks = rng.choice([top, float(info.smallest_subnormal), 2 * float(info.smallest_subnormal)], size=shape)
    return np.where(extreme, picks * rng.choice([-1.0, 1.0], size=shape), x)


def make_fp8_problem(shape, fmt: str, seed: int, *, causal: bool = False, spread: str = "ordinary",
                     logit_spread: float = 2.0, offset_gap: float | None = None,
                     per_tensor: bool = False, output_dtype: str = "bf16") -> FP8Problem:
    """The FP8 problem `fp8_problems` draws for these choices. `shape` = (B, H, Hkv, Nq, Nk, D)."""
    B, H, Hkv, Nq, Nk, D = shape
    rng = np.random.default_rng(seed)
    # +-max among ordinary q and k would make a few logits dwarf the rest: v always has them
    q, k = (_stored(rng, s, fmt, spread, spread != "ordinary") for s in ((B, H, Nq, D), (B, Hkv, Nk, D)))
    v = _stored(rng, (B, Hkv, Nk, D), fmt, spread)
    if offset_gap is not None:  # coordinate 0: q large, keys low except one dominant key per head
        top = float(finfo(fmt).max) / 4
        q, k = q / 64, k / 64  # the other coordinates' noise: a few hundredths of the gap
        q[..., 0] = top
        k[..., 0] = -top
        k[:, :, rng.integers(Nk), 0] = top
    descale_shape = (1,) if per_tensor else (B, Hkv)
    dq = _descale(rng, descale_shape, int(rng.integers(-14, 11)))
    dv = _descale(rng, descale_shape, int(rng.integers(-14, 11)))
    # k's descale sets the logits' spread: scale dq dk |q.k| ~ logit_spread (or the offset gap)
    stored_q, stored_k = round_to(q, fmt).astype(np.float64), round_to(k, fmt).astype(np.float64)
    if offset_gap is not None:
        unit = 2 * (float(finfo(fmt).max) / 4) ** 2  # the dominant key's lead in q.k
        target = offset_gap
    else:
        raw = stored_q @ np.repeat(stored_k, H // Hkv, axis=1).swapaxes(-1, -2)  # the stored values' q.k
        unit = max(float(np.sqrt(np.mean(raw ** 2))), 2.0 ** -60)
        target = logit_spread
    magnitude = target / (unit * float(np.mean(dq)) / math.sqrt(D))
    dk = _descale(rng, descale_shape, int(np.floor(np.log2(magnitude))))
    if offset_gap is not None:  # the lead exactly, for each (batch, kv head)'s own dq
        dk = (magnitude * float(np.mean(dq)) / dq.astype(np.float64)).astype(np.float32)
    descales = _distinct(rng, [dq, dk, dv])
    tags = (("fp8", fmt), ("spread", spread), ("logit_spread", logit_spread), ("offset_gap", offset_gap),
            ("per_tensor", per_tensor), ("seed", seed))
    return FP8Problem.from_float(q, k, v, fmt, **dict(zip(DESCALES, descales)), causal=causal,
                                 output_dtype=output_dtype, tags=tags)


def make_descaled_problem(distribution: str, shape, fmt: str, seed: int, descales: tuple, *,
                          causal: bool = False, output_dtype: str = "bf16") -> FP8Problem:
    """The FP8 problem of a report sweep point: the true values the dense `make_problem` draws
    (`distribution`, fp32) divided by descales drawn from U(descales) per (batch, kv head) for
    each of q, k and v (the same rng, after the values), then stored in `fmt`: so the true
    inputs, and the logits, are those of the dense problem whatever the range, and the range
    sets how far the stored values sit from 1 (small descales: stored values near the format's
    top; large ones: down among its subnormals). Tags: distribution, seed, descales."""
    from fa_verify.strategies._problems import make_problem

    low, high = (float(x) for x in descales)
    dense = make_problem(distribution, shape, "fp32", seed, causal=causal)
    B, Hkv = dense.batch, dense.kv_heads
    rng = np.random.default_rng([seed, 8])
    drawn = [rng.uniform(low, high, (B, Hkv)).astype(np.float32) for _ in DESCALES]
    G = dense.heads // Hkv
    q = dense.q.astype(np.float64) / np.repeat(drawn[0], G, axis=1)[..., None, None]
    k, v = (x.astype(np.float64) / d[..., None, None] for x, d in zip((dense.k, dense.v), drawn[1:]))
    top = float(finfo(fmt).max)
    q, k, v = (np.clip(x, -top, top) for x in (q, k, v))
    return FP8Problem.from_float(q, k, v, fmt, **dict(zip(DESCALES, drawn)), causal=causal,
                                 output_dtype=output_dtype,
                                 tags=(("distribution", distribution), ("seed", seed), ("descales", (low, high))))


def _distinct(rng, descales: list) -> list:
    """The descales with any value shared across tensors or entries (or a power of two) nudged."""
    seen = set()
    found = []
    for d in descales:
        d = d.copy()
        for index in np.ndindex(d.shape):
            while float(d[index]) in seen or math.log2(float(d[index])).is_integer():
                d[index] = np.float32(float(d[index]) * rng.uniform(1.01, 1.1))
            seen.add(float(d[index]))
        found.append(d)
    return found


#: Slots of the share draws (st.sampled_from is uniform; st.floats and st.integers lean to
#: simple values). Slot 0 is outside every share, so shrinking leaves the shares where it can.
_SLOTS = 20


def _in_share(draw, share: float) -> bool:
    return draw(st.sampled_from(range(_SLOTS))) >= _SLOTS - round(share * _SLOTS)


@st.composite
def fp8_problems(draw, formats=FP8_DTYPES, causal=(False, True), max_nq: int = 24, max_work: int = 300_000,
                 head_dims=HEAD_DIMS):
    """FP8 problems in `formats`, of the causal modes in `causal`, with head dims among `head_dims`
    (see the module's doc)."""
    fmt = draw(st.sampled_from(formats))
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2, 3)))
    D = draw(st.sampled_from(tuple(head_dims)))
    nq = draw(st.integers(1, max_nq))
    edge = _in_share(draw, TILE_EDGE_SHARE)
    nk = draw(st.sampled_from(TILE_EDGE_KEYS)) if edge else draw(st.integers(1, 64))
    while B * Hkv * G * nq * nk * D > max_work and D // 2 in head_dims:
        D //= 2
    offset = _in_share(draw, OFFSET_SHARE)
    return make_fp8_problem(
        (B, Hkv * G, Hkv, nq, nk, D), fmt, draw(st.integers(0, 2 ** 32 - 1)), causal=draw(st.sampled_from(causal)),
        spread=draw(st.sampled_from(tuple(VALUE_SPREADS))), logit_spread=draw(st.sampled_from(LOGIT_SPREADS)),
        offset_gap=draw(st.sampled_from(OFFSET_GAPS)) if offset else None,
        per_tensor=_in_share(draw, PER_TENSOR_SHARE))
