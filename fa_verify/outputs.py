"""What a run returns, per kind of problem: its outputs, each named, with its shape and dtype.

A problem's `outputs(precision)` lists them in the order a backend returns them (the forward:
out and an optional LSE; the backward: dq, dk, dv and, with sinks, dsinks). `Backend.run` checks
what came back against this list once for every kind (`check_outputs`), and `backends.watch`
reads it to tell a non-finite value from a right one (an LSE's -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.dtypes import dtype_name, numpy_dtype
from fa_verify.errors import BackendOutputError, InvalidArgumentError


@dataclass(frozen=True)
class Output:
    """One array a run returns."""

    name: str
    shape: tuple
    #: its axes in words, e.g. "[B,H,Nq,D]"
    label: str
    #: its dtype's name
    dtype: str
    #: a backend may return None instead (a target without an LSE)
    optional: bool = False
    #: -inf is a right value there (an LSE's rows that see no key)
    minus_inf: bool = False
    #: said when the array comes in the problem's dtype instead: how to declare that
    input_dtype_hint: str = ""

    def in_layout(self, layout: str) -> "Output":
        """The output as a "bshd" target returns it (axes 1 and 2 of a 4-D array swapped)."""
        if layout != "bshd" or len(self.shape) != 4:
            return self
        axes = self.label.strip("[]").split(",")
        B, H, N, D = self.shape
        return Output(self.name, (B, N, H, D), f"[{axes[0]},{axes[2]},{axes[1]},{axes[3]}]", self.dtype,
                      self.optional, self.minus_inf, self.input_dtype_hint)


def attention_outputs(problem, precision) -> tuple:
    """A forward problem's outputs: out in the output dtype, and the LSE (optional)."""
    return (Output("out", problem.out_shape, problem.out_label, precision.output),
            Output("lse", problem.lse_shape, problem.lse_label, precision.lse, optional=True, minus_inf=True,
                   input_dtype_hint="an LSE in the input dtype is declared with --lse-dtype input"))


def check_outputs(name: str, problem, result, precision, layout: str = "bhsd") -> tuple:
    """`result` as a tuple of the problem's outputs; BackendOutputError unless it holds one array
    (or None where that is optional) per output, of the shape and dtype the protocol fixes.
    A forward problem's single array is its out. Values are not checked: NaN or wrong numbers
    are findings, not misuse."""
    outputs = [o.in_layout(layout) for o in problem.outputs(precision)]
    if not isinstance(result, tuple):
        result = (result,)
    required = [o.name for o in outputs if not o.optional]
    if not len(required) <= len(result) <= len(outputs):
        expected = " or ".join(dict.fromkeys(f"({', '.join(names)})" for names in
                                             (required, [o.name for o in outputs])))
        raise BackendOutputError(f"backend {name!r} returned {len(result)} items; expected {expected} for "
                                 f"{problem.describe()}")
    result = result + (None,) * (len(outputs) - len(result))
    for output, x in zip(outputs, result):
        if x is None and output.optional:
            continue
        if not isinstance(x, np.ndarray):
            raise BackendOutputError(
                f"backend {name!r} returned {output.name} of type {type(x).__name__}; expected a numpy array"
                + (" or None" if output.optional else ""))
        dtype = numpy_dtype(output.dtype)
        if x.shape != output.shape or x.dtype != dtype:
            in_input_dtype = x.dtype == numpy_dtype(problem.dtype) != dtype and output.input_dtype_hint
            raise BackendOutputError(
                f"backend {name!r} returned {output.name} with shape={x.shape} dtype={_dtype_label(x.dtype)}; "
                f"expected shape={output.shape} ({output.label}) dtype={dtype_name(dtype)} for "
                f"{problem.describe()}" + (f" ({output.input_dtype_hint})" if in_input_dtype else ""))
    return result


def _dtype_label(dtype: np.dtype) -> str:
    try:
        return dtype_name(dtype)
    except InvalidArgumentError:
        return str(dtype)
