"""The shape of an attention problem: B, H, Hkv, Nq, Nk and D, without values."""

from __future__ import annotations

from dataclasses import dataclass

from fa_verify.errors import InvalidArgumentError
from fa_verify.validation import check_int


@dataclass(frozen=True)
class Shape:
    """The shape of an attention problem: q [B, H, Nq, D], k and v [B, Hkv, Nk, D]."""

    batch: int
    heads: int
    kv_heads: int
    nq: int
    nk: int
    head_dim: int

    def __post_init__(self):
        for field in ("batch", "heads", "kv_heads", "nq", "nk", "head_dim"):
            object.__setattr__(self, field, check_int(f"Shape.{field}", getattr(self, field)))
        if self.heads % self.kv_heads:
            raise InvalidArgumentError(
                f"Shape.heads={self.heads!r} must be divisible by Shape.kv_heads={self.kv_heads!r} "
                "(MHA: equal, GQA: a multiple, MQA: kv_heads=1)"
            )

    @classmethod
    def coerce(cls, value) -> "Shape":
        """A Shape, or a 6-tuple (batch, heads, kv_heads, nq, nk, head_dim)."""
        if isinstance(value, cls):
            return value
        try:
            fields = tuple(value)
        except TypeError:
            fields = ()
        if len(fields) != 6:
            raise InvalidArgumentError(
                f"shape={value!r} must be a Shape or a tuple (batch, heads, kv_heads, nq, nk, head_dim)"
            )
        return cls(*fields)

    @classmethod
    def of(cls, problem) -> "Shape":
        """The shape of an AttentionProblem."""
        return cls(problem.batch, problem.heads, problem.kv_heads, problem.nq, problem.nk,
                   problem.head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1: MHA; heads: MQA)."""
        return self.heads // self.kv_heads

    @property
    def q_shape(self) -> tuple:
        return (self.batch, self.heads, self.nq, self.head_dim)

    @property
    def kv_shape(self) -> tuple:
        return (self.batch, self.kv_heads, self.nk, self.head_dim)

    @property
    def work(self) -> int:
        """B*H*Nq*Nk*D: the multiply-adds of one of the two products q·kᵀ and P·v."""
        return self.batch * self.heads * self.nq * self.nk * self.head_dim

    def __str__(self) -> str:
        return (f"B={self.batch} H={self.heads} Hkv={self.kv_heads} "
                f"Nq={self.nq} Nk={self.nk} D={self.head_dim}")
