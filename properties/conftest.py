"""The property suite: every property of fa_verify.properties against every selected backend.

    python3 -m pytest properties                         # every available backend, ci profile
    python3 -m pytest properties --fa-backend fa2-cpu --fa-profile thorough
    python3 -m pytest properties --fa-backend mymodule:attention   # a callable-protocol function

Options and fixtures come from the fa_verify pytest plugin (fa_verify/pytest_plugin.py). Each
test is named test_<property>; a known deviation of a backend is an expected failure, strict
where the ci profile's examples always show it (if it stops failing, the table is out of date).
"""

import pytest

LSE_ZERO = "torch's CPU flash kernel returns LSE 0, not -inf, for fully masked rows"
#: (backend, property) -> (why it fails, strict). Findings about third-party code, kept visible.
KNOWN_DEVIATIONS = {
    ("torch-sdpa-flash-cpu", "lse_agreement"): (LSE_ZERO, True),  # an edge case has such rows
    ("torch-sdpa-flash-cpu", "fully_masked_rows"): (LSE_ZERO, True),
    # only key chunks that some causal rows cannot see show it; not every search draws one
    ("torch-sdpa-flash-cpu", "merge_law"): (LSE_ZERO + ": merging weighs their output 0 as a state", False),
    # Ours, by design of the "finite" rule: a softcap flattens P, so over V near fp16's maximum
    # an fp16 P·V accumulator overflows; every honest implementation of that precision model
    # overflows too (the verdict says so), yet an overflow is never passed. Not every search draws it.
    ("naive-same-precision", "variant_agreement"): (
        "fp16 P·V accumulation overflows on fp16-extreme V under a binding softcap, as its precision model does",
        False),
}


def pytest_collection_modifyitems(items):
    for item in items:
        backend = getattr(item, "callspec", None) and item.callspec.params.get("fa_backend")
        prop = item.originalname.removeprefix("test_")
        known = backend is not None and KNOWN_DEVIATIONS.get((backend.name, prop))
        if known:
            item.add_marker(pytest.mark.xfail(reason=known[0], strict=known[1]))
