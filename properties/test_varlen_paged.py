"""Ragged batches (varlen, paged KV, split-KV): every ragged property on every selected ragged
backend (fa_ragged_backend: the --fa-backend MODULE:FUNC functions of --fa-layout varlen|paged,
else the built-in ones of fa_verify.backends.ragged_base), drawn by
fa_verify.strategies.ragged_problems within each backend's limits; not applicable ones (a page
table for a varlen target, splits for one without num_splits) are skipped with the reason, and
so is every one when --fa-backend selects (dense) targets."""

import pytest


@pytest.fixture
def ragged_search(fa_ragged_backend, fa_search):
    """fa_search on each selected ragged backend."""
    return lambda prop: fa_search(fa_ragged_backend, prop)


def test_ragged_agreement(ragged_search):
    ragged_search("ragged_agreement")


def test_sequence_alone(ragged_search):
    ragged_search("sequence_alone")


def test_sequence_independence(ragged_search):
    ragged_search("sequence_independence")


def test_page_placement(ragged_search):
    ragged_search("page_placement")


def test_paged_contiguous(ragged_search):
    ragged_search("paged_contiguous")


def test_unused_cache(ragged_search):
    ragged_search("unused_cache")


def test_split_invariance(ragged_search):
    ragged_search("split_invariance")


def test_unwritten_rows(ragged_search):
    ragged_search("unwritten_rows")
