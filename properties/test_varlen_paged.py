"""Ragged batches (varlen, paged KV, split-KV): every ragged property on every built-in ragged
backend (fa_verify.backends.ragged_base), drawn by fa_verify.strategies.ragged_problems within
each backend's limits; not applicable ones (a page table for a varlen target, splits for one
without num_splits) are skipped with the reason."""

import pytest

from fa_verify.backends.ragged_base import builtin_ragged_backends
from fa_verify.properties import RAGGED_PROPERTY_NAMES


@pytest.mark.parametrize("backend", builtin_ragged_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("prop", RAGGED_PROPERTY_NAMES)
def test_ragged_property(backend, prop, fa_search):
    fa_search(backend, prop)
