"""The online-softmax state law: per-chunk (O, LSE) merged by LSE equals the whole."""

from fa_verify.properties import check_merge_law


def test_merge_law(fa_backend, fa_search):
    fa_search(fa_backend, check_merge_law)
