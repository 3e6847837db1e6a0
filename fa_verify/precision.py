"""Precision models: where an attention implementation rounds, and to what.

A precision model names the dtype of each stage of the forward pass, and how accurate its
transcendental functions are (tanh for softcap, exp). The error model turns it into a
per-element error bound; backends declare theirs so a verdict can judge them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fa_verify.dtypes import dtype_name
from fa_verify.errors import InvalidArgumentError

#: Declarable accuracy of tanh (softcap): a few ulp (libm tanhf); an absolute error of a few
#: u_fp32, as 1 - 2 / (e^{2x} + 1) in fp32 has; the relative bound of the hardware tanh.approx.f32.
#: The bounds are fa_verify.error_model's TANH_ABSOLUTE_UNITS and TANH_APPROX_ERROR.
TANH_ACCURACIES = ("accurate", "absolute", "approx")
#: Declarable accuracy of exp: a few ulp (EXP_ULPS), or ex2.approx.f32's bound (EX2_APPROX_ERROR).
EXP_ACCURACIES = ("accurate", "approx")


@dataclass(frozen=True)
class PrecisionModel:
    #: dtype of q, k, v (the problem dtype).
    input: str
    #: dtype in which q·k is accumulated and the online softmax is carried out.
    score_accumulation: str = "fp32"
    #: dtype P is rounded to before P·V (FA2 rounds to the input dtype; fp32 = not rounded).
    p_rounding: str = "fp32"
    #: dtype in which P·V and the row sum are accumulated.
    pv_accumulation: str = "fp32"
    #: dtype of the output O.
    output: str | None = None
    #: dtype the LSE is stored in (fa_verify's convention: fp32; `fa_verify.conventions` lse-dtype).
    lse: str = "fp32"
    #: subnormal inputs and outputs flushed to zero (`fa_verify.conventions` ftz).
    ftz: bool = False
    #: accuracy of tanh in softcap: one of TANH_ACCURACIES
    tanh: str = "accurate"
    #: accuracy of exp (and exp2): one of EXP_ACCURACIES
    exp: str = "accurate"
    #: dtype q, k and v are rounded to inside the kernel before any arithmetic (an fp32 API over
    #: fp16 arithmetic); None: used as given. The error model's input_rounding term.
    input_rounding: str | None = None

    def __post_init__(self):
        for field in ("input", "score_accumulation", "p_rounding", "pv_accumulation", "lse"):
            object.__setattr__(self, field, dtype_name(getattr(self, field)))
        if self.input_rounding is not None:
            object.__setattr__(self, "input_rounding", dtype_name(self.input_rounding))
        object.__setattr__(self, "output", dtype_name(self.output or self.input))
        if self.input == "fp64":
            raise InvalidArgumentError("input='fp64' is not a problem dtype; use fp16, bf16 or fp32")
        for field, allowed in (("tanh", TANH_ACCURACIES), ("exp", EXP_ACCURACIES)):
            if getattr(self, field) not in allowed:
                raise InvalidArgumentError(
                    f"{field}={getattr(self, field)!r} is not an accuracy of {field}; use one of {', '.join(allowed)}")

    @classmethod
    def flash(cls, dtype) -> "PrecisionModel":
        """FlashAttention-2 style: fp32 scores and accumulators, P rounded to the input dtype."""
        return cls(input=dtype, p_rounding=dtype)

    @classmethod
    def fp32_accumulate(cls, dtype) -> "PrecisionModel":
        """Everything in fp32 after the inputs, output rounded once to the input dtype."""
        return cls(input=dtype)

    @classmethod
    def input_scores(cls, dtype) -> "PrecisionModel":
        """Scores and the softmax in the input dtype (q·k accumulated in it), P·V accumulated in
        fp32: attention that rounds its scores to fp16/bf16."""
        return cls(input=dtype, score_accumulation=dtype, p_rounding=dtype)

    @classmethod
    def same_precision(cls, dtype) -> "PrecisionModel":
        """Every stage in the input dtype: naive attention computed in fp16/bf16/fp32 throughout."""
        return cls(input=dtype, score_accumulation=dtype, p_rounding=dtype, pv_accumulation=dtype)

    @classmethod
    def parse(cls, text: str, dtype) -> "PrecisionModel":
        """From a CLI spelling: a preset name, 'score=fp32,p=bf16,pv=fp32,out=bf16', or a preset
        followed by keys that change it ('flash,tanh=approx'; 'fp32-accumulate,inputs=fp16': q, k, v
        rounded to fp16 inside). Keys: score, p, pv, out, inputs (dtypes); tanh (accurate, absolute,
        approx) and exp (accurate, approx), the accuracy of the transcendental functions."""
        presets = {"flash": cls.flash, "fp32-accumulate": cls.fp32_accumulate,
                   "input-scores": cls.input_scores, "same-precision": cls.same_precision}
        keys = {"score": "score_accumulation", "p": "p_rounding", "pv": "pv_accumulation", "out": "output",
                "inputs": "input_rounding", "tanh": "tanh", "exp": "exp"}
        items = [item.strip() for item in text.split(",") if item.strip()]
        base = presets[items.pop(0)](dtype) if items and items[0] in presets else cls(input=dtype)
        fields = {}
        for item in items:
            key, _, value = item.partition("=")
            if key not in keys or not value:
                raise InvalidArgumentError(
                    f"precision={text!r}: use a preset ({', '.join(presets)}), "
                    "'score=DT,p=DT,pv=DT,out=DT,inputs=DT' with DT in fp16, bf16, fp32, or either followed by "
                    f"tanh=({'|'.join(TANH_ACCURACIES)}) and exp=({'|'.join(EXP_ACCURACIES)}), e.g. 'flash,tanh=approx' "
                    "or 'fp32-accumulate,inputs=fp16'"
                )
            fields[keys[key]] = value
        try:
            return replace(base, **fields)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"precision={text!r}: {exc}") from None

    def replace(self, **changes) -> "PrecisionModel":
        """This model with `changes` (field=value), validated as a new one."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        found = asdict(self)
        if self.input_rounding is None:  # records of models without it stay as they were
            del found["input_rounding"]
        return found

    def describe(self) -> str:
        conventions = ((f" lse={self.lse}" if self.lse != "fp32" else "") + (" ftz" if self.ftz else "")
                       + (f" inputs->{self.input_rounding}" if self.input_rounding else ""))
        conventions += "".join(f" {name}={value}" for name, value in (("tanh", self.tanh), ("exp", self.exp))
                               if value != "accurate")
        return (f"in={self.input} score={self.score_accumulation} p={self.p_rounding} "
                f"pv={self.pv_accumulation} out={self.output}{conventions}")
