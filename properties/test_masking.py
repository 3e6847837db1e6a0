"""Fully masked rows: output 0 and LSE -inf, never NaN."""

from fa_verify.properties import check_fully_masked_rows


def test_fully_masked_rows(fa_backend, fa_search):
    fa_search(fa_backend, check_fully_masked_rows)
