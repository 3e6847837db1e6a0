"""Outputs a target must write, and inputs it must not.

Output buffers (`GuardedOutput`): where a target writes into buffers it is given (the
CUDA-on-CPU runner; a callable with `out=`/`lse=` parameters), each buffer sits in the middle
of a larger one with guard bands of GUARD_ROWS rows on both sides, and all of it starts filled
with a NaN whose payload arithmetic does not produce (SENTINEL_BITS). After the call, an
element of the output that still holds those bits was never written, and a guard element that
does not was written out of bounds: both are reported with their index. (A kernel that
computes a NaN writes the canonical one, so a NaN result is told from an unwritten element.)

Inputs (`InputSnapshot`): copies taken before a call; after it, the inputs must be bitwise
unchanged, and the first element that changed is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.errors import BackendOutputError

#: Rows (of the buffer's last dimension) of guard band on each side: one large tile.
GUARD_ROWS = 128
#: A quiet NaN in fp16 and bf16 (0x7FDA) and in fp32, with a payload no operation yields.
SENTINEL_BITS = {2: 0x7FDA, 4: 0x7FDADADA}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # 1: FP8 inputs


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(_UINT[x.dtype.itemsize])


def _index(flat: int, shape) -> list:
    return [int(i) for i in np.unravel_index(flat, shape)]


@dataclass(frozen=True, eq=False)
class GuardedOutput:
    """An output buffer of `shape` inside a sentinel-filled 1-D `buffer`, from element `offset`."""

    name: str
    buffer: np.ndarray
    offset: int
    shape: tuple

    @classmethod
    def allocate(cls, name: str, shape, dtype) -> "GuardedOutput":
        dtype = np.dtype(dtype)
        size, guard = int(np.prod(shape)), GUARD_ROWS * int(shape[-1])
        buffer = np.empty(size + 2 * guard, dtype=dtype)
        _bits(buffer)[:] = SENTINEL_BITS[dtype.itemsize]
        return cls(name, buffer, guard, tuple(int(n) for n in shape))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def view(self) -> np.ndarray:
        """The output itself: a contiguous view into the buffer."""
        return self.buffer[self.offset:self.offset + self.size].reshape(self.shape)

    def findings(self, unwritten: bool = True) -> list[str]:
        """What the target did wrong with this buffer: writes out of bounds, and unwritten
        elements unless `unwritten` is False (a caller that reports them itself)."""
        touched = _bits(self.buffer) != SENTINEL_BITS[self.buffer.dtype.itemsize]
        before, inside, after = (touched[:self.offset], touched[self.offset:self.offset + self.size],
                                 touched[self.offset + self.size:])
        found = []
        if after.any():
            first = int(np.argmax(after))
            found.append(f"{self.name}: {int(after.sum())} elements written past its end (first at flat "
                         f"element {self.size + first}, {first + 1} past the last of {self.size})")
        if before.any():
            last = len(before) - 1 - int(np.argmax(before[::-1]))
            found.append(f"{self.name}: {int(before.sum())} elements written before its start (nearest "
                         f"{self.offset - last} elements before element 0)")
        if unwritten and not inside.all():
            first = int(np.argmax(~inside))
            found.append(f"{self.name}: {int((~inside).sum())} / {self.size} elements never written "
                         f"(first at {_index(first, self.shape)} of {list(self.shape)})")
        return found


def check_written(target: str, *outputs: GuardedOutput) -> None:
    """Raise BackendOutputError naming every unwritten element range and out-of-bounds write."""
    found = [line for output in outputs for line in output.findings()]
    if found:
        raise BackendOutputError(f"target {target!r} " + "; ".join(found))


@dataclass(frozen=True, eq=False)
class InputSnapshot:
    """Copies of a call's input arrays (numpy), to show the call left them untouched."""

    names: tuple
    copies: tuple

    @classmethod
    def of(cls, **arrays: np.ndarray) -> "InputSnapshot":
        return cls(tuple(arrays), tuple(np.array(a, copy=True) for a in arrays.values()))

    def check(self, target: str, *arrays: np.ndarray) -> None:
        """Raise BackendOutputError if an array differs in any bit from its copy (first index)."""
        for name, before, after in zip(self.names, self.copies, arrays):
            changed = _bits(before) != _bits(np.ascontiguousarray(after))
            if changed.any():
                first = int(np.argmax(changed))
                where = _index(first, before.shape)
                raise BackendOutputError(
                    f"target {target!r} wrote into its input {name}: {int(changed.sum())} elements "
                    f"changed, first at {where}: {before[tuple(where)]!r} became "
                    f"{np.asarray(after)[tuple(where)]!r} (inputs must come back bitwise unchanged)")


def output_buffers(problem, out_dtype) -> tuple[GuardedOutput, GuardedOutput]:
    """Sentinel-filled out and LSE buffers in the problem's layout (`problem.out_shape`,
    `problem.lse_shape`), for targets that write into buffers they are given: rows left
    unwritten keep the sentinel (a ragged problem's `unwritten_rows` names their sequences)."""
    from fa_verify.dtypes import numpy_dtype

    return (GuardedOutput.allocate("out", problem.out_shape, numpy_dtype(out_dtype)),
            GuardedOutput.allocate("lse", problem.lse_shape, np.float32))


def padded_array(x, pad: int):
    """A contiguous copy of `x` (numpy array or torch tensor) inside a NaN-filled buffer with
    `pad` elements before and after it; returns (view, buffer)."""
    n = int(np.prod(x.shape))
    if isinstance(x, np.ndarray):
        buffer = np.full(n + 2 * pad, np.nan, dtype=x.dtype)
        buffer[pad:pad + n] = x.reshape(-1)
        return buffer[pad:pad + n].reshape(x.shape), buffer
    import torch  # a torch tensor came in, so torch is there

    buffer = torch.full((n + 2 * pad,), float("nan"), dtype=x.dtype, device=x.device)
    buffer[pad:pad + n].copy_(x.reshape(-1))
    return buffer[pad:pad + n].view(x.shape), buffer
