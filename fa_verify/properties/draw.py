"""What to draw for a property on a target: the problems it is meaningful on and the target runs.

A target's dtypes, head dims and causal alignments are probed once through `supports` (and one
tiny run says whether it returns an LSE), with tiny problems of the kind it runs; the dense
strategy (`problem_strategy`; the ragged one is `fa_verify.properties.draw_ragged`'s) then draws
only such problems, so that
a kernel with a few instantiated head dims is not drowned in rejected examples. A target's
declared `Limits` shape the probe's problems, the strategy (drawn within them) and the edge
cases (moved to the nearest allowed shape).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import weakref
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from fa_verify import strategies as fst
from fa_verify.backends import Backend
from fa_verify.dtypes import DTYPE_NAMES
from fa_verify.errors import BackendOutputError, FaVerifyError, InvalidArgumentError, KernelRunError
from fa_verify.limits import ANY_HEAD_DIM_V, Limits
from fa_verify.problem import CAUSAL_ALIGNMENTS, FEATURES, AttentionProblem
from fa_verify.properties.registry import Property
from fa_verify.properties.selection import Selection
from fa_verify.properties.shape_budget import budgeted_problems

#: Edge cases run before the random search by the properties that ask for them, so that the
#: classes of bug they expose are always looked for: (B, H, Hkv, Nq, Nk, D) and a distribution.
EDGE_CASES = (
    ((1, 1, 1, 1, 1, 8), "normal"),               # a single query and key
    ((1, 2, 1, 5, 2, 16), "normal"),              # Nq > Nk: fully masked rows under bottom-right
    ((1, 2, 2, 3, 17, 16), "normal"),             # Nq < Nk
    ((2, 4, 2, 65, 63, 32), "fa3_outliers"),      # tile +- 1, GQA, outliers
    ((1, 3, 1, 13, 31, 96), "large_logits"),      # primes, MQA, D = 96, logits in the hundreds
    # 128 - 1 queries, 128 + 1 keys: the row max rises by 89 logits (beyond exp's fp32 range)
    # at key 64 and again at key 128, alone in the last tile of 64 or 128 keys
    ((1, 2, 1, 127, 129, 16), "normal+rise(step=89.0,every=64,start=64,count=2)"),
    # Past the first query tile and the first key tile, with small rises (the state rescaled by
    # about exp(-2), far from 0, so a wrong factor shows): 129 = 4 x 32 + 1 = 2 x 64 + 1 = 128 + 1
    # queries and keys, the max rising by 2 logits at keys 32, 64, 96 and 128 (tile starts) ...
    ((1, 1, 1, 129, 129, 16), "normal+rise(step=2.0,every=32,start=32,count=4)"),
    # ... and 96 = 3 x 32 queries, 159 = 5 x 32 - 1 keys, where the max rises by itself
    ((1, 2, 1, 96, 159, 16), "normal"),
    # 2049 keys, 3 rows (seed 0: q = 0 and V constant along the keys): an fp16/bf16 P·V
    # accumulator's error grows with every key
    ((1, 1, 1, 3, 2049, 16), "constant_rows"),
    # D_v != D (B, H, Hkv, Nq, Nk, D, D_v), for targets that declare it (--head-dims-v): FA3's
    # 192/128 across two key tiles of 32, and MLA decode's 576/512 with a few queries and keys
    ((1, 2, 1, 5, 40, 192, 128), "normal"),
    ((1, 2, 1, 2, 9, 576, 512), "normal"),
)
#: Properties that draw a fixed share of deep and long-key problems (fst.depth_shares): the
#: agreement ones, which judge every element of the output (or LSE) against the oracle.
DEPTH_PROPERTIES = ("oracle_agreement", "lse_agreement")
#: Head dims probed for support (a backend that runs all of them runs any D).
_PROBED_HEAD_DIMS = range(1, 257)
#: Head dims D probed with each declared D_v != D (--head-dims-v): those above, and MLA's 576.
_PROBED_PAIRED_HEAD_DIMS = (*_PROBED_HEAD_DIMS, 576)


@dataclass(frozen=True)
class Capabilities:
    """What a target runs, probed through `supports` (and one tiny run for the LSE)."""

    name: str
    dtypes: tuple
    #: None: any head dim
    head_dims: tuple | None
    alignments: tuple
    returns_lse: bool
    limits: Limits = Limits()
    #: the variants it runs (keys of fa_verify.problem.FEATURES)
    features: tuple = ()
    #: D_v != D: None (D_v = D only), ANY_HEAD_DIM_V, or the (D, D_v) pairs with D_v != D it runs
    head_dims_v: tuple | str | None = None


_CAPABILITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tiny(limits: Limits, dtype, d=None, longer_keys=False, causal=None, dv=None, **kwargs) -> AttentionProblem:
    """The smallest problem within `limits` (one more tile of keys with longer_keys; v's head dim
    `dv`, default D); causal unless limits allow non-causal ones, or as given."""
    shape = dataclasses.replace(limits.smallest_shape(d), head_dim_v=dv)
    if longer_keys:
        shape = fst.Shape(1, shape.heads, shape.kv_heads, shape.nq, shape.nk + max(limits.seq_multiple, 1),
                          shape.head_dim, head_dim_v=shape.head_dim_v)
    causal = False not in limits.causal if causal is None else causal
    return fst.make_problem("normal", shape, dtype, 0, causal=causal, **kwargs)


def _runs(backend: Backend, problem, as_kind=None) -> bool:
    """Whether `supports` accepts `problem` (made a problem of its kind by `as_kind`); a
    `supports` that raises does not."""
    try:
        return backend.supports(problem if as_kind is None else as_kind(problem, backend)) is None
    except Exception:  # noqa: BLE001 - the probe never raises: a broken supports() supports nothing
        return False


def capabilities(backend: Backend, as_kind=None) -> Capabilities:
    """Probe (once per backend object and kind) the dtypes, head dims and alignments it supports,
    with tiny dense problems made problems of its kind by `as_kind(problem, backend)` (None: dense)."""
    cache = _CAPABILITIES.setdefault(backend, {})
    if as_kind in cache:
        return cache[as_kind]
    limits = backend.limits
    dense = [d for d in backend.dtypes if d in DTYPE_NAMES]
    if not dense:  # FP8 formats only (--dtype e4m3): no dense problem to probe or draw
        cache[as_kind] = Capabilities(name=backend.name, dtypes=(), head_dims=None, alignments=(),
                                      returns_lse=False, limits=limits)
        return cache[as_kind]
    dtype = dense[0]
    runs = lambda problem: _runs(backend, problem, as_kind)  # noqa: E731
    dims = tuple(d for d in limits.head_dims or _PROBED_HEAD_DIMS if runs(_tiny(limits, dtype, d)))
    d = dims[0] if dims else None
    # Alignments differ only when Nq != Nk: where the limits allow no such problem, any will do.
    longer = not limits.equal_seq and limits.seq_allowed(limits.seq_lo + limits.seq_multiple)
    alignments = tuple(a for a in CAUSAL_ALIGNMENTS
                       if runs(_tiny(limits, dtype, d, longer, causal=True, causal_alignment=a)))
    probe = _tiny(limits, dtype, d)
    try:
        if limits.lse is not None or not runs(probe):
            returns_lse = limits.lse is not False  # declared, or nothing to probe with: the examples tell
        else:
            returns_lse = backend.run(probe if as_kind is None else as_kind(probe, backend))[1] is not None
    except (BackendOutputError, KernelRunError):
        returns_lse = True  # a broken target: the examples will show how
    except FaVerifyError:
        raise  # setup or misuse
    except (Exception, SystemExit):  # noqa: BLE001 - whatever the target itself raises, the examples report
        returns_lse = True
    features = tuple(f for f, switched_on in _FEATURE_PROBES.items() if runs(switched_on(probe)))
    caps = Capabilities(name=backend.name, dtypes=tuple(dense),  # (its FP8 formats are the FP8 kind's to draw)
                        head_dims=None if len(dims) == len(_PROBED_HEAD_DIMS) else dims,
                        alignments=alignments, returns_lse=returns_lse, limits=limits, features=features,
                        head_dims_v=_head_dim_pairs(limits, runs, dtype))
    cache[as_kind] = caps
    return caps


def _head_dim_pairs(limits: Limits, runs, dtype):
    """What a target declaring `limits` runs with D_v != D (`Capabilities.head_dims_v`): the
    declared D_v values are probed with every D (the declared ones, else _PROBED_PAIRED_HEAD_DIMS)."""
    if limits.head_dims_v is None or limits.head_dims_v == ANY_HEAD_DIM_V:
        return limits.head_dims_v
    pairs = tuple((d, dv) for d in limits.head_dims or _PROBED_PAIRED_HEAD_DIMS for dv in limits.head_dims_v
                  if dv != d and runs(_tiny(limits, dtype, d, dv=dv)))
    return pairs or None


#: Each variant switched on in a probe problem.
_FEATURE_PROBES = {
    "window": lambda p: p.replace(window_size=(1, 1)),
    "softcap": lambda p: p.replace(softcap=1.0),
    "alibi": lambda p: p.replace(alibi_slopes=np.ones(p.heads)),
    "sinks": lambda p: p.replace(sinks=np.zeros(p.heads)),
}


def _causal_modes(prop: Property, *allowed: tuple) -> tuple:
    """The causal modes `prop` is meaningful on that each of `allowed` (selection, limits) allows."""
    wanted = {"any": (False, True), "causal": (True,), "non-causal": (False,)}[prop.masking]
    return tuple(c for c in (False, True) if c in wanted and all(c in modes for modes in allowed))


#: Shapes drawn around each task shape, and how far (in rows) their lengths move from it.
AROUND, AROUND_REACH = 3, 16


def around_task_shapes(task_shapes, seed) -> list:
    """Edge cases ((shape, distribution) pairs) from a target's task shapes: each with one batch and
    one K/V head (its group of query heads), and AROUND shapes whose Nq and Nk move by 1 to
    AROUND_REACH rows either way, drawn from `seed` (the run's: a kernel cannot know them ahead), so
    a kernel right only on the task's shape shows."""
    rng = random.Random(seed)
    cases = []
    for b, h, hkv, nq, nk, d in task_shapes:
        group = max(h // max(hkv, 1), 1)
        cases.append(((1, group, 1, nq, nk, d), "normal"))
        for _ in range(AROUND):
            moved = [max(n + rng.choice((-1, 1)) * rng.randint(1, AROUND_REACH), 1) for n in (nq, nk)]
            cases.append(((1, group, 1, *moved, d), "normal"))
    return cases


def edge_problems(prop: Property, backend: Backend, selection: Selection, cases=EDGE_CASES,
                  as_kind=None) -> tuple[list[AttentionProblem], tuple]:
    """The edge `cases` ((shape, distribution) pairs) for the selected dtypes and causal modes
    that the target runs (made problems of its kind by `as_kind`, as `capabilities` probes), and
    those around the target's task shapes, each moved to the nearest shape within the target's
    declared limits; and notes on what was moved or dropped."""
    if not prop.edge_cases:
        return [], ()
    # first: a budget on edge cases keeps every k-th from the first, so the task's shape stays
    cases = around_task_shapes(backend.task_shapes, selection.seed) + list(cases)
    limits = backend.limits
    causal = _causal_modes(prop, selection.causal, limits.causal)
    modes = ([(False, "bottom-right")] * (False in causal)
             + [(True, a) for a in CAUSAL_ALIGNMENTS] * (True in causal))
    adapted_cases, notes = {}, []
    for case, dist in cases:
        shape = fst.Shape.coerce(case)
        if not limits.head_dim_v_allowed(shape.head_dim, shape.head_dim_v):
            continue  # a D_v != D case, for targets that declare D_v (--head-dims-v)
        adapted = limits.adapt(shape)
        if isinstance(adapted, str):
            notes.append(f"edge case {shape} dropped: {adapted}")
        else:
            adapted_cases.setdefault((adapted, dist), None)
    if limits.declared:
        notes.append(f"{len(cases)} edge cases moved to {len(adapted_cases)} shapes within the declared limits")
    problems = [fst.make_problem(dist, shape, dtype, seed=0, causal=c, causal_alignment=a)
                for shape, dist in adapted_cases for dtype in selection.dtypes if dtype in DTYPE_NAMES  # (not FP8)
                for c, a in modes]
    return [p for p in problems if _runs(backend, p, as_kind)], tuple(notes)


def _shape_limits(limits: Limits) -> dict:
    """fst.shapes' keyword arguments for drawing within `limits`."""
    return dict(seq_multiple=limits.seq_multiple, seq_min=limits.seq_min, equal_seq=limits.equal_seq,
                head_layouts=limits.heads, group_sizes=limits.group_sizes,
                # room for the fewest heads allowed, and for MQA with the largest group size
                max_heads=max(4, limits.smallest_shape().heads, *(limits.group_sizes or ())))


def _large_shapes(head_dims, limits: Limits):
    """Shapes with enough rows and elements for a statistic (within the limits where declared)."""
    dims = [d for d in (head_dims or (16, 32, 64)) if 16 <= d <= 64] or [min(head_dims)]
    if limits.declared:
        max_seq = min(max(96, limits.seq_lo), limits.seq_max or limits.seq_lo + 96)
        return fst.shapes(max_batch=2, max_seq=max_seq, max_head_dim=max(dims),
                          head_dims=dims, max_work=_max_work(limits, 2 * 4 * 96 * 96 * max(dims), dims),
                          **_shape_limits(limits))
    return st.builds(fst.Shape, batch=st.integers(1, 2), heads=st.just(4), kv_heads=st.sampled_from([1, 2, 4]),
                     nq=st.integers(32, 96), nk=st.integers(8, 96), head_dim=st.sampled_from(dims))


#: The work budget is raised to this many times the smallest shape within the limits, so that a
#: kernel with large tiles still reaches lengths of 4 x its smallest one (its fourth tile).
_WORK_ROOM = 16


def _max_work(limits: Limits, max_work: int, head_dims) -> int:
    least = limits.seq_lo ** 2 * limits.smallest_shape().heads
    return max(max_work, _WORK_ROOM * least * min(head_dims or (1,)))


def problem_strategy(prop: Property, caps: Capabilities, selection: Selection):
    """Problems for `prop` that the target runs, or a reason string when there are none."""
    dtypes = [d for d in selection.dtypes if d in caps.dtypes]
    causal = _causal_modes(prop, selection.causal, caps.limits.causal)
    alignments = caps.alignments if True in causal else ()
    if not dtypes:
        return f"none of the selected dtypes {list(selection.dtypes)} is run by {caps.name}"
    if prop.needs_lse and not caps.returns_lse:
        return f"{caps.name} returns no LSE"
    if not _causal_modes(prop, caps.limits.causal):
        return f"needs {prop.masking} problems, but {caps.name} declares {caps.limits.describe_causal()} (--causal)"
    if prop.needs_bottom_right and "bottom-right" not in caps.alignments:
        return f"needs bottom-right causal problems, which {caps.name} does not run"
    if not causal or (causal == (True,) and not alignments):
        return f"needs {prop.masking} problems, which the selection (--causal) or the target excludes"
    features = tuple(f for f in prop.features if f in caps.features)
    if prop.features and not (features and set(prop.always) <= set(caps.features)):
        needed = prop.always or prop.features
        keywords = ", ".join(FEATURES[f] for f in needed)
        return (f"about {' or '.join(needed)}, which {caps.name} does not implement (a callable takes "
                f"{'it' if len(needed) == 1 else 'them'} through the keyword{'s' * (len(needed) > 1)} {keywords})")
    if prop.unequal_seq and caps.limits.equal_seq:
        return f"{prop.unequal_seq}, but {caps.name} declares Nq = Nk (--equal-seq)"
    limits = caps.limits
    max_seq = min(selection.max_seq, limits.seq_max or selection.max_seq)
    work = _max_work(limits, selection.max_work, caps.head_dims)
    paired = [max(pair) for pair in caps.head_dims_v] if isinstance(caps.head_dims_v, tuple) else []
    dims = {} if caps.head_dims is None else dict(max_head_dim=max((*caps.head_dims, *paired)), head_dims=caps.head_dims)
    try:
        if prop.large:
            shapes = _large_shapes(caps.head_dims, limits)
        else:
            shapes = fst.shapes(max_seq=max_seq, max_work=work, typical_seq=selection.typical_seq,
                                head_dims_v=caps.head_dims_v, **_shape_limits(limits), **dims)
    except InvalidArgumentError as exc:
        return f"the declared limits ({limits.describe()}) leave no shape to draw within --max-seq {max_seq}: {exc}"
    deep = long_keys = None  # where the limits and budget leave no such shape, none
    if prop.name in DEPTH_PROPERTIES and not prop.large:
        max_nk = selection.max_long_keys
        with contextlib.suppress(InvalidArgumentError):
            deep = fst.deep_shapes(max_seq=max_seq, max_work=work, **_shape_limits(limits), **dims)
        with contextlib.suppress(InvalidArgumentError):
            long_keys = fst.long_key_shapes(max_nk=min(max_nk, limits.seq_max or max_nk), max_work=work,
                                            max_scores=max_seq ** 2, **_shape_limits(limits), **dims)
    modes = dict(non_causal=False in causal, alignments=alignments)
    dense = (budgeted_problems(fst.depth_shares(shapes, deep, long_keys), fst.dtypes(dtypes),
                               [(False, "bottom-right")] * (False in causal) + [(True, a) for a in alignments],
                               selection.shapes, selection.seed)
             if selection.shapes is not None else
             fst.depth_shares(fst.problems(shapes=shapes, dtypes=fst.dtypes(dtypes), causal=fst.causal_modes(**modes)),
                              None if deep is None else fst.deep_problems(deep, fst.dtypes(dtypes), **modes),
                              None if long_keys is None else fst.long_key_problems(long_keys, fst.dtypes(dtypes),
                                                                                   **modes)))
    if features:
        return fst.variant_problems(dense, features, always=prop.always)
    optional = tuple(f for f in prop.holds_under if f in caps.features)
    # plain problems first: a failure shrinks towards one without variants where it shows there
    return st.one_of(dense, fst.variant_problems(dense, optional)) if optional else dense
