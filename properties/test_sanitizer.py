"""A CUDA kernel's AddressSanitizer build runs without an invalid memory access (a few examples)."""

from fa_verify.properties import check_address_sanitizer


def test_address_sanitizer(fa_backend, fa_search):
    fa_search(fa_backend, check_address_sanitizer)
