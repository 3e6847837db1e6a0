"""A shape budget for compiled targets: every property draws from at most N problem signatures.

A JIT-compiled target (a `jax.jit` function, `torch.compile`d flex_attention) compiles once per
new signature: B, H, Hkv, Nq, Nk, D, the dtype, causal and its alignment, and the scale where it
is a compile-time constant (a static argument of `jax.jit`). With `--shapes N` each property
first draws N signatures from its own problem strategy (so within the declared limits, with the
strategy's favoured edge values), in one short Hypothesis run seeded by the search's seed; the
search then picks one of them per example with `st.sampled_from` and draws fresh values
(distribution, score profile, seed) for it. Properties whose strategies agree draw the same
signatures, so a target's compile cache serves them all. The fixed edge cases keep their
shapes. The problems some properties derive (merge_law's key chunks, fully_masked_rows' shorter
keys) are chosen by the property's seed: under a budget it is fixed, so that each budgeted shape
derives the same ones. `budget_note` says what the budget meant in each property's result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from fa_verify import strategies as fst
from fa_verify.profiles import RELAXED_HEALTH_CHECKS

#: Draws per budgeted signature when collecting candidates: enough for N distinct ones, and to
#: pick them at random among more than Hypothesis' first (simplest) draws.
_CANDIDATES_PER_SHAPE = 8


@dataclass(frozen=True)
class Signature:
    """What makes a compiled target compile again: all of a problem but its values."""

    shape: fst.Shape
    dtype: str
    causal: bool
    alignment: str
    scale: float | None

    def problems(self):
        """Problems of this signature, values drawn afresh."""
        return fst.problems(shapes=st.just(self.shape), dtypes=st.just(self.dtype),
                            causal=st.just((self.causal, self.alignment)), scale=st.just(self.scale))


def draw_signatures(shapes, dtypes, modes, budget: int, seed: int | None) -> list[Signature]:
    """`budget` distinct signatures of `shapes`, `dtypes` (strategies), `modes` ((causal,
    alignment) pairs) and `fst.scales()`, fewer if they hold fewer: `budget *
    _CANDIDATES_PER_SHAPE` Hypothesis draws, then a seeded random pick among the distinct ones,
    in the order drawn."""
    candidates = {}
    signatures = st.builds(lambda shape, dtype, mode, scale: Signature(shape, dtype, *mode, scale),
                           shapes, dtypes, st.sampled_from(modes), fst.scales())

    @given(signatures)
    def collect(signature):
        candidates.setdefault(signature, None)

    collect = settings(max_examples=budget * _CANDIDATES_PER_SHAPE, database=None, deadline=None,
                       phases=(Phase.generate,), suppress_health_check=RELAXED_HEALTH_CHECKS)(collect)
    if seed is not None:
        collect = hypothesis_seed(seed)(collect)
    collect()
    found = list(candidates)
    chosen = sorted(random.Random(seed).sample(range(len(found)), min(budget, len(found))))
    return [found[i] for i in chosen]


def budgeted_problems(shapes, dtypes, modes, budget: int, seed: int | None):
    """Problems whose signatures are `budget` ones drawn once (`draw_signatures`)."""
    return st.sampled_from(draw_signatures(shapes, dtypes, modes, budget, seed)).flatmap(Signature.problems)


#: Properties that also run problems they derive from the drawn one, of other shapes, chosen
#: by the property's seed.
DERIVED_SHAPES = {
    "merge_law": "its key chunks",
    "fully_masked_rows": "its shorter key sets",
}


def property_seeds(prop, budget: int | None):
    """The strategy of `prop`'s own seed: any, but under a budget one seed (0) for the properties
    that derive other shapes with it, so that each budgeted shape derives the same ones."""
    if not prop.seeded:
        return st.just(0)
    return st.just(0) if budget is not None and prop.name in DERIVED_SHAPES else fst.seeds()


def budget_note(prop, budget: int) -> str:
    """What --shapes N means for this property's (a Property's) results."""
    extra = [f"{what}: one choice per shape (property seed 0)" for name, what in DERIVED_SHAPES.items()
             if name == prop.name]
    if prop.edge_cases:
        extra.insert(0, "the fixed edge cases keep theirs")
    return f"--shapes {budget}: drawn from {budget} shapes" + "".join(f"; {e}" for e in extra)


def budgeted(problems, signature, revalued, budget: int, seed: int | None):
    """Problems of `budget` signatures drawn once from the strategy `problems` (`signature(p)`:
    all of p but its values), each example a drawn one with values afresh (`revalued(p, seed)`):
    the shape budget of a kind whose strategy draws whole problems (ragged batches)."""
    candidates = {}

    @given(problems)
    def collect(problem):
        candidates.setdefault(signature(problem), problem)

    collect = settings(max_examples=budget * _CANDIDATES_PER_SHAPE, database=None, deadline=None,
                       phases=(Phase.generate,), suppress_health_check=RELAXED_HEALTH_CHECKS)(collect)
    if seed is not None:
        collect = hypothesis_seed(seed)(collect)
    collect()
    found = list(candidates.values())
    chosen = [found[i] for i in sorted(random.Random(seed).sample(range(len(found)), min(budget, len(found))))]
    return st.sampled_from(chosen).flatmap(lambda problem: fst.seeds().map(lambda s: revalued(problem, s)))
