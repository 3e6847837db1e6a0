"""Rounding-error algebra shared by the oracle's paths."""

from __future__ import annotations

import numpy as np

#: float64 unit roundoff.
U64 = 2.0 ** -53


def gamma(n, unit: float = U64):
    """gamma_n = n u / (1 - n u): the classic bound on n accumulated relative roundings;
    inf once n u >= 1, where no such bound exists."""
    nu = np.asarray(n, dtype=np.float64) * unit
    with np.errstate(divide="ignore"):
        return np.where(nu < 1, nu / np.where(nu < 1, 1 - nu, 1.0), np.inf)


def softmax_output_coefficient(r, n_rounded, unit: float):
    """Relative output error of softmax(x) @ V in units of the row scale D_c.

    Inputs: every probability carries relative error <= r, the numerator and the row sum
    are sums whose terms each pass through <= n_rounded roundings of size `unit`, and one
    final division rounds. Then alpha = r + gamma_n (1 + r) bounds the relative error of
    every term, and with l the row sum, O = sum p v / l:
        |O_hat - O| <= (2 alpha / (1 - alpha)) * D_c      (numerator and denominator)
                      + unit * (1 + 2 alpha / (1 - alpha)) * D_c   (the division)
    because |O| <= D_c; no bound (inf) once alpha >= 1. Returns (coefficient, alpha).
    """
    alpha = r + gamma(n_rounded, unit) * (1 + r)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(alpha < 1, 2 * alpha / (1 - alpha), np.inf)
    return ratio + unit * (1 + ratio), alpha
