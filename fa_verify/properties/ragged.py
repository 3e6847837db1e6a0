"""Properties of ragged batches (varlen and paged KV, fa_verify.ragged), each reporting the
sequence where it fails:

  * ragged_agreement: every sequence's output and LSE agree with the oracle under the error
    model (`check_attention` per sequence), LSE read in the layout's own shape ([H, total_q]
    varlen, [B, H, Nq] paged);
  * sequence_alone: each sequence run alone gives what it gives in the batch: bitwise where the
    target claims batch invariance, else within the error model (bound of each run);
  * sequence_independence: new values in the other sequences (same lengths) leave a sequence
    bitwise unchanged;
  * paged_contiguous: a paged target agrees with its varlen twin (`Backend.contiguous`, the
    same kernel taking packed K/V) on the same sequences, within the error model;
  * page_placement: the same pages under a freshly shuffled block table (and other entries past
    each sequence's pages) give bitwise the same output;
  * unused_cache: the cache slots no sequence uses (past each cache_seqlens, unused pages) set
    to NaN or to 0 give bitwise the same output;
  * split_invariance: num_splits = k, 2 and 0 (auto) agree with num_splits = 1 within the error
    model (whose rescale count includes one split-KV combine);
  * unwritten_rows: a target writing into sentinel-filled buffers writes every output row.
"""

from __future__ import annotations

import functools

import numpy as np

from fa_verify.error_model import error_bound
from fa_verify.honest_ensemble import ensemble_errors
from fa_verify.null_model import batch_guard, guard, null_outputs
from fa_verify.oracle import reference
from fa_verify.oracle.ragged import ragged_error_bound, reference_ragged
from fa_verify.properties._compare import differing, exceeding
from fa_verify.properties._result import PropertyResult, failed, not_applicable, passed
from fa_verify.properties.independence import fresh_values
from fa_verify.ragged import PageLayout, RaggedProblem
from fa_verify.verdict import check_attention


def _bitwise(problem: RaggedProblem, b: int, first, second) -> str | None:
    """Where two runs' (out, lse) of sequence b (each [1, H, Nq_b(, D)]) first differ, or None."""
    for label, got, want in (("O", second[0], first[0]), ("LSE", second[1], first[1])):
        mismatch = None if got is None or want is None else differing(got, want)
        if mismatch is not None:
            return f"{problem.part_label(b)}: {mismatch.describe(label)} (index in the sequence's [1, H, Nq(, D)])"
    return None


def _modelled(problem: RaggedProblem, b: int, first, second, precision) -> tuple[str | None, float]:
    """Two runs of sequence b within the sum of their error bounds (twice the bound):
    (where they are not, or None; the worst ratio)."""
    bound = _bound(problem.sequences[b], precision)
    worst = 0.0
    for label, got, want, tolerance in (("O", second[0], first[0], bound.out), ("LSE", second[1], first[1], bound.lse)):
        if got is None or want is None:
            continue
        mismatch, ratio = exceeding(got, want, 2 * tolerance)
        worst = max(worst, ratio)
        if mismatch is not None:
            return f"{problem.part_label(b)}: {mismatch.describe(label)}", worst
    return None, worst


@functools.lru_cache(maxsize=16)
def _bound(seq, precision):
    """The error-model bound of a sequence (cached: comparisons of several runs share it)."""
    return error_bound(seq, precision, reference(seq))


def _identical(name: str, what: str, problem: RaggedProblem, first, second) -> PropertyResult:
    """Two runs in the layout's shapes bitwise identical, sequence by sequence."""
    for b, pair in enumerate(zip(problem.split(*first), problem.split(*second))):
        found = _bitwise(problem, b, *pair)
        if found:
            return failed(name, problem, f"{what}: {found}", part=b)
    return passed(name, problem, note="" if first[1] is not None else "no LSE returned: only the output was checked")


def check_ragged_agreement(backend, problem: RaggedProblem) -> PropertyResult:
    """Every sequence's output (and LSE, in the layout's shape) agrees with the oracle under the error model."""
    out, lse = backend.run(problem)
    precision = backend.precision(problem.dtype)
    ref = reference_ragged(problem)
    bound = ragged_error_bound(problem, precision, ref)
    verdicts, guards, worst = [], [], 0.0
    for b, ((seq_out, seq_lse), seq, seq_ref, seq_bound) in enumerate(
            zip(problem.split(out, lse), problem.sequences, ref.sequences, bound.sequences)):
        ensemble = ensemble_errors(seq, precision, seq_ref, seq_bound)
        verdict = check_attention(seq_out, seq, lse=seq_lse, precision=precision, reference=seq_ref, bound=seq_bound,
                                  ensemble=ensemble)
        verdicts.append(verdict)
        worst = max(worst, verdict.bound_ratio if np.isfinite(verdict.bound_ratio) else 0.0,
                    verdict.lse_bound_ratio or 0.0)
        if not verdict.passed:
            return failed("ragged_agreement", problem,
                          f"{problem.part_label(b)}, LSE read as {problem.lse_label}: {verdict.message()}",
                          verdict.bound_ratio, verdicts, part=b, verdict_parts=range(len(verdicts)))
        guards.append(guard(null_outputs(seq, seq_ref, precision.output),
                            lambda null, seq=seq, seq_ref=seq_ref, seq_bound=seq_bound, ensemble=ensemble:
                            check_attention(null.out, seq, precision=precision, reference=seq_ref, bound=seq_bound,
                                            ensemble=ensemble).passed))
    note = "" if lse is not None else "no LSE returned: only the output was checked"
    return passed("ragged_agreement", problem, note=note, worst_ratio=worst, verdicts=verdicts,
                  guard=batch_guard(guards), verdict_parts=range(len(verdicts)))


def _alone(problem: RaggedProblem, b: int) -> RaggedProblem:
    seq = problem.sequences[b]
    pages = PageLayout.contiguous([seq.nk], problem.pages.page_size) if problem.layout == "paged" else None
    return problem.replace(sequences=(seq,), pages=pages)


def check_sequence_alone(backend, problem: RaggedProblem) -> PropertyResult:
    """Each sequence run alone gives what it gives in the batch (bitwise if the target claims batch invariance)."""
    if problem.batch == 1:
        return not_applicable("sequence_alone", problem, "a batch of one sequence")
    in_batch = problem.split(*backend.run(problem))
    precision = backend.precision(problem.dtype)
    worst = 0.0
    for b in range(problem.batch):
        alone = _alone(problem, b)
        first, second = in_batch[b], alone.split(*backend.run(alone))[0]
        if backend.batch_invariant:
            found, how = _bitwise(problem, b, first, second), "bitwise (the target claims batch invariance)"
        else:
            (found, ratio), how = _modelled(problem, b, first, second, precision), "within twice its error bound"
            worst = max(worst, ratio)
        if found:
            return failed("sequence_alone", problem, f"run alone against in the batch, {how}: {found}",
                          None if backend.batch_invariant else worst, part=b)
    return passed("sequence_alone", problem, worst_ratio=None if backend.batch_invariant else worst,
                  note="bitwise (batch invariance claimed)" if backend.batch_invariant else "")


def check_sequence_independence(backend, problem: RaggedProblem, *, seed: int = 0) -> PropertyResult:
    """New values in the other sequences (same lengths) leave a sequence's output bitwise unchanged."""
    if problem.batch == 1:
        return not_applicable("sequence_independence", problem, "a batch of one sequence")
    rng = np.random.default_rng(seed)
    kept = int(rng.integers(problem.batch))
    shared = _shared_keys(problem)  # keys in pages sequences share stay (the cache holds one value)
    changed = tuple(seq if b == kept else
                    seq.replace(q=fresh_values(rng, seq.q, np.ones(1, bool)),
                                k=fresh_values(rng, seq.k, ~shared[b][None, None, :, None]),
                                v=fresh_values(rng, seq.v, ~shared[b][None, None, :, None]))
                    for b, seq in enumerate(problem.sequences))
    derived = problem.replace(sequences=changed)
    found = _bitwise(problem, kept, problem.split(*backend.run(problem))[kept],
                     derived.split(*backend.run(derived))[kept])
    if found:
        return failed("sequence_independence", problem, f"new values in every other sequence changed {found}",
                      part=kept)
    return passed("sequence_independence", problem)


def _shared_keys(problem: RaggedProblem) -> list:
    """Per sequence, boolean [Nk]: its keys in page slots another sequence's keys use too (new
    values there would have to agree between the sequences; the kept one's must not change)."""
    if problem.layout != "paged":
        return [np.zeros(seq.nk, bool) for seq in problem.sequences]

    def slots(b):
        page, slot = problem.pages.key_slots(b, problem.sequences[b].nk)
        return page * problem.pages.page_size + slot

    every = [slots(b) for b in range(problem.batch)]
    return [np.isin(every[b], np.concatenate([s for c, s in enumerate(every) if c != b]))
            for b in range(problem.batch)]


def check_page_placement(backend, problem: RaggedProblem, *, seed: int = 0) -> PropertyResult:
    """The same pages under a freshly shuffled block table give bitwise the same output."""
    if problem.layout != "paged":
        return not_applicable("page_placement", problem, "a varlen problem has no page table")
    moved = problem.as_paged(problem.pages.shuffled(np.random.default_rng(seed), problem.seqlens_k))
    return _identical("page_placement", "the same keys in other pages (a shuffled block table)", problem,
                      backend.run(problem), backend.run(moved))


def check_paged_contiguous(backend, problem: RaggedProblem) -> PropertyResult:
    """A paged target agrees with its varlen twin on the same sequences, within the error model."""
    twin = backend.contiguous
    if problem.layout != "paged" or twin is None:
        return not_applicable("paged_contiguous", problem, "needs a paged target with a varlen twin")
    contiguous = problem.as_varlen()
    reason = twin.supports(contiguous)
    if reason:
        return not_applicable("paged_contiguous", problem, f"{twin.name} cannot run {contiguous.describe()}: {reason}")
    precision = backend.precision(problem.dtype)
    paged, varlen = problem.split(*backend.run(problem)), contiguous.split(*twin.run(contiguous))
    worst = 0.0
    for b in range(problem.batch):
        found, ratio = _modelled(problem, b, varlen[b], paged[b], precision)
        worst = max(worst, ratio)
        if found:
            return failed("paged_contiguous", problem, f"paged against {twin.name} on the same sequences stored "
                          f"contiguously, within twice the error bound: {found}", ratio, part=b)
    return passed("paged_contiguous", problem, worst_ratio=worst)


def check_unused_cache(backend, problem: RaggedProblem) -> PropertyResult:
    """Cache slots no sequence uses (past cache_seqlens, unused pages) as NaN or 0 change nothing."""
    if problem.layout != "paged":
        return not_applicable("unused_cache", problem, "a varlen problem has no cache slots beyond its keys")
    return _identical("unused_cache", "the cache slots no sequence uses (past each cache_seqlens and in unused "
                      "pages) as NaN instead of 0", problem, backend.run(problem.replace(cache_fill=0.0)),
                      backend.run(problem.replace(cache_fill=np.nan)))


def check_split_invariance(backend, problem: RaggedProblem) -> PropertyResult:
    """num_splits = k, 2 and 0 (the kernel's choice) agree with num_splits = 1 within the error model."""
    if not backend.splits:
        return not_applicable("split_invariance", problem, f"{backend.name} takes no num_splits")
    precision = backend.precision(problem.dtype)
    counts = sorted({problem.num_splits, 0, 1, 2})
    runs = {n: problem.split(*backend.run(problem.replace(num_splits=n))) for n in counts}
    worst = 0.0
    for n in (n for n in counts if n != 1):
        for b in range(problem.batch):
            found, ratio = _modelled(problem, b, runs[1][b], runs[n][b], precision)
            worst = max(worst, ratio)
            if found:
                chosen = " (the kernel's choice)" if n == 0 else ""
                return failed("split_invariance", problem, f"num_splits={n}{chosen} against num_splits=1 (no "
                              f"split), within twice the error bound: {found}", ratio, part=b)
    return passed("split_invariance", problem, worst_ratio=worst)


def check_unwritten_rows(backend, problem: RaggedProblem) -> PropertyResult:
    """Every output row is written (the target writes into sentinel-filled buffers)."""
    if not backend.writes_buffers:
        return not_applicable("unwritten_rows", problem,
                              f"{backend.name} returns its output: there is no pre-filled buffer to leave unwritten")
    out, _ = backend.run(problem)
    rows = problem.unwritten_rows(out)
    if not rows:
        return passed("unwritten_rows", problem)
    by_sequence = {}
    for b, i in rows:
        by_sequence.setdefault(b, []).append(i)
    listed = "; ".join(f"{problem.part_label(b)}: rows {_spans(rows_b)}" for b, rows_b in by_sequence.items())
    return failed("unwritten_rows", problem, f"{len(rows)} output rows never written: {listed}", part=rows[0][0])


def _spans(rows: list) -> str:
    """[0, 1, 2, 5] -> '0..2, 5'."""
    spans = []
    for row in rows:
        if spans and row == spans[-1][1] + 1:
            spans[-1][1] = row
        else:
            spans.append([row, row])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in spans)


def no_contiguous_twin(backend) -> str | None:
    return None if backend.contiguous is not None else (
        f"{backend.name} has no varlen twin (Backend.contiguous) to compare with")


def not_split(backend) -> str | None:
    return None if backend.splits else f"{backend.name} takes no num_splits (no split-KV)"


def returns_its_output(backend) -> str | None:
    return None if backend.writes_buffers else (
        f"{backend.name} returns its output: there is no pre-filled buffer to leave unwritten")
