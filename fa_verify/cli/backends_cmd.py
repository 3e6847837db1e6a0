"""`fa_verify backends`: every backend, whether it can run here, and why not."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    cmd = sub.add_parser("backends", help="list backends and their availability",
                         description="Lists every built-in backend (CPU models, torch SDPA, kernels; dense, "
                                     "varlen and paged KV) with the kind of problem it runs, its dtypes, "
                                     "variants and whether it splits the keys; whether each is available here, "
                                     "and the reason when it is not. Exit 0 (an unavailable backend is listed, "
                                     "not an error); 2: usage error.")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmd.set_defaults(handler=_run)


def _run(args) -> int:
    from fa_verify.backends import backend_table

    rows = backend_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        features = ",".join(row["features"]) or "no variants"
        splits = "; split-KV" if row["splits"] else ""
        print(f"{row['name']:<{width}}  {'/'.join(row['kinds']):<6}  {','.join(row['dtypes']):<15}  "
              f"{features}{splits}  {_status(row)}")
    return 0


def _status(row: dict) -> str:
    return "available" if row["available"] else f"unavailable: {row['reason']}"
