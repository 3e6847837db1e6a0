"""Properties of attention kernels, as plain functions other projects can call.

Every check takes a target — a `fa_verify.backends.Backend` or a function
`run(problem) -> out | (out, lse)` (judged under the lenient "flash" precision model; wrap it
with `as_backend(run, precision=...)` to choose) — and a problem, and returns a
`PropertyResult` (passed / failed with where and by how much / not applicable):

    from fa_verify.properties import check_merge_law
    check_merge_law(my_run, problem, seed=3).raise_for_failure()

`search_property` runs one property over Hypothesis-drawn problems and shrinks a failure to a
minimal counterexample with a reproducer; `PROPERTIES` lists the suite, for every kind of
problem (dense, and the ragged batches of `fa_verify.ragged`: varlen, paged KV), each property
naming the kinds it is about; `properties_for(backend)` those about what a target runs.
"""

from fa_verify.properties._result import (
    FAILED,
    NOT_APPLICABLE,
    PASSED,
    UNINFORMATIVE,
    PropertyFailure,
    PropertyResult,
)
from fa_verify.properties._subject import as_backend
from fa_verify.properties.agreement import check_lse_agreement, check_oracle_agreement
from fa_verify.properties.convexity import check_constant_v, check_convex_hull, check_v_affinity
from fa_verify.properties.independence import (
    check_batch_head_independence,
    check_determinism,
    check_reused_buffers,
    check_masked_key_independence,
)
from fa_verify.properties.masking import check_fully_masked_rows
from fa_verify.properties.metamorphic import (
    check_key_permutation,
    check_query_permutation,
    check_score_shift,
)
from fa_verify.properties.online_softmax import check_merge_law
from fa_verify.properties.padding import PaddedInputs, check_nan_padding, pad_inputs, run_padded
from fa_verify.properties.races import check_races
from fa_verify.properties.sanitizer import check_address_sanitizer
from fa_verify.properties.registry import (
    PROPERTIES,
    PROPERTY_NAMES,
    Property,
    get_property,
    properties_for,
)
from fa_verify.properties.rounding import check_unbiased_rounding
from fa_verify.properties.variants import (
    check_feature_sensitivity,
    check_softcap_limit,
    check_variant_agreement,
    check_wide_window,
    check_window_independence,
)
from fa_verify.properties.draw import EDGE_CASES
from fa_verify.properties.search import PropertyOutcome, search_property
from fa_verify.properties.selection import Selection

__all__ = [
    "EDGE_CASES",
    "FAILED",
    "NOT_APPLICABLE",
    "PASSED",
    "PROPERTIES",
    "PROPERTY_NAMES",
    "PaddedInputs",
    "Property",
    "PropertyFailure",
    "PropertyOutcome",
    "PropertyResult",
    "Selection",
    "UNINFORMATIVE",
    "as_backend",
    "check_batch_head_independence",
    "check_constant_v",
    "check_convex_hull",
    "check_determinism",
    "check_reused_buffers",
    "check_fully_masked_rows",
    "check_key_permutation",
    "check_lse_agreement",
    "check_masked_key_independence",
    "check_merge_law",
    "check_nan_padding",
    "check_address_sanitizer",
    "check_oracle_agreement",
    "check_query_permutation",
    "check_races",
    "check_score_shift",
    "check_unbiased_rounding",
    "check_v_affinity",
    "check_variant_agreement",
    "check_feature_sensitivity",
    "check_wide_window",
    "check_softcap_limit",
    "check_window_independence",
    "get_property",
    "properties_for",
    "pad_inputs",
    "run_padded",
    "search_property",
]
