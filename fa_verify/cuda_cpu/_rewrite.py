"""What the builder changes in a preprocessed kernel before g++ compiles it, and what it refuses.

Why rewrite after preprocessing rather than with a macro: ``__shared__`` must give static storage
to ``__shared__ float tile[64];`` (so every emulated thread of a block sees one array) while
``extern __shared__ unsigned char smem[];`` must stay an extern declaration that names the block's
dynamic shared memory. No macro can do both (``#define __shared__ static`` turns the second into
``extern static``). On the preprocessed text, which still carries the ``__shared__`` token from
every header and macro, the two cases are told apart by the preceding ``extern``:

* ``extern __shared__ SPECS name[];`` -> ``typedef SPECS alias[]; alias& name = *(alias*)
  fa_cpu_dynamic_smem;`` — every such array is a reference to the one buffer the runtime defines,
  as on the GPU. (An asm label on the extern declaration would be simpler, but g++ ignores asm
  labels on block-scope externs inside templates.) The typedef repeats the declaration's own
  specifiers, so the element type, qualifiers and attributes stay what the kernel wrote;
* any other ``__shared__`` -> ``static``, followed by a registration of the variable with the
  runtime (``static const bool reg = fa_cpu::register_shared(&name, sizeof(name));``), which
  fills it with NaN when control first passes the declaration and again at every block start.
  Function-local statics are per block because blocks run one after another; the NaN fill makes
  a read of shared memory the block has not written show in the output instead of reusing the
  previous block's values. (A linker section would not do: g++ ignores section attributes on
  the statics of templates and inline functions, which land in their own COMDAT ``.bss``.)
  The variables stay in default sections, so AddressSanitizer guards them too.

Line structure is kept, so the preprocessor's line markers still point compiler errors at the
user's files.
"""

from __future__ import annotations

import re
from pathlib import Path

from fa_verify.errors import KernelUnsupportedError

DYNAMIC_SHARED_SYMBOL = "fa_cpu_dynamic_smem"
REGISTER_SHARED = "::fa_cpu::register_shared"

_LINE_MARKER = re.compile(r'^#\s*(\d+)\s+"((?:[^"\\]|\\.)*)"([\d ]*)$')
STRING_OR_CHAR = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
_UNSUPPORTED_WORDS = re.compile(r"\b(__managed__)\b")
_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\b")
_STATIC_SHARED = re.compile(r"\bstatic\s+__shared__\b|\b__shared__\s+static\b")
_SHARED = re.compile(r"\b__shared__\b")
_ATTRIBUTE = re.compile(r"__attribute__\s*\(\(.*?\)\)|alignas\s*\([^)]*\)|\[\[.*?\]\]", re.S)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_UNKNOWN_BOUND_ARRAY = re.compile(r"([A-Za-z_]\w*)\s*\[\s*\]\s*(__attribute__\s*\(\(.*\)\))?\s*$", re.S)


def user_lines(text: str, shim_dir: Path):
    """Yield (offset, path, line, raw) for each line of preprocessed `text` from the kernel author's files.

    System headers and the shim may use ``__asm__`` (glibc does); only lines whose line marker
    names another file are the kernel author's.
    """
    shim_prefix = str(shim_dir.resolve())
    path, line, user, offset = "<unknown>", 0, False, 0
    for raw in text.split("\n"):
        start, offset = offset, offset + len(raw) + 1
        marker = _LINE_MARKER.match(raw)
        if marker:
            line = int(marker.group(1))
            path = marker.group(2)
            flags = marker.group(3).split()
            user = not ("3" in flags or path.startswith("<") or path.startswith(shim_prefix))
            continue
        if user:
            yield start, path, line, raw
        line += 1


def check_supported(text: str, shim_dir: Path) -> None:
    """Raise KernelUnsupportedError for ``__managed__`` memory in the user's code.

    (Inline assembly was rewritten or refused before, by ``_ptx.rewrite_inline_asm``.)
    """
    for _, path, line, raw in user_lines(text, shim_dir):
        if "__managed__" in raw:
            found = _UNSUPPORTED_WORDS.search(STRING_OR_CHAR.sub('""', raw))
            if found:
                raise KernelUnsupportedError(
                    f"{path}:{line}: `{found.group(1)}` memory is not supported by the CUDA-on-CPU runner"
                )


def rewrite_shared(text: str) -> str:
    """Give ``__shared__`` its meaning on the CPU (see the module docstring)."""
    text = _rewrite_extern_shared(text)
    text = _STATIC_SHARED.sub("__shared__", text)
    out: list[str] = []
    pos = 0
    for count, match in enumerate(_SHARED.finditer(text)):
        end = _declaration_end(text, match.end())
        names = [_declarator_name(d) for d in _split_top_level(text[match.end() : end])]
        registrations = "".join(
            f" [[maybe_unused]] static const bool __fa_cpu_shared_reg{count}_{i} = "
            f"{REGISTER_SHARED}((void*)&{name}, sizeof({name}));"
            for i, name in enumerate(names)
        )
        out.append(text[pos : match.start()] + "static" + text[match.end() : end + 1] + registrations)
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def _declaration_end(text: str, start: int) -> int:
    """Index of the `;` that ends the declaration starting at `start` (outside brackets)."""
    depth = 0
    for index in range(start, len(text)):
        ch = text[index]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ";" and depth == 0:
            return index
    raise KernelUnsupportedError("a `__shared__` declaration has no terminating `;`")


def _split_top_level(declaration: str) -> list[str]:
    """The declarators of a declaration: split at commas outside brackets and template arguments."""
    parts, depth, angle, current = [], 0, 0, ""
    for ch in declaration:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch == "<":
            angle += 1
        elif depth == 0 and ch == ">":
            angle -= 1
        elif ch == "," and depth == 0 and angle == 0:
            parts.append(current)
            current = ""
            continue
        current += ch
    return parts + [current]


def _declarator_name(declarator: str) -> str:
    """The variable a declarator declares: its last identifier outside brackets and attributes."""
    code = _ATTRIBUTE.sub(" ", declarator.split("=", 1)[0])
    code = re.sub(r"\[[^\[\]]*\]", " ", code)  # array bounds (one nesting level is all CUDA code uses)
    names = _IDENTIFIER.findall(code)
    if not names:
        raise KernelUnsupportedError(f"cannot tell which variable `__shared__{declarator}` declares")
    return names[-1]


def _rewrite_extern_shared(text: str) -> str:
    out: list[str] = []
    pos = 0
    for count, match in enumerate(_EXTERN_SHARED.finditer(text)):
        if match.start() < pos:
            continue
        end = text.find(";", match.end())
        if end < 0:
            raise KernelUnsupportedError("an `extern __shared__` declaration has no terminating `;`")
        declaration = text[match.end() : end]
        declarator = _UNKNOWN_BOUND_ARRAY.search(declaration)
        if declarator is None or len(_split_top_level(declaration)) > 1:
            raise KernelUnsupportedError(
                f"`extern __shared__ {' '.join(declaration.split())};`: the CUDA-on-CPU runner supports "
                "dynamic shared memory declared as one array of unknown size per declaration, e.g. "
                "`extern __shared__ __align__(16) unsigned char smem[];`"
            )
        name, tail = declarator.group(1), declarator.group(2) or ""
        alias = f"__fa_cpu_dynamic_shared_t{count}"
        specifiers = declaration[: declarator.start(1)]
        out.append(text[pos : match.start()])
        out.append(
            f"typedef{specifiers}{alias}[]{tail}; "
            f"{alias}& {name} = *reinterpret_cast<{alias}*>(::{DYNAMIC_SHARED_SYMBOL})"
        )
        pos = end
    out.append(text[pos:])
    return "".join(out)

