"""Problems with the same exact answer: permutations and score shifts, within the error model."""

from fa_verify.properties import check_key_permutation, check_query_permutation, check_score_shift


def test_key_permutation(fa_backend, fa_search):
    fa_search(fa_backend, check_key_permutation)


def test_query_permutation(fa_backend, fa_search):
    fa_search(fa_backend, check_query_permutation)


def test_score_shift(fa_backend, fa_search):
    fa_search(fa_backend, check_score_shift)
