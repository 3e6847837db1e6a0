"""`fa_verify build --nvcc`: compile every kernel for real GPU targets and report resource usage."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    cmd = sub.add_parser(
        "build", help="compile the CUDA kernels with nvcc (no GPU needed) and report resources",
        description="Compiles every kernel in kernels/ with nvcc for each --arch (nvcc -cubin "
                    "--resource-usage; no GPU needed) and prints registers, shared memory "
                    "(static, and the dynamic amount the catalogue launches with), stack frame "
                    "and spills per kernel entry. --cpu builds them for the CUDA-on-CPU runner "
                    "(g++) instead or as well. Exit 1 if a kernel fails to compile, 2 if nvcc "
                    "is missing (looked for on PATH, under $CUDA_HOME, then in the pip "
                    "nvidia-cuda-nvcc wheel).")
    cmd.add_argument("--nvcc", action="store_true",
                     help="compile with nvcc for GPU targets (the default when --cpu is not given)")
    cmd.add_argument("--cpu", action="store_true",
                     help="build every kernel for the CUDA-on-CPU runner (g++ and the shim)")
    cmd.add_argument("--arch", default="sm_80,sm_90",
                     help="comma-separated GPU targets (default: sm_80,sm_90)")
    cmd.add_argument("--kernel", default=None,
                     help="comma-separated kernel families (default: all; see 'fa_verify backends')")
    cmd.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: CPUs)")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmd.set_defaults(handler=_run)


def _run(args) -> int:
    from fa_verify.errors import InvalidArgumentError
    from fa_verify.kernels.catalogue import get_family
    from fa_verify.kernels.nvcc import check_build, find_nvcc, nvcc_version

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs:
        raise InvalidArgumentError(f"--arch={args.arch!r} names no target; use e.g. sm_80,sm_90")
    families = None
    if args.kernel:
        families = [get_family(name.strip()) for name in args.kernel.split(",") if name.strip()]
    if args.jobs is not None and args.jobs < 1:
        raise InvalidArgumentError(f"--jobs={args.jobs} must be >= 1")
    status, cpu_rows = 0, None
    if args.cpu:
        status, cpu_rows = _build_cpu(families, as_json=args.json)
        if not args.nvcc:
            if args.json:
                print(json.dumps({"passed": not status, "cpu": cpu_rows}, indent=2))
            return status
    nvcc = find_nvcc()  # NvccNotFoundError -> exit 2 with its message
    results = check_build(archs, families=families, nvcc=nvcc, jobs=args.jobs)
    failed = [r for r in results if not r.ok]

    if args.json:
        print(json.dumps({
            "nvcc": str(nvcc), "version": nvcc_version(nvcc), "archs": archs,
            "passed": not failed and not status,
            **({"cpu": cpu_rows} if cpu_rows is not None else {}),
            "files": [{"source": r.source, "families": r.families, "arch": r.arch, "ok": r.ok,
                       "seconds": round(r.seconds, 2), "log": r.log,
                       "entries": [e.as_dict() for e in r.entries]} for r in results],
        }, indent=2))
        return 1 if failed or status else 0

    print(f"nvcc {nvcc_version(nvcc)} ({nvcc}); targets {', '.join(archs)}")
    header = f"{'entry':<18} {'arch':<6} {'regs':>5} {'threads':>7} {'smem static':>11} " \
             f"{'smem dynamic':>12} {'stack':>6} {'spill st':>8} {'spill ld':>8}"
    for r in results:
        print(f"\n{r.source} [{r.arch}]: {'ok' if r.ok else 'FAILED'} in {r.seconds:.1f} s")
        if r.log.strip():
            print("\n".join("  " + line for line in r.log.strip().splitlines()),
                  file=sys.stdout if r.ok else sys.stderr)
        if r.entries:
            print(header)
            for e in r.entries:
                print(f"{e.entry:<18} {e.arch:<6} {e.registers:>5} {e.threads:>7} {e.static_smem:>11} "
                      f"{e.dynamic_smem:>12} {e.stack_frame:>6} {e.spill_stores:>8} {e.spill_loads:>8}")
    spills = sum(1 for r in results for e in r.entries if e.spill_stores or e.spill_loads)
    print(f"\n{len(results) - len(failed)}/{len(results)} kernel files compiled; "
          f"{sum(len(r.entries) for r in results)} entries; {spills} with register spills")
    if failed:
        print("failed: " + ", ".join(f"{r.source} [{r.arch}]" for r in failed), file=sys.stderr)
        return 1
    return status


def _build_cpu(families, as_json: bool) -> tuple[int, list]:
    """Build each family for the CPU runner: (exit status, one row per family); prints lines unless JSON."""
    import time

    from fa_verify.backends.cuda_kernels import cpu_module, cpu_runner_availability
    from fa_verify.errors import BackendUnavailableError, KernelBuildError
    from fa_verify.kernels.catalogue import FAMILIES

    availability = cpu_runner_availability()
    if not availability.available:
        raise BackendUnavailableError(f"cannot build for the CPU runner: {availability.reason}")
    rows, failed = [], 0
    for family in families or FAMILIES.values():
        start = time.perf_counter()
        try:
            module = cpu_module(family)
            row = {"family": family.name, "source": family.source, "ok": True, "library": module.library_path}
        except KernelBuildError as exc:
            failed += 1
            row = {"family": family.name, "source": family.source, "ok": False, "log": str(exc)}
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        if not as_json:
            print(f"cpu runner: {family.source} ({family.name}): "
                  f"{'ok' if row['ok'] else 'FAILED'} in {row['seconds']:.1f} s")
            if not row["ok"]:
                print(row["log"], file=sys.stderr)
    return (1 if failed else 0), rows
