"""The `fa_verify` command: parser, dispatch, and exit codes CI can use.

Exit codes: 0 success; 1 a check failed (a kernel is wrong, or a benchmark misses its
target); 2 usage or setup error (bad arguments, unavailable backend, bad input).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fa_verify.cli import backends_cmd, bench_cmd, build_cmd, check_cmd, mutants_cmd, report_cmd
from fa_verify.cli.other_warnings import held_back
from fa_verify.errors import FaVerifyError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_COMMANDS = (backends_cmd, bench_cmd, check_cmd, build_cmd, report_cmd, mutants_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fa_verify",
        description="Correctness and numerics harness for FlashAttention kernels: a certified "
                    "reference (float64 with rigorous error bounds, mpmath fallback), an error "
                    "model that derives tolerances from a kernel's precision, and checks.",
        epilog="Exit codes: 0 success, 1 a check failed or a target was missed, "
               "2 usage or setup error. Run 'fa_verify COMMAND --help' for each command.",
    )
    from fa_verify import __version__
    parser.add_argument("--version", action="version", version=f"fa_verify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def hypothesis_storage() -> None:
    """Point Hypothesis' storage at a cache folder unless the user chose one.

    The searches use no example database (a fixed seed replays a failure, and every failure
    prints a reproducer), but Hypothesis also caches the constants it reads from the target's
    source, in ./.hypothesis by default: a folder left in whatever directory the command ran
    in. The cache is worth keeping between runs, so it moves rather than going away.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(cache / "fa_verify" / "hypothesis"))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    hypothesis_storage()
    try:
        with held_back(args.command):
            return args.handler(args)
    except FaVerifyError as exc:
        print(f"fa_verify {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"fa_verify {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
