"""On a failure, whether a looser legitimate precision model would pass, and the option to declare it.

A callable is judged under FlashAttention's model by default (fp32 scores and accumulation, P in
the input dtype): a kernel that silently computes its scores in fp16 should be told. But it
should also be told that this is what it does: the failing example is judged again under the
looser legitimate models, from the least to the most lenient, and the first that passes is
named with the exact option that declares it; if none passes, the failure is not a matter of
declared precision.
"""

from __future__ import annotations

from fa_verify.backends import Backend
from fa_verify.precision import PrecisionModel

#: The looser legitimate models tried, from the least to the most lenient: preset -> in words.
LOOSER_PRESETS = {"input-scores": "q·k and the softmax in the input dtype, P·V accumulated in fp32",
                  "same-precision": "every stage in the input dtype"}


class _JudgedUnder(Backend):
    """`inner` as it is, judged under the precision preset `preset` (and its conventions)."""

    def __init__(self, inner: Backend, preset: str):
        self.inner, self.preset = inner, preset
        self.name, self.dtypes, self.limits, self.kinds = inner.name, inner.dtypes, inner.limits, inner.kinds
        self.judged_under = inner.judged_under
        for declared in ("features", "splits", "page_sizes", "batch_invariant", "writes_buffers", "contiguous"):
            setattr(self, declared, getattr(inner, declared))

    def precision(self, dtype) -> PrecisionModel:
        return self.judged_under.precision(PrecisionModel.parse(self.preset, dtype))

    def supports(self, problem):
        return self.inner.supports(problem)

    def _run(self, problem):  # as returned: `run` checks it and applies the conventions once
        return self.inner._run(problem)


def precision_hint(backend: Backend, prop, problem, seed: int, result) -> str:
    """A line for the failure of `prop` on `problem` (`result`): the looser model under which it
    passes and its option, or that none does; "" where precision is not what was judged (a
    built-in backend's precision is its own; a raise or a bitwise check compares no tolerance)."""
    if not backend.declared_precision or result.worst_ratio is None:
        return ""
    current = backend.precision(problem.dtype)
    presets = list(LOOSER_PRESETS)
    tighter = [p for p in presets
               if backend.judged_under.precision(PrecisionModel.parse(p, problem.dtype)) == current]
    tried = presets[presets.index(tighter[0]) + 1:] if tighter else presets
    for preset in tried:
        try:
            judged = prop(_JudgedUnder(backend, preset), problem, seed)
        except Exception:  # noqa: BLE001 - whatever the target raises, this model does not pass it
            continue
        if judged.applicable and not judged.failed:
            wide = "" if judged.informative is not False else (
                " (though its tolerance there is wide enough for a trivial output to pass too)")
            return (f"precision: this example passes under --precision {preset} ({LOOSER_PRESETS[preset]}){wide}; "
                    f"if the kernel computes so, declare it (precision={preset!r} in the API)")
    if not tried:
        return ""
    return (f"precision: it fails under the looser legitimate models too ({', '.join(tried)}): "
            "not a matter of declared precision")
