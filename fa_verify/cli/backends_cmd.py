"""`fa_verify backends`: every backend, whether it can run here, and why not."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    cmd = sub.add_parser("backends", help="list backends and their availability",
                         description="Lists every backend (CPU models, torch SDPA, kernels) "
                                     "with its dtypes and precision model, whether it is "
                                     "available here, and the reason when it is not. Exit 0 "
                                     "(an unavailable backend is listed, not an error); 2: usage "
                                     "error.")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmd.set_defaults(handler=_run)


def _run(args) -> int:
    from fa_verify.backends import backend_table

    table = backend_table()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    width = max(len(row["name"]) for row in table)
    for row in table:
        status = "available" if row["available"] else f"unavailable: {row['reason']}"
        print(f"{row['name']:<{width}}  {','.join(row['dtypes']):<15}  {status}")
    return 0
