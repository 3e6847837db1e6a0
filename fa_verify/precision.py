"""Precision models: where an attention implementation rounds, and to what.

A precision model names the dtype of each stage of the forward pass. The error model turns it
into a per-element error bound; backends declare theirs so a verdict can judge them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fa_verify.dtypes import dtype_name
from fa_verify.errors import InvalidArgumentError


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

    def __post_init__(self):
        for field in ("input", "score_accumulation", "p_rounding", "pv_accumulation", "lse"):
            object.__setattr__(self, field, dtype_name(getattr(self, field)))
        object.__setattr__(self, "output", dtype_name(self.output or self.input))
        if self.input == "fp64":
            raise InvalidArgumentError("input='fp64' is not a problem dtype; use fp16, bf16 or fp32")

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
        """From a CLI spelling: a preset name or 'score=fp32,p=bf16,pv=fp32,out=bf16'."""
        presets = {"flash": cls.flash, "fp32-accumulate": cls.fp32_accumulate,
                   "input-scores": cls.input_scores, "same-precision": cls.same_precision}
        if text in presets:
            return presets[text](dtype)
        keys = {"score": "score_accumulation", "p": "p_rounding", "pv": "pv_accumulation", "out": "output"}
        fields = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in keys or not value:
                raise InvalidArgumentError(
                    f"precision={text!r}: use a preset ({', '.join(presets)}) or "
                    "'score=DT,p=DT,pv=DT,out=DT' with DT in fp16, bf16, fp32"
                )
            fields[keys[key]] = value
        return cls(input=dtype, **fields)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        conventions = (f" lse={self.lse}" if self.lse != "fp32" else "") + (" ftz" if self.ftz else "")
        return (f"in={self.input} score={self.score_accumulation} p={self.p_rounding} "
                f"pv={self.pv_accumulation} out={self.output}{conventions}")
