"""A user's varlen or paged attention function as a ragged backend, with flash-attn's signatures.

Protocol (the conventions of `fa_verify.ragged`; numpy arrays, or CPU torch tensors with
array="torch"):
  layout "varlen" (flash_attn_varlen_func):
    fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, softmax_scale, ...)
    q [total_q, H, D], k, v [total_k, Hkv, D], cu_seqlens_* int32 [B+1], max_seqlen_* ints;
    returns out [total_q, H, D] or (out, lse [H, total_q]).
  layout "paged" (flash_attn_with_kvcache):
    fn(q, k_cache, v_cache, *, cache_seqlens, block_table, causal, softmax_scale, ...)
    q [B, Nq, H, D], k_cache, v_cache [num_blocks, page_size, Hkv, D], cache_seqlens int32 [B],
    block_table int32 [B, max_blocks]; returns out [B, Nq, H, D] or (out, lse [B, H, Nq]).
The scale is flash-attn's keyword softmax_scale (the dense protocol's `scale`). Keywords the
signature names are passed, as flash-attn spells them: window_size, softcap, alibi_slopes ([H] or
[B, H]), sinks (the variants, as in the dense protocol; `features=` narrows them),
return_softmax_lse=True (then the function returns (out, lse)), num_splits (then it is a
split-KV target: problems ask for 0 = its own choice, 1, 2, ... splits), k_scale and v_scale (then a
paged function also runs FP8 KV caches, kind "paged-fp8": q, k_cache and v_cache come as
ml_dtypes float8 arrays, e4m3fn or e5m2, with float32 scales [1] per tensor or [B, Hkv], true
value = stored x scale, and q's descale as q_descale when the signature names it; without it, only
batches whose q_descale is 1 are run). A function with an `out`
parameter (and optionally `lse`) is given sentinel-filled buffers of the layout's shapes to
write (`buffers.output_buffers`): rows it leaves unwritten are reported with their sequence.
With isolate=True it runs in a worker process as `CallableBackend` does (a crash, a hang or a
runaway allocation fails the example; the input checks run in the worker, on what it saw).
"""

from __future__ import annotations

import inspect

import numpy as np

from fa_verify.backends.base import AVAILABLE, Backend, leaving_inputs_unchanged, parse_precision
from fa_verify.backends.buffers import output_buffers
from fa_verify.backends.torch_arrays import import_torch, to_numpy, to_torch, torch_availability
from fa_verify.backends.user_callable import (
    ARRAYS,
    _qualified_name,
    check_signature,
    isolated_worker,
    output_parameters,
    variant_parameters,
)
from fa_verify.conventions import of as conventions_of
from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES, dtype_name
from fa_verify.errors import BackendOutputError, InvalidArgumentError
from fa_verify.guards import guarded
from fa_verify.isolation import DEFAULT_MEMORY_LIMIT, DEFAULT_TIMEOUT
from fa_verify.limits import Limits, parse_limits
from fa_verify.precision import PrecisionModel
from fa_verify.problem import FEATURES
from fa_verify.ragged import LAYOUTS, PAGED_SCALES, RaggedProblem

#: The positional arguments of each layout, in flash-attn's order; the rest go by keyword.
POSITIONAL = {"varlen": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
              "paged": ("q", "k_cache", "v_cache")}


class RaggedCallableBackend(Backend):
    """Adapts a varlen or paged function (see the module's doc) to `Backend`, running that layout.

    precision, dtypes, limits, features, array, conventions (per sequence), isolate, timeout and memory_limit as for `CallableBackend`; `page_sizes` (None: any) declares the page sizes a paged function supports."""

    def __init__(self, fn, layout: str, name: str | None = None, precision: str | None = None, dtypes=None,
                 limits: Limits | dict | None = None, features=None, array: str = "numpy",
                 page_sizes=None, conventions=None, isolate: bool = False, timeout: float = DEFAULT_TIMEOUT,
                 memory_limit: int | str | None = DEFAULT_MEMORY_LIMIT, forbid=()):
        if not callable(fn):
            raise InvalidArgumentError(f"fn={fn!r} is not callable")
        for arg, value, allowed in (("layout", layout, LAYOUTS), ("array", array, ARRAYS)):
            if value not in allowed:
                raise InvalidArgumentError(f"{arg}={value!r}; use one of {allowed}")
        self._precision = "flash" if precision is None else precision
        parse_precision(self._precision, "fp32")  # reject a bad spec now, not at the first run
        self.limits = limits if isinstance(limits, Limits) else parse_limits(limits or {}, prefix="limits.")
        keywords = _keywords(fn)
        #: the scales of an FP8 cache it takes (PAGED_SCALES' keywords its signature names)
        self.takes_scales = tuple(k for k in PAGED_SCALES.values() if k in keywords)
        fp8_cache = layout == "paged" and {"k_scale", "v_scale"} <= set(self.takes_scales)
        # scales without a default: the function runs FP8 caches only
        fp8_only = fp8_cache and not set(self.takes_scales) <= _keywords(fn, with_default=True)
        self.kinds = ("paged-fp8",) if fp8_only else (layout, "paged-fp8") if fp8_cache else (layout,)
        allowed = DTYPE_NAMES + FP8_DTYPES if fp8_cache else DTYPE_NAMES
        dtypes = self.limits.dtypes if dtypes is None else dtypes
        self.dtypes = tuple(dtype_name(d) for d in ((FP8_DTYPES if fp8_only else allowed) if dtypes is None else dtypes))
        if not self.dtypes or not set(self.dtypes) <= set(allowed):
            raise InvalidArgumentError(f"dtypes={dtypes!r} must be a non-empty subset of {allowed}"
                                       + ("" if "paged-fp8" in self.kinds else
                                          " (FP8 formats: a paged function whose signature names k_scale and "
                                          "v_scale)"))
        self.fn, self.layout, self.array = fn, layout, array
        check_signature(fn, name or _qualified_name(fn), layout, POSITIONAL[layout],
                        ("causal", "softmax_scale", *output_parameters(fn),
                         *(("cache_seqlens", "block_table") if layout == "paged" else ()), *self.takes_scales))
        self.declared_precision = True
        self.name = name or _qualified_name(fn)
        self.features = variant_parameters(fn, features)
        self.fills = output_parameters(fn)
        self.splits = "num_splits" in keywords
        self._asks_lse = "return_softmax_lse" in keywords
        self.writes_buffers = bool(self.fills)
        self.page_sizes = None if page_sizes is None else tuple(int(p) for p in page_sizes)
        self.judged_under = conventions_of(conventions)
        self._worker = isolated_worker(fn, name, isolate, timeout, memory_limit, dict(
            name=self.name, layout=layout, precision=precision, dtypes=self.dtypes, features=self.features,
            array=array, forbid=tuple(forbid or ())))
        self.forbid = tuple(forbid or ())
        if self.forbid:  # the worker's backend guards its own copy; this one serves --no-isolate
            self.fn = guarded(fn, self.forbid)

    def precision(self, dtype) -> PrecisionModel:
        return self.judged_under.precision(parse_precision(self._precision, dtype))

    def availability(self):
        return torch_availability() if self.array == "torch" else AVAILABLE

    def supports(self, problem) -> str | None:
        """Backend.supports; and an FP8 batch's q_descale must be 1 for a function taking none."""
        reason = super().supports(problem)
        q_descale = problem.input_arrays().get("q_descale") if reason is None else None
        if q_descale is not None and "q_descale" not in self.takes_scales and np.any(q_descale != 1):
            return (f"{self.name} takes no q_descale (its signature does not name it): it runs FP8 batches whose "
                    "q_descale is 1 only")
        return reason

    def _run(self, problem: RaggedProblem):
        if self._worker is None:
            return self._call(problem, problem.inputs())
        return self._worker.run(problem)

    def run_in_worker(self, problem: RaggedProblem):
        """What the worker process runs: the call, and the check that it left its inputs unchanged."""
        inputs = problem.inputs()
        return leaving_inputs_unchanged(self.name, problem.input_arrays(), lambda: self._call(problem, inputs))

    def _call(self, problem: RaggedProblem, inputs: dict):
        arrays = {name: to_torch(x) if self.array == "torch" and isinstance(x, np.ndarray) else x
                  for name, x in inputs.items()}
        buffers = output_buffers(problem, self.precision(problem.dtype).output)[:len(self.fills)]
        keywords = {name: arrays[name] for name in inputs if name not in POSITIONAL[self.layout]
                    and (name in self.takes_scales or name not in PAGED_SCALES.values())}
        keywords.update(causal=problem.causal, softmax_scale=problem.first.scale_value,
                        **self._variant_arguments(problem),
                        **({"return_softmax_lse": True} if self._asks_lse else {}),
                        **({"num_splits": problem.num_splits} if self.splits else {}),
                        **{name: self._to_array(b.view) for name, b in zip(self.fills, buffers)})
        result = self.fn(*(arrays[name] for name in POSITIONAL[self.layout]), **keywords)
        if buffers:  # the out= form: what the function wrote (unwritten rows keep the sentinel)
            outside = [f for b in buffers for f in b.findings(unwritten=False)]
            if outside:
                raise BackendOutputError(f"target {self.name!r} " + "; ".join(outside))
            return buffers[0].view.copy(), buffers[1].view.copy() if len(buffers) > 1 else None
        out, lse = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
        if isinstance(result, tuple) and len(result) != 2:
            raise BackendOutputError(f"backend {self.name!r} returned a tuple of {len(result)} items; "
                                     "expected out or (out, lse)")
        return self._from_array(out, "out"), self._from_array(lse, "lse")

    def _variant_arguments(self, problem: RaggedProblem) -> dict:
        values = {"window": problem.window_size, "softcap": problem.softcap,
                  "alibi": problem.alibi_slopes, "sinks": problem.sinks}
        return {FEATURES[f]: self._to_array(values[f].copy()) if isinstance(values[f], np.ndarray) else values[f]
                for f in self.features}

    def _to_array(self, x):
        return to_torch(x) if self.array == "torch" else x

    def _from_array(self, x, what: str):
        if self.array == "numpy" or x is None:
            return x
        if not isinstance(x, import_torch().Tensor):
            raise BackendOutputError(f"backend {self.name!r} returned {what} of type {type(x).__name__}; "
                                     "with array='torch' it must return torch tensors")
        return to_numpy(x)


def _keywords(fn, with_default: bool = False) -> set:
    """The parameter names `fn` takes by keyword (none for a builtin without a signature); only
    those with a default if `with_default`."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in keyword and (not with_default or p.default is not p.empty)}
