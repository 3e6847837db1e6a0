"""Sets aside the host code of a published ``.cu`` file, so that only its device code is built.

A kernel file as found on GitHub also holds a launcher with ``<<<>>>``, a ``main``, torch
extension glue (``#include <torch/extension.h>``, ``PYBIND11_MODULE``) and host-only includes
(cuBLAS, the driver API). None of it can be built by the CPU runner, and none of it is needed:
the kernel spec says how to launch. The user's file is never edited; a copy is, and only by
turning characters into spaces (newlines stay, and a ``#line`` directive names the original), so
compiler errors and sanitizer reports point at the user's file and line.

What is set aside, conservatively (anything not listed stays):

* ``#include`` lines of host-only headers (HOST_ONLY_HEADERS);
* at file scope (and inside ``namespace`` and ``extern "C"`` blocks), every function
  definition that is not ``__global__``, ``__device__`` or ``constexpr`` (``__host__ __device__``
  stays), macro blocks such as ``PYBIND11_MODULE(m, ...) { ... }`` included;
* file-scope declarations naming a host-only library (HOST_ONLY_NAMES): prototypes such as
  ``torch::Tensor forward(torch::Tensor q);``, ``cublasHandle_t handle;``.

Structs, classes, templates of device functions, variables with initialisers and every
preprocessor line other than those includes are kept; a macro of the file or of a header it
includes with quotes that expands to ``__device__`` or ``__global__`` counts as those words.
Known limit: braces that only balance across ``#if``/``#else`` branches confuse the scan.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

#: Headers that only host code uses (prefixes of the included path).
HOST_ONLY_HEADERS = (
    "torch/", "ATen/", "c10/", "pybind11/", "Python.h", "cuda.h", "cublas", "cublasLt", "cudnn", "cufft",
    "cusparse", "cusolver", "curand.h", "nccl", "helper_cuda.h", "helper_functions.h", "cuda_profiler_api.h",
    "nvtx", "nvToolsExt", "thrust/", "cub/device/",
)  # fmt: skip
#: Names that mark a file-scope declaration as host code.
HOST_ONLY_NAMES = re.compile(
    r"\b(torch|at|c10|py|pybind11)::|\b(cublas|cudnn|cufft|cusparse|cusolver|curandGenerator|nccl)\w*|\bPyObject\b"
)
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
_DEVICE_WORDS = re.compile(r"\b(__global__|__device__|constexpr)\b")
_SCOPE = re.compile(r"^\s*(namespace\b[\w\s:]*|extern\s+\"C\"\s*)$", re.S)
_DEFINE = re.compile(r"^\s*#\s*define\s+([A-Za-z_]\w*)(?:\([^)]*\))?[ \t]*((?:[^\n\\]|\\.)*)", re.M)
_ANY_INCLUDE = re.compile(r'^\s*#\s*include\s*(?:(")([^"]+)"|<([^>]+)>)', re.M)
#: The root of a copied tree, up to the original's absolute path (`device_only_copy`).
_COPY_ROOT = re.compile(r"[^\s'\"]*/device_only/[0-9a-f]{24}(?=/)")
_TYPE_DEFINITION = re.compile(r"^\s*(template\s*<.*?>\s*)?(typedef\s+)?(struct|class|union|enum)\b", re.S)


def set_aside(text: str, device_macros=()) -> str:
    """`text` with its host code turned into spaces (line structure kept). `device_macros`:
    macro names that expand to ``__device__``/``__global__`` (found by `device_macros`)."""
    chars = list(text)
    _blank_host_includes(text, chars)
    words = _DEVICE_WORDS
    if device_macros:
        words = re.compile(rf"{_DEVICE_WORDS.pattern}|\b({'|'.join(map(re.escape, device_macros))})\b")
    _Scanner(text, chars, words).scope(0, len(text))
    return "".join(chars)


def project_headers(source: Path, include_dirs=()) -> list[Path]:
    """`source` and the project's own headers it reaches, recursively: each ``#include "..."``
    found beside its includer or in `include_dirs`, each ``#include <...>`` found in `include_dirs`
    or beside `source` (the runner puts that folder on the include path)."""
    source = source.resolve()
    dirs = [source.parent, *(Path(d).resolve() for d in include_dirs)]
    found: list[Path] = []
    pending = [source]
    while pending:
        path = pending.pop()
        if path in found or not path.is_file():
            continue
        found.append(path)
        for include in _ANY_INCLUDE.finditer(path.read_text(errors="replace")):
            quoted, name = include.group(1), include.group(2) or include.group(3)
            if name.startswith(HOST_ONLY_HEADERS):
                continue
            folders = [path.parent, *dirs] if quoted else dirs
            first = next((f / name for f in folders if (f / name).is_file()), None)
            if first is not None:
                pending.append(first.resolve())
    return found


def device_macros(source: Path, include_dirs=()) -> tuple[str, ...]:
    """Macros of `source` and of the project's headers it includes (`project_headers`) whose
    replacement names __device__, __global__ or such a macro: ``#define DEVICE_INLINE __device__
    __forceinline__`` makes ``DEVICE_INLINE float f()`` device code."""
    found: dict[str, str] = {}
    for path in project_headers(source, include_dirs):
        found.update((m.group(1), m.group(2)) for m in _DEFINE.finditer(path.read_text(errors="replace")))
    device: set[str] = set()
    while True:  # macros naming macros that name __device__, to a fixed point
        pattern = re.compile(r"\b(__global__|__device__" + "".join(f"|{re.escape(d)}" for d in device) + r")\b")
        more = {name for name, body in found.items() if name not in device and pattern.search(body)}
        if not more:
            return tuple(sorted(device))
        device |= more


def device_only_copy(source: Path, folder: Path, include_dirs=()) -> tuple[Path, tuple[Path, ...]]:
    """A copy of `source` and of the project's headers it reaches with their host code set aside,
    under `folder`, and the include dirs that find the copies first.

    Each file is copied to its own absolute path below one root (named by the content of them
    all), so a relative ``#include "../common/utils.h"`` finds the copy where it found the
    original; a ``#line`` directive on top of each keeps diagnostics at the original file and line.
    The original folders follow the copies on the include path, for headers the scan did not reach
    (an include spelled through a macro)."""
    macros = device_macros(source, include_dirs)
    files = project_headers(source, include_dirs)
    kept = {path: f'#line 1 "{path}"\n' + set_aside(path.read_text(errors="replace"), macros) for path in files}
    digest = hashlib.sha256("".join(f"{path}\0{text}\0" for path, text in kept.items()).encode()).hexdigest()[:24]
    root = folder / digest
    for path, text in kept.items():
        copy = root / path.relative_to(path.anchor)
        if not copy.exists():
            copy.parent.mkdir(parents=True, exist_ok=True)
            partial = copy.with_name(copy.name + f".{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(copy)
    originals = [source.resolve().parent, *(Path(d).resolve() for d in include_dirs)]
    mirrored = tuple(root / d.relative_to(d.anchor) for d in originals)
    return root / files[0].relative_to(files[0].anchor), mirrored + tuple(originals)


def originals(text: str) -> str:
    """`text` (a message, a report) with the paths of `device_only_copy`'s copies turned back into
    the originals' (debug info may name the copy where a ``#line`` directive did not reach)."""
    return _COPY_ROOT.sub("", text)


def _blank(chars: list[str], start: int, end: int) -> None:
    for i in range(start, end):
        if chars[i] != "\n":
            chars[i] = " "


def _blank_host_includes(text: str, chars: list[str]) -> None:
    offset = 0
    for line in text.splitlines(keepends=True):
        found = _INCLUDE.match(line)
        if found and found.group(1).startswith(HOST_ONLY_HEADERS):
            _blank(chars, offset, offset + len(line.rstrip("\n")))
        offset += len(line)


class _Scanner:
    """Walks file scope statement by statement, skipping comments, strings and preprocessor lines."""

    def __init__(self, text: str, chars: list[str], device_words: re.Pattern):
        self.text, self.chars, self.device_words = text, chars, device_words

    def scope(self, start: int, end: int) -> None:
        """Scan the declarations between `start` and `end` (a file or a namespace body)."""
        text, i, head = self.text, start, start
        while i < end:
            skipped = self._skip(i, end)
            if skipped is not None:
                if text[i] == "#":  # a preprocessor line ends the statement before it
                    head = skipped
                i = skipped
            elif text[i] == ";":
                self._declaration(head, i + 1)
                i = head = i + 1
            elif text[i] == "{":
                close = self._matching_brace(i, end)
                self._block(head, i, close)
                i = head = close + 1
                if i < end and text[i] == ";":  # `struct S { ... };`
                    i = head = i + 1
            else:
                i += 1

    def _block(self, head: int, brace: int, close: int) -> None:
        words = self._code(head, brace)
        if _SCOPE.match(words):
            self.scope(brace + 1, close)
        elif _TYPE_DEFINITION.match(words) or "=" in _outside_parens(words):
            return  # a type, or a variable with an initialiser
        elif "(" in words and not self.device_words.search(words):
            _blank(self.chars, self._first_code(head, brace), close + 1)

    def _declaration(self, head: int, end: int) -> None:
        words = self._code(head, end)
        if HOST_ONLY_NAMES.search(words) and not self.device_words.search(words):
            _blank(self.chars, self._first_code(head, end), end)

    def _skip(self, i: int, end: int) -> int | None:
        """The index past the comment, literal or preprocessor line that starts at `i`, else None."""
        text = self.text
        if text.startswith("//", i):
            newline = text.find("\n", i)
            return end if newline < 0 else newline
        if text.startswith("/*", i):
            close = text.find("*/", i + 2)
            return end if close < 0 else close + 2
        if text[i] in "\"'":
            j = i + 1
            while j < len(text) and text[j] != text[i] and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            return j + 1
        if text[i] == "#" and text[text.rfind("\n", 0, i) + 1 : i].strip() == "":
            j = i
            while True:  # up to the end of the line, continuation lines included
                newline = text.find("\n", j)
                if newline < 0:
                    return len(text)
                if text[newline - 1] != "\\":
                    return newline + 1
                j = newline + 1
        return None

    def _code(self, start: int, end: int) -> str:
        """The text between start and end without comments (for deciding, not for blanking)."""
        text = re.sub(r"/\*.*?\*/", " ", self.text[start:end], flags=re.S)
        return re.sub(r"//[^\n]*", " ", text)

    def _first_code(self, start: int, end: int) -> int:
        """Where the statement itself starts: past leading blanks and comments."""
        i = start
        while i < end:
            if self.text[i].isspace():
                i += 1
            elif self.text.startswith(("//", "/*"), i):
                i = self._skip(i, end)
            else:
                break
        return i

    def _matching_brace(self, i: int, end: int) -> int:
        text, depth, j = self.text, 0, i
        while j < end:
            skipped = self._skip(j, end)
            if skipped is not None:
                j = skipped
                continue
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return j
            j += 1
        return end - 1


def _outside_parens(words: str) -> str:
    """`words` without what is inside parentheses or angle brackets (default arguments, templates)."""
    out, depth = [], 0
    for ch in words:
        if ch in "(<":
            depth += 1
        elif ch in ")>" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)
