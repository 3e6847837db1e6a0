"""Targets from options: the one builder behind `fa_verify check` and the pytest plugin.

The options both take are declared here once (`SEARCH_OPTIONS`, `callable_arguments()`; the
plugin spells them --fa-NAME), and `build_targets` turns a list of target names and the option
values into backends, whatever kind of problem they run: a built-in backend by name, 'all' (every
available built-in one), MODULE:FUNC (the callable protocol; `layout` varlen or paged: flash-attn's
varlen and kvcache signatures), or a CUDA file with its kernel spec. Every check of the options'
combination is here, and every refusal names the option and the fix (an InvalidArgumentError:
exit 2 in the CLI, a UsageError in pytest).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import replace

from fa_verify.arguments import positive_int, writable_file, writable_folder
from fa_verify.conventions import CONVENTION_OPTIONS, convention_arguments, conventions_from_options
from fa_verify.errors import BackendUnavailableError, InvalidArgumentError
from fa_verify.guards import forbidden_names
from fa_verify.isolation import DEFAULT_MEMORY_LIMIT, DEFAULT_TIMEOUT
from fa_verify.limits import _positive_set, limit_arguments, limits_from_options, read_limits_file
from fa_verify.profiles import DEFAULT_PROFILE, PROFILES

#: --layout's values for flash-attn's varlen and paged (kvcache) functions.
RAGGED_LAYOUTS = ("varlen", "paged")
LAYOUTS = ("bhsd", "bshd", *RAGGED_LAYOUTS)
#: Limit options that are also `check`'s selection options (--dtype, --causal), for any target.
SELECTION_LIMITS = ("dtype", "causal")
#: The value of --seed (--fa-seed) that draws a new seed per run.
RANDOM_SEED = "random"
SEED_HELP = ("Hypothesis seed: an integer, or 'random' to draw one per run (printed first and recorded, so "
             "a CI run explores new examples each time and a failure replays with --seed N)")
#: Where --no-isolate, --timeout and --memory-limit are not given.
ISOLATION_DEFAULTS = {"isolate": True, "timeout": DEFAULT_TIMEOUT, "memory_limit": DEFAULT_MEMORY_LIMIT}
#: The callable-protocol options and their defaults (CallableBackend's).
CALLABLE_DEFAULTS = {"layout": "bhsd", "array": "numpy", "causal_alignment": "bottom-right", "precision": None,
                     "grad": None, **ISOLATION_DEFAULTS, "forbid": None}


def parse_seed(text: str):
    """--seed's value: an int, or RANDOM_SEED."""
    if text == RANDOM_SEED:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor {RANDOM_SEED!r}") from None


def resolve_seed(seed):
    """(the seed to search with, whether it was drawn): RANDOM_SEED draws a 32-bit one."""
    if seed == RANDOM_SEED:
        return secrets.randbelow(2**32), True
    return seed, False


#: How a search runs and what it keeps, for any target: name -> argparse keyword arguments.
SEARCH_OPTIONS = {
    "profile": dict(default=None, choices=tuple(PROFILES),
                    help=f"search profile: examples per property and problem sizes (default: {DEFAULT_PROFILE})"),
    "results": dict(default=None, metavar="FILE", type=writable_file,
                    help="append every oracle comparison's metrics to FILE (JSON lines), for "
                         "'fa_verify report'; a ragged batch writes one record per sequence, naming it"),
    "shapes": dict(default=None, metavar="N", type=positive_int,
                   help="shape budget for JIT-compiled targets: each property draws its problems from at most N "
                        "shapes (B, H, Hkv, Nq, Nk, D, dtype, causal mode, scale; a ragged batch's lengths, pages "
                        "and splits; values still vary), so the target compiles about N times per property "
                        "instead of once per example (default: no budget)"),
    "repro-dir": dict(default=None, metavar="DIR", type=writable_folder,
                      help="write each failing example's reproducer (a script and its inputs, .npz) "
                           "into DIR (default: $FA_VERIFY_REPRO_DIR, else .fa_verify/repro in the current "
                           "folder; pytest: in its rootdir); run it from any folder with the printed "
                           "'python3 ...' command"),
}


def callable_arguments(skip=()) -> dict:
    """The options that describe a MODULE:FUNC target (name -> argparse keyword arguments; the
    isolation options apart: `add_isolation_options`), its declared limits and conventions
    included (`skip`: limit options a caller declares otherwise)."""
    return {
        "layout": dict(choices=LAYOUTS, default=None,
                       help="tensor layout: bhsd [B,H,N,D] (default) or bshd [B,N,H,D] as flash_attn_func; varlen: "
                            "fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, "
                            "softmax_scale, ...) with packed q [total_q,H,D], k, v [total_k,Hkv,D], as "
                            "flash_attn_varlen_func; paged: fn(q, k_cache, v_cache, *, cache_seqlens, block_table, "
                            "causal, softmax_scale, ...) with q [B,Nq,H,D], caches [num_blocks,page_size,Hkv,D], as "
                            "flash_attn_with_kvcache. Both return out or (out, lse) (LSE [H,total_q] varlen, "
                            "[B,H,Nq] paged) and get window_size, softcap, alibi_slopes, sinks, "
                            "return_softmax_lse=True and num_splits when their signature names them; they are "
                            "checked with the varlen / paged properties"),
        "page-sizes": dict(default=None, metavar="N,N,...",
                           help="declared limit of a --layout paged function: the page sizes (keys per page) it "
                                "supports (default: any; drawn below, at and above a tile of 64)"),
        "array": dict(choices=("numpy", "torch"), default=None, help="pass numpy arrays (default) or CPU torch tensors"),
        "grad": dict(action="store_const", const=True, default=None,
                     help="check a differentiable forward MODULE:FUNC (the callable protocol, with --array torch) "
                          "through its gradients: torch.autograd back-propagates an upstream dout through it, and "
                          "the backward properties judge dq, dk, dv (a function whose signature names dout is a "
                          "backward and needs no --grad)"),
        "causal-alignment": dict(choices=("bottom-right", "top-left"), default=None,
                                 help="causal alignment the callable implements (default bottom-right; torch SDPA's "
                                      "is_causal is top-left; varlen and paged functions are bottom-right)"),
        "precision": dict(default=None,
                          help="precision model: a preset (flash, fp32-accumulate, input-scores, same-precision) or "
                               "'score=fp32,p=bf16,pv=fp32,out=bf16', either followed by the accuracy of tanh "
                               "(softcap) and exp: ',tanh=accurate|absolute|approx', ',exp=accurate|approx' (e.g. "
                               "'flash,tanh=approx': the hardware tanh.approx.f32); default: flash (FlashAttention's: "
                               "fp32 scores and accumulation, P in the input dtype, accurate tanh and exp); a failure "
                               "says which looser preset would pass"),
        "model-scale": dict(default=None, metavar="SCALE|default",
                            help="a KernelBench file (path/to/problem.py with Model and ModelNew): the scale its Model "
                                 "computes with, a number or 'default' (1/sqrt(D)), where probing cannot tell "
                                 "(default: inferred from Model)"),
        **limit_arguments(skip=skip),
        **convention_arguments(),
    }


def add_isolation_options(add_argument, prefix: str = "") -> None:
    """--no-isolate, --timeout, --memory-limit and --forbid (--fa-... in the pytest plugin); None
    when not given, CALLABLE_DEFAULTS then."""
    add_argument(f"--{prefix}no-isolate", dest=f"{prefix.replace('-', '_')}isolate", action="store_const",
                 const=False, default=None,
                 help="run MODULE:FUNC in this process, for a debugger (default: in a worker process, so that "
                      "a crash, a hang or a runaway allocation fails the example instead of the run)")
    add_argument(f"--{prefix}timeout", type=float, default=None, metavar="SECONDS",
                 help=f"time limit of one call of an isolated MODULE:FUNC (default {DEFAULT_TIMEOUT:g})")
    add_argument(f"--{prefix}memory-limit", default=None, metavar="SIZE",
                 help="memory an isolated MODULE:FUNC may allocate (RLIMIT_DATA): e.g. 4GiB, 50%% of the "
                      f"machine's memory, or none (default {DEFAULT_MEMORY_LIMIT.replace('%', '%%')})")
    add_argument(f"--{prefix}forbid", action="append", default=None, metavar="NAME[,NAME...]",
                 help="framework functions (dotted names: torch.nn.functional.scaled_dot_product_attention) whose "
                      "call fails MODULE:FUNC, naming the call and where it was made; repeatable; 'default': the "
                      "attention, softmax and matmul entry points of torch and JAX where installed ('check "
                      "--grading' forbids them unless --forbid none); see docs/grading.md for what it cannot see")


def _option(name: str) -> str:
    return "--no-isolate" if name == "isolate" else f"--{name.replace('_', '-')}"


def build_targets(names, values: dict, *, spec=None, runner: str = "auto", arch=None, prefix: str = "--",
                  shared=()) -> list:
    """The backends `names` name (built-in names, 'all', MODULE:FUNC, or one CUDA file with
    `spec`), described by the option `values` (keys: the options' names with '_', as argparse
    stores them; None: not given). `prefix` spells the options in messages ("--fa-" in pytest);
    `shared` names the limit options that also select what any target is checked on (`check`'s
    --dtype and --causal), so giving them is no callable option."""
    options = (*CALLABLE_DEFAULTS, *(k.replace("-", "_") for k in callable_arguments(skip=shared)))
    given = [name for name in dict.fromkeys(options) if values.get(name) is not None]
    say = lambda names: ", ".join(prefix + _option(n)[2:] for n in names)  # noqa: E731
    if spec is not None or any(str(n).endswith((".cu", ".cuh")) for n in names):
        return [_spec_target(names, spec, runner, arch, [n for n in given if n != "isolate"], say)]
    for option, value in (("--arch", arch), ("--runner", None if runner == "auto" else runner)):
        if value is not None:
            raise InvalidArgumentError(f"{option} applies to CUDA files checked with --spec, not to {', '.join(names)}")
    from fa_verify.adapters.kernelbench import is_kernelbench_file

    functions = [n for n in names if ":" in n or is_kernelbench_file(n)]
    if given and not functions:
        raise InvalidArgumentError(
            f"{say(given)} appl{'ies' if len(given) == 1 else 'y'} to MODULE:FUNC targets only; "
            f"{', '.join(map(repr, names))} name{'s' if len(names) == 1 else ''} built-in backends, whose layout, "
            "arrays, precision, isolation, conventions and limits are their own (see 'fa_verify backends'): "
            f"drop {say(given)}, or check your function as MODULE:FUNC")
    options = _callable_options(values, prefix, say) if functions else {}
    targets = []
    for name in names:
        if name == "all":
            from fa_verify.backends import builtin_backends

            targets += [b for b in builtin_backends() if b.availability().available]
        elif ":" in name:
            targets.append(_callable(name, options))
        elif is_kernelbench_file(name):
            targets.append(_kernelbench(name, options, values, say))
        else:
            from fa_verify.backends import get_backend

            targets.append(get_backend(name))
    for backend in targets:
        availability = backend.availability()
        if not availability.available:
            raise BackendUnavailableError(f"backend {backend.name!r} is unavailable: {availability.reason}")
    return targets


def _callable_options(values: dict, prefix: str, say) -> dict:
    """The keyword arguments of a MODULE:FUNC target's backend, its limits and conventions from
    the options given (and --limits FILE), defaults for the others."""
    options = {name: default if values.get(name) is None else values[name] for name, default in CALLABLE_DEFAULTS.items()}
    options["forbid"] = forbidden_names(options["forbid"])
    if values.get("model_scale") is not None:
        options["model_scale"] = values["model_scale"]
    limits_file = values.get("limits")
    limit_values = {name: values.get(name.replace("-", "_")) for name in limit_arguments() if name != "limits"}
    options["limits"] = limits_from_options(limit_values, limits_file, prefix, other_keys=CONVENTION_OPTIONS)
    declared = None
    if limits_file is not None:
        try:
            declared = read_limits_file(limits_file)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{prefix}limits {limits_file}: {exc}") from None
    options["conventions"] = conventions_from_options(
        {name: values.get(name.replace("-", "_")) for name in convention_arguments()}, declared, prefix)
    layout, page_sizes = options["layout"], values.get("page_sizes")
    if page_sizes is not None and layout != "paged":
        raise InvalidArgumentError(f"{say(['page_sizes'])} declares the page sizes of a paged function: give "
                                   f"{say(['layout'])} paged (not {layout}), or drop {say(['page_sizes'])}")
    if layout in RAGGED_LAYOUTS:
        if options["causal_alignment"] != "bottom-right":
            raise InvalidArgumentError(
                f"{say(['causal_alignment'])} {options['causal_alignment']} cannot be used with {say(['layout'])} "
                f"{layout}: varlen and paged functions are bottom-right aligned per sequence (flash-attn's "
                f"convention); drop {say(['causal_alignment'])}")
        del options["causal_alignment"]
        try:
            options["page_sizes"] = None if page_sizes is None else _positive_set(page_sizes)
        except (ValueError, InvalidArgumentError):
            raise InvalidArgumentError(f"{say(['page_sizes'])}={page_sizes!r} is not valid: page sizes >= 1, "
                                       f"e.g. {say(['page_sizes'])} 16,256") from None
    return options


def _callable(name: str, options: dict):
    """The backend of MODULE:FUNC: a CallableBackend, for a varlen or paged layout a
    RaggedCallableBackend, for a function whose signature names dout a BackwardCallableBackend."""
    from fa_verify.backends import CallableBackend, load_callable
    from fa_verify.backends.backward_callable import BackwardCallableBackend, is_backward
    from fa_verify.backends.grad_callable import GradCallableBackend
    from fa_verify.backends.ragged_callable import RaggedCallableBackend

    sys.path.insert(0, os.getcwd())  # MODULE is looked up where the user runs the command
    fn = load_callable(name)
    options = dict(options)
    if options.pop("model_scale", None) is not None:
        raise InvalidArgumentError(f"--model-scale declares the scale of a KernelBench file's Model, not of {name}: "
                                   "drop it (a function is given the scale with each call)")
    grad = options.pop("grad", None)
    if options["layout"] in RAGGED_LAYOUTS and not grad:
        return RaggedCallableBackend(fn, name=name, **options)
    if grad:
        if options["layout"] in RAGGED_LAYOUTS or is_backward(fn):
            raise InvalidArgumentError(f"--grad differentiates a dense forward function; {name} is "
                                       + ("a backward (its signature names dout): drop --grad" if is_backward(fn)
                                          else f"a {options['layout']} function"))
        if options["conventions"].declared:
            raise InvalidArgumentError(f"--grad: the convention options ({options['conventions'].describe()}) are "
                                       "about a forward's outputs, not its gradients; drop them")
        return GradCallableBackend(fn, name=name, **options)
    if is_backward(fn):
        about_outputs = options["conventions"].about_outputs
        if about_outputs.declared:
            raise InvalidArgumentError(
                f"{name} is a backward (its signature names dout): it is given out and lse in fa_verify's "
                f"conventions, so the convention options ({about_outputs.describe()}) do not apply; "
                "drop them (--ftz, about its arithmetic, does)")
        return BackwardCallableBackend(fn, name=name, **options)
    return CallableBackend(fn, name=name, **options)


def _kernelbench(name: str, options: dict, values: dict, say):
    """The backend of a KernelBench-format file: its ModelNew, under what its Model computes
    (`fa_verify.adapters.kernelbench`); --layout, --causal yes|no and --model-scale declare what
    probing would otherwise infer."""
    from fa_verify.adapters.kernelbench import kernelbench_target

    options = dict(options)
    causal = values.get("causal")
    declared = {"layout": values.get("layout"), "array": values.get("array"), "scale": options.pop("model_scale", None),
                "causal": None if causal in (None, "both") else causal == "yes"}
    return kernelbench_target(name, options, declared, say)


def _spec_target(names, spec, runner: str, arch, given: list, say):
    """The backend of `check kernel.cu --spec kernel.toml`."""
    from fa_verify.kernels.spec import KernelSpec

    if len(names) != 1:
        raise InvalidArgumentError(f"one CUDA file at a time, got {', '.join(names)}")
    target = names[0]
    if spec is None:
        raise InvalidArgumentError(f"{target} is a CUDA file: give its kernel spec with --spec kernel.toml "
                                   "(which parameter is q, k, v, o, lse; the entry; grid, block, shared memory)")
    if given:
        raise InvalidArgumentError(f"{say(given)}: a CUDA file's layout, precision and limits are its "
                                   f"spec's ({spec}); declare them there")
    kernel_spec = KernelSpec.from_toml(spec)
    missing = kernel_spec.missing_entry(target)
    if missing:
        raise InvalidArgumentError(missing)
    if arch is not None:
        kernel_spec = replace(kernel_spec, arch=arch)
    if runner == "auto":
        from fa_verify.kernels.pycuda_runner import pycuda_availability

        runner = "pycuda" if pycuda_availability().available else "cpu"
    if runner == "pycuda":
        from fa_verify.backends.spec_pycuda import SpecPyCudaBackend

        return SpecPyCudaBackend(target, kernel_spec)
    from fa_verify.backends.spec_kernel import SpecKernelBackend

    return SpecKernelBackend(target, kernel_spec)
