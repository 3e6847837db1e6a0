"""Unbiased rounding: the output errors' signed mean is statistically 0."""

from fa_verify.properties import check_unbiased_rounding


def test_unbiased_rounding(fa_backend, fa_search):
    fa_search(fa_backend, check_unbiased_rounding)
