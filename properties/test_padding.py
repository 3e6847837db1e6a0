"""Inputs inside NaN-filled buffers change nothing (reads outside the inputs show)."""

from fa_verify.properties import check_nan_padding


def test_nan_padding(fa_backend, fa_search):
    fa_search(fa_backend, check_nan_padding)
