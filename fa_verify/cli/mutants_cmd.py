"""`fa_verify mutants`: judge the harness: mutation score, false positives, other rules side by side."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from fa_verify.arguments import int_at_least, positive_int, not_a_folder, writable_file
from fa_verify.profiles import DEFAULT_PROFILE, PROFILES


def add_parser(sub) -> None:
    from fa_verify.judge.rule_table import RULE_NAMES

    cmd = sub.add_parser(
        "mutants", help="mutation score of the property suite on seeded kernel bugs, false positives, "
                        "and the checking rules others use side by side",
        description="Runs the property suite (ci profile by default) against every mutant of "
                    "kernels/mutants/mutants.toml (one seeded bug each) through the CUDA-on-CPU runner "
                    "(and, for a mutant no property kills, against its AddressSanitizer build: 'killed "
                    "by sanitizer'); prints per mutant the property that killed it, the examples and "
                    "seconds until then and the minimal counterexample. Runs the suite on the unmutated "
                    "kernels with --seeds Hypothesis seeds and counts false positives. Runs the rules "
                    "others use (flash-attention's tests, KernelBench's, torch.testing.assert_close "
                    "defaults) on every mutant and on the unmutated kernels, and prints each rule's kill "
                    "rate, false positives and time to kill next to the suite's. Exit 0: every mutant "
                    "killed and no false positive; 1: a mutant survived the suite or a correct kernel "
                    "failed it; 2: usage or setup error. With --exploits: the same for the catalogue of "
                    "known exploits of kernel checkers (fa_verify.judge.exploits: mean of V, caches, state "
                    "between calls, writes into inputs, ...), false positives on the correct callables; an "
                    "exploit declared out of reach of an in-process checker may survive.")
    cmd.add_argument("--family", action="append", metavar="FAMILY",
                     help="only mutants of this kernel family (repeatable: fa2, wmma, mma_ptx, naive, naive16, "
                          "fa3_fp8, split_kv, fa2_bwd)")
    cmd.add_argument("--mutant", action="append", metavar="NAME", help="only this mutant (repeatable)")
    cmd.add_argument("--exploits", action="store_true",
                     help="judge the exploit catalogue (fa_verify.judge.exploits) instead of the mutants")
    cmd.add_argument("--exploit", action="append", metavar="NAME",
                     help="only this exploit (repeatable; implies --exploits)")
    cmd.add_argument("--fp8", action="store_true",
                     help="the FP8 judging table: the FP8 mutants (fa_verify.judge.fp8_mutants, and any mutant of "
                          "mutants.toml whose kernel runs FP8 problems) and their correct kernels, each judged on "
                          "every one of --seeds seeds by the suite and by the FP8 gates others use "
                          "(fa_verify.judge.fp8_rules); prints seeds killed per target and rule")
    cmd.add_argument("--markdown-into", default=None, metavar="PATH", type=not_a_folder,
                     help="with --fp8: write the table into PATH between its markers (docs/results.md)")
    cmd.add_argument("--seeds", type=int_at_least(0), default=20, metavar="N",
                     help="Hypothesis seeds for the suite on the unmutated kernels (default 20; 0 skips "
                          "the false-positive runs)")
    cmd.add_argument("--max-examples", type=positive_int, default=None, metavar="N",
                     help="examples per property (default: the profile's; ci: 20)")
    cmd.add_argument("--profile", default=None, choices=tuple(PROFILES),
                     help=f"search profile of the suite (default: {DEFAULT_PROFILE})")
    cmd.add_argument("--rule", action="append", dest="rules", choices=RULE_NAMES,
                     help="other rule to run side by side (repeatable; default: all)")
    cmd.add_argument("--no-rules", action="store_true", help="run only the property suite")
    cmd.add_argument("--no-sanitizer", action="store_true",
                     help="do not try the AddressSanitizer build on mutants the properties miss")
    cmd.add_argument("--first-kill", action="store_true",
                     help="stop each mutant's suite at the first failing property (faster; the table "
                          "then lists no 'also caught by')")
    cmd.add_argument("--mutants-file", default=None, metavar="PATH", type=not_a_folder,
                     help="read mutants from PATH instead of kernels/mutants/mutants.toml")
    cmd.add_argument("--json", action="store_true", help="print one JSON document")
    cmd.add_argument("--save", default=None, metavar="PATH", type=writable_file,
                     help="also write the JSON document to PATH (e.g. with the table printed)")
    cmd.add_argument("--markdown", default=None, metavar="PATH", type=writable_file,
                     help="also write the two tables in Markdown to PATH (the README's tables)")
    cmd.set_defaults(handler=_run)


def _run(args) -> int:
    from fa_verify.backends.cuda_kernels import cpu_runner_availability
    from fa_verify.errors import BackendUnavailableError, InvalidArgumentError
    from fa_verify.kernels.mutants import load_mutants, mutable_kernels
    from fa_verify.judge.report import run_campaign
    from fa_verify.kernels.catalogue import get_family

    if args.fp8:
        return _run_fp8(args)
    if args.markdown_into:
        raise InvalidArgumentError("--markdown-into writes the FP8 judging table: use it with --fp8")
    if args.exploits or args.exploit:
        return _run_exploits(args)
    for family in args.family or ():
        if family not in mutable_kernels():
            get_family(family)  # an unknown family is a usage error before "no mutant of it"
    if args.mutants_file is not None and not Path(args.mutants_file).exists():
        raise InvalidArgumentError(f"--mutants-file {args.mutants_file!r}: no such file")
    mutants = load_mutants(args.mutants_file, families=args.family, names=args.mutant)
    runner = cpu_runner_availability()
    if not runner.available:
        raise BackendUnavailableError(f"the mutants run through the CUDA-on-CPU runner: {runner.reason}")
    if not mutants:
        raise InvalidArgumentError("no mutant selected")
    profile, selection = _selection(args)
    report = run_campaign(mutants, selection, profile=profile, seeds=range(args.seeds),
                          families=args.family or None, rules=_rules(args), sanitizer=not args.no_sanitizer,
                          stop_at_first=args.first_kill, quiet=False)
    return _print(report, args)


def _selection(args):
    from fa_verify.properties import Selection

    profile = args.profile or DEFAULT_PROFILE
    selection = Selection.from_profile(profile, max_examples=args.max_examples)
    if selection.seed is None:  # a profile that explores: seed it, so the table can be reproduced
        selection = dataclasses.replace(selection, seed=0)
    return profile, selection


def _rules(args) -> list:
    from fa_verify.judge.rule_table import RULES, get_rule

    return [] if args.no_rules else [get_rule(r) for r in args.rules] if args.rules else list(RULES)


def _run_exploits(args) -> int:
    """The campaign on the exploit catalogue: the exploits that cannot run here are listed, not run."""
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.judge.exploits import FAMILY, get_exploits
    from fa_verify.judge.report import run_campaign

    for option, given in (("--family", args.family), ("--mutant", args.mutant), ("--mutants-file", args.mutants_file)):
        if given:
            raise InvalidArgumentError(f"{option} selects mutants; with --exploits select with --exploit NAME")
    chosen = get_exploits(args.exploit)
    skipped = [(e.name, e.missing()) for e in chosen if e.missing()]
    runnable = [e for e in chosen if not e.missing()]
    if not runnable:
        raise InvalidArgumentError("no exploit can run here: " + "; ".join(f"{n}: {why}" for n, why in skipped))
    profile, selection = _selection(args)
    report = run_campaign(runnable, selection, profile=profile, seeds=range(args.seeds), families=[FAMILY],
                          rules=_rules(args), sanitizer=not args.no_sanitizer, stop_at_first=args.first_kill,
                          quiet=False, exploits=True, skipped=skipped)
    return _print(report, args)


def _run_fp8(args) -> int:
    """The FP8 judging table: the campaign over --seeds seeds (fa_verify.judge.over_seeds)."""
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.judge.fp8_rules import FP8_RULES
    from fa_verify.judge.over_seeds import fp8_mutants, run_over_seeds, write_between_markers

    for option, given in (("--family", args.family), ("--exploits", args.exploits or args.exploit),
                          ("--markdown", args.markdown)):
        if given:
            raise InvalidArgumentError(f"{option} does not apply to --fp8 (select with --mutant NAME; write "
                                       "the table with --markdown-into PATH)")
    if args.seeds < 1:
        raise InvalidArgumentError("--fp8 judges over seeds: give --seeds 1 or more")
    mutants = [m for m in fp8_mutants(args.mutants_file) if not args.mutant or m.name in args.mutant]
    unknown = set(args.mutant or ()) - {m.name for m in mutants}
    if unknown:
        raise InvalidArgumentError(f"--mutant {sorted(unknown)[0]!r} is no FP8 mutant; FP8 mutants: "
                                   + ", ".join(m.name for m in fp8_mutants(args.mutants_file)))
    _, selection = _selection(args)
    rules = [] if args.no_rules else [r for r in FP8_RULES if not args.rules or r.name in args.rules]
    table = run_over_seeds(mutants, rules, range(args.seeds), dataclasses.replace(selection, shrink=False),
                           quiet=False)
    if args.markdown_into:
        write_between_markers(args.markdown_into, table.markdown())
    return _print(table, args)


def _print(report, args) -> int:
    document = json.dumps(report.as_dict(), indent=2)
    if args.save:
        with open(args.save, "w") as fh:
            fh.write(document + "\n")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(report.markdown() + "\n")
    if args.json:
        print(document)
    else:
        print(report.text())
    sys.stdout.flush()
    return 0 if report.passed else 1
