"""The launch geometry a GPU accepts, checked on what a kernel spec's expressions give for a shape.

A spec's grid is an expression of the problem (``cdiv(Nq, 64)``); for some shapes it can give 0
(``Nq // 64`` with Nq < 64) or more blocks than a grid dimension holds. On a GPU that launch fails
(cudaErrorInvalidConfiguration), and the author's host code either refuses such shapes or never
meets them: a precondition of the kernel, not a mistake in the spec. So a value of the wrong
kind (not an integer: the spec cannot be right) is a usage error, while an integer the GPU
refuses for this shape is a failed launch (`KernelLaunchError`), a failing example that names
the expression, the shape and the limit, which precondition discovery can then generalise.
"""

from __future__ import annotations

import ast
import math

from fa_verify.errors import InvalidArgumentError, KernelLaunchError

#: (lowest, highest) per grid and block dimension (CUDA C++ Programming Guide, compute capabilities).
GRID_LIMITS = ((1, 2**31 - 1), (1, 65535), (1, 65535))
BLOCK_LIMITS = ((1, 1024), (1, 1024), (1, 64))
#: Threads a block may have.
MAX_THREADS = 1024


def dimension(tree, value, key: str, index: int, values: dict, origin: str) -> int:
    """`value`, what the spec's `key` expression `tree` gave for the shape in `values`, as a launch
    dimension; `index` is its place in grid or block (any non-negative value for other keys)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{origin}: {key}={ast.unparse(tree)!r} gave {value!r} for {_shape(values)}: "
                                   "a launch dimension must be an integer (use cdiv or //)")
    limits = GRID_LIMITS if key == "grid" else BLOCK_LIMITS if key == "block" else ((0, None),) * 3
    low, high = limits[index]
    if value < low or (high is not None and value > high):
        what = "empty" if value < 1 and key in ("grid", "block") else "refused"
        bound = f"at least {low}" if value < low else f"at most {high}"
        raise KernelLaunchError(f"the launch is {what} for this shape: {key}[{index}]={ast.unparse(tree)!r} gives "
                                f"{value} for {_shape(values)}, and a GPU needs {bound} there "
                                "(cudaErrorInvalidConfiguration); if the kernel's host never launches this shape, "
                                "declare the precondition in [limits]")
    return value


def check_threads(block: list[int], values: dict) -> None:
    """A block of more than MAX_THREADS threads fails on every GPU."""
    threads = math.prod(block)
    if threads > MAX_THREADS:
        raise KernelLaunchError(f"the launch is refused for this shape: a block of {threads} threads for "
                                f"{_shape(values)} (at most {MAX_THREADS}); if the kernel's host never launches "
                                "this shape, declare the precondition in [limits]")


def _shape(values: dict) -> str:
    return ", ".join(f"{name}={values[name]}" for name in ("B", "H", "Nq", "Nk", "D"))
