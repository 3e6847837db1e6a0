"""Shape buckets and table columns: how records are grouped into the summary table's cells.

Rows bucket shapes by sequence length, head dim and head grouping rather than listing exact
shapes, so that randomly generated problems (pytest, `fa_verify check`) group as well as a
sweep's; the sweeps pick one shape per bucket. Problems with variants (window, softcap, ALiBi,
sinks) get rows of their own, per combination of features, after the dense ones, and FP8 problems
per descale range (`ProblemDescriptor.descales`); a backward
problem's gradients (records of dq, dk, dv) get a row each, after the bucket's output. Columns are
dtype × causal.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa_verify.dtypes import DTYPE_NAMES, FP8_DTYPES
from fa_verify.problem import FEATURES

#: Upper ends of the sequence-length buckets (by max(Nq, Nk)); beyond the last, one open bucket.
SEQ_EDGES = (16, 64, 256, 1024, 4096)
#: Upper ends of the head-dim buckets.
HEAD_DIM_EDGES = (32, 64, 128)
GROUPINGS = ("MHA", "GQA", "MQA")
#: The dtypes of the table's columns and the figures' panels, in order: FP8 inputs after the others.
REPORT_DTYPES = DTYPE_NAMES + FP8_DTYPES
#: What a record's errors can be of (`Record.tensor`), in row order: the output, the gradients.
TENSORS = ("out", "dq", "dk", "dv", "dsinks")


def _range_label(value: int, edges, name: str) -> tuple[int, str]:
    low = 1
    for index, high in enumerate(edges):
        if value <= high:
            return index, (f"{name} {low}–{high}" if low < high else f"{name} {high}")
        low = high + 1
    return len(edges), f"{name} > {edges[-1]}"


@dataclass(frozen=True, order=True)
class Bucket:
    """A row of the summary table; orders by variant (dense first), then sequence length, head
    dim and grouping."""

    #: (number of features, their indices in FEATURES): () for a dense problem
    variant_index: tuple
    seq_index: int
    dim_index: int
    grouping_index: int
    seq: str
    head_dim: str
    grouping: str
    #: the features, e.g. "window + softcap"; "" for a dense problem
    variant: str = ""
    #: TENSORS' index of what the errors are of (0: the output)
    tensor_index: int = 0

    @property
    def tensor(self) -> str:
        return TENSORS[self.tensor_index]

    @property
    def label(self) -> str:
        shape = f"{self.seq} · {self.head_dim} · {self.grouping}"
        shape = f"{self.variant} · {shape}" if self.variant else shape
        return shape if self.tensor == "out" else f"{shape} · {self.tensor}"


def grouping(heads: int, kv_heads: int) -> str:
    if heads == kv_heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else "GQA"


def bucket_of(problem, tensor: str = "out") -> Bucket:
    """The bucket of a ProblemDescriptor, for the errors of `tensor` (a record's `tensor`)."""
    seq_index, seq = _range_label(max(problem.nq, problem.nk), SEQ_EDGES, "N")
    dim_index, dim = _range_label(problem.head_dim, HEAD_DIM_EDGES, "D")
    kind = grouping(problem.heads, problem.kv_heads)
    features = problem.features
    key, variant = variant_key(features), variant_name(features)
    descales = getattr(problem, "descales", None)
    if descales:  # an FP8 sweep's problem: a row per descale range
        label = descale_label(descales)
        key, variant = key + tuple(descales), (f"{variant} · {label}" if variant else label)
    return Bucket(key, seq_index, dim_index, GROUPINGS.index(kind), seq, dim, kind, variant,
                  TENSORS.index(tensor))


def descale_label(descales) -> str:
    """How the report names an FP8 problem's descale range: "descales 0.5–2"."""
    return f"descales {descales[0]:g}–{descales[1]:g}"


def variant_name(features) -> str:
    """How the report names a combination of features: "window + softcap"; "" for none."""
    return " + ".join(features)


def variant_key(features) -> tuple:
    """The order of combinations of features: fewer first (dense first), then FEATURES' order."""
    return (len(features), tuple(list(FEATURES).index(f) for f in features))


@dataclass(frozen=True, order=True)
class Column:
    dtype_index: int
    causal: bool

    @property
    def dtype(self) -> str:
        return REPORT_DTYPES[self.dtype_index]

    @property
    def label(self) -> str:
        return f"{self.dtype} · {'causal' if self.causal else 'full'}"


def column_of(problem) -> Column:
    return Column(REPORT_DTYPES.index(problem.dtype), bool(problem.causal))

