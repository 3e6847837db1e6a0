"""Shape buckets and table columns: how records are grouped into the summary table's cells.

Rows bucket shapes by sequence length, head dim and head grouping rather than listing exact
shapes, so that randomly generated problems (pytest, `fa_verify check`) group as well as a
sweep's; the sweeps pick one shape per bucket. Columns are dtype × causal.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa_verify.dtypes import DTYPE_NAMES

#: Upper ends of the sequence-length buckets (by max(Nq, Nk)); beyond the last, one open bucket.
SEQ_EDGES = (16, 64, 256, 1024, 4096)
#: Upper ends of the head-dim buckets.
HEAD_DIM_EDGES = (32, 64, 128)
GROUPINGS = ("MHA", "GQA", "MQA")


def _range_label(value: int, edges, name: str) -> tuple[int, str]:
    low = 1
    for index, high in enumerate(edges):
        if value <= high:
            return index, (f"{name} {low}–{high}" if low < high else f"{name} {high}")
        low = high + 1
    return len(edges), f"{name} > {edges[-1]}"


@dataclass(frozen=True, order=True)
class Bucket:
    """A row of the summary table; orders by sequence length, then head dim, then grouping."""

    seq_index: int
    dim_index: int
    grouping_index: int
    seq: str
    head_dim: str
    grouping: str

    @property
    def label(self) -> str:
        return f"{self.seq} · {self.head_dim} · {self.grouping}"


def grouping(heads: int, kv_heads: int) -> str:
    if heads == kv_heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else "GQA"


def bucket_of(problem) -> Bucket:
    """The bucket of a ProblemDescriptor."""
    seq_index, seq = _range_label(max(problem.nq, problem.nk), SEQ_EDGES, "N")
    dim_index, dim = _range_label(problem.head_dim, HEAD_DIM_EDGES, "D")
    kind = grouping(problem.heads, problem.kv_heads)
    return Bucket(seq_index, dim_index, GROUPINGS.index(kind), seq, dim, kind)


@dataclass(frozen=True, order=True)
class Column:
    dtype_index: int
    causal: bool

    @property
    def dtype(self) -> str:
        return DTYPE_NAMES[self.dtype_index]

    @property
    def label(self) -> str:
        return f"{self.dtype} · {'causal' if self.causal else 'full'}"


def column_of(problem) -> Column:
    return Column(DTYPE_NAMES.index(problem.dtype), bool(problem.causal))

