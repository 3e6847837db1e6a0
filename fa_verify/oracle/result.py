"""The oracle's contract: the reference output and LSE, each with a rigorous error bound."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Reference:
    """Reference attention of one problem; float64 arrays.

    Guarantee: |out - exact_out| <= out_bound and |lse - exact_lse| <= lse_bound, elementwise,
    where "exact" is attention evaluated in real arithmetic with the exact scale.
    Fully masked rows have out 0, lse -inf and bounds 0 (with a sink: lse = the sink's logit,
    judged by its bound like any row).
    """

    out: np.ndarray          # [B, H, Nq, D_v]
    lse: np.ndarray          # [B, H, Nq], natural log of the row's sum of exp(logits) (+ exp(sink))
    out_bound: np.ndarray    # [B, H, Nq, D_v]
    lse_bound: np.ndarray    # [B, H, Nq]
    #: D_ic = sum_j p_ij |v_jc| / sum_j p_ij: the natural scale of output element (i, c). [B,H,Nq,D_v]
    row_scale: np.ndarray
    #: "mpmath" or "certified"
    method: str
    #: Rows (of all B*H*Nq) that the certified path handed to mpmath.
    mpmath_rows: int = 0
    #: Rows whose bound needed the |q_i||K|^T GEMM (the free norm bound was too loose there).
    gemm_rows: int = 0

    @property
    def relative_bound(self) -> float:
        """Largest out_bound / row_scale: how tight the reference is, in units of the row scale."""
        ok = self.row_scale > 0
        return float(np.max(self.out_bound[ok] / self.row_scale[ok], initial=0.0))
