"""Find fp32 inputs on which the certified oracle's float64 path errs nearly as much as its
bound allows. Not a test: the measurement behind the inputs of tests/test_tightness.py, run as

    python3 tests/measure_oracle_worst_case.py

The oracle's bound (fa_verify/oracle/certified.py) is a worst case over every rounding. A
random problem's error is orders of magnitude below it, so comparing them cannot tell a sound
bound from one made 2x or 4x too small. These inputs make the roundings line up.

Output rows (what the bound's leading term counts): head dim 2, the default scale
s = fl(1/sqrt(2)) (rounded: 0.8 u below the exact scale), q = [a, 0], two keys k1 = [b1, 0],
k2 = [-b2, 0] with t1 = fl(fl(s a) b1) ~ +128 and t2 ~ -128, and values v1 = 0, v2 != 0, so
that O ~ p2 v2 with p2 = e^(t2 - t1) ~ e^-256 (O's relative error is p2's, i.e. the error of
the computed x2 = fl(t2 - t1)). x2 passes through five roundings: the scale's (2T relative
weight), Q' = fl(s a) (2T), the two products (T each) and the subtraction (2T). This script
picks a (the Q' rounding), b1, b2 (the products' and the subtraction's) among fp32 values so
that all of them round the same way by nearly half an ulp: |x2 error| reaches 7.59 u T of the
7.6 u T possible, where the bound allows 2 (u|m| + gamma_5 s A) ~ 12 u T of it.

LSE rows: 56 equal keys b, q = [a, 0]: LSE = fl(t + fl(log 56)) errs by the score's three
roundings plus the final addition's, 3.77 u T, where the bound allows about 8.8 u T.
"""

import math
from fractions import Fraction

import mpmath
import numpy as np

U = 2.0 ** -53
SCALE = 1.0 / math.sqrt(2)  # fa_verify.problem.AttentionProblem.scale_value for D = 2
mpmath.mp.dps = 60
EXACT_SCALE = 1 / mpmath.sqrt(2)


def fp32_values(lo, hi):
    """Every fp32 value in [lo, hi]."""
    a, out = np.float32(lo), []
    while a <= hi:
        out.append(float(a))
        a = np.nextafter(a, np.float32(np.inf))
    return out


def relative_rounding(x, y):
    """(fl(x y) - x y) / (x y) in units of u, exactly."""
    exact = Fraction(x) * Fraction(y)
    return float((Fraction(x * y) - exact) / exact) / U


def by_rounding(x, candidates):
    """candidates sorted by the relative rounding of x * candidate."""
    return sorted((relative_rounding(x, c), c) for c in candidates)


def output_case(top=40):
    qs = by_rounding(SCALE, fp32_values(8 / SCALE, 8 / SCALE * (1 + 2 ** -9)))
    best = []
    for _, a in (qs[0], qs[-1]):  # Q' rounded down or up by nearly half an ulp
        qp = SCALE * a
        ks = by_rounding(qp, fp32_values(128 / qp, 128 / qp * (1 + 2 ** -9)))
        sides = (ks[:top], ks[-top:])
        for side1 in sides:
            for _, b1 in side1:
                for side2 in sides:
                    for _, b2 in side2:
                        t1, t2 = qp * b1, qp * -b2
                        exact = EXACT_SCALE * mpmath.mpf(a) * (mpmath.mpf(-b2) - mpmath.mpf(b1))
                        error = float(mpmath.mpf(t2 - t1) - exact) / (U * t1)
                        best.append((abs(error), a, b1, b2))
    return max(best)


def lse_case(top=30):
    qs = by_rounding(SCALE, fp32_values(8 / SCALE, 8 / SCALE * (1 + 2 ** -9)))
    best = []
    for _, a in qs[:5] + qs[-5:]:
        qp = SCALE * a
        ks = by_rounding(qp, fp32_values(128 / qp, 128 / qp * (1 + 2 ** -9)))
        for _, b in ks[:top] + ks[-top:]:
            t = qp * b
            exact_t = EXACT_SCALE * mpmath.mpf(a) * mpmath.mpf(b)
            for n in range(2, 65):
                error = float(mpmath.mpf(t + math.log(n)) - (exact_t + mpmath.log(n))) / (U * t)
                best.append((abs(error), a, b, n))
    return max(best)


if __name__ == "__main__":
    error, a, b1, b2 = output_case()
    print(f"output: |x2 error| = {error:.3f} u T with a={a!r}, b1={b1!r}, b2={b2!r}")
    error, a, b, n = lse_case()
    print(f"lse: |LSE error| = {error:.3f} u T with a={a!r}, b={b!r}, {n} equal keys")
