"""`fa_verify backends`: every backend, whether it can run here, and why not."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    cmd = sub.add_parser("backends", help="list backends and their availability",
                         description="Lists every backend (CPU models, torch SDPA, kernels) "
                                     "with its dtypes and precision model, then the ragged "
                                     "backends (varlen / paged KV) with their layout, variants "
                                     "and whether they split the keys; whether each is "
                                     "available here, and the reason when it is not. Exit 0 "
                                     "(an unavailable backend is listed, not an error); 2: usage "
                                     "error.")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmd.set_defaults(handler=_run)


def _run(args) -> int:
    from fa_verify.backends import backend_table, ragged_backend_table

    dense = [{**row, "layout": "dense"} for row in backend_table()]
    ragged = ragged_backend_table()
    if args.json:
        print(json.dumps(dense + ragged, indent=2))
        return 0
    width = max(len(row["name"]) for row in dense + ragged)
    for row in dense:
        print(f"{row['name']:<{width}}  {','.join(row['dtypes']):<15}  {_status(row)}")
    print("\nragged backends (varlen / paged KV; a function of yours: check MODULE:FUNC --layout varlen|paged):")
    for row in ragged:
        features = ",".join(row["features"]) or "no variants"
        splits = "split-KV" if row["splits"] else "no split"
        print(f"{row['name']:<{width}}  {row['layout']:<6}  {','.join(row['dtypes']):<15}  "
              f"{features}; {splits}  {_status(row)}")
    return 0


def _status(row: dict) -> str:
    return "available" if row["available"] else f"unavailable: {row['reason']}"
