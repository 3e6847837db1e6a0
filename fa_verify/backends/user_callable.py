"""A user's attention function as a backend, following the callable protocol.

Protocol: `fn(q, k, v, *, causal: bool, scale: float) -> out | (out, lse)`; q is [B,H,Nq,D]
and k, v are [B,Hkv,Nk,D] (GQA passes Hkv heads) in layout "bhsd", or [B,N,H,D] in layout
"bshd" (flash_attn_func's); LSE is [B,H,Nq] float32 in both layouts. Arrays are numpy arrays of
the problem dtype (ml_dtypes.bfloat16 for bf16) or, with array="torch", CPU torch tensors.

The out= form: a function with an `out` parameter (and optionally `lse`) is called with
out= (and lse=) buffers to fill, of the shapes above in the output dtype and float32, and
returns nothing (a returned value is ignored). The buffers start NaN-filled inside guard bands
(`buffers.GuardedOutput`), so an element left unwritten or a write past either end is reported
with its index. In both forms the inputs must come back bitwise unchanged.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np

from fa_verify.backends.base import AVAILABLE, Backend, check_output, parse_precision
from fa_verify.backends.buffers import GuardedOutput, InputSnapshot, check_written
from fa_verify.backends.torch_arrays import import_torch, to_numpy, to_torch, torch_availability
from fa_verify.dtypes import DTYPE_NAMES, dtype_name, numpy_dtype
from fa_verify.errors import BackendOutputError, InvalidArgumentError
from fa_verify.precision import PrecisionModel
from fa_verify.problem import CAUSAL_ALIGNMENTS

LAYOUTS = ("bhsd", "bshd")
ARRAYS = ("numpy", "torch")


class CallableBackend(Backend):
    """Adapts `fn` to the backend protocol.

    `precision` is the model the function claims: a preset or spec for PrecisionModel.parse,
    a PrecisionModel (for its input dtype only), or None for PrecisionModel.flash, the most
    lenient model a legitimate kernel uses. `dtypes=None` means every dtype the precision
    allows. `causal_alignment` is the alignment the function implements for causal=True.
    """

    def __init__(self, fn, name: str | None = None, layout: str = "bhsd", array: str = "numpy",
                 causal_alignment: str = "bottom-right", dtypes=None,
                 precision: str | PrecisionModel | None = None):
        if not callable(fn):
            raise InvalidArgumentError(f"fn={fn!r} is not callable")
        for arg, value, allowed in (("layout", layout, LAYOUTS), ("array", array, ARRAYS),
                                    ("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)):
            if value not in allowed:
                raise InvalidArgumentError(f"{arg}={value!r}; use one of {allowed}")
        precision = "flash" if precision is None else precision
        if isinstance(precision, PrecisionModel):
            dtypes = (precision.input,) if dtypes is None else dtypes
        elif isinstance(precision, str):
            parse_precision(precision, "fp32")  # reject a bad spec now, not at the first run
        else:
            raise InvalidArgumentError(
                f"precision={precision!r} must be a preset or spec string, a PrecisionModel or None")
        self.dtypes = tuple(dtype_name(d) for d in (DTYPE_NAMES if dtypes is None else dtypes))
        if not self.dtypes or not set(self.dtypes) <= set(DTYPE_NAMES):
            raise InvalidArgumentError(f"dtypes={dtypes!r} must be a non-empty subset of {DTYPE_NAMES}")
        if isinstance(precision, PrecisionModel) and self.dtypes != (precision.input,):
            raise InvalidArgumentError(
                f"precision={precision.describe()!r} is for input {precision.input} only but "
                f"dtypes={self.dtypes!r}; pass dtypes=({precision.input!r},) or a preset such as 'flash'")
        self.fn, self.layout, self.array = fn, layout, array
        self.fills = output_parameters(fn)
        self.causal_alignment, self._precision = causal_alignment, precision
        self.name = name or _qualified_name(fn)

    def precision(self, dtype) -> PrecisionModel:
        if isinstance(self._precision, PrecisionModel):
            return self._precision
        return parse_precision(self._precision, dtype)

    def availability(self):
        return torch_availability() if self.array == "torch" else AVAILABLE

    def supports(self, problem):
        reason = super().supports(problem)
        if reason is None and problem.causal and problem.nq != problem.nk \
                and problem.causal_alignment != self.causal_alignment:
            reason = (f"{self.name} implements {self.causal_alignment} causal masking; the problem needs "
                      f"{problem.causal_alignment} (they differ when Nq={problem.nq} != Nk={problem.nk})")
        return reason

    def _run(self, problem):
        # Copies, so a function that writes into its inputs cannot change the problem; the
        # snapshot shows whether it did (torch tensors share the copies' memory).
        inputs = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if self.layout == "bshd" else x.copy()
                  for x in (problem.q, problem.k, problem.v)]
        snapshot = InputSnapshot.of(q=inputs[0], k=inputs[1], v=inputs[2])
        buffers = self._output_buffers(problem)
        arrays = [*inputs, *(b.view for b in buffers)]
        if self.array == "torch":
            arrays = [to_torch(x) for x in arrays]
        q, k, v, *fill = arrays
        result = self.fn(q, k, v, causal=problem.causal, scale=problem.scale_value, **dict(zip(self.fills, fill)))
        snapshot.check(self.name, *inputs)
        if buffers:  # the out= form: what the function wrote, whatever it returned
            check_written(self.name, *buffers)
            out, lse = buffers[0].view.copy(), buffers[1].view.copy() if len(buffers) > 1 else None
        else:
            out, lse = self._returned(result)
        check_output(self.name, problem, out, lse, self.precision(problem.dtype).output, self.layout)
        if self.layout == "bshd":
            out = np.ascontiguousarray(out.transpose(0, 2, 1, 3))
        return out, lse

    def _returned(self, result):
        """(out, lse | None) as numpy arrays from what a returning function gave back."""
        if isinstance(result, tuple):
            if len(result) != 2:
                raise BackendOutputError(
                    f"backend {self.name!r} returned a {type(result).__name__} of {len(result)} items; "
                    "expected out or (out, lse)")
            out, lse = result
        else:
            out, lse = result, None
        return self._from_array(out, "out"), self._from_array(lse, "lse")

    def _output_buffers(self, problem) -> list[GuardedOutput]:
        """Guarded out= (and lse=) buffers for the out= form; none for a function that returns."""
        B, H, Nq, D = problem.out_shape
        shapes = {"out": (B, Nq, H, D) if self.layout == "bshd" else (B, H, Nq, D), "lse": (B, H, Nq)}
        dtypes = {"out": numpy_dtype(self.precision(problem.dtype).output), "lse": np.float32}
        return [GuardedOutput.allocate(name, shapes[name], dtypes[name]) for name in self.fills]

    def _from_array(self, x, what: str):
        if self.array == "numpy" or x is None:
            return x
        if not isinstance(x, import_torch().Tensor):
            raise BackendOutputError(
                f"backend {self.name!r} returned {what} of type {type(x).__name__}; "
                "with array='torch' it must return torch tensors")
        return to_numpy(x)


def output_parameters(fn) -> tuple:
    """("out",) or ("out", "lse") when `fn` takes output buffers by keyword (the out= form), else ()."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the returning form
        return ()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = tuple(n for n in ("out", "lse") if n in parameters and parameters[n].kind in keyword)
    if names == ("lse",):
        raise InvalidArgumentError(
            f"fn={_qualified_name(fn)} takes lse= but not out=: the out= form of the callable protocol "
            "needs an out parameter (lse is optional); or drop lse and return (out, lse)")
    return names


def _qualified_name(fn) -> str:
    qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__module__', None) or '?'}:{qualname}"


def load_callable(spec: str):
    """Import and return the function named by 'MODULE:FUNC' (FUNC may be dotted: 'mod:Cls.fn')."""
    module_name, _, attr_path = str(spec).partition(":")
    if not isinstance(spec, str) or not module_name or not attr_path:
        raise InvalidArgumentError(
            f"spec={spec!r} must look like 'MODULE:FUNC', e.g. 'my_kernels.attention:forward'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # any error raised while importing the user's module
        raise InvalidArgumentError(
            f"spec={spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise InvalidArgumentError(
                f"spec={spec!r}: {getattr(obj, '__name__', module_name)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InvalidArgumentError(f"spec={spec!r} names a {type(obj).__name__}, which is not callable")
    return obj
