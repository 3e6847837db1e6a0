"""The backward problem: a forward problem, the upstream gradient dout (and optionally dlse), and
the forward's out and lse a backward kernel is given.

flash-attn's conventions (DESIGN.md, "The backward pass"): with P = exp(S - lse) (0 where
masked), dV = P^T dO, dP = dO V^T, D_i = sum_c dO_ic O_ic, dS = P o (dP - D + dlse),
dQ = scale dS K, dK = scale dS^T Q (softcap multiplies dS by the cap's derivative); with sinks
dsink_h = -sum_i P_sink,i (D_i - dlse_i). GQA/MQA: dK, dV of a kv head sum over its query heads;
a row that sees no key has dQ = 0 and adds nothing.

A backward kernel is given q, k, v, out, lse and dout: here out and lse are the certified
forward's, rounded to the problem dtype and to float32 (`forward_source` says so in every
description), so a verdict on the gradients never depends on some other forward's errors.
The gradients' exact values are those of the exact attention of q, k, v. Every other attribute
of the forward (shapes, masking, variants) is read through the backward problem, which is the
forward problem plus its upstream gradient: `problem.heads`, `problem.mask()`, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from fa_verify.dtypes import numpy_dtype, round_to
from fa_verify.errors import InvalidProblemError
from fa_verify.outputs import Output
from fa_verify.problem import AttentionProblem, OnePart

#: Where the out and lse a backward kernel is given come from.
FROM_ORACLE = "the certified forward, rounded"
#: The arrays a backward problem adds to its forward's, as saved (bf16 ones as uint16 bits).
_ARRAYS = ("dout", "out", "lse", "dlse")


@dataclass(frozen=True, eq=False)
class BackwardProblem(OnePart):
    """A forward problem and its upstream gradient. Build it with `BackwardProblem.of`."""

    forward: AttentionProblem
    #: upstream gradient of out, [B,H,Nq,D] in the problem dtype
    dout: np.ndarray
    #: the forward's out ([B,H,Nq,D], problem dtype) and lse ([B,H,Nq], float32) given to the kernel
    out: np.ndarray
    lse: np.ndarray
    #: upstream gradient of the LSE ([B,H,Nq], float32), or None when no loss depends on it
    dlse: np.ndarray | None = None
    forward_source: str = FROM_ORACLE
    #: labels of the upstream gradient (its distribution), after the forward's in `tags`
    gradient_tags: tuple = ()

    def __post_init__(self):
        f = self.forward
        if not isinstance(f, AttentionProblem):
            raise InvalidProblemError(f"forward must be an AttentionProblem, got {type(f).__name__}")
        if f.head_dim_v != f.head_dim:  # the gradients' oracle and error model take one D
            raise InvalidProblemError(
                f"v.shape={f.v.shape!r}: the backward pass needs D_v = D (q's D={f.head_dim}); D_v != D is "
                "checked for the forward pass only")
        dtype = numpy_dtype(f.dtype)
        expected = {"dout": (f.out_shape, dtype), "out": (f.out_shape, dtype),
                    "lse": (f.lse_shape, np.dtype(np.float32)), "dlse": (f.lse_shape, np.dtype(np.float32))}
        for name, (shape, want) in expected.items():
            x = getattr(self, name)
            if x is None and name == "dlse":
                continue
            if not isinstance(x, np.ndarray) or x.shape != shape or x.dtype != want:
                got = f"{type(x).__name__} {getattr(x, 'shape', '')} {getattr(x, 'dtype', '')}".strip()
                raise InvalidProblemError(f"{name} must be a {want} array of shape {shape} for "
                                          f"{f.describe()}, got {got}")
        for name in ("dout", "dlse"):
            x = getattr(self, name)
            if x is not None and not np.isfinite(x.astype(np.float32)).all():
                raise InvalidProblemError(f"{name} holds a non-finite value; fa_verify only checks finite inputs")

    @classmethod
    def of(cls, forward: AttentionProblem, dout, dlse=None, tags: tuple = ()) -> "BackwardProblem":
        """The backward of `forward` for upstream gradient `dout` (float data, rounded to the
        problem dtype) and `dlse` (rounded to float32, or None), given the certified forward's
        out and lse rounded as a kernel stores them."""
        from fa_verify.oracle import reference  # the oracle sits above the problem types

        ref = reference(forward)
        return cls(forward, round_to(np.asarray(dout, dtype=np.float64), forward.dtype),
                   round_to(ref.out, forward.dtype), ref.lse.astype(np.float32),
                   None if dlse is None else np.asarray(dlse, dtype=np.float64).astype(np.float32),
                   gradient_tags=tuple(tags))

    def replace(self, **changes) -> "BackwardProblem":
        return dataclasses.replace(self, **changes)

    def __getattr__(self, name):
        # Everything else is the forward's (shapes, masking, variants). Dunder and the field
        # itself are not delegated, so copying and unpickling never recurse.
        if name.startswith("__") or name == "forward":
            raise AttributeError(name)
        return getattr(self.forward, name)

    # --- the kind protocol (fa_verify.properties.kinds) --------------------------------------
    kind = "backward"
    finite_because = "the gradients of attention at finite inputs are finite"

    @property
    def tags(self) -> tuple:
        return self.forward.tags + self.gradient_tags

    def outputs(self, precision) -> tuple:
        """dq, dk, dv in the output dtype (flash-attn: the input dtype) and, with sinks, dsinks (float32 [H])."""
        f = self.forward
        grads = (Output("dq", f.q.shape, "[B,H,Nq,D]", precision.output),
                 Output("dk", f.k.shape, "[B,Hkv,Nk,D]", precision.output),
                 Output("dv", f.v.shape, "[B,Hkv,Nk,D]", precision.output))
        return grads + ((Output("dsinks", (f.heads,), "[H]", "fp32"),) if f.sinks is not None else ())

    def split(self, *result) -> list:
        """[the gradients]: a backward's result is a tuple of them, not (out, lse)."""
        return [result]

    def input_arrays(self) -> dict:
        arrays = {**self.forward.input_arrays(), "out": self.out, "lse": self.lse, "dout": self.dout}
        return arrays if self.dlse is None else {**arrays, "dlse": self.dlse}

    def unsupported_by(self, backend) -> str | None:
        about_outputs = backend.judged_under.about_outputs
        if about_outputs.declared:
            return (f"{backend.name} declares conventions ({about_outputs.describe()}), which are about a "
                    "forward's outputs; a backward target is given out and lse in fa_verify's")
        return self.forward.unsupported_by(backend)

    def saved(self, prefix: str = "") -> tuple[dict, dict]:
        parameters, arrays = self.forward.saved(prefix)
        parameters["backward"] = {"forward_source": self.forward_source,
                                  "gradient_tags": [list(t) for t in self.gradient_tags]}
        for name in _ARRAYS:
            x = getattr(self, name)
            if x is not None:
                arrays[prefix + name] = x.view(np.uint16) if x.dtype == numpy_dtype("bf16") else x
        return parameters, arrays

    @classmethod
    def from_saved(cls, parameters: dict, arrays, prefix: str = "") -> "BackwardProblem":
        forward = AttentionProblem.from_saved(parameters, arrays, prefix)
        dtype = numpy_dtype(forward.dtype)
        dout, out = (np.ascontiguousarray(arrays[prefix + name]).view(dtype) for name in ("dout", "out"))
        dlse = arrays[prefix + "dlse"] if prefix + "dlse" in arrays else None
        extra = parameters["backward"]
        return cls(forward, dout, out, np.asarray(arrays[prefix + "lse"]), None if dlse is None else np.asarray(dlse),
                   forward_source=extra["forward_source"],
                   gradient_tags=tuple(tuple(t) for t in extra["gradient_tags"]))

    def describe(self) -> str:
        dout = dict(self.gradient_tags).get("dout")
        return (f"backward of {self.forward.describe()}" + (f" dout={dout}" if dout else "")
                + (" with dlse" if self.dlse is not None else "") + f" (out, lse from {self.forward_source})")
