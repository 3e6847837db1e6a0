"""A differentiable forward function checked through its gradients (`fa_verify check MODULE:FUNC
--grad --array torch`): the forward callable protocol, differentiated by torch.autograd.

For a backward problem, q, k, v (and sinks, when the function takes them) become CPU tensors
that require grad, in the problem dtype and the declared layout; the function's out is
back-propagated with dout (no dlse is drawn for it: `takes_dlse` is False): dq, dk, dv (dsinks)
are judged by the backward properties. The function computes its own forward, so the out and lse the problem gives a
backward kernel are not used: its gradients are judged against the exact ones all the same,
with FA2's backward model (or the declared --precision).
"""

from __future__ import annotations

import numpy as np

from fa_verify.backends.torch_arrays import import_torch, to_numpy, to_torch
from fa_verify.backends.user_callable import CallableBackend
from fa_verify.errors import BackendOutputError, InvalidArgumentError
from fa_verify.outputs import check_outputs


class GradCallableBackend(CallableBackend):
    """Adapts a differentiable forward function (`CallableBackend`'s protocol and options, with
    array="torch") to backward problems through torch.autograd."""

    kinds = ("backward",)
    pads_inputs = False  # autograd's leaves are its own tensors

    def __init__(self, fn, *args, array: str = "torch", **kwargs):
        if array != "torch":
            raise InvalidArgumentError(f"array={array!r}: --grad differentiates the function with torch.autograd, "
                                       "so it must take torch tensors: give --array torch")
        super().__init__(fn, *args, array=array, **kwargs)

    def _output_parameters(self, fn) -> tuple:
        return ()  # what an out= buffer receives is not differentiable

    def run_here(self, problem):
        torch = import_torch()
        forward, bshd = problem.forward, self.layout == "bshd"
        layout = (lambda x: x.transpose(1, 2)) if bshd else (lambda x: x)  # noqa: E731
        leaves = [to_torch(x.copy()).requires_grad_() for x in (forward.q, forward.k, forward.v)]
        arguments = self._variant_arguments(forward)
        if "sinks" in arguments and arguments["sinks"] is not None:
            arguments["sinks"] = arguments["sinks"].requires_grad_()
            leaves.append(arguments["sinks"])
        result = self.fn(*(layout(x) for x in leaves[:3]), causal=forward.causal, scale=forward.scale_value,
                         **arguments)
        out = result[0] if isinstance(result, tuple) else result
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            raise BackendOutputError(f"{self.name} returned {type(out).__name__} without a gradient: --grad needs a "
                                     "differentiable torch function")
        grads = torch.autograd.grad([layout(out)], leaves, [to_torch(problem.dout.copy())], allow_unused=True)
        result = tuple(np.zeros(leaf.shape, to_numpy(leaf).dtype) if g is None else to_numpy(g)
                       for g, leaf in zip(grads, leaves))
        return check_outputs(self.name, problem, result, self.precision(problem.dtype))
