"""What a `fa_verify report` run asked for and left out, kept beside its results as run.json.

The records say what was measured; this says what was not (points a backend does not
support or that did not fit its time budget) and on which machine, so that a report rendered
later with --from still tells the whole story.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: Version of run.json's format.
RUN_INFO_VERSION = 1
FILE_NAME = "run.json"


@dataclass
class Skip:
    backend: str
    #: ProblemDescriptor as a dict
    problem: dict
    #: "unsupported" or "budget"
    kind: str
    reason: str


@dataclass
class RunInfo:
    sweep: str
    sweep_description: str
    backends: list
    budget_s: float
    started: str
    finished: str | None = None
    interrupted: bool = False
    skips: list = field(default_factory=list)
    #: `environment.collect()` of the machine that ran the sweep
    environment: dict = field(default_factory=dict)
    format_version: int = RUN_INFO_VERSION

    def save(self, directory) -> None:
        path = Path(directory) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)  # no record may have created it
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)  # never leave a half-written run.json behind

    @classmethod
    def load(cls, directory) -> "RunInfo | None":
        """The run.json in `directory`, or None if there is none of this format version."""
        path = Path(directory) / FILE_NAME
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        if data.get("format_version") != RUN_INFO_VERSION:
            return None
        data["skips"] = [Skip(**s) for s in data["skips"]]
        return cls(**data)
