"""A user's attention function as a backend, following the callable protocol.

Protocol: `fn(q, k, v, *, causal: bool, scale: float) -> out | (out, lse)`; q is [B,H,Nq,D]
and k, v are [B,Hkv,Nk,D] (GQA passes Hkv heads) in layout "bhsd", or [B,N,H,D] in layout
"bshd" (flash_attn_func's); LSE is [B,H,Nq] float32 in both layouts. Arrays are numpy arrays of
the problem dtype (ml_dtypes.bfloat16 for bf16) or, with array="torch", CPU torch tensors.

Variants, with flash-attn's keyword names: a function whose signature names `window_size`,
`softcap`, `alibi_slopes` or `sinks` implements that variant and is called with it on every
problem (window_size=(left, right), softcap=float (0 = off), alibi_slopes=float32 [H] or [B, H]
or None, sinks=float32 [H] or None: numpy arrays, or torch tensors with array="torch"), with
the conventions of fa_verify.problem; `features=` narrows (or switches off) what is exercised.
Problems using a variant the function does not take are not supported.

FP8: a function whose signature names FlashAttention-3's `q_descale`, `k_descale` and
`v_descale` also runs FP8 problems (`fa_verify.fp8`): q, k, v come as ml_dtypes float8 arrays
(e4m3fn or e5m2; with array="torch", torch.float8_e4m3fn / float8_e5m2 tensors of the same
bits), the descales by those keywords as float32 [B, Hkv] (or [1], per tensor), true
value = stored value x descale, q's descale indexed by the kv head of its group; it returns out
in the problem's output dtype (bf16 unless declared). On other problems it is called without them.

The out= form: a function with an `out` parameter (and optionally `lse`) is called with
out= (and lse=) buffers to fill, of the shapes above in the output dtype and float32, and
returns nothing (a returned value is ignored). The buffers start NaN-filled inside guard bands
(`buffers.GuardedOutput`), so an element left unwritten or a write past either end is reported
with its index. In both forms the inputs must come back bitwise unchanged.

Isolation: with isolate=True (the default wherever the target is named as MODULE:FUNC: the CLI,
the pytest plugin, `check_backend("MODULE:FUNC")`) the function runs in a worker process
(fa_verify.isolation), started once and reused across examples, which imports it by that
reference from the folder and sys.path of the parent. Each call has a time limit (`timeout`
seconds) and a memory limit (`memory_limit`: RLIMIT_DATA, by default half the machine's memory);
a crash (the signal), a hang (the seconds) or an allocation past the limit (the bytes) fails the
example with what happened, and the next call starts a fresh worker. The input and output
checks run in the worker, on what the function saw.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import pickle
import re
import signal
import sys
import warnings
from pathlib import Path

import numpy as np

from fa_verify.backends.base import AVAILABLE, Backend, parse_precision
from fa_verify.backends.buffers import GuardedOutput, InputSnapshot, check_written, padded_array
from fa_verify.backends.torch_arrays import import_torch, to_numpy, to_torch, torch_availability
from fa_verify.conventions import Conventions
from fa_verify.conventions import of as conventions_of
from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES, dtype_name, numpy_dtype
from fa_verify.errors import BackendOutputError, InvalidArgumentError, KernelCrashError, KernelTimeoutError
from fa_verify.fp8 import DESCALES
from fa_verify.guards import guarded
from fa_verify.isolation import (
    DEFAULT_MEMORY_LIMIT,
    DEFAULT_TIMEOUT,
    RAISED_AT,
    WorkerDied,
    WorkerProcess,
    WorkerTimedOut,
    format_size,
    parse_size,
)
from fa_verify.limits import Limits, parse_limits
from fa_verify.outputs import check_outputs
from fa_verify.precision import PrecisionModel
from fa_verify.problem import CAUSAL_ALIGNMENTS, FEATURES

LAYOUTS = ("bhsd", "bshd")
ARRAYS = ("numpy", "torch")


class CallableBackend(Backend):
    """Adapts `fn` to the backend protocol.

    `precision` is the model the function claims: a preset or spec for PrecisionModel.parse,
    a PrecisionModel (for its input dtype only), or None for PrecisionModel.flash, FlashAttention's
    model (fp32 scores and accumulation, P in the input dtype). `dtypes=None` means every dtype the precision
    allows. `causal_alignment` is the alignment the function implements for causal=True.
    `isolate=True` runs it in a worker process with `timeout` seconds and `memory_limit` per call
    (see the module's doc); the function must then be importable as MODULE:FUNC (`name` may
    give that reference), not a lambda, a local function or one defined in __main__.
    `limits` (a `Limits`, or a dict of limit options for `parse_limits`) declares the problems
    it supports: only those are drawn. `features` (None: every variant whose keyword the
    signature names) lists the variants to exercise (keys of fa_verify.problem.FEATURES).
    `conventions` (a `Conventions`, or a dict of convention options such as {"lse_base": "2",
    "ftz": True}) declares where its outputs differ from fa_verify's conventions on purpose: it
    is judged under them (`fa_verify.conventions`). `forbid` (dotted names, `fa_verify.guards`)
    lists framework functions whose call fails the example (ForbiddenCallError).
    """

    #: the protocol's positional arguments, in order (`_inputs` gives them)
    positional = ("q", "k", "v")
    #: its arguments are placed inside NaN-filled buffers when `pad` is set (the nan_padding properties)
    pads_inputs = True

    def __init__(self, fn, name: str | None = None, layout: str = "bhsd", array: str = "numpy",
                 causal_alignment: str = "bottom-right", dtypes=None,
                 precision: str | PrecisionModel | None = None, isolate: bool = False,
                 timeout: float = DEFAULT_TIMEOUT, memory_limit: int | str | None = DEFAULT_MEMORY_LIMIT,
                 limits: Limits | dict | None = None, features=None,
                 conventions: Conventions | dict | None = None, forbid=()):
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
        self.limits = limits if isinstance(limits, Limits) else parse_limits(limits or {}, prefix="limits.")
        self.judged_under = conventions_of(conventions)
        if self.kinds == ("dense",) and takes_descales(fn):  # a forward taking FA3's descales
            self.kinds = ("dense", "fp8")
        allowed = DTYPE_NAMES + FP8_DTYPES if "fp8" in self.kinds else DTYPE_NAMES
        dtypes = self.limits.dtypes if dtypes is None else dtypes
        self.dtypes = tuple(dtype_name(d) for d in (allowed if dtypes is None else dtypes))
        if not self.dtypes or not set(self.dtypes) <= set(allowed):
            raise InvalidArgumentError(f"dtypes={dtypes!r} must be a non-empty subset of {allowed}"
                                       + ("" if "fp8" in self.kinds else
                                          " (FP8 formats: a function whose signature names q_descale, k_descale "
                                          "and v_descale)"))
        if isinstance(precision, PrecisionModel) and self.dtypes != (precision.input,):
            raise InvalidArgumentError(
                f"precision={precision.describe()!r} is for input {precision.input} only but "
                f"dtypes={self.dtypes!r}; pass dtypes=({precision.input!r},) or a preset such as 'flash'")
        self.fn, self.layout, self.array = fn, layout, array
        self.fills = self._output_parameters(fn)
        check_signature(fn, name or _qualified_name(fn), self._protocol(layout), self.positional,
                        ("causal", "scale", *self.fills))
        self.declared_precision = True
        self.features = variant_parameters(fn, features)
        self.causal_alignment, self._precision = causal_alignment, precision
        self.name = name or _qualified_name(fn)
        #: Elements of NaN padding around each of q, k, v as passed (fa_verify.properties.padding sets it).
        self.pad = 0
        #: The input buffers of the last call (`_in_held_buffers`).
        self._held = []
        self._worker = isolated_worker(fn, name, isolate, timeout, memory_limit, dict(
            name=self.name, layout=layout, array=array, causal_alignment=causal_alignment, dtypes=self.dtypes,
            precision=precision, features=self.features, conventions=self.judged_under, protocol=type(self).__name__,
            forbid=tuple(forbid or ())))
        self.forbid = tuple(forbid or ())
        if self.forbid:  # the worker's backend guards its own copy; this one serves --no-isolate
            self.fn = guarded(fn, self.forbid)

    def precision(self, dtype) -> PrecisionModel:
        """The claimed model, with the LSE dtype and flushing the conventions declare."""
        model = self._precision if isinstance(self._precision, PrecisionModel) else parse_precision(self._precision, dtype)
        return self.judged_under.precision(model)

    def availability(self):
        return torch_availability() if self.array == "torch" else AVAILABLE

    def supports(self, problem):
        reason = super().supports(problem)
        diagonal = problem.causal or "window" in problem.features or "alibi" in problem.features
        if reason is None and diagonal and problem.nq != problem.nk \
                and problem.causal_alignment != self.causal_alignment:
            reason = (f"{self.name} implements {self.causal_alignment} causal masking; the problem needs "
                      f"{problem.causal_alignment} (they differ when Nq={problem.nq} != Nk={problem.nk})")
        return reason

    def _run(self, problem):
        return self._worker.run(problem, self.pad) if self._worker is not None else self.run_here(problem)

    def run_in_worker(self, problem, pad: int):
        """What the worker process runs for `CallableWorker.run(problem, pad)`."""
        self.pad = pad
        return self.run_here(problem)

    def run_here(self, problem):
        """_run in this process (the worker calls it too)."""
        # Copies, so a function that writes into its inputs cannot change the problem; the
        # snapshot shows whether it did (torch tensors share the copies' memory).
        inputs = self._in_held_buffers([x.transpose(0, 2, 1, 3) if self.layout == "bshd" and x.ndim == 4 else x
                                        for x in self._inputs(problem)])
        snapshot = InputSnapshot.of(**dict(zip(self.positional, inputs)))
        buffers = self._output_buffers(problem)
        arrays = [*inputs, *(b.view for b in buffers)]
        if self.array == "torch":
            arrays = [to_torch(x) for x in arrays]
        positional, fill = arrays[:len(inputs)], arrays[len(inputs):]
        if self.pad:  # nan_padding's run: the arguments inside NaN-filled buffers
            positional = [padded_array(x, self.pad)[0] for x in positional]
        result = self.fn(*positional, causal=problem.causal, scale=problem.scale_value, **dict(zip(self.fills, fill)),
                         **self._variant_arguments(problem), **self._keywords(problem))
        snapshot.check(self.name, *inputs)
        if buffers:  # the out= form: what the function wrote, whatever it returned
            check_written(self.name, *buffers)
            result = (buffers[0].view.copy(), buffers[1].view.copy() if len(buffers) > 1 else None)
        else:
            result = self._returned(result, problem)
        result = check_outputs(self.name, problem, result, self.precision(problem.dtype), self.layout)
        if self.layout == "bshd":
            result = tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if x is not None and x.ndim == 4 else x
                           for x in result)
        return result

    def _in_held_buffers(self, arrays) -> list:
        """Contiguous copies of `arrays`, each written into the buffer the previous call's argument
        in its place had where shape and dtype match: the function sees new contents at the same
        addresses, so a cache keyed on them answers stale (`reused_buffers` checks the answer)."""
        held = []
        for i, x in enumerate(arrays):
            buffer = self._held[i] if i < len(self._held) else None
            if buffer is None or buffer.shape != x.shape or buffer.dtype != x.dtype:
                buffer = np.empty(x.shape, x.dtype)
            np.copyto(buffer, x)
            held.append(buffer)
        self._held = held
        return held

    def _inputs(self, problem) -> list:
        """The positional arguments' arrays, in bhsd."""
        return [problem.q, problem.k, problem.v]

    def _keywords(self, problem) -> dict:
        """Keyword arguments beyond causal, scale, the variants and the out= buffers: the problem's
        input arrays that are not positional (an FP8 problem's descales), by their names."""
        return {name: to_torch(x.copy()) if self.array == "torch" else x.copy()
                for name, x in problem.input_arrays().items() if name not in self.positional}

    def _output_parameters(self, fn) -> tuple:
        """The out= form's buffers `fn` takes (see `output_parameters`)."""
        return output_parameters(fn)

    @staticmethod
    def _protocol(layout: str) -> str:
        """The key of PROTOCOLS that names this backend's protocol in a refusal."""
        return layout

    def _variant_arguments(self, problem) -> dict:
        """The keyword arguments of the variants the function takes, off where the problem has none."""
        values = {"window": problem.window_size, "softcap": problem.softcap,
                  "alibi": problem.alibi_slopes, "sinks": problem.sinks}
        arguments = {}
        for feature in self.features:
            value = values[feature]
            if isinstance(value, np.ndarray):
                value = to_torch(value.copy()) if self.array == "torch" else value.copy()
            arguments[FEATURES[feature]] = value
        return arguments

    def _returned(self, result, problem):
        """A returning function's result as a tuple of numpy arrays (`check_outputs` checks how many)."""
        items = result if isinstance(result, tuple) else (result,)
        names = [o.name for o in problem.outputs(self.precision(problem.dtype))] + ["item"] * len(items)
        return tuple(self._from_array(x, name) for x, name in zip(items, names))

    def _output_buffers(self, problem) -> list[GuardedOutput]:
        """Guarded out= (and lse=) buffers for the out= form; none for a function that returns."""
        outputs = {o.name: o.in_layout(self.layout) for o in problem.outputs(self.precision(problem.dtype))}
        return [GuardedOutput.allocate(name, outputs[name].shape, numpy_dtype(outputs[name].dtype))
                for name in self.fills]

    def _from_array(self, x, what: str):
        if self.array == "numpy" or x is None:
            return x
        if not isinstance(x, import_torch().Tensor):
            raise BackendOutputError(
                f"backend {self.name!r} returned {what} of type {type(x).__name__}; "
                "with array='torch' it must return torch tensors")
        return to_numpy(x)


#: The callable protocols, by layout, in words (what `check_signature` names when none fits).
PROTOCOLS = {"bhsd": "fn(q, k, v, *, causal, scale) with q [B,H,Nq,D]",
             "bshd": "fn(q, k, v, *, causal, scale) with q [B,Nq,H,D] (--layout bshd)",
             "varlen": "fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, softmax_scale) "
                       "(--layout varlen)",
             "paged": "fn(q, k_cache, v_cache, *, cache_seqlens, block_table, causal, softmax_scale) (--layout paged)",
             "backward": "bwd(q, k, v, out, lse, dout, *, causal, scale) -> (dq, dk, dv) (a backward: its "
                         "signature names dout)"}


def check_signature(fn, name: str, layout: str, positional: tuple, keywords: tuple) -> None:
    """InvalidArgumentError (exit 2, before anything runs) unless `fn` can be called with the
    protocol's `positional` and `keywords` arguments; a signature that cannot be read is let be."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its calls will tell
        return
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        others = "; ".join(text for other, text in PROTOCOLS.items() if other != layout)
        raise InvalidArgumentError(
            f"{name}{signature} does not fit the callable protocol {PROTOCOLS[layout]}: {exc}. The other "
            f"protocols: {others}") from None


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


def variant_parameters(fn, features=None) -> tuple:
    """The variants (keys of FEATURES) `fn` takes by keyword, narrowed to `features` if given."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: no variants
        parameters = {}
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    taken = tuple(f for f, name in FEATURES.items() if name in parameters and parameters[name].kind in keyword)
    if features is None:
        return taken
    features = (features,) if isinstance(features, str) else tuple(features)
    for feature in features:
        if feature not in FEATURES:
            raise InvalidArgumentError(f"features={features!r}: {feature!r} is not a variant; use any of "
                                       f"{tuple(FEATURES)}")
        if feature not in taken:
            raise InvalidArgumentError(
                f"features={features!r}: {_qualified_name(fn)} has no keyword parameter {FEATURES[feature]!r}, "
                f"so it cannot be given {feature}; add the parameter or drop {feature!r}")
    return tuple(f for f in FEATURES if f in features)


def takes_descales(fn) -> bool:
    """Whether `fn` takes FlashAttention-3's q_descale, k_descale and v_descale by keyword."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return all(name in parameters and parameters[name].kind != inspect.Parameter.POSITIONAL_ONLY
               for name in DESCALES)


def _reference(fn, name: str | None) -> str:
    """The MODULE:FUNC by which a worker process imports `fn`: `name` if it is one, else the
    function's own module and qualified name; InvalidArgumentError when neither finds `fn`. A
    callable object marked `portable` (picklable by what it loads, as a KernelBench solution) is
    its own reference: the worker gets it pickled."""
    if getattr(fn, "portable", False) is True:
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    for spec in (name, f"{module}:{qualname}"):
        if not spec or ":" not in spec or spec.startswith("__main__:") or "<" in spec:
            continue
        try:
            if load_callable(spec) is fn:
                return spec
        except InvalidArgumentError:
            continue
    raise InvalidArgumentError(
        f"fn={_qualified_name(fn)} cannot be isolated: the worker process imports the function by a "
        "MODULE:FUNC reference, and this one is a lambda, a local function or defined in __main__; define it "
        "at the top level of an importable module (or pass that reference as name=), or pass isolate=False")


class CallableWorker:
    """Runs a MODULE:FUNC callable in a worker process (fa_verify.isolation) with a time limit and
    a memory limit per call; a crash, a hang or running out of memory raises an error that says
    so, and the next call starts a fresh worker."""

    def __init__(self, spec: str, options: dict, timeout: float, memory_limit: int | None):
        self.spec, self.options, self.timeout, self.memory_limit = spec, options, timeout, memory_limit
        env = dict(os.environ)
        # This fa_verify first: the worker must run the same code as its parent.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        command = (sys.executable, "-c", "import sys; from fa_verify.backends.callable_worker import worker_main; "
                                         "worker_main(int(sys.argv[1]), int(sys.argv[2]))")
        self.process = WorkerProcess(command, env=env, cwd=os.getcwd(), memory_limit=self.memory_limit,
                                     traceback_signal=signal.SIGUSR1)

    def run(self, problem, *arguments):
        """The worker's backend's `run_in_worker(problem, *arguments)`, returned or raised here."""
        name = self.options["name"]
        with self.process.lock:
            try:
                if not self.process.alive:
                    self.process.stop()
                    self.process.start()
                    kind, payload = self.process.call(("load", sys.path, self.spec, self.options, self.memory_limit),
                                                      self.process.startup_timeout)
                    if kind != "ok":
                        raise InvalidArgumentError(f"the worker process cannot load {self.spec}: {payload[2]}")
                kind, payload = self.process.call(("run", problem, *arguments), self.timeout)
                if kind == "out of memory":  # the worker exits after this reply: the next call starts afresh
                    self.process.stop()
            except WorkerTimedOut as late:
                raise _located(KernelTimeoutError(
                    f"{name} did not return within {self.timeout:g} s (killed; the next example starts a fresh "
                    "worker process; --timeout sets the limit)"), late.output) from None
            except WorkerDied as died:
                raise _crash_error(name, died) from None
        payload, warned = payload
        for message, category, filename, lineno in warned:  # issued here, so the parent's filters see them
            warnings.warn_explicit(message, category, filename, lineno)
        if kind == "done":
            return payload
        raise _raised_again(*payload)


def isolated_worker(fn, name: str | None, isolate: bool, timeout, memory_limit, options: dict):
    """The worker process that runs `fn` with `timeout` seconds and `memory_limit` per call (its
    backend built from `options`), or None when not `isolate`. The limits are checked either way:
    a bad one is an error whether or not it applies."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise InvalidArgumentError(f"timeout={timeout!r} must be a positive, finite number of seconds")
    memory_limit = memory_limit_bytes(memory_limit)
    return CallableWorker(_reference(fn, name), options, float(timeout), memory_limit) if isolate else None


#: The least memory limit a worker starts under (Python, numpy and fa_verify need ~150 MiB):
#: a smaller one would fail every example as a crash of the target.
MIN_MEMORY_LIMIT = 256 * 2**20


def memory_limit_bytes(limit) -> int | None:
    """Bytes from a memory_limit argument: an int, a string for isolation.parse_size, or None;
    at least MIN_MEMORY_LIMIT."""
    if isinstance(limit, str):
        try:
            limit = parse_size(limit)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"memory_limit={limit!r}: {exc}") from None
    if limit is None:
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise InvalidArgumentError(f"memory_limit={limit!r} must be a positive number of bytes, a size such as "
                                   "'4GiB' or '50%', or None")
    if limit < MIN_MEMORY_LIMIT:
        raise InvalidArgumentError(
            f"memory_limit={format_size(limit)} is below the {format_size(MIN_MEMORY_LIMIT)} a worker process needs "
            f"to start (Python, numpy, fa_verify): give at least {format_size(MIN_MEMORY_LIMIT)}, or none")
    return limit


def _crash_error(name: str, died: WorkerDied) -> KernelCrashError:
    """The error for a worker that died in a call: the signal, where Python was (faulthandler's
    traceback, innermost frame first) and what the worker printed last."""
    cause = str(died)
    if cause == "SIGKILL":
        cause += " (killed from outside the worker: the system's out-of-memory killer?)"
    error = KernelCrashError(f"{name} crashed the worker process: {cause} (the next example starts a fresh one)",
                             detail=died.output)
    return _located(error, died.output)


def _located(error: Exception, output: str) -> Exception:
    """`error`, carrying the innermost frame of the Python traceback that faulthandler wrote to
    `output` (on a crash, or on the signal sent before a hung worker is killed)."""
    frame = re.search(r'File "([^"]+)", line (\d+)', output.split("most recent call first", 1)[-1])
    setattr(error, RAISED_AT, f"{frame.group(1)}:{frame.group(2)}" if frame else "the worker process")
    return error


_GUARD_FILE = os.path.join("fa_verify", "guards.py")


def _portable(exc: BaseException, memory_limit: int | None = None) -> tuple:
    """What the parent needs to raise `exc` again: (the exception if it pickles and is an
    Exception or SystemExit, else None, its type's name, its message, where it was raised)."""
    type_name, message, tb = type(exc).__name__, str(exc), exc.__traceback__
    where = None
    while tb is not None:  # the innermost frame that is not --forbid's guard raising on its behalf
        if not tb.tb_frame.f_code.co_filename.endswith(_GUARD_FILE):
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    if isinstance(exc, MemoryError):
        limit = "no limit" if memory_limit is None else format_size(memory_limit)
        message = f"{message or 'out of memory'} (the worker's memory limit: {limit}; --memory-limit)"
        exc = MemoryError(message)
    try:  # SystemExit is a finding as in-process; a KeyboardInterrupt must not stop the parent: a stand-in
        exc = pickle.loads(pickle.dumps(exc)) if isinstance(exc, (Exception, SystemExit)) else None
    except Exception:  # noqa: BLE001 - an exception type the parent cannot rebuild: its name and message
        exc = None
    return exc, type_name, message, where


def _portable_warning(caught: warnings.WarningMessage) -> tuple:
    """(message, category, filename, lineno) of a warning, its category UserWarning if it does not pickle."""
    category = caught.category
    try:
        pickle.dumps(category)
    except Exception:  # noqa: BLE001 - a category the parent cannot import
        category = UserWarning
    return str(caught.message), category, caught.filename, caught.lineno


def _raised_again(exc, type_name, message, where) -> BaseException:
    """The exception raised in the worker, rebuilt in the parent (a stand-in of the same name if it
    did not pickle), carrying where it was raised."""
    if exc is None:
        exc = type(type_name or "Exception", (Exception,), {})(message)
    setattr(exc, RAISED_AT, where)
    return exc


def _qualified_name(fn) -> str:
    qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__module__', None) or '?'}:{qualname}"


def _import_file(path: str):
    """The module in the Python file `path`, imported with its folder first on sys.path (so that it
    imports its neighbours as it would as a script)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise InvalidArgumentError(f"spec names the file {path!r}, which does not exist (from {Path.cwd()})")
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    name = file.stem
    if getattr(sys.modules.get(name), "__file__", None) == str(file):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickling (worker isolation) finds its functions by module name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_callable(spec: str):
    """Import and return the function named by 'MODULE:FUNC' or 'path/to/file.py:FUNC' (FUNC may
    be dotted: 'mod:Cls.fn'); a `portable` callable object (see `_reference`) is returned as it is."""
    if callable(spec) and getattr(spec, "portable", False) is True:
        return spec
    module_name, _, attr_path = str(spec).rpartition(":")
    if not isinstance(spec, str) or not module_name or not attr_path:
        raise InvalidArgumentError(
            f"spec={spec!r} must look like 'MODULE:FUNC' or 'FILE.py:FUNC', e.g. 'my_kernels.attention:forward'")
    try:
        obj = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except InvalidArgumentError:
        raise
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
