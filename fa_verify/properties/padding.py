"""NaN-padded input buffers: a kernel that reads outside its inputs shows it.

Each of q, k, v is placed, contiguous and in its layout, in the middle of a larger buffer
filled with NaN (`pad_inputs`). A kernel that reads past the end of a tensor (a partial tile
loaded whole, a wrong stride, an off-by-one in a pointer) then picks up NaN, which spreads
to its output, where without padding it would read whatever memory happens to follow.
`check_nan_padding` requires the padded run to be identical to the plain one.

How the padding reaches a target (`run_padded`):
  * a backend may define `run_padded(padded: PaddedInputs) -> (out, lse)` and hand the kernel
    a pointer into `padded.buffers[i]` at `padded.offsets[i]` (runners that copy inputs, as
    a worker process does, should copy the whole buffer);
  * a callable-protocol target (`CallableBackend`) gets its arguments, after the layout copy
    it always makes, placed in NaN-padded buffers (numpy arrays or torch tensors alike);
  * any other backend has no way to be handed the buffers: it indexes or copies its arrays,
    so it cannot read past them, and the property is not applicable to it (rather than a pass
    that tested nothing).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass


from fa_verify.backends.buffers import padded_array
from fa_verify.backends.user_callable import CallableBackend
from fa_verify.problem import AttentionProblem
from fa_verify.properties._result import PropertyResult, not_applicable
from fa_verify.properties._subject import as_backend
from fa_verify.properties.independence import judge_identical

#: Rows of padding on each side, in units of the tensor's last dimension: one large tile.
PAD_ROWS = 256


@dataclass(frozen=True, eq=False)
class PaddedInputs:
    """`problem` with q, k, v as contiguous views into NaN-filled 1-D `buffers`, starting at
    element `offsets` of each."""

    problem: AttentionProblem
    buffers: tuple
    offsets: tuple


def pad_inputs(problem: AttentionProblem, pad_rows: int = PAD_ROWS) -> PaddedInputs:
    """The problem with its inputs inside NaN-padded buffers (pad_rows * D elements each side)."""
    pad = pad_rows * problem.head_dim
    views, buffers = zip(*(padded_array(x, pad) for x in (problem.q, problem.k, problem.v)))
    return PaddedInputs(problem.replace(q=views[0], k=views[1], v=views[2]), buffers, (pad,) * 3)


def reaches_padding(backend) -> bool:
    """Whether `backend` is handed the padded buffers (a run_padded hook, or a callable)."""
    return getattr(backend, "run_padded", None) is not None or isinstance(backend, CallableBackend)


def run_padded(backend, padded: PaddedInputs):
    """Run `backend` on `padded` through the best hook it offers (see the module doc)."""
    backend = as_backend(backend)
    hook = getattr(backend, "run_padded", None)
    if hook is not None:
        return hook(padded)
    if isinstance(backend, CallableBackend):  # it pads the arguments it passes, in its worker process too
        padding = copy.copy(backend)
        padding.pad = padded.offsets[0]
        return padding.run(padded.problem)
    return backend.run(padded.problem)  # no hook: copies or indexes them (check_nan_padding skips it)


def check_nan_padding(backend, problem) -> PropertyResult:
    """Inputs inside NaN-filled buffers give results identical to plain inputs."""
    backend = as_backend(backend)
    if not reaches_padding(backend):
        return not_applicable("nan_padding", problem, (
            f"{backend.name} has no run_padded hook and is no callable: it indexes or copies its "
            "input arrays, so NaN padding around them cannot reach it and would test nothing"))
    return judge_identical("nan_padding", "inputs placed inside NaN-filled buffers changed the result "
                           "(the target reads outside its inputs)", problem,
                           backend.run(problem), run_padded(backend, pad_inputs(problem)))
