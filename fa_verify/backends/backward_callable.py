"""A user's backward function as a backend of backward problems, with flash-attn's names.

Protocol: `bwd(q, k, v, out, lse, dout, *, causal, scale) -> (dq, dk, dv)`, plus `dsinks`
(float32 [H]) as a fourth item when it takes `sinks`. q, out, dout are [B,H,Nq,D] and k, v
[B,Hkv,Nk,D] (layout "bhsd"; [B,N,H,D] with layout "bshd"), lse [B,H,Nq] float32 in natural log
(-inf for rows that see no key); the gradients come back in the input dtype. The variants'
keywords are passed as to a forward function (`CallableBackend`), and `dlse` ([B,H,Nq] float32)
when the signature names it: problems with an upstream LSE gradient are drawn only then.
Arrays, isolation, limits and precision as for `CallableBackend`; `deterministic_dq=True`
declares its dq bitwise reproducible (dk and dv must be whatever it declares). A function is
told from a forward one by its signature (it names `dout`: `is_backward`).
"""

from __future__ import annotations

import inspect

from fa_verify.backends.torch_arrays import to_torch
from fa_verify.backends.user_callable import CallableBackend


def is_backward(fn) -> bool:
    """Whether `fn` follows the backward protocol (its signature names `dout`)."""
    try:
        return "dout" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: a forward, as before
        return False


class BackwardCallableBackend(CallableBackend):
    """Adapts a backward function (see the module's doc) to `Backend`, running backward problems.
    The options are `CallableBackend`'s."""

    kinds = ("backward",)
    positional = ("q", "k", "v", "out", "lse", "dout")

    def __init__(self, fn, *args, deterministic_dq: bool = False, **kwargs):
        super().__init__(fn, *args, **kwargs)
        try:
            self.takes_dlse = "dlse" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            self.takes_dlse = False
        self.deterministic_dq = deterministic_dq

    def supports(self, problem):
        reason = super().supports(problem)
        if reason is None and problem.dlse is not None and not self.takes_dlse:
            reason = f"{self.name} takes no dlse (the problem has an upstream LSE gradient)"
        return reason

    def _inputs(self, problem) -> list:
        return [problem.q, problem.k, problem.v, problem.out, problem.lse, problem.dout]

    def _keywords(self, problem) -> dict:
        if problem.dlse is None:
            return {}
        return {"dlse": to_torch(problem.dlse.copy()) if self.array == "torch" else problem.dlse.copy()}

    def _output_parameters(self, fn) -> tuple:
        return ()  # `out` is the forward's output here, not a buffer to fill

    @staticmethod
    def _protocol(layout: str) -> str:
        return "backward"
