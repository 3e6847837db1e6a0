"""Warnings from code other than fa_verify's, held back until a command's output is written.

A kernel's numpy RuntimeWarnings or a library's deprecation notices, printed as they come,
split the per-property lines and the report summary apart. fa_verify's own warnings (a
skipped results line, ...) concern the run and are shown at once, as before.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent


def _is_own(category, filename: str) -> bool:
    return category.__module__.startswith("fa_verify") or Path(filename).resolve().is_relative_to(_PACKAGE)


@contextlib.contextmanager
def held_back(command: str):
    """Show fa_verify's warnings at once; list every other distinct warning once, on stderr,
    when the block ends (normally or not). The filters (-W, PYTHONWARNINGS) still decide
    which warnings are issued at all."""
    held = {}
    show = warnings.showwarning

    def hold(message, category, filename, lineno, file=None, line=None):
        if _is_own(category, filename):
            show(message, category, filename, lineno, file, line)
        else:
            held.setdefault((filename, lineno, category.__name__, str(message)), None)

    warnings.showwarning = hold
    try:
        yield
    finally:
        warnings.showwarning = show
        if held:
            print(f"fa_verify {command}: {len(held)} warning(s) from other code (the target or a "
                  "library), each shown once:", file=sys.stderr)
            for filename, lineno, category, message in held:
                message = message.replace("\n", "\n    ")
                print(f"  {filename}:{lineno}: {category}: {message}", file=sys.stderr)
