"""What an output must not depend on at all (identical results required)."""

from fa_verify.properties import (
    check_batch_head_independence,
    check_determinism,
    check_masked_key_independence,
    check_reused_buffers,
)


def test_batch_head_independence(fa_backend, fa_search):
    fa_search(fa_backend, check_batch_head_independence)


def test_masked_key_independence(fa_backend, fa_search):
    fa_search(fa_backend, check_masked_key_independence)


def test_determinism(fa_backend, fa_search):
    fa_search(fa_backend, check_determinism)


def test_reused_buffers(fa_backend, fa_search):
    fa_search(fa_backend, check_reused_buffers)
