"""The shape of an attention problem: B, H, Hkv, Nq, Nk, D and D_v, without values."""

from __future__ import annotations

from dataclasses import dataclass, field

from fa_verify.errors import InvalidArgumentError
from fa_verify.validation import check_int


@dataclass(frozen=True)
class Shape:
    """The shape of an attention problem: q and k [.., D], v and the output [.., D_v]:
    q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, D_v]."""

    batch: int
    heads: int
    kv_heads: int
    nq: int
    nk: int
    head_dim: int
    #: D_v, the head dim of v and the output; None: D (the usual D_v = D_qk). Keyword-only, so
    #: that dataclasses extending Shape (results.ProblemDescriptor) keep their positional fields.
    head_dim_v: int | None = field(default=None, kw_only=True)

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        for name in ("batch", "heads", "kv_heads", "nq", "nk", "head_dim", "head_dim_v"):
            object.__setattr__(self, name, check_int(f"Shape.{name}", getattr(self, name)))
        if self.heads % self.kv_heads:
            raise InvalidArgumentError(
                f"Shape.heads={self.heads!r} must be divisible by Shape.kv_heads={self.kv_heads!r} "
                "(MHA: equal, GQA: a multiple, MQA: kv_heads=1)"
            )

    @classmethod
    def coerce(cls, value) -> "Shape":
        """A Shape, or a tuple (batch, heads, kv_heads, nq, nk, head_dim[, head_dim_v])."""
        if isinstance(value, cls):
            return value
        try:
            fields = tuple(value)
        except TypeError:
            fields = ()
        if len(fields) not in (6, 7):
            raise InvalidArgumentError(
                f"shape={value!r} must be a Shape or a tuple (batch, heads, kv_heads, nq, nk, head_dim"
                "[, head_dim_v])"
            )
        return cls(*fields[:6], head_dim_v=fields[6] if len(fields) == 7 else None)

    @classmethod
    def of(cls, problem) -> "Shape":
        """The shape of an AttentionProblem."""
        return cls(problem.batch, problem.heads, problem.kv_heads, problem.nq, problem.nk,
                   problem.head_dim, head_dim_v=problem.head_dim_v)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1: MHA; heads: MQA)."""
        return self.heads // self.kv_heads

    @property
    def q_shape(self) -> tuple:
        return (self.batch, self.heads, self.nq, self.head_dim)

    @property
    def kv_shape(self) -> tuple:
        """k's shape (v's too where D_v = D: `v_shape`)."""
        return (self.batch, self.kv_heads, self.nk, self.head_dim)

    @property
    def v_shape(self) -> tuple:
        return (self.batch, self.kv_heads, self.nk, self.head_dim_v)

    @property
    def work(self) -> int:
        """B*H*Nq*Nk*max(D, D_v): the multiply-adds of the larger of the two products q·kᵀ and P·v."""
        return self.batch * self.heads * self.nq * self.nk * max(self.head_dim, self.head_dim_v)

    def __str__(self) -> str:
        dv = f" Dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        return (f"B={self.batch} H={self.heads} Hkv={self.kv_heads} "
                f"Nq={self.nq} Nk={self.nk} D={self.head_dim}{dv}")
