"""Argument types of the command line and the pytest plugin: a bad value is a usage error (exit 2) that names
the option, the value and how to fix it, before anything runs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer; give a whole number >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be a whole number >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse calls the type in its messages
    return parse


#: Counts that must be at least one (examples per property, sequence lengths, repeats...).
positive_int = int_at_least(1)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give seconds > 0, e.g. 60") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value:g} must be a finite number of seconds > 0")
    return value


def _nearest_existing(path: Path) -> Path:
    """`path` itself or its nearest ancestor that exists."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def writable_file(text: str) -> str:
    """A file fa_verify may create or append to: not a folder, and any missing folders on its
    way can be created."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file inside it, e.g. "
                                         f"{str(path / 'results.jsonl')!r}")
    existing = _nearest_existing(path)
    if existing != path and not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(existing)!r} is a file, not a folder; "
                                         "choose a path whose folders are folders")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {str(existing)!r} is not writable; choose another path")
    return text


def writable_folder(text: str) -> str:
    """A folder fa_verify writes into (created if missing): not an existing file."""
    path = Path(text).expanduser()
    existing = _nearest_existing(path)
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under the file {str(existing)!r}"
        raise argparse.ArgumentTypeError(f"{text!r} {what}; name a folder (it is created if missing)")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {str(existing)!r} is not writable; choose another folder")
    return text


def not_a_folder(text: str) -> str:
    """A file to read: not a folder (a missing file is the command's to report)."""
    path = Path(text).expanduser()
    if path.is_dir():
        inside = sorted(str(p) for p in path.glob("*.jsonl"))  # a report folder holds results.jsonl
        hint = f"; did you mean {inside[0]!r}?" if inside else ""
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file; name the file itself{hint}")
    return text
