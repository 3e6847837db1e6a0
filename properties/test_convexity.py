"""The P·V stage: convex hull, constant V, V-affinity (sharper than the error model)."""

from fa_verify.properties import check_constant_v, check_convex_hull, check_v_affinity


def test_convex_hull(fa_backend, fa_search):
    fa_search(fa_backend, check_convex_hull)


def test_constant_v(fa_backend, fa_search):
    fa_search(fa_backend, check_constant_v)


def test_v_affinity(fa_backend, fa_search):
    fa_search(fa_backend, check_v_affinity)
