"""The backend protocol for ragged batches (varlen and paged KV, `fa_verify.ragged`).

Like `Backend`, with the layout's inputs: `RaggedBackend.run(problem)` checks availability and
support, builds the layout's input arrays (a paged cache's unused slots hold `fill`, NaN by
default: a kernel that reads them shows it), hands them to the subclass's `_run`, checks that
they came back bitwise unchanged and that out / LSE have the layout's shapes and dtypes:
varlen out [total_q, H, D] and LSE [H, total_q]; paged out [B, Nq, H, D] and LSE [B, H, Nq].
Values are not judged here: the properties judge them per sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from fa_verify.backends.base import AVAILABLE, Availability, _dtype_label, parse_precision
from fa_verify.backends.buffers import GuardedOutput, InputSnapshot
from fa_verify.backends.numpy_tiled import tiled_attention
from fa_verify.conventions import Conventions
from fa_verify.dtypes import DTYPE_NAMES, dtype_name, numpy_dtype
from fa_verify.errors import BackendOutputError, BackendUnavailableError, InvalidArgumentError
from fa_verify.limits import Limits
from fa_verify.precision import PrecisionModel
from fa_verify.problem import FEATURES, AttentionProblem, unsupported_features
from fa_verify.ragged import LAYOUTS, RaggedProblem


class RaggedBackend(ABC):
    """A varlen or paged attention implementation: metadata plus `run(problem) -> (out, lse | None)`."""

    name: str
    #: "varlen" or "paged": the layout of the inputs it takes
    layout: str
    dtypes: tuple = DTYPE_NAMES
    #: the variants it implements (keys of fa_verify.problem.FEATURES)
    features: tuple = ()
    #: whether it honours RaggedProblem.num_splits (a split-KV kernel)
    splits: bool = False
    #: what it supports, per sequence (each sequence's Nq, Nk, heads, D, causal)
    limits: Limits = Limits()
    #: whether it claims batch invariance: a sequence's output is bitwise the same whatever
    #: else the batch holds (then "varlen == each sequence alone" is checked bitwise)
    batch_invariant: bool = False
    #: the page sizes it supports (paged layout), or None: any
    page_sizes: tuple | None = None
    #: whether it writes into sentinel-filled buffers it is given (`output_buffers`), so that
    #: rows it leaves unwritten show (`unwritten_rows`)
    writes_buffers: bool = False
    #: for a paged target: the same kernel taking the varlen layout, if it has one (the
    #: paged_contiguous property compares the two on the same sequences)
    contiguous: "RaggedBackend | None" = None
    #: the conventions it is judged under, per sequence (`fa_verify.conventions`; the scale's
    #: precision excepted): run() converts what it returns to fa_verify's
    judged_under: Conventions = Conventions()

    @abstractmethod
    def precision(self, dtype) -> PrecisionModel:
        """The precision model it claims for inputs of `dtype`."""

    def availability(self) -> Availability:
        return AVAILABLE

    def supports(self, problem: RaggedProblem) -> str | None:
        """None if it can run `problem`, else why not."""
        if problem.layout != self.layout:
            return f"{self.name} takes the {self.layout} layout, not {problem.layout}"
        if problem.dtype not in self.dtypes:
            return f"{self.name} does not run dtype={problem.dtype} (it runs {', '.join(self.dtypes)})"
        if problem.pages is not None and self.page_sizes is not None and problem.pages.page_size not in self.page_sizes:
            return (f"{self.name} does not run page_size={problem.pages.page_size} (it runs "
                    f"{', '.join(map(str, self.page_sizes))}; declared by --page-sizes)")
        if problem.num_splits > 1 and not self.splits:
            return f"{self.name} does not split the keys (num_splits={problem.num_splits}); it is no split-KV kernel"
        for b, seq in enumerate(problem.sequences):
            reason = unsupported_features(self.name, seq, self.features) or self.limits.check(seq)
            if reason:
                return f"sequence {b}: {reason}"
        return None

    def run(self, problem: RaggedProblem, fill=np.nan) -> tuple[np.ndarray, np.ndarray | None]:
        """(out, LSE or None) in the layout's shapes: out in the precision model's output dtype,
        LSE float32, in fa_verify's conventions (the declared ones, `judged_under`, converted per
        sequence as `Backend.run` does). A paged cache's slots that no sequence uses hold `fill`.

        Raises BackendOutputError if the run changed a bit of its inputs or returned the wrong
        shapes or dtypes."""
        availability = self.availability()
        if not availability.available:
            raise BackendUnavailableError(f"backend {self.name!r} is unavailable: {availability.reason}")
        reason = self.supports(problem)
        if reason is not None:
            raise InvalidArgumentError(f"backend {self.name!r} cannot run {problem.describe()}: {reason}")
        inputs = problem.inputs(fill)
        out, lse = leaving_inputs_unchanged(self.name, inputs, lambda: self._run(problem, inputs))
        precision = self.precision(problem.dtype)
        check_ragged_output(self.name, problem, out, lse, precision.output, precision.lse)
        if not self.judged_under.declared:
            return out, lse
        return problem.join([self.judged_under.normalise(seq, *pair, precision)
                             for seq, pair in zip(problem.sequences, problem.split(out, lse))])

    @abstractmethod
    def _run(self, problem: RaggedProblem, inputs: dict) -> tuple[np.ndarray, np.ndarray | None]:
        """Compute (out, lse | None) from `inputs` (`RaggedProblem.inputs`: the layout's arrays
        and ints, named as flash-attn names them); `run` has checked availability and support."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def leaving_inputs_unchanged(name: str, inputs: dict, call):
    """call()'s result; BackendOutputError if it changed a bit of an array of `inputs`."""
    arrays = {key: x for key, x in inputs.items() if isinstance(x, np.ndarray)}
    snapshot = InputSnapshot.of(**arrays)
    result = call()
    snapshot.check(name, *arrays.values())
    return result


def output_buffers(problem: RaggedProblem, out_dtype) -> tuple[GuardedOutput, GuardedOutput]:
    """Sentinel-filled out and LSE buffers in the layout's shapes, for targets that write into
    buffers they are given: rows left unwritten keep the sentinel, and
    `RaggedProblem.unwritten_rows` names their sequences."""
    return (GuardedOutput.allocate("out", problem.out_shape, numpy_dtype(out_dtype)),
            GuardedOutput.allocate("lse", problem.lse_shape, np.float32))


def check_ragged_output(name: str, problem: RaggedProblem, out, lse, out_dtype, lse_dtype="fp32") -> None:
    """Raise BackendOutputError unless out / lse have the layout's shapes and dtypes."""
    labels = {"varlen": ("[total_q,H,D]", "[H,total_q]"), "paged": ("[B,Nq,H,D]", "[B,H,Nq]")}[problem.layout]
    for what, x, shape, dtype, label in (("out", out, problem.out_shape, numpy_dtype(out_dtype), labels[0]),
                                         ("lse", lse, problem.lse_shape, numpy_dtype(lse_dtype), labels[1])):
        if x is None and what == "lse":
            continue
        if not isinstance(x, np.ndarray):
            raise BackendOutputError(
                f"backend {name!r} returned {what} of type {type(x).__name__}; expected a numpy array")
        if x.shape != shape or x.dtype != dtype:
            raise BackendOutputError(
                f"backend {name!r} returned {what} with shape={x.shape} dtype={_dtype_label(x.dtype)}; expected "
                f"shape={shape} ({label}, the {problem.layout} layout) dtype={dtype_name(dtype)} "
                f"for {problem.describe()}")


def sequences_of(problem: RaggedProblem, inputs: dict) -> list[AttentionProblem]:
    """Each sequence as a dense problem with B = 1, its q, k, v read from the layout's `inputs`
    (cu_seqlens, or block_table and cache_seqlens) and its options from the problem."""
    if problem.layout == "varlen":
        cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
        parts = [(inputs["q"][cu_q[b]:cu_q[b + 1]], inputs["k"][cu_k[b]:cu_k[b + 1]],
                  inputs["v"][cu_k[b]:cu_k[b + 1]]) for b in range(problem.batch)]
    else:
        page_size, parts = inputs["k_cache"].shape[1], []
        for b in range(problem.batch):
            j = np.arange(inputs["cache_seqlens"][b])
            page, slot = inputs["block_table"][b, j // page_size], j % page_size
            parts.append((inputs["q"][b], inputs["k_cache"][page, slot], inputs["v_cache"][page, slot]))
    return [seq.replace(**{name: np.ascontiguousarray(x.transpose(1, 0, 2))[None] for name, x in zip("qkv", part)})
            for seq, part in zip(problem.sequences, parts)]


class NumpyRaggedBackend(RaggedBackend):
    """The reference ragged backend: each sequence, read from the layout's inputs, through the
    dense numpy FA2 model (`tiled_attention`), every variant included."""

    def __init__(self, layout: str = "varlen", block_q: int = 64, block_k: int = 64, precision: str = "flash"):
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout={layout!r}; use one of {LAYOUTS}")
        self.layout, self.block_q, self.block_k, self.precision_spec = layout, block_q, block_k, precision
        self.features = tuple(FEATURES)
        self.batch_invariant = True  # sequences never share a tile
        self.name = f"numpy-ragged-{layout}"

    def precision(self, dtype) -> PrecisionModel:
        return parse_precision(self.precision_spec, dtype)

    def _run(self, problem, inputs):
        precision = self.precision(problem.dtype)
        return problem.join([tiled_attention(seq, precision, self.block_q, self.block_k)
                             for seq in sequences_of(problem, inputs)])


def builtin_ragged_backends() -> list[RaggedBackend]:
    """The ragged backends fa_verify ships, one per layout (the paged one with the varlen one as its twin)."""
    varlen, paged = NumpyRaggedBackend("varlen"), NumpyRaggedBackend("paged")
    paged.contiguous = varlen
    return [varlen, paged]
