"""How large an honest FP8 kernel's error is: FlashAttention-3's FP8 forward computed by members
that differ where correct FP8 kernels differ, for the FP8 ensemble rule.

Members (`fp8_emulation.fa3_fp8_forward` under the target's precision model): key tiles of 128
(FA3) or 64, ascending or descending; the q.k descales folded into the softmax scale and v's at
the end (FA3), or every descale applied as the values are loaded (q dq, k dk, v dv rounded to
fp32). P's quantisation dominates their errors (u = 1/16 for e4m3), and which probabilities
round which way depends on the tile size and order (each tile's P is relative to the running
max) and on where the descales are applied, so the members spread over what honest kernels do.

The rule (`fp8_agreement`): a kernel's largest normalised output error (error / row scale) must
stay within DEFAULT_ENSEMBLE_FACTOR x E + floor, E the members' largest, the floor that of the
dense rule (`fa_verify.verdict`: FLOOR_ROUNDINGS (u_out + sqrt(Nk) u_pv)). As the dense
ensemble's, the members' sums are explicit and in a fixed order (no BLAS): the same bits on
every machine.
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import unit_roundoff
from fa_verify.fp8_emulation import fa3_fp8_forward, per_head
from fa_verify.verdict import DEFAULT_ENSEMBLE_FACTOR, FLOOR_ROUNDINGS

#: name -> fa3_fp8_forward's options
MEMBERS = {
    "128-key tiles": {},
    "64-key tiles": dict(block_n=64),
    "descending 128-key tiles": dict(descending=True),
    "descales at load": dict(at_load=True),
    "descending 64-key tiles, descales at load": dict(block_n=64, descending=True, at_load=True),
}


def normalised_error(out, reference) -> float:
    """The largest |out - reference| / row scale over the elements with a row scale."""
    scale = reference.row_scale
    err = np.abs(np.asarray(out, dtype=np.float64) - reference.out)
    return float(np.max(np.where(scale > 0, err / np.where(scale > 0, scale, 1.0), 0.0), initial=0.0))


def ensemble_allowance(problem, precision, reference) -> tuple[float, str, float]:
    """(K E + floor, the member with the largest error E, E): what the FP8 ensemble rule allows."""
    descales = [per_head(problem, name) for name in ("q_descale", "k_descale", "v_descale")]
    errors = {name: normalised_error(fa3_fp8_forward(problem, precision, *descales, **options)[0], reference)
              for name, options in MEMBERS.items()}
    worst = max(errors, key=errors.get)
    floor = FLOOR_ROUNDINGS * (unit_roundoff(problem.output_dtype)
                               + np.sqrt(problem.nk) * unit_roundoff(precision.pv_accumulation))
    return DEFAULT_ENSEMBLE_FACTOR * errors[worst] + floor, worst, errors[worst]
