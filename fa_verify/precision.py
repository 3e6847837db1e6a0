"""Precision models: where an attention implementation rounds, and to what.

A precision model names the dtype of each stage of the forward pass. The error model turns it
into a per-element error bound; backends declare theirs so a verdict can judge them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

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
        followed by such changes ('fp32-accumulate,inputs=fp16': q, k, v rounded to fp16 inside)."""
        presets = {"flash": cls.flash, "fp32-accumulate": cls.fp32_accumulate,
                   "input-scores": cls.input_scores, "same-precision": cls.same_precision}
        items = [item.strip() for item in text.split(",") if item.strip()]
        model = presets[items.pop(0)](dtype) if items and items[0] in presets else cls(input=dtype)
        keys = {"score": "score_accumulation", "p": "p_rounding", "pv": "pv_accumulation", "out": "output",
                "inputs": "input_rounding"}
        fields = {}
        for item in items:
            key, _, value = item.partition("=")
            if key not in keys or not value:
                raise InvalidArgumentError(
                    f"precision={text!r}: use a preset ({', '.join(presets)}), "
                    "'score=DT,p=DT,pv=DT,out=DT,inputs=DT' with DT in fp16, bf16, fp32, or a preset followed by "
                    "those ('fp32-accumulate,inputs=fp16')"
                )
            fields[keys[key]] = value
        return replace(model, **fields)

    def as_dict(self) -> dict:
        found = asdict(self)
        if self.input_rounding is None:  # records of models without it stay as they were
            del found["input_rounding"]
        return found

    def describe(self) -> str:
        conventions = ((f" lse={self.lse}" if self.lse != "fp32" else "") + (" ftz" if self.ftz else "")
                       + (f" inputs->{self.input_rounding}" if self.input_rounding else ""))
        return (f"in={self.input} score={self.score_accumulation} p={self.p_rounding} "
                f"pv={self.pv_accumulation} out={self.output}{conventions}")
