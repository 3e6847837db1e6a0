"""Properties of a backward pass (the kind "backward": `fa_verify.backward.BackwardProblem`).

* gradient_agreement: dq, dk, dv (and dsinks) against the certified gradients, within the bound
  of the target's precision model (`backward_verdict.check_gradients`: shapes, finiteness,
  structural zeros exactly, then the error bound, each tensor's worst element named).
* gradient_variant_agreement: the same on problems with the variants the target implements
  (window, softcap, ALiBi, sinks) switched on.
* gradient_determinism: two identical calls give bitwise the same dk and dv (a key tile's
  gradients have one owner, so any honest order is fixed), and dq too where the target declares a
  deterministic mode; a second call differing from the first is also a stale workspace (a dQ
  accumulator not zeroed between calls).
* gradient_strided_dout: dout given as a non-contiguous view (flash-attn's bshd memory) gives
  bitwise the same gradients: a kernel reading dout with out's strides shows.
* gradient_nan_padding: inputs (q, k, v, out, lse, dout) placed inside NaN-filled buffers give
  bitwise the same gradients: a kernel reading past a tensor picks up NaN.
"""

from __future__ import annotations

import copy

import numpy as np

from fa_verify.backward_verdict import check_gradients
from fa_verify.backends.user_callable import CallableBackend
from fa_verify.properties._result import failed, not_applicable, passed
from fa_verify.properties._subject import as_backend
from fa_verify.properties._compare import differing
from fa_verify.properties.padding import PAD_ROWS


def _named(problem, backend, result) -> dict:
    """The run's arrays by output name (dq, dk, dv, dsinks)."""
    return {o.name: x for o, x in zip(problem.outputs(backend.precision(problem.dtype)), result)}


def check_gradient_agreement(backend, problem, name: str = "gradient_agreement"):
    """dq, dk, dv (dsinks) agree with the certified gradients within the target's precision model."""
    backend = as_backend(backend)
    grads = _named(problem, backend, backend.run(problem))
    verdict = check_gradients(grads, problem.forward, problem.dout, out_given=problem.out, lse_given=problem.lse,
                              dlse=problem.dlse, precision=backend.precision(problem.dtype))
    if not verdict.passed:
        return failed(name, problem, verdict.message(), worst_ratio=verdict.worst_ratio)
    return passed(name, problem, worst_ratio=verdict.worst_ratio)


def check_gradient_variant_agreement(backend, problem):
    """With the variants the target implements switched on, the gradients agree with the certified ones."""
    return check_gradient_agreement(backend, problem, "gradient_variant_agreement")


def _compare(name: str, problem, names, first: dict, second: dict, why: str):
    for tensor in names:
        mismatch = differing(second[tensor], first[tensor])
        if mismatch is not None:
            return failed(name, problem, f"{why}: {mismatch.describe(tensor)}")
    return passed(name, problem)


def check_gradient_determinism(backend, problem):
    """Two identical calls give bitwise the same dk and dv (and dq, where declared deterministic)."""
    backend = as_backend(backend)
    first = _named(problem, backend, backend.run(problem))
    second = _named(problem, backend, backend.run(problem))
    names = [n for n in first if n != "dq" or backend.deterministic_dq]
    return _compare("gradient_determinism", problem, names, first, second,
                    "a second identical call gave other bits (nondeterministic, or a workspace kept from the "
                    "first call)")


def given_copies(backend) -> str | None:
    """Why a non-contiguous dout cannot reach `backend` (a callable is given contiguous copies), or None."""
    if isinstance(backend, CallableBackend):
        return (f"{backend.name} is a callable: it is given contiguous copies of its arrays in its layout, so "
                "dout's strides never reach it")
    return None


def strided(x: np.ndarray) -> np.ndarray:
    """`x` ([B,H,N,D]) with the same values, as a view into bshd memory (flash-attn's layout): other
    batch, head and row strides than a contiguous array's (and than out's), contiguous columns."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def check_gradient_strided_dout(backend, problem):
    """dout as a non-contiguous view (out contiguous) gives bitwise the same gradients."""
    backend = as_backend(backend)
    reason = given_copies(backend)
    if reason:
        return not_applicable("gradient_strided_dout", problem, reason)
    plain = _named(problem, backend, backend.run(problem))
    viewed = _named(problem, backend, backend.run(problem.replace(dout=strided(problem.dout))))
    return _compare("gradient_strided_dout", problem, list(plain), plain, viewed,
                    "dout given as a non-contiguous view (bshd memory) changed the gradient (the "
                    "target reads dout with other strides than its own)")


def not_padded(backend) -> str | None:
    """Why NaN padding cannot reach `backend` (a target given copies of its inputs), or None."""
    if isinstance(backend, CallableBackend) and backend.pads_inputs:
        return None
    return (f"{backend.name} is no callable: it is not handed its input arrays, so NaN padding around them "
            "would test nothing")


def check_gradient_nan_padding(backend, problem):
    """q, k, v, out, lse and dout inside NaN-filled buffers give bitwise the same gradients."""
    backend = as_backend(backend)
    reason = not_padded(backend)
    if reason:
        return not_applicable("gradient_nan_padding", problem, reason)
    plain = _named(problem, backend, backend.run(problem))
    padding = copy.copy(backend)
    padding.pad = PAD_ROWS * problem.head_dim
    padded = _named(problem, backend, padding.run(problem))
    return _compare("gradient_nan_padding", problem, list(plain), plain, padded,
                    "inputs placed inside NaN-filled buffers changed the gradient (the target reads outside "
                    "its inputs)")
