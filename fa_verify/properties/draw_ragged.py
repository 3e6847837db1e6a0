"""What to draw for a property on a target of ragged batches (varlen, paged KV): batches within
what it runs, probed as dense targets are (`draw.capabilities`), with tiny one-sequence batches.

The batches themselves are `strategies.ragged_problems`'s: lengths of 1, a tile +- 1, one long
among short ones, decode and prefill queries, page sizes around the tile, shared pages, split
counts. Under a shape budget (`Selection.shapes`) the search draws from at most N batch
signatures (`strategies.batch_signature`: lengths, pages, splits, options), with values drawn
afresh for each example (`strategies.revalued`).
"""

from __future__ import annotations

from dataclasses import replace


from fa_verify import strategies as fst
from fa_verify.properties.draw import capabilities
from fa_verify.properties.registry import Property
from fa_verify.properties.selection import Selection
from fa_verify.properties.shape_budget import budgeted
from fa_verify.ragged import PageLayout, RaggedProblem
from fa_verify.strategies._variants import DEFAULT_TILE


def longest_sequence(selection: Selection) -> int:
    """The longest sequence a batch draws: the selection's max_seq, but where most problems stay
    within typical_seq (the ci profile: 64), past the second tile of that only (129): B sequences
    run, each through the oracle."""
    if selection.typical_seq is None:
        return selection.max_seq
    return min(selection.max_seq, 2 * selection.typical_seq + 1)


def as_batch(layout: str):
    """A function making a dense problem with B = 1 a one-sequence batch of `layout` (paged: in
    contiguous pages of the target's first page size), for probing what a target runs."""
    def batch(problem, backend) -> RaggedProblem:
        pages = None
        if layout == "paged":
            pages = PageLayout.contiguous([problem.nk], (backend.page_sizes or (DEFAULT_TILE,))[0])
        return RaggedProblem((problem,), layout, pages=pages)

    batch.__qualname__ = f"as_batch({layout!r})"
    return batch


def batch_strategy(layout: str, as_kind):
    """The strategy builder of `layout`'s batches: (prop, backend, selection) -> strategy or reason."""
    def problems(prop: Property, backend, selection: Selection):
        caps = capabilities(backend, as_kind)
        dtypes = tuple(d for d in selection.dtypes if d in caps.dtypes)
        if not dtypes:
            return f"none of the selected dtypes {list(selection.dtypes)} is run by {backend.name}"
        causal = tuple(c for c in backend.limits.causal if c in selection.causal)
        if not causal:
            return (f"the selection's causal modes are not among {backend.name}'s "
                    f"({backend.limits.describe_causal()})")
        if caps.head_dims == ():
            return f"{backend.name} runs no head dim from 1 to 256"
        limits = replace(backend.limits, causal=causal, head_dims=caps.head_dims)
        strategy = fst.ragged_problems(layout, dtypes, limits, backend.features, backend.page_sizes,
                                       backend.splits, DEFAULT_TILE, max_seq=longest_sequence(selection))
        if selection.shapes is None:
            return strategy
        return budgeted(strategy, fst.batch_signature, fst.revalued, selection.shapes, selection.seed)

    return problems
