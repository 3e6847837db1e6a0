"""The honest FP8 ensemble (fa_verify.fp8_ensemble): FlashAttention-3's FP8 forward built other
honest ways stays well within its allowance, and a kernel that stores P in e5m2 while declaring
e4m3 fails it where the error-model bound lets it pass."""

import sys
from pathlib import Path

import numpy as np

from fa_verify.fp8_emulation import fa3_fp8_forward, per_head
from fa_verify.fp8_ensemble import ensemble_allowance, normalised_error
from fa_verify.fp8_error_model import fp8_error_bound
from fa_verify.oracle.fp8 import reference_fp8
from fa_verify.precision import PrecisionModel
from fa_verify.strategies import make_fp8_problem

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import fp8_mutants  # noqa: E402

#: Honest FP8 kernels the members do not include: other tile sizes, orders, placements.
OTHERS = {"96-key tiles": dict(block_n=96), "176-key tiles": dict(block_n=176),
          "descending 96-key tiles": dict(block_n=96, descending=True),
          "32-key tiles, descales at load": dict(block_n=32, at_load=True)}
#: error / allowance of OTHERS, measured: at most 0.24 on the 12 draws below, 0.28 over 120
#: (seeds 0-5). K (4) and the floor 4x smaller: 0.97, past the upper limit (2x: 0.48, a margin of
#: 2 left); 2x larger: 0.12, under the lower limit.
OTHERS_USE = (0.15, 0.6)


def _descales(p):
    return [per_head(p, n) for n in ("q_descale", "k_descale", "v_descale")]


def test_other_honest_fp8_kernels_stay_well_within_the_allowance():
    worst = 0.0
    for p in fp8_mutants.drawn_problems(0, 12):
        precision, ref = PrecisionModel.flash(p.dtype), reference_fp8(p)
        allowance, _, _ = ensemble_allowance(p, precision, ref)
        for options in OTHERS.values():
            worst = max(worst, normalised_error(fa3_fp8_forward(p, precision, *_descales(p), **options)[0], ref) / allowance)
    assert OTHERS_USE[0] <= worst <= OTHERS_USE[1]


def test_p_stored_in_e5m2_under_a_declared_e4m3_fails_the_ensemble_where_the_bound_passes_it():
    """Offset-deciding logits: the small probabilities sit at 2^-2.5 after the offset, where
    e5m2's rounding (u = 1/8) is twice e4m3's. Measured: 0.53 of the bound, 2.5x the allowance."""
    p = make_fp8_problem((1, 1, 1, 13, 128, 32), "e5m2", 55689247, logit_spread=6.0, offset_gap=7.3)
    precision, ref = PrecisionModel.flash("e5m2"), reference_fp8(p)
    out, lse = fa3_fp8_forward(p, precision.replace(p_rounding="e5m2"), *_descales(p))
    assert np.all(np.abs(out.astype(np.float64) - ref.out) <= fp8_error_bound(p, precision, ref).out)
    assert normalised_error(out, ref) > 2 * ensemble_allowance(p, precision, ref)[0]
