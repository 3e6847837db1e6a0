"""Declared conventions: what a target returns that differs from fa_verify's conventions on
purpose, and how each changes what is judged.

fa_verify's conventions: the LSE is the natural log of the row's sum of exp(scaled scores), in
float32; a fully masked row has output 0 and LSE -inf; subnormals are kept; the scale is used
exactly. Real kernels differ, and none of these is a bug:

* `lse-base 2`: an exp2-based kernel keeps log2 of the sum. Converted to base e (times ln 2,
  in float64: 1e-16 relative, inside the bound's slack) before anything judges it. A rounding
  error u|lse| is the same relative error in either base, so the allowance does not change.
* `lse-dtype input`: the LSE is stored in the problem dtype. Widened exactly to float32; the
  error model's lse_rounding term uses that dtype's unit roundoff (`PrecisionModel.lse`).
* `masked-rows uniform`: a finite mask value instead of -inf gives a fully masked row uniform
  weights, so its output is the mean of V over the keys. Judged against that mean (within P
  rounding, the P.V accumulation and one output ulp), then set to 0 and LSE -inf, so every
  property sees fa_verify's convention; where it is not the mean, the difference from the mean
  is left in its place, so the row fails "must be 0" by what it is off. Its LSE (the mask value
  plus log Nk) is not judged unless it is NaN. NaN is never a convention: 0/0 in a masked row is
  a bug (`--masked-rows nan` is refused, saying so).
* `ftz`: subnormal inputs and outputs are flushed to zero (GPUs' .ftz). The error model adds what
  flushing can cost (`PrecisionModel.ftz`): a score moves by at most scale x tiny x (sum|q| +
  sum|k|), an output by tiny(input) for V and tiny(output) for itself; the verdict's ensemble
  rule gains the same absolute floor.
* `scale-precision input`: the kernel rounds the scale to the input dtype. The problem judged
  carries that rounded scale (`Conventions.problem`), so the reference and the bound use it and
  the target is called with it; scores in the input dtype are a precision model instead:
  `--precision input-scores`.

One spelling everywhere (as with `fa_verify.limits`): the CLI (`--lse-base 2 --ftz ...`), the
pytest plugin (`--fa-lse-base 2 ...`), the `--limits` TOML file (`lse-base = 2`) and the API
(`CallableBackend(fn, conventions={"lse_base": 2})` or `Conventions(...)`). A target's declared
conventions are printed with every check ("judged under: LSE base 2, flush-to-zero").
A built-in backend's declared `Deviation`s (`fa_verify.backends.base`) are another thing: kept visible
as declared deviations in reports, not judged under.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from fa_verify.dtypes import round_to, ulp, unit_roundoff
from fa_verify.error_model import flushed_output_error, gamma
from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import read_options, yes_no

LSE_BASES = ("e", "2")
LSE_DTYPES = ("fp32", "input")
MASKED_ROWS = ("zero", "uniform")
SCALE_PRECISIONS = ("exact", "input")


@dataclass(frozen=True)
class Conventions:
    """A target's conventions; the defaults are fa_verify's."""

    #: base of the returned LSE: "e" or "2"
    lse_base: str = "e"
    #: dtype of the returned LSE: "fp32" or "input" (the problem dtype)
    lse_dtype: str = "fp32"
    #: fully masked rows: "zero" (output 0, LSE -inf) or "uniform" (output the mean of V)
    masked_rows: str = "zero"
    #: subnormal inputs and outputs flushed to zero
    ftz: bool = False
    #: the scale as used: "exact" or "input" (rounded to the problem dtype)
    scale_precision: str = "exact"

    def __post_init__(self):
        """Values built directly are held to what the options accept, with the same words:
        Conventions(lse_base="3") is refused, not judged as base e."""
        for option, (field, read, example, what) in CONVENTION_OPTIONS.items():
            value = getattr(self, field)
            try:
                valid = read(value) == value
            except (ValueError, KeyError, TypeError):
                valid = False
            if not valid:
                raise InvalidArgumentError(f"Conventions({field}={value!r}) is not valid: {what}; e.g. "
                                           f"{field}={read(example)!r}")

    @property
    def declared(self) -> bool:
        return self != Conventions()

    @property
    def about_outputs(self) -> "Conventions":
        """The declared conventions about a forward's outputs and scale: all but flushing, which is
        arithmetic (a backward target may declare it; what it is given is in fa_verify's)."""
        return replace(self, ftz=False)

    def describe(self) -> str:
        """The declared conventions in words, e.g. 'LSE base 2, flush-to-zero'."""
        parts = []
        if self.lse_base == "2":
            parts.append("LSE base 2")
        if self.lse_dtype == "input":
            parts.append("LSE in the input dtype")
        if self.masked_rows == "uniform":
            parts.append("fully masked rows uniform (output the mean of V)")
        if self.ftz:
            parts.append("flush-to-zero")
        if self.scale_precision == "input":
            parts.append("scale rounded to the input dtype")
        return ", ".join(parts) or "fa_verify's conventions"

    def as_dict(self) -> dict:
        """As option values (what parse_conventions reads)."""
        return {option: asdict(self)[field] for option, (field, *_) in CONVENTION_OPTIONS.items()}

    def precision(self, model):
        """The PrecisionModel `model` with this LSE dtype and flushing."""
        lse = model.input if self.lse_dtype == "input" else "fp32"
        return replace(model, lse=lse, ftz=self.ftz)

    def problem(self, problem):
        """The problem (of any kind) as the target computes it: each part's scale rounded to the
        input dtype if declared."""
        if self.scale_precision == "exact":
            return problem

        def rounded(part):
            scale = float(round_to(part.scale_value, part.dtype))
            return part if scale == part.scale else part.replace(scale=scale)

        return problem.map_parts(rounded)

    def normalise(self, problem, out, lse, precision):
        """(out, lse) in fa_verify's conventions: LSE in base e and widened, fully masked rows
        under the uniform convention checked and set to 0 / -inf (see the module doc)."""
        if lse is not None and (self.lse_base == "2" or lse.dtype != np.float32):
            lse = lse.astype(np.float64) * math.log(2.0) if self.lse_base == "2" else lse.astype(np.float32)
        if self.masked_rows == "uniform" and problem.masked_rows.any():
            out, lse = _uniform_rows(problem, out, lse, precision)
        return out, lse


def lse_hint(lse, reference_lse) -> str:
    """A hint when a failing LSE is, row by row, log2 of the sum (ratio 1/ln 2 to the reference):
    the convention that declares it; "" otherwise."""
    ref = np.asarray(reference_lse, dtype=np.float64)
    got = np.asarray(lse, dtype=np.float64)
    rows = np.isfinite(ref) & np.isfinite(got) & (np.abs(ref) > 1e-2)
    if rows.any() and np.allclose(got[rows] * math.log(2.0), ref[rows], rtol=1e-3, atol=0):
        return ("the LSE is log2 of the row sum (it is 1/ln 2 = 1.4427 x the reference's in every row): "
                "if the kernel keeps it in base 2, declare --lse-base 2")
    return ""


def _uniform_rows(problem, out, lse, precision):
    """Fully masked rows that are the mean of V set to 0 (LSE -inf); others less that mean."""
    _, v = problem.kv64()
    mean = v.mean(axis=2, keepdims=True)  # [B, H, 1, D]: uniform weights over every key
    scale = np.abs(v).mean(axis=2, keepdims=True)
    u_p = unit_roundoff(precision.p_rounding)
    work = (u_p + float(gamma(problem.nk + 2, unit_roundoff(precision.pv_accumulation)))) * scale
    allowed = work + ulp(np.abs(mean) + work, precision.output)
    if precision.ftz:
        allowed = allowed + flushed_output_error(precision)
    masked = problem.masked_rows[None, None, :, None]
    off = out.astype(np.float64) - mean
    ok = np.abs(off) <= allowed
    out = np.where(masked, np.where(ok, 0.0, off), out).astype(out.dtype)
    if lse is not None:
        lse = np.where(masked[..., 0] & ~np.isnan(lse), -np.inf, lse).astype(lse.dtype)
    return out, lse


def _choice(allowed: tuple):
    def read(value):
        text = str(value).lower()
        if text not in allowed:
            raise ValueError
        return text
    return read


#: Each convention option: (the Conventions field, how to read a value, an example, what it declares).
CONVENTION_OPTIONS = {
    "lse-base": ("lse_base", _choice(LSE_BASES), "2",
                 "base of the returned LSE: e (natural log, default) or 2 (log2, as exp2-based kernels keep it)"),
    "lse-dtype": ("lse_dtype", _choice(LSE_DTYPES), "input",
                  "dtype of the returned LSE: fp32 (default) or input (the problem's dtype)"),
    "masked-rows": ("masked_rows", _choice(MASKED_ROWS), "uniform",
                    "fully masked rows: zero (output 0, LSE -inf; default) or uniform (a finite mask value: "
                    "output the mean of V); NaN there is a bug (0/0), never a convention"),
    "ftz": ("ftz", yes_no, "yes", "subnormal inputs and outputs flushed to zero (yes/no)"),
    "scale-precision": ("scale_precision", _choice(SCALE_PRECISIONS), "input",
                        "the scale as the target uses it: exact (default) or input (rounded to the input dtype; "
                        "scores in the input dtype are --precision input-scores)"),
}


def parse_conventions(values: dict, prefix: str = "--", base: Conventions | None = None) -> Conventions:
    """Conventions from option values (strings as typed, or TOML values), keyed by
    CONVENTION_OPTIONS names (underscores allowed); None values are ignored. `prefix` names the
    options in errors ('--', '--fa-', 'conventions.' for the API, '' for TOML keys)."""
    fields = read_options(values, CONVENTION_OPTIONS, prefix, "convention")
    return replace(base or Conventions(), **fields)


def convention_arguments() -> dict:
    """argparse / pytest addoption keyword arguments of each convention option, by name; the
    values stay strings for `parse_conventions`."""
    metavars = {"lse-base": "e|2", "lse-dtype": "fp32|input", "masked-rows": "zero|uniform", "ftz": "yes|no",
                "scale-precision": "exact|input"}
    arguments = {option: dict(default=None, metavar=metavars[option], help=f"declared convention: {what}")
                 for option, (_, _, example, what) in CONVENTION_OPTIONS.items()}
    arguments["ftz"].update(nargs="?", const="yes")  # a bare --ftz says yes
    return arguments


def conventions_from_options(values: dict, declarations: dict | None = None, prefix: str = "--") -> Conventions:
    """Conventions from the convention keys of a --limits TOML file (`declarations`, already
    read) overridden by the option values given (None: not given)."""
    base = Conventions()
    if declarations:
        from_file = {k: v for k, v in declarations.items() if is_convention(k)}
        base = parse_conventions(from_file, prefix="")
    return parse_conventions(values, prefix, base)


def is_convention(key) -> bool:
    """Whether a --limits file key names a convention (the file declares both)."""
    return str(key).replace("_", "-") in CONVENTION_OPTIONS


def of(conventions) -> Conventions:
    """A Conventions from a Conventions, a dict of convention options (the API) or None."""
    if isinstance(conventions, Conventions):
        return conventions
    if conventions is not None and not isinstance(conventions, dict):
        raise InvalidArgumentError(
            f"conventions={conventions!r} must be a Conventions, a dict such as {{'lse_base': '2'}} or None")
    return parse_conventions(conventions or {}, prefix="conventions.")
