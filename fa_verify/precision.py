"""Precision models: where an attention implementation rounds, and to what.

A precision model names the dtype of each stage of the forward pass, and how accurate its
transcendental functions are (tanh for softcap, exp). The error model turns it into a
per-element error bound; backends declare theirs so a verdict can judge them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fa_verify.dtypes import FP8_DTYPES, dtype_name, finfo
from fa_verify.errors import InvalidArgumentError

#: Declarable accuracy of tanh (softcap): a few ulp (libm tanhf); an absolute error of a few
#: u_fp32, as 1 - 2 / (e^{2x} + 1) in fp32 has; the relative bound of the hardware tanh.approx.f32.
#: The bounds are fa_verify.error_model's TANH_ABSOLUTE_UNITS and TANH_APPROX_ERROR.
TANH_ACCURACIES = ("accurate", "absolute", "approx")
#: Declarable accuracy of exp: a few ulp (EXP_ULPS), or ex2.approx.f32's bound (EX2_APPROX_ERROR).
EXP_ACCURACIES = ("accurate", "approx")
#: FlashAttention-3's FP8 kernel multiplies P by 2^8 before rounding it to e4m3 (its max_offset),
#: so that probabilities down to 2^-14 stay normal; 256 < 448, so P never saturates.
FA3_P_OFFSET = 8


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
    #: P is multiplied by 2^p_offset before it is rounded to `p_rounding` (FA3's FP8: 8), the row
    #: sum and the LSE compensating; 0 = no offset
    p_offset: int = 0

    def __post_init__(self):
        for field in ("input", "score_accumulation", "p_rounding", "pv_accumulation", "lse"):
            object.__setattr__(self, field, dtype_name(getattr(self, field)))
        if self.input_rounding is not None:
            object.__setattr__(self, "input_rounding", dtype_name(self.input_rounding))
        object.__setattr__(self, "output", dtype_name(self.output or self.input))
        if self.input == "fp64":
            raise InvalidArgumentError("input='fp64' is not a problem dtype; use fp16, bf16 or fp32")
        if not (isinstance(self.p_offset, int) and 0 <= self.p_offset
                and 2.0 ** self.p_offset <= float(finfo(self.p_rounding).max)):
            raise InvalidArgumentError(
                f"p_offset={self.p_offset!r} must be an integer >= 0 with 2^p_offset within p={self.p_rounding}'s "
                f"range (P <= 2^p_offset must not saturate); FlashAttention-3's FP8 uses {FA3_P_OFFSET}")
        for field, allowed in (("tanh", TANH_ACCURACIES), ("exp", EXP_ACCURACIES)):
            if getattr(self, field) not in allowed:
                raise InvalidArgumentError(
                    f"{field}={getattr(self, field)!r} is not an accuracy of {field}; use one of {', '.join(allowed)}")

    @classmethod
    def flash(cls, dtype) -> "PrecisionModel":
        """FlashAttention-2 style: fp32 scores and accumulators, P rounded to the input dtype.
        FP8 inputs (e4m3, e5m2): FlashAttention-3's FP8 model (`fa3_fp8`)."""
        if dtype_name(dtype) in FP8_DTYPES:
            return cls.fa3_fp8(dtype)
        return cls(input=dtype, p_rounding=dtype)

    @classmethod
    def fa3_fp8(cls, dtype, p: str = "e4m3", p_offset: int = FA3_P_OFFSET) -> "PrecisionModel":
        """FlashAttention-3's FP8 forward: fp32 scores (q.k descales folded into the softmax scale),
        P = exp(s - m) 2^8 rounded once to e4m3, the row sum from the fp32 P, P.V in fp32, v's
        descale at the end, bf16 output. `p` and `p_offset` declare the others (P in e5m2 or bf16,
        no offset)."""
        return cls(input=dtype, p_rounding=p, output="bf16", p_offset=p_offset)

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
                   "input-scores": cls.input_scores, "same-precision": cls.same_precision, "fa3-fp8": cls.fa3_fp8}
        keys = {"score": "score_accumulation", "p": "p_rounding", "pv": "pv_accumulation", "out": "output",
                "inputs": "input_rounding", "tanh": "tanh", "exp": "exp", "p_offset": "p_offset"}
        items = [item.strip() for item in text.split(",") if item.strip()]
        base = presets[items.pop(0)](dtype) if items and items[0] in presets else cls(input=dtype)
        fields = {}
        for item in items:
            key, _, value = item.partition("=")
            if key not in keys or not value:
                raise InvalidArgumentError(
                    f"precision={text!r}: use a preset ({', '.join(presets)}), "
                    "'score=DT,p=DT,pv=DT,out=DT,inputs=DT' with DT in fp16, bf16, fp32, or either followed by "
                    f"tanh=({'|'.join(TANH_ACCURACIES)}), exp=({'|'.join(EXP_ACCURACIES)}) and p_offset=N (P times 2^N "
                    "before its rounding), e.g. 'flash,tanh=approx', 'fp32-accumulate,inputs=fp16' or 'fa3-fp8,p=e5m2'"
                )
            fields[keys[key]] = int(value) if key == "p_offset" and value.isdigit() else value
        try:
            return replace(base, **fields)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"precision={text!r}: {exc}") from None

    @property
    def tiny_p(self) -> float:
        """The smallest probability exp(s - m) that is a normal number of `p_rounding` once
        multiplied by 2^p_offset: below it, P's rounding error is absolute."""
        return float(finfo(self.p_rounding).smallest_normal) * 2.0 ** -self.p_offset

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
        conventions += f" p_offset={self.p_offset}" if self.p_offset else ""
        return (f"in={self.input} score={self.score_accumulation} p={self.p_rounding} "
                f"pv={self.pv_accumulation} out={self.output}{conventions}")
