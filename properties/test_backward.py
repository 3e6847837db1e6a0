"""The backward pass: the properties about it on every selected backend that runs backward
problems (the built-in numpy-fa2-backward and our backward kernel's backends, or the
--fa-backend MODULE:FUNC functions whose signature names dout), drawn by
fa_verify.strategies.backward_problems within each backend's limits; a forward backend skips
them with the reason."""

import pytest


@pytest.fixture
def backward_search(fa_backend, fa_search):
    """fa_search on each selected backend."""
    return lambda prop: fa_search(fa_backend, prop)


def test_gradient_agreement(backward_search):
    backward_search("gradient_agreement")


def test_gradient_variant_agreement(backward_search):
    backward_search("gradient_variant_agreement")


def test_gradient_determinism(backward_search):
    backward_search("gradient_determinism")


def test_gradient_nan_padding(backward_search):
    backward_search("gradient_nan_padding")


def test_gradient_strided_dout(backward_search):
    backward_search("gradient_strided_dout")


def test_gradient_key_sum(backward_search):
    backward_search("gradient_key_sum")


def test_gradient_value_sum(backward_search):
    backward_search("gradient_value_sum")


def test_gradient_gqa_group_sum(backward_search):
    backward_search("gradient_gqa_group_sum")


def test_gradient_adjoint(backward_search):
    backward_search("gradient_adjoint")


def test_gradient_linearity(backward_search):
    backward_search("gradient_linearity")


def test_gradient_key_shift(backward_search):
    backward_search("gradient_key_shift")


def test_gradient_permutation(backward_search):
    backward_search("gradient_permutation")
