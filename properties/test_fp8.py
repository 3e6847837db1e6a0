"""FP8 attention with descales: the properties about it on every selected backend that runs FP8
problems (the built-in numpy-fa3-fp8, or --fa-backend MODULE:FUNC functions whose signature
names q_descale, k_descale and v_descale), drawn by fa_verify.strategies.fp8_problems within each
backend's limits; a backend without FP8 skips them with the reason."""

import pytest


@pytest.fixture
def fp8_search(fa_backend, fa_search):
    """fa_search on each selected backend."""
    return lambda prop: fa_search(fa_backend, prop)


def test_fp8_agreement(fp8_search):
    fp8_search("fp8_agreement")


def test_descale_sensitivity(fp8_search):
    fp8_search("descale_sensitivity")


def test_descale_rescaling(fp8_search):
    fp8_search("descale_rescaling")


def test_saturation_finite(fp8_search):
    fp8_search("saturation_finite")


def test_fp8_head_independence(fp8_search):
    fp8_search("fp8_head_independence")


def test_kv_scale_sensitivity(fp8_search):
    """An FP8 KV cache's k_scale / v_scale (paged batches of FP8 sequences: numpy-paged-fp8, or
    --fa-layout paged functions naming k_scale and v_scale)."""
    fp8_search("kv_scale_sensitivity")
