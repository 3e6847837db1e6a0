"""The online-softmax state law: per-chunk (O, LSE) states merged by LSE equal the whole.

Keys are split into chunks at random points; each chunk is run as its own problem; the states
are merged in float64, in a random order:
    LSE = log sum_c exp(LSE_c),   O = sum_c exp(LSE_c - LSE) O_c.
The result is compared with the reference of the whole problem.

Causal problems: row i sees keys j <= i + o (o = Nk - Nq bottom-right, 0 top-left), so for a
chunk [a, b) the rows split into three runs: rows that see none of it (they take no state from
it: LSE -inf, weight 0), rows that see a prefix, and rows that see all of it. The prefix rows
[i0, i1) = [max(0, a - o), min(Nq, b - o)) against keys [a, i1 + o) are a bottom-right causal
problem (square when i0 = a - o, so it also fits a top-left-only target); the remaining rows
are a non-causal problem over [a, b). For bottom-right problems the prefix piece starts at row 0
instead, which gives it fully masked rows (still bottom-right: i0 does not enter the offset):
the law then needs their state to be (0, -inf), i.e. weight 0.

Tolerance, from the chunks' own error-model bounds: with |O_c - O*_c| <= B_c and
|LSE_c - LSE*_c| <= F_c, F = max_c F_c, the computed weights are w_c exp(f) with |f| <= 2F and
sum to 1, so
    |O - O*| <= sum_c w_c [B_c + expm1(2F) (|O_c| + B_c)],    |LSE - LSE*| <= F,
plus the whole reference's own bound and float64 slack. A pass is guarded: where a trivial
(O, LSE) in place of the merged one passes the same tolerance, the example is uninformative
(`fa_verify.null_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.error_model import error_bound
from fa_verify.null_model import guard, null_outputs
from fa_verify.oracle import reference
from fa_verify.properties._compare import exceeding
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties._subject import as_backend, unsupported

NAME = "merge_law"
#: Relative slack for the float64 merge itself (a handful of roundings).
_MERGE_SLACK = 64 * 2.0 ** -53


@dataclass(frozen=True)
class Piece:
    """Rows `rows` of the queries against keys `keys`, run as one problem."""

    rows: slice
    keys: slice
    causal: bool
    alignment: str = "bottom-right"

    def problem(self, whole):
        q, k, v = (np.ascontiguousarray(x) for x in
                   (whole.q[:, :, self.rows], whole.k[:, :, self.keys], whole.v[:, :, self.keys]))
        return whole.replace(q=q, k=k, v=v, causal=self.causal, causal_alignment=self.alignment)

    def __str__(self) -> str:
        mask = f"causal {self.alignment}" if self.causal else "non-causal"
        return f"rows {self.rows.start}:{self.rows.stop} x keys {self.keys.start}:{self.keys.stop} {mask}"


def chunk_pieces(problem, a: int, b: int) -> list[Piece]:
    """The pieces that give every row its state over keys [a, b) (see the module doc)."""
    nq = problem.nq
    if not problem.causal:
        return [Piece(slice(0, nq), slice(a, b), False)]
    o = problem.nk - nq if problem.causal_alignment == "bottom-right" else 0
    i0 = 0 if problem.causal_alignment == "bottom-right" else max(0, a - o)
    i1 = min(nq, b - o)
    pieces = []
    if i1 > max(0, a - o):
        square = i1 - i0 == i1 + o - a
        pieces.append(Piece(slice(i0, i1), slice(a, i1 + o), True,
                            problem.causal_alignment if square else "bottom-right"))
    if max(0, b - o) < nq:
        pieces.append(Piece(slice(max(0, b - o), nq), slice(a, b), False))
    return pieces


def merge_states(states):
    """Merge (O, LSE, bound on O, bound on LSE) states in the order given, in float64.

    Returns (O, LSE, tolerance on O, tolerance on LSE) with the tolerances of the module doc
    (rows that no state covers: O 0, LSE -inf, tolerance 0)."""
    merged_lse = np.full(states[0][1].shape, -np.inf)
    for _, lse, _, _ in states:
        merged_lse = np.logaddexp(merged_lse, lse)
    live = np.isfinite(merged_lse)
    base = np.where(live, merged_lse, 0.0)
    f = np.max([np.where(np.isfinite(lse), bl, 0.0) for _, lse, _, bl in states], axis=0)
    merged, tol_out = np.zeros(states[0][0].shape), np.zeros(states[0][0].shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for o, lse, bo, _ in states:
            w = np.where(live & np.isfinite(lse), np.exp(lse - base), 0.0)[..., None]
            merged += w * o
            # where w = 0 nothing is contributed, even if the bound there is infinite (0 * inf)
            tol_out += np.where(w > 0, w * (bo + np.expm1(2 * f)[..., None] * (np.abs(o) + bo)
                                            + _MERGE_SLACK * np.abs(o)), 0.0)
    return merged, merged_lse, tol_out, f + _MERGE_SLACK * np.abs(base)


def check_merge_law(backend, problem, *, seed: int = 0) -> PropertyResult:
    """Split the keys at random points, run the chunks, merge their (O, LSE) by LSE in a random
    order, and compare with the whole problem's reference."""
    backend = as_backend(backend)
    if problem.nk < 2:
        return not_applicable(NAME, problem, "Nk=1: a single key cannot be split")
    # Cut where the declared limits allow: at multiples of the sequence multiple, chunks no shorter
    # than the shortest allowed length (both 1 when nothing is declared).
    step, limits = backend.limits.seq_multiple, backend.limits
    places = np.arange(limits.seq_lo, problem.nk - limits.seq_lo + 1, step)
    if not len(places):
        return not_applicable(NAME, problem, f"Nk={problem.nk} cannot be split into key chunks within the "
                                             f"declared limits ({limits.describe()})")
    rng = np.random.default_rng(seed)
    n_chunks = int(rng.integers(2, min(4, len(places) + 1) + 1))
    cuts = [0, *sorted(int(c) for c in rng.choice(places, n_chunks - 1, replace=False)), problem.nk]
    chunks = [chunk_pieces(problem, a, b) for a, b in zip(cuts, cuts[1:])]
    subproblems = [[piece.problem(problem) for piece in pieces] for pieces in chunks]
    reason = unsupported(backend, *(p for ps in subproblems for p in ps))
    if reason:
        return not_applicable(NAME, problem, reason)

    precision = backend.precision(problem.dtype)
    B, H, Nq, D = problem.out_shape
    states = []  # per chunk: O, LSE, bound on O, bound on LSE (rows without a piece: 0, -inf, 0, 0)
    for pieces, subs in zip(chunks, subproblems):
        o, lse = np.zeros((B, H, Nq, D)), np.full((B, H, Nq), -np.inf)
        bo, bl = np.zeros((B, H, Nq, D)), np.zeros((B, H, Nq))
        for piece, sub in zip(pieces, subs):
            out_p, lse_p = backend.run(sub)
            if lse_p is None:
                return not_applicable(NAME, problem, f"{backend.name} returns no LSE")
            ref_p = reference(sub)
            bound_p = error_bound(sub, precision, ref_p)
            o[:, :, piece.rows] = out_p.astype(np.float64)
            lse[:, :, piece.rows] = lse_p
            bo[:, :, piece.rows], bl[:, :, piece.rows] = bound_p.out, bound_p.lse
        states.append((o, lse, bo, bl))

    order = rng.permutation(n_chunks)
    merged, merged_lse, tol_out, tol_lse = merge_states([states[c] for c in order])
    whole = reference(problem)

    def mismatches(out, lse):
        return (exceeding(out, whole.out, tol_out + whole.out_bound),
                exceeding(lse, whole.lse, tol_lse + whole.lse_bound))

    (out_bad, out_worst), (lse_bad, lse_worst) = mismatches(merged, merged_lse)
    worst = max(out_worst, lse_worst)
    if out_bad is None and lse_bad is None:
        nulls = null_outputs(problem, whole, precision.output)
        null_guard = guard(nulls, lambda null: all(m is None for m, _ in mismatches(null.out, null.lse)),
                           judged=("out", "lse"))
        return passed(NAME, problem, worst_ratio=worst, guard=null_guard)
    split = "; ".join(f"chunk {a}:{b} = " + " + ".join(map(str, ps)) if ps else f"chunk {a}:{b} = no rows"
                      for (a, b), ps in zip(zip(cuts, cuts[1:]), chunks))
    found = [m.describe(what) for m, what in ((out_bad, "merged O vs whole"), (lse_bad, "merged LSE vs whole"))
             if m is not None]
    detail = (f"states of {n_chunks} key chunks merged in order {[int(c) for c in order]} differ from "
              f"the whole problem's reference ({split}): " + "; ".join(found))
    return failed(NAME, problem, detail, worst)
