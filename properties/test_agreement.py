"""Agreement with the certified oracle under the error model (fixed edge cases first)."""

from fa_verify.properties import check_lse_agreement, check_oracle_agreement


def test_oracle_agreement(fa_backend, fa_search):
    fa_search(fa_backend, check_oracle_agreement)


def test_lse_agreement(fa_backend, fa_search):
    fa_search(fa_backend, check_lse_agreement)
