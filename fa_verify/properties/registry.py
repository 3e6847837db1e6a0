"""The properties of the suite, in the order they run, with what each needs: one registry for
every kind of problem (`fa_verify.kinds`); each property declares the kinds it applies to."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from fa_verify.backends import watch
from fa_verify.errors import InvalidArgumentError
from fa_verify.problem import FEATURES
from fa_verify.properties import (
    agreement,
    backward,
    convexity,
    fp8,
    gradient_identities,
    independence,
    masking,
    metamorphic,
    online_softmax,
    padding,
    races,
    ragged,
    rounding,
    sanitizer,
    variants,
)
from fa_verify.properties._result import failed

#: How the failure of a property that saw non-finite outputs begins (`backends.watch`).
NON_FINITE = "non-finite output: "
#: The kinds of ragged batch.
RAGGED = ("varlen", "paged")
#: The kinds of a dense property that also holds on FP8 problems, as it is (FP8Problem's shapes,
#: masking, `replace`, reference, error bound and null outputs: docs/properties.md, "On FP8 problems").
DENSE_AND_FP8 = ("dense", "fp8")


@dataclass(frozen=True)
class Property:
    """A property of the suite: its check function and the problems it is meaningful on."""

    name: str
    check: Callable
    #: the target must return an LSE (otherwise the property is not applicable)
    needs_lse: bool = False
    #: which problems to draw: any, causal only, non-causal only
    masking: str = "any"
    #: the check derives bottom-right causal problems, so the target must run them
    needs_bottom_right: bool = False
    #: draw shapes with enough rows and elements for a statistic
    large: bool = False
    #: also run the fixed edge cases of each kind (`properties.kinds.KINDS`) first: True for
    #: every kind it is about, or the kinds whose edge cases it runs
    edge_cases: bool | tuple = False
    #: why the check derives problems with Nq != Nk from any problem ("" if it does not)
    unequal_seq: str = ""
    #: target -> why the property cannot judge it at all (None: it can), asked before any draw
    target_reason: Callable | None = None
    #: a slow check's cap on the examples of a search, and why (both said in the output)
    max_examples: int | None = None
    max_examples_reason: str = ""
    #: variants (keys of fa_verify.problem.FEATURES) the check is about: not applicable to a
    #: target implementing none of them; its problems use those the target implements
    features: tuple = ()
    #: variants every drawn problem uses (the target must implement them)
    always: tuple = ()
    #: variants (keys of FEATURES) a check about plain problems also holds under: besides plain
    #: problems it draws problems with a subset of those the target implements switched on (a
    #: target implementing none gets plain problems only)
    holds_under: tuple = ()
    #: the kinds of problem it is about (`fa_verify.kinds.KINDS`)
    kinds: tuple = ("dense",)

    @property
    def seeded(self) -> bool:
        """Whether the check draws its own random choices from a `seed` argument."""
        return "seed" in inspect.signature(self.check).parameters

    @property
    def summary(self) -> str:
        return inspect.getdoc(self.check).splitlines()[0]

    def applies_to(self, backend) -> bool:
        """Whether it is about a kind of problem `backend` runs."""
        return bool(set(self.kinds) & set(backend.kinds))

    def __call__(self, backend, problem, seed: int = 0):
        """The check's result; a pass that saw non-finite outputs of finite inputs is a failure
        (`backends.watch`): no relation between two runs makes inf or NaN right."""
        with watch.watching() as nonfinite:
            result = self.check(backend, problem, seed=seed) if self.seeded else self.check(backend, problem)
        if nonfinite and result.applicable and not result.failed:
            return failed(self.name, problem, f"{NON_FINITE}{nonfinite[0]}")
        return result


PROPERTIES = (
    Property("oracle_agreement", agreement.check_oracle_agreement, edge_cases=True),
    Property("lse_agreement", agreement.check_lse_agreement, needs_lse=True, edge_cases=True),
    Property("merge_law", online_softmax.check_merge_law, needs_lse=True,
             unequal_seq="needs key chunks shorter than the queries"),
    Property("convex_hull", convexity.check_convex_hull),
    Property("constant_v", convexity.check_constant_v),
    Property("v_affinity", convexity.check_v_affinity),
    Property("key_permutation", metamorphic.check_key_permutation, masking="non-causal", kinds=DENSE_AND_FP8),
    Property("query_permutation", metamorphic.check_query_permutation, masking="non-causal", kinds=DENSE_AND_FP8),
    Property("score_shift", metamorphic.check_score_shift),
    Property("batch_head_independence", independence.check_batch_head_independence, kinds=DENSE_AND_FP8),
    Property("masked_key_independence", independence.check_masked_key_independence, masking="causal",
             kinds=DENSE_AND_FP8),
    Property("fully_masked_rows", masking.check_fully_masked_rows, masking="causal", needs_bottom_right=True,
             unequal_seq="needs fewer keys than queries (rows that see no key)", kinds=DENSE_AND_FP8),
    Property("nan_padding", padding.check_nan_padding, kinds=DENSE_AND_FP8),
    Property("determinism", independence.check_determinism, kinds=DENSE_AND_FP8),
    Property("reused_buffers", independence.check_reused_buffers, kinds=DENSE_AND_FP8),
    Property("unbiased_rounding", rounding.check_unbiased_rounding, large=True),
    # A backward's dQ atomics race only across key tiles: its edge cases have several.
    Property("races", races.check_races, target_reason=races.not_checkable, max_examples=races.RACE_EXAMPLES,
             max_examples_reason="the race detector checks every memory access of the kernel",
             kinds=("dense", "backward", "fp8"), edge_cases=("backward",)),
    Property("address_sanitizer", sanitizer.check_address_sanitizer, target_reason=sanitizer.not_checkable,
             max_examples=sanitizer.SANITIZER_EXAMPLES,
             max_examples_reason="the kernel's AddressSanitizer build runs several times slower",
             kinds=("dense", "backward", "fp8")),
    Property("variant_agreement", variants.check_variant_agreement, features=tuple(FEATURES)),
    Property("feature_sensitivity", variants.check_feature_sensitivity, features=tuple(FEATURES)),
    Property("wide_window", variants.check_wide_window, features=("window",)),
    Property("softcap_limit", variants.check_softcap_limit, features=("softcap",)),
    Property("window_independence", variants.check_window_independence, features=("window",), always=("window",)),
    # ragged batches (varlen, paged KV, split-KV: fa_verify.ragged)
    Property("ragged_agreement", ragged.check_ragged_agreement, kinds=RAGGED),
    Property("sequence_alone", ragged.check_sequence_alone, kinds=RAGGED),
    Property("sequence_independence", ragged.check_sequence_independence, kinds=RAGGED + ("paged-fp8",)),
    Property("page_placement", ragged.check_page_placement, kinds=("paged", "paged-fp8")),
    Property("paged_contiguous", ragged.check_paged_contiguous, kinds=("paged",),
             target_reason=ragged.no_contiguous_twin),
    Property("unused_cache", ragged.check_unused_cache, kinds=("paged", "paged-fp8")),
    Property("split_invariance", ragged.check_split_invariance, kinds=RAGGED, target_reason=ragged.not_split),
    Property("unwritten_rows", ragged.check_unwritten_rows, kinds=RAGGED, target_reason=ragged.returns_its_output),
    # the backward pass (fa_verify.backward)
    Property("gradient_agreement", backward.check_gradient_agreement, kinds=("backward",), edge_cases=True),
    Property("gradient_variant_agreement", backward.check_gradient_variant_agreement, kinds=("backward",),
             features=tuple(FEATURES)),
    Property("gradient_determinism", backward.check_gradient_determinism, kinds=("backward",)),
    Property("gradient_strided_dout", backward.check_gradient_strided_dout, kinds=("backward",),
             target_reason=backward.given_copies),
    Property("gradient_nan_padding", backward.check_gradient_nan_padding, kinds=("backward",),
             target_reason=backward.not_padded),
    # identities of the backward pass (fa_verify.properties.gradient_identities)
    # (each also drawn with the variants it holds under that the target implements)
    Property("gradient_key_sum", gradient_identities.check_gradient_key_sum, kinds=("backward",),
             holds_under=("window", "alibi", "sinks")),
    Property("gradient_value_sum", gradient_identities.check_gradient_value_sum, kinds=("backward",),
             holds_under=tuple(FEATURES)),
    Property("gradient_gqa_group_sum", gradient_identities.check_gradient_gqa_group_sum, kinds=("backward",),
             holds_under=tuple(FEATURES)),
    Property("gradient_adjoint", gradient_identities.check_gradient_adjoint, kinds=("backward",),
             holds_under=tuple(FEATURES)),
    Property("gradient_linearity", gradient_identities.check_gradient_linearity, kinds=("backward",),
             holds_under=tuple(FEATURES)),
    Property("gradient_key_shift", gradient_identities.check_gradient_key_shift, kinds=("backward",),
             holds_under=("window", "alibi")),
    Property("gradient_permutation", gradient_identities.check_gradient_permutation, kinds=("backward",),
             masking="non-causal", holds_under=("softcap", "sinks")),
    # FP8 inputs with descales (fa_verify.fp8)
    Property("fp8_agreement", fp8.check_fp8_agreement, kinds=("fp8", "paged-fp8"), edge_cases=True),
    Property("descale_sensitivity", fp8.check_descale_sensitivity, kinds=("fp8",), edge_cases=True),
    Property("descale_rescaling", fp8.check_descale_rescaling, kinds=("fp8",)),
    Property("saturation_finite", fp8.check_saturation_finite, kinds=("fp8",)),
    Property("fp8_head_independence", fp8.check_fp8_head_independence, kinds=("fp8",)),
    Property("kv_scale_sensitivity", fp8.check_kv_scale_sensitivity, kinds=("paged-fp8",), edge_cases=True),
)

PROPERTY_NAMES = tuple(p.name for p in PROPERTIES)


def properties_for(backend) -> tuple:
    """The properties about the kinds of problem `backend` runs, in the suite's order."""
    return tuple(p for p in PROPERTIES if p.applies_to(backend))


def get_property(name_or_check) -> Property:
    """A Property by name or by its check function; a Property is returned as it is (one the
    suite's were derived from with dataclasses.replace, e.g. fa_verify.judge's)."""
    if isinstance(name_or_check, Property):
        return name_or_check
    for prop in PROPERTIES:
        if name_or_check in (prop.name, prop.check, prop):
            return prop
    raise InvalidArgumentError(f"property={name_or_check!r} is unknown; properties: {', '.join(PROPERTY_NAMES)}")
