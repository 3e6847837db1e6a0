"""The variants: sliding window, softcap, ALiBi and sinks (not applicable to targets without them)."""

from fa_verify.properties import (
    check_feature_sensitivity,
    check_softcap_limit,
    check_variant_agreement,
    check_wide_window,
    check_window_independence,
)


def test_variant_agreement(fa_backend, fa_search):
    fa_search(fa_backend, check_variant_agreement)


def test_feature_sensitivity(fa_backend, fa_search):
    fa_search(fa_backend, check_feature_sensitivity)


def test_wide_window(fa_backend, fa_search):
    fa_search(fa_backend, check_wide_window)


def test_softcap_limit(fa_backend, fa_search):
    fa_search(fa_backend, check_softcap_limit)


def test_window_independence(fa_backend, fa_search):
    fa_search(fa_backend, check_window_independence)
