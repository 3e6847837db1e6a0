"""Mutants: deliberately broken copies of the kernels, to measure what the harness catches.

Each mutant (kernels/mutants/mutants.toml) is one textual edit of one kernel family's source.
`materialise` writes the edited source beside a copy of fa_common.cuh in a folder of its own, so
the CPU runner (or nvcc) builds it exactly like the original.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fa_verify.errors import InvalidArgumentError
from fa_verify.kernels.catalogue import FAMILIES, KernelFamily, kernels_dir

CAUGHT_BY = ("oracle", "sanitizer", "property", "race")


@dataclass(frozen=True)
class Mutant:
    name: str
    family: str
    #: the kind of bug (issue 5's classes), for the campaign's table
    bug_class: str
    description: str
    find: str
    replace: str
    #: what catches it in tests/test_kernels.py: "oracle" (the oracle comparison over the fixed
    #: grid fails), "sanitizer" (AddressSanitizer reports it), "property" (only the property
    #: suite's search finds it: tests/test_judge.py) or "race" (the race detector reports it)
    caught_by: str
    #: split_kv's mutants only: the layout of the ragged backend that runs it, "paged" or "varlen"
    #: (a bug one layout alone shows, such as the varlen LSE layout)
    layout: str | None = None

    @property
    def kernel_family(self) -> KernelFamily:
        """The mutated kernel: a catalogue family, or split_kv.cu (SplitKvKernel, its own ABI)."""
        return mutable_kernels()[self.family]

    @property
    def backward(self) -> bool:
        """Whether the mutated kernel computes gradients (fa2_bwd): it runs as a backend of
        backward problems (fa_verify.judge.mutants.mutant_backend)."""
        return getattr(self.kernel_family, "backward", False)

    def mutate(self, source: str) -> str:
        count = source.count(self.find)
        if count != 1:
            raise InvalidArgumentError(
                f"mutant {self.name!r}: its `find` text occurs {count} times in "
                f"{self.kernel_family.source} (it must occur exactly once; was the kernel edited?)")
        return source.replace(self.find, self.replace)

    def materialise(self, folder: str | Path) -> Path:
        """Write the mutated source (and fa_common.cuh, and the files it includes) into `folder`;
        return the source's path."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        src = kernels_dir()
        for name in ("fa_common.cuh", *getattr(self.kernel_family, "includes", ())):
            shutil.copyfile(src / name, folder / name)
        path = folder / self.kernel_family.source
        path.write_text(self.mutate((src / self.kernel_family.source).read_text()))
        return path


def mutable_kernels() -> dict:
    """{family: kernel} of every kernel a mutant may edit: the catalogue's dense families, the
    split-KV kernel (fa_verify.kernels.split_kv), whose mutants run as ragged backends, and the
    backward kernel (fa_verify.kernels.backward), whose mutants run as backward backends
    (`Mutant.backward`)."""
    from fa_verify.kernels.backward import FA2_BWD
    from fa_verify.kernels.split_kv import SPLIT_KV

    return {**FAMILIES, SPLIT_KV.name: SPLIT_KV, FA2_BWD.name: FA2_BWD}


def load_mutants(path: str | Path | None = None, *, families=None, names=None) -> list[Mutant]:
    """The mutants listed in kernels/mutants/mutants.toml (or `path`), optionally only those of
    the given families and/or names (an unknown name, or a family without mutants, is an error)."""
    path = Path(path) if path else kernels_dir() / "mutants" / "mutants.toml"
    data = tomllib.loads(path.read_text())
    mutants = []
    for entry in data.get("mutant", []):
        try:
            mutant = Mutant(**entry)
        except TypeError as exc:
            raise InvalidArgumentError(f"{path}: bad mutant entry {entry.get('name')!r}: {exc}") from None
        if mutant.family not in mutable_kernels():
            raise InvalidArgumentError(f"{path}: mutant {mutant.name!r} names unknown family {mutant.family!r}")
        if (mutant.layout is not None) != (mutant.family == "split_kv") or mutant.layout not in (None, "paged", "varlen"):
            raise InvalidArgumentError(f"{path}: mutant {mutant.name!r}: layout={mutant.layout!r}; split_kv's mutants "
                                       "name the layout that runs them ('paged' or 'varlen'), other families' none")
        if mutant.caught_by not in CAUGHT_BY:
            raise InvalidArgumentError(f"{path}: mutant {mutant.name!r}: caught_by must be one of {CAUGHT_BY}")
        mutants.append(mutant)
    known_names = {m.name for m in mutants}
    for name in names or ():
        if name not in known_names:
            raise InvalidArgumentError(f"mutant {name!r} is unknown; mutants: {', '.join(sorted(known_names))}")
    known_families = {m.family for m in mutants}
    for family in families or ():
        if family not in known_families:
            raise InvalidArgumentError(
                f"no mutant of family {family!r}; families with mutants: {', '.join(sorted(known_families))}")
    return [m for m in mutants if (not families or m.family in families) and (not names or m.name in names)]
