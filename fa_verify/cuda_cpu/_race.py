"""The race detector's findings, from the runtime's report to a message with file:line.

The race build (``CpuKernelModule(..., racecheck=True)``, runtime/race_runtime.cpp) reports each
distinct pair of conflicting instructions as one line of numbers: the memory, the byte, and per
access its kind, its instruction (an offset into the kernel's library), block, thread and
barrier interval. Here the instructions become file:line (with the functions they were inlined
into) through binutils' addr2line on the library, which the race build compiles with -g, and a
static ``__shared__`` byte becomes its variable's name through nm.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass

from fa_verify.cuda_cpu._build import SHIM_DIR
from fa_verify.cuda_cpu._host_code import originals

#: Region ids of the report (race_runtime.cpp); argument buffers are numbered from 0.
DYNAMIC_SHARED, STATIC_SHARED = -1, -2
#: The grades of a race, the one to fix first first.
CHANGES_RESULTS = "changes results"
UNDEFINED = "benign on today's hardware, but undefined"
#: Races listed in a message; the others are counted.
LISTED = 6


@dataclass(frozen=True)
class RaceAccess:
    """One side of a race."""

    kind: str  # "read", "write" or "atomic"
    #: where, innermost first: "path:line" of the access and of each call it was inlined through
    frames: tuple
    block: tuple
    thread: tuple
    #: barrier interval: the number of __syncthreads the block had passed
    interval: int

    @property
    def location(self) -> str:
        """The access's own file:line."""
        return self.frames[0] if self.frames else "?"

    def describe(self) -> str:
        chain = "".join(f"\n        inlined into {frame}" for frame in self.frames[1:])
        return (f"{self.kind} by thread {_xyz(self.thread)} of block {_xyz(self.block)} at "
                f"{self.location}{chain}")


@dataclass(frozen=True)
class Race:
    """Two accesses to one byte, at least one a write, from threads that nothing orders."""

    memory: str
    first: RaceAccess
    second: RaceAccess
    same_warp: bool
    #: how often this pair of instructions conflicted in the launch
    count: int
    #: every conflict of the pair was a write of the value the memory already held
    same_value: bool = False

    @property
    def why(self) -> str:
        if self.first.block != self.second.block:
            return "different blocks: nothing orders them (only atomics on both sides may meet)"
        if self.same_warp:
            return ("one warp, no __syncthreads or __syncwarp between them: since Volta the threads of a warp "
                    "need not run in lockstep")
        return "one block, no __syncthreads between them"

    @property
    def grade(self) -> str:
        """CHANGES_RESULTS (threads of different warps or blocks, values that differ) or UNDEFINED
        (every write stored the value already there, or lanes of one warp: warp-synchronous code,
        which today's GPUs mostly run in step)."""
        return UNDEFINED if self.same_value or self.same_warp else CHANGES_RESULTS

    @property
    def rule(self) -> str:
        """The CUDA rule the pair breaks."""
        if self.same_value:
            return ("conflicting accesses that nothing orders are a data race, undefined under the PTX memory "
                    "consistency model even when every write stores the same value (make one thread write, "
                    "then __syncthreads)")
        if self.first.block != self.second.block:
            return ("blocks are not ordered: one block's writes reach another only through atomics, or a "
                    "__threadfence and a flag (CUDA C++ Programming Guide, memory fence functions)")
        if self.same_warp:
            return ("since Volta's independent thread scheduling the lanes of a warp are not implicitly "
                    "synchronous: __syncwarp() must separate a write from another lane's access (CUDA C++ "
                    "Programming Guide, warp synchronous programming)")
        return ("a __syncthreads() must separate a write from another thread's access to the same address "
                "(CUDA C++ Programming Guide, synchronization functions)")

    def describe(self) -> str:
        same = ", every write storing the value already there" if self.same_value else ""
        return (f"[{self.grade}] {self.first.kind}/{self.second.kind} race on {self.memory} ({self.why}{same}):\n"
                f"    {self.first.describe()}\n    {self.second.describe()}\n    rule: {self.rule}"
                + (f"\n    (this pair of instructions conflicted {self.count} times)" if self.count > 1 else ""))


def parse(report: str, library: str, buffers) -> list[Race]:
    """The races of `report` (race_runtime.cpp's text); `buffers`: (description, itemsize) of
    each argument buffer, in the order they were registered."""
    rows = [line.split("\t") for line in report.splitlines() if line.strip()]
    pcs = sorted({int(row[i], 16) for row in rows for i in (4, 9)})
    frames = _symbolise(library, pcs)
    races = []
    for row in rows:
        region, offset, image_offset = int(row[0]), int(row[1]), int(row[2], 16)
        first, second = (RaceAccess(row[i], frames.get(int(row[i + 1], 16), ()), _ints(row[i + 2]),
                                    _ints(row[i + 3]), int(row[i + 4])) for i in (3, 8))
        races.append(Race(_memory(region, offset, image_offset, library, buffers), first, second,
                          row[13] == "1", int(row[14]), row[15] == "1"))
    return sorted(races, key=lambda race: race.grade != CHANGES_RESULTS)  # the ones to fix first, first


def describe(races: list[Race], total: int, what: str) -> str:
    """The message of a KernelRaceError."""
    pairs = f"{len(races)} distinct pair{'s' if len(races) != 1 else ''} of instructions"
    grades = ", ".join(f"{n} {grade}" for grade in (CHANGES_RESULTS, UNDEFINED)
                       if (n := sum(race.grade == grade for race in races)))
    head = f"data race: {total} conflicting access{'es' if total != 1 else ''} ({pairs}: {grades}) in {what}"
    body = "\n".join(f"  {race.describe()}" for race in races[:LISTED])
    more = f"\n  ... and {len(races) - LISTED} more pairs" if len(races) > LISTED else ""
    return f"{head}\n{body}{more}"


def _xyz(values) -> str:
    return "(" + ",".join(str(v) for v in values) + ")"


def _ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(","))


def _memory(region: int, offset: int, image_offset: int, library: str, buffers) -> str:
    if region == DYNAMIC_SHARED:
        return f"dynamic shared memory (extern __shared__), byte {offset}"
    if region == STATIC_SHARED:
        name = _static_variable(library, image_offset)
        return f"static __shared__ {name}" if name else f"static __shared__ memory, byte {offset} of the block's"
    if 0 <= region < len(buffers):
        description, itemsize = buffers[region]
        element = f" (element {offset // itemsize})" if itemsize > 1 else ""
        return f"global memory, {description}, byte {offset}{element}"
    return f"global memory, buffer {region}, byte {offset}"


def _symbolise(library: str, pcs: list[int]) -> dict:
    """{pc: frames} through addr2line (none where it is missing or cannot say)."""
    tool = shutil.which("addr2line")
    if not pcs or tool is None:
        return {}
    # A pc is the return address of the call to the detector's hook: the access is the call before it.
    proc = subprocess.run([tool, "-e", library, "-f", "-i", "-C", "-a", *(hex(pc - 1) for pc in pcs)],
                          capture_output=True, text=True)
    groups: dict = {}
    lines: list = []
    for line in proc.stdout.splitlines():  # per address: its line, then (function, file:line) per frame
        if _ADDRESS.fullmatch(line):
            lines = groups.setdefault(int(line, 16) + 1, [])
        else:
            lines.append(line)
    # Function names are left out: with inlining, addr2line's pairing of names and lines misleads.
    return {pc: tuple(originals(where.split(" (discriminator")[0]) for where in lines[1::2] if _in_kernel_source(where))
            for pc, lines in groups.items()}


_ADDRESS = re.compile(r"0x[0-9a-f]+")


def _in_kernel_source(where: str) -> bool:
    """Whether a frame is the kernel author's code (not the shim's or the launch trampolines')."""
    return not (where.startswith("??") or where.startswith(str(SHIM_DIR)) or "<fa_verify launch trampolines" in where)


@functools.lru_cache(maxsize=32)
def _symbols(library: str) -> tuple:
    """(start, size, name) of the library's data symbols, from nm."""
    tool = shutil.which("nm")
    if tool is None:
        return ()
    proc = subprocess.run([tool, "-C", "-S", "--defined-only", library], capture_output=True, text=True)
    found = []
    for line in proc.stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[2] in "bBdD":
            found.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    return tuple(found)


def _static_variable(library: str, image_offset: int) -> str:
    """"'name', byte k" of the static variable at this offset into the library, or ""."""
    for start, size, name in _symbols(library):
        if start <= image_offset < start + size:
            return f"'{name}', byte {image_offset - start}"
    return ""
