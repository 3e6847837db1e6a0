"""Published results the report reproduces beside the papers' figures: FlashAttention-3's
Table 3 (`fa3.measure_table3`) and Golden et al. 2024 (`golden`).

They are fixed experiments on our own kernels and models, independent of the sweep's
backends; a sweep names the ones it runs (`Sweep.published`). `fa_verify report` measures them
after the sweep — every problem's figures come from the measurement cache when its inputs
(setup, seed, code) are unchanged, so a re-run costs ~nothing — and saves them as
OUT/published.json, which the page renders (with `--from`, the one beside the results file).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fa_verify.report import fa3, golden
from fa_verify.report.measurements import MeasurementCache

FILE = "published.json"
#: name -> (measure(cache, progress) -> JSON, JSON -> the page's view)
EXPERIMENTS = {
    "fa3": (lambda cache, progress: fa3.measure_table3(fa3.Table3Setup(), cache, progress), fa3.table3),
    "golden": (lambda cache, progress: golden.measure(golden.GoldenSetup(), cache, progress),
               golden.summarise),
}


def measure(names, cache: MeasurementCache | None = None, stream=None) -> dict:
    """The experiments `names` (keys of EXPERIMENTS) as JSON, with what the run cost and reused."""
    cache = cache or MeasurementCache()
    stream = stream if stream is not None else sys.stderr
    tty = hasattr(stream, "isatty") and stream.isatty()
    start = time.perf_counter()

    def progress(step: str) -> None:  # redrawn in place on a terminal; a log gets the last line only
        if tty:
            print(f"\rfa_verify report: reproducing {step}\x1b[K", end="", file=stream, flush=True)

    results = {name: EXPERIMENTS[name][0](cache, progress) for name in names}
    seconds = time.perf_counter() - start
    print(f"{chr(13) if tty else ''}fa_verify report: published results reproduced in {seconds:.1f} s "
          f"({cache.computed} problems measured, {cache.reused} from the cache {cache.folder})"
          f"{chr(27) + '[K' if tty else ''}", file=stream, flush=True)
    return {"experiments": results, "seconds": seconds, "computed": cache.computed,
            "reused": cache.reused}


def save(data: dict, out_dir) -> None:
    path = Path(out_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.replace(path)


def load(folder) -> dict | None:
    """published.json of `folder`, None if there is none (or it cannot be read)."""
    try:
        return json.loads((Path(folder) / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@dataclass
class Published:
    """What the page shows: each experiment's view (None: not measured in this run)."""

    fa3: fa3.Table3 | None
    golden: golden.Golden | None
    seconds: float
    computed: int
    reused: int


def view(data: dict | None) -> Published | None:
    if not data:
        return None
    experiments = data["experiments"]
    return Published(**{name: EXPERIMENTS[name][1](experiments[name]) if name in experiments else None
                        for name in EXPERIMENTS},
                     seconds=data["seconds"], computed=data["computed"], reused=data["reused"])
