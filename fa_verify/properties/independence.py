"""What an output must not depend on at all: identical results required (bitwise, with +0 = -0).

  * batch/head independence: changing every other batch's and head's q, k, v leaves the
    output and LSE of one (batch, query head) untouched;
  * causal independence from masked keys: changing the keys and values that a row cannot see
    leaves its output and LSE untouched;
  * determinism: the same inputs twice, each time in fresh allocations, give the same outputs
    (outputs are fresh too: every run allocates its own, NaN-filled where the target takes
    buffers, so no run can inherit the previous one's answer);
  * reused buffers: new contents in the buffers of the previous call give the new answer. The
    problem runs, then again with V negated: a callable target gets the second call's inputs in
    the first call's buffers (`CallableBackend` keeps them), so an answer cached on their
    addresses, or on the shape, or left from the last call, shows. Negation is exact and every
    rounding is symmetric, so O must come back exactly negated and the LSE identical.

Bitwise is fair here: the shapes do not change (so neither do tile counts nor a split-KV
kernel's split heuristic, which depends on B*H and Nk), the inputs the checked rows read are
the same and in the same positions, and a masked key contributes exp(-inf) = 0 exactly, so
the order and values of everything those rows add up are unchanged.
"""

from __future__ import annotations

import numpy as np

from fa_verify.dtypes import finfo, round_to
from fa_verify.properties._compare import differing
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported


def judge_identical(name: str, what: str, problem, first, second, rows=None) -> PropertyResult:
    """Compare two (out, lse) runs for identical values at `rows` (boolean [B,H,Nq]; all if None)."""
    (out, lse), (out2, lse2) = first, second
    out_rows = None if rows is None else rows[..., None]
    found = []
    for label, got, want, where in (("O", out2, out, out_rows), ("LSE", lse2, lse, rows)):
        mismatch = None if got is None or want is None else differing(got, want, where)
        if mismatch is not None:
            found.append(mismatch.describe(label))
    if found:
        return failed(name, problem, f"{what}: " + "; ".join(found))
    note = "no LSE returned: only the output was checked" if lse is None else ""
    return passed(name, problem, note=note)


def fresh_values(rng, x: np.ndarray, where: np.ndarray, magnitude: float = 1.0) -> np.ndarray:
    """x with the elements selected by `where` (broadcast to x) replaced by new random values of
    about `magnitude` times x's largest, rounded to x's dtype and kept far from overflow."""
    x64 = x.astype(np.float64)
    info = finfo(x.dtype)
    size = min(magnitude * max(float(np.abs(x64).max()), 1.0), float(info.max) / 8)
    new = round_to(rng.standard_normal(x.shape) * size, x.dtype).astype(np.float64)
    return round_to(np.where(np.broadcast_to(where, x.shape), new, x64), x.dtype)


def check_batch_head_independence(backend, problem, *, seed: int = 0) -> PropertyResult:
    """The output of one (batch, query head) ignores every other batch's and head's inputs."""
    backend = as_backend(backend)
    B, H = problem.batch, problem.heads
    if B * H == 1:
        return not_applicable("batch_head_independence", problem, "B=H=1: no other batch or head")
    rng = np.random.default_rng(seed)
    b0, h0 = int(rng.integers(B)), int(rng.integers(H))
    g0 = h0 // problem.group_size
    other_q = np.ones((B, H, 1, 1), bool)
    other_q[b0, h0] = False
    other_kv = np.ones((B, problem.kv_heads, 1, 1), bool)
    other_kv[b0, g0] = False
    derived = problem.replace(q=fresh_values(rng, problem.q, other_q),
                              k=fresh_values(rng, problem.k, other_kv),
                              v=fresh_values(rng, problem.v, other_kv))
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable("batch_head_independence", problem, reason)
    rows = np.zeros(problem.out_shape[:3], bool)
    rows[b0, h0] = True
    return judge_identical("batch_head_independence",
                           f"changing the inputs of every other batch and head changed batch {b0}, "
                           f"query head {h0} (kv head {g0})",
                           problem, backend.run(problem), backend.run(derived), rows)


def check_masked_key_independence(backend, problem, *, seed: int = 0) -> PropertyResult:
    """Causal: changing keys and values >= j0 leaves every row that sees only keys < j0 untouched."""
    backend = as_backend(backend)
    if not problem.causal:
        return not_applicable("masked_key_independence", problem, "non-causal: no key is masked")
    limit = problem.key_limit()
    if limit.min() >= problem.nk:
        return not_applicable("masked_key_independence", problem, "every row attends every key")
    rng = np.random.default_rng(seed)
    j0 = int(rng.integers(limit.min(), problem.nk))
    changed = (np.arange(problem.nk) >= j0)[None, None, :, None]
    # Large new keys: a kernel that lets masked scores into its running max shows it.
    derived = problem.replace(k=fresh_values(rng, problem.k, changed, magnitude=8.0),
                              v=fresh_values(rng, problem.v, changed))
    reason = unsupported(backend, derived)
    if reason:
        return not_applicable("masked_key_independence", problem, reason)
    rows = np.broadcast_to(limit <= j0, problem.out_shape[:3])
    return judge_identical("masked_key_independence",
                           f"changing keys/values {j0}..{problem.nk - 1} changed rows that cannot see "
                           f"them (rows attending at most {j0} keys)",
                           problem, backend.run(problem), backend.run(derived), rows)


def fresh_copy(problem):
    """The problem with q, k, v in new allocations (a target that caches by address sees new inputs)."""
    return problem.replace(q=problem.q.copy(), k=problem.k.copy(), v=problem.v.copy())


def check_determinism(backend, problem) -> PropertyResult:
    """Running the same problem twice, on fresh copies of the inputs, gives identical outputs and LSE."""
    backend = as_backend(backend)
    first, second = fresh_copy(problem), fresh_copy(problem)  # both alive: different addresses
    return judge_identical("determinism", "two runs of the same problem, on fresh copies of the inputs, differ",
                           problem, backend.run(first), backend.run(second))


def check_reused_buffers(backend, problem) -> PropertyResult:
    """The problem, then the problem with V negated in the same buffers: O exactly negated, the same LSE."""
    backend = as_backend(backend)
    out, lse = backend.run(problem)
    return judge_identical("reused_buffers", "V negated in the buffers of the previous call did not negate O "
                           "exactly (or moved the LSE): an answer kept from the previous call?",
                           problem, (-out, lse), backend.run(problem.replace(v=-problem.v)))
