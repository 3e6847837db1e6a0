"""On a failure, whether a looser legitimate precision model would pass, and the option to declare it.

A callable is judged under FlashAttention's model by default (fp32 scores and accumulation, P in
the input dtype): a kernel that silently computes its scores in fp16 should be told. But it
should also be told that this is what it does: the failing example is judged again under the
looser legitimate models, from the least to the most lenient, and the first that passes is
named with the exact option that declares it; if none passes, the failure is not a matter of
declared precision. A target that implements softcap and declares an accurate tanh is first
tried with its declaration plus a cheaper tanh (`PrecisionModel.tanh`: tanh=absolute, then
tanh=approx), the most specific fix for a softcap computed the cheap or the hardware way. What a
target declares of its implementation beside the preset (tanh, exp, inputs rounded inside) is
kept in every looser model tried: those describe the kernel, not the precision of its stages.
"""

from __future__ import annotations

from fa_verify.backends import Backend
from fa_verify.precision import PrecisionModel

#: The looser legitimate models tried, from the least to the most lenient: preset -> in words.
LOOSER_PRESETS = {"input-scores": "q·k and the softmax in the input dtype, P·V accumulated in fp32",
                  "same-precision": "every stage in the input dtype"}
#: Declarations of softcap's tanh tried first, after the target's own declaration: key -> in words.
TANH_DECLARATIONS = {"tanh=absolute": "tanh with an absolute error of a few u_fp32, as 1 − 2/(e^{2x} + 1) in fp32",
                     "tanh=approx": "tanh within tanh.approx.f32's relative error, 2^-10.987"}


def _tanh_candidates(backend: Backend, current: PrecisionModel) -> list:
    """'<declared spec>,tanh=...' for a target that implements softcap under an accurate tanh,
    declared as a spec string (a callable's --precision); else none."""
    declared = getattr(backend, "_precision", None)
    if "softcap" not in backend.features or current.tanh != "accurate" or not isinstance(declared, str):
        return []
    return [f"{declared},{key}" for key in TANH_DECLARATIONS]


#: PrecisionModel fields that describe how a kernel computes, not a preset: spec key -> field.
KEPT_DECLARATIONS = {"tanh": "tanh", "exp": "exp", "inputs": "input_rounding"}


def _kept(current: PrecisionModel) -> str:
    """The declared keys a looser preset keeps, as a spec suffix (',tanh=approx,inputs=fp16')."""
    defaults = {"tanh": "accurate", "exp": "accurate", "input_rounding": None}
    return "".join(f",{key}={getattr(current, field)}" for key, field in KEPT_DECLARATIONS.items()
                   if getattr(current, field) != defaults[field])


def _in_words(candidate: str) -> str:
    preset = candidate.split(",", 1)[0]
    if preset in LOOSER_PRESETS:
        kept = candidate[len(preset) + 1:]
        return LOOSER_PRESETS[preset] + (f", with the declared {kept}" if kept else "")
    return TANH_DECLARATIONS[candidate.rsplit(",", 1)[-1]]


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


def passes_under(backend: Backend, prop, problem, seed: int, result) -> tuple | None:
    """The looser legitimate presets (least lenient first) under which the failing example of
    `prop` on `problem` (`result`) passes; () when none does; None where precision is not what
    was judged (a built-in backend's precision is its own, or no looser model is left to try).
    A bitwise check (no error ratio) passes under no model: precision does not enter it."""
    if not backend.declared_precision:
        return None
    current = backend.precision(problem.dtype)
    presets = [preset + _kept(current) for preset in LOOSER_PRESETS]
    tighter = [p for p in presets
               if backend.judged_under.precision(PrecisionModel.parse(p, problem.dtype)) == current]
    tried = _tanh_candidates(backend, current) + (presets[presets.index(tighter[0]) + 1:] if tighter else presets)
    if not tried:
        return None
    if result.worst_ratio is None:
        return ()
    passing = []
    for preset in tried:
        try:
            judged = prop(_JudgedUnder(backend, preset), problem, seed)
        except Exception:  # noqa: BLE001 - whatever the target raises, this model does not pass it
            continue
        if judged.applicable and not judged.failed and judged.informative is not False:
            passing.append(preset)
    return tuple(passing)


def run_precision_hint(outcomes, offer: bool = True) -> str:
    """One line for a run's failures (`PropertyOutcome`s): the least lenient looser model under
    which every failing property's example passes, with its option; or that the failures are not
    a matter of declared precision, naming the properties no looser model explains. A hint that
    fixes one property of several would invite the wrong fix (a kernel that never rescales its
    accumulator can pass one property under same-precision and fail another under every model).
    offer=False: only the second kind of line (for one property of a run whose others are unknown)."""
    failing = [o for o in outcomes if o.status == "failed" and o.passes_under is not None]
    if not failing or all(o.worst_ratio is None and not o.passes_under for o in failing):
        return ""
    tried = dict.fromkeys(p for o in failing for p in o.passes_under)  # each in its least-lenient-first order
    common = [p for p in tried if all(p in o.passes_under for o in failing)]
    names = ", ".join(o.property for o in failing)
    if common and not offer:
        return ""
    if common:
        preset = common[0]
        every = "its failing example" if len(failing) == 1 else f"the failing example of every one of {names}"
        return (f"precision: {every} passes under --precision {preset} ({_in_words(preset)}); "
                f"if the kernel computes so, declare it (precision={preset!r} in the API)")
    unexplained = [o.property for o in failing if not o.passes_under]
    why = (f"{', '.join(unexplained)} fail{'s' if len(unexplained) == 1 else ''} under every looser legitimate "
           f"model ({', '.join(LOOSER_PRESETS)}) too" if unexplained
           else f"no looser legitimate model passes every one of {names}")
    return f"precision: not a matter of declared precision: {why}"
