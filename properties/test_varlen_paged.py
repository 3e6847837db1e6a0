"""Ragged batches (varlen, paged KV, split-KV): the properties about them on every selected
backend that runs them (the built-in ones, or the --fa-backend MODULE:FUNC functions of
--fa-layout varlen|paged), drawn by fa_verify.strategies.ragged_problems within each backend's
limits; not applicable ones (a page table for a varlen target, splits for one without
num_splits, any of them for a dense target) are skipped with the reason."""

import pytest


@pytest.fixture
def ragged_search(fa_backend, fa_search):
    """fa_search on each selected backend."""
    return lambda prop: fa_search(fa_backend, prop)


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
