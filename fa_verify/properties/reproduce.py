"""Reproducers: a failing example as a short script that runs from any folder.

`write_reproducer(folder, target, properties, problem)` writes `repro_<property>_<hash>.py` and,
beside it, the example's inputs `repro_<property>_<hash>.npz` (q, k, v exactly as drawn, bf16
as its uint16 bits, and the problem's dtype, causal flag, alignment and scale). The script

1. sets the environment variables that mattered when it was written (`ENVIRONMENT_NAMES` and
   `ENVIRONMENT_PREFIXES`; PYTHONPATH made absolute), re-executing itself when they differ so
   that they apply from the interpreter's start (PYTHONPATH, BLAS threads, TRITON_INTERPRET);
2. puts the folder fa_verify was imported from, and the one the target's module was, first on
   sys.path;
3. rebuilds the target (`Target`: a built-in backend by name, or MODULE:FUNC with the options
   of the callable protocol) and the problem, and calls the property's check function from
   `fa_verify.properties` on it, with the property's seed: a property whose failing example is
   derived from the problem (merge-law chunks, permutations, the null model) derives it again.

It prints each result and exits 1 while a property still fails (a target that raises fails
with its traceback, the way to debug it), 0 once none does, 2 when it cannot judge (the
property is not applicable, or the target cannot be rebuilt). The target runs in the script's
own process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fa_verify.properties._result import FAILED, NOT_APPLICABLE

#: Environment variables a reproducer sets again when they were set at check time: they change
#: what a target computes or how it runs (Triton's interpreter, the GPU, BLAS threading, paths).
ENVIRONMENT_NAMES = ("PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING")
#: ... and every variable with one of these prefixes.
ENVIRONMENT_PREFIXES = ("TRITON_", "OPENBLAS_", "OMP_", "MKL_", "JAX_", "XLA_", "PYTORCH_", "TORCH_")
#: Where `fa_verify check` and the pytest plugin write reproducers unless told: this variable's
#: folder, else DEFAULT_FOLDER under the current folder (pytest: its rootdir).
FOLDER_VARIABLE = "FA_VERIFY_REPRO_DIR"
DEFAULT_FOLDER = Path(".fa_verify") / "repro"


def default_folder(root=".") -> Path:
    """Where reproducers go when no folder is given (see FOLDER_VARIABLE)."""
    return Path(os.environ.get(FOLDER_VARIABLE) or Path(root) / DEFAULT_FOLDER)


class NotReproducible(Exception):
    """The target cannot be rebuilt by a script (the message says why and what would do)."""


def relevant_environment(environ=None) -> dict:
    """The variables of `environ` (default os.environ) a reproducer sets again; PYTHONPATH's
    relative entries made absolute, so that the script runs from any folder."""
    environ = os.environ if environ is None else environ
    kept = {name: value for name, value in sorted(environ.items())
            if name in ENVIRONMENT_NAMES or name.startswith(ENVIRONMENT_PREFIXES)}
    if "PYTHONPATH" in kept:
        kept["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in kept["PYTHONPATH"].split(os.pathsep))
    return kept


def _import_folder(module) -> str | None:
    """The sys.path entry `module` was imported from (None for one without a file)."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    depth = module.__name__.count(".") + hasattr(module, "__path__")  # a package's file is its __init__.py
    return str(Path(file).absolute().parents[depth])


def _resolve(reference: str):
    """What MODULE:FUNC names among the modules imported already (None if nothing)."""
    module_name, _, attributes = reference.partition(":")
    obj = sys.modules.get(module_name)
    for part in attributes.split("."):
        obj = getattr(obj, part, None)
    return obj


def _reference(fn, name: str) -> tuple[str, str | None]:
    """("MODULE:FUNC", the folder its module was imported from) naming `fn`: its target `name`
    when that is a MODULE:FUNC (a function made by a factory has no importable qualified name),
    else its module and qualified name; NotReproducible when neither names it. A function
    wrapped by fa_verify (`guards.guarded`: --forbid) is named by what it wraps."""
    fn = getattr(fn, "fa_verify_guards", fn)
    qualified = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', None)}"
    for reference in (name, qualified):
        if ":" in reference and not reference.startswith("__main__:") and _resolve(reference) is fn:
            return reference, _import_folder(sys.modules[reference.partition(":")[0]])
    if qualified.startswith("__main__:"):
        raise NotReproducible(f"{qualified} is defined in the script that ran the check: move it into a "
                              "module and check it as MODULE:FUNC")
    raise NotReproducible(f"{qualified} is not importable by name (a lambda, a nested function or a "
                          "callable object): define it at the top level of a module, or name it as MODULE:FUNC")


def precision_spec(model) -> str:
    """The `--precision` spec of a PrecisionModel (its input dtype is the problem's)."""
    spec = f"score={model.score_accumulation},p={model.p_rounding},pv={model.pv_accumulation},out={model.output}"
    declared = (("tanh", model.tanh != "accurate" and model.tanh), ("exp", model.exp != "accurate" and model.exp),
                ("inputs", model.input_rounding), ("p_offset", model.p_offset))
    return spec + "".join(f",{name}={value}" for name, value in declared if value)


def callable_options(backend, dtype: str) -> dict:
    """The keyword arguments of CallableBackend that change what `backend` runs or how it is
    judged, for problems of `dtype`. A new option of CallableBackend belongs here too (a test
    compares this with the constructor's parameters)."""
    return {"layout": backend.layout, "array": backend.array, "causal_alignment": backend.causal_alignment,
            "precision": precision_spec(backend.precision(dtype)),
            # merge_law's and fully_masked_rows' derived problems follow the declared limits
            "limits": backend.limits.as_dict(),
            "features": list(backend.features), "conventions": backend.judged_under.as_dict(),
            # a forbidden call fails the example: the replay forbids it too
            "forbid": list(backend.forbid)}


def ragged_callable_options(backend, dtype: str) -> dict:
    """The keyword arguments of RaggedCallableBackend that change what `backend` runs or how it
    is judged, for problems of `dtype` (as `callable_options`)."""
    return {"layout": backend.layout, "array": backend.array, "precision": precision_spec(backend.precision(dtype)),
            "dtypes": list(backend.dtypes), "limits": backend.limits.as_dict(), "features": list(backend.features),
            "page_sizes": None if backend.page_sizes is None else list(backend.page_sizes),
            "conventions": backend.judged_under.as_dict(), "forbid": list(backend.forbid)}


def spec_options(backend) -> dict:
    """How a reproducer rebuilds a CUDA file's target: its spec file, runner and arch."""
    spec = Path(backend.spec.origin)
    if not spec.is_file():
        raise NotReproducible(f"{backend.name!r} runs a kernel spec given as a Python object: write it as a TOML "
                              "file (fa_verify check kernel.cu --spec kernel.toml) for a reproducer")
    from fa_verify.backends.spec_pycuda import SpecPyCudaBackend

    runner = "pycuda" if isinstance(backend, SpecPyCudaBackend) else "cpu"
    return {"spec": str(spec.resolve()), "runner": runner, "arch": backend.spec.arch}


@dataclass(frozen=True)
class Target:
    """What a reproducer rebuilds: a built-in backend (`reference` None), or the function
    `reference` (MODULE:FUNC, imported from `folder`) wrapped as `kind` ("callable": the callable
    protocol, CallableBackend with `options`; "run": a run(problem) function, RunFunctionBackend;
    "ragged": a varlen or paged function, RaggedCallableBackend; "backward": a backward function,
    BackwardCallableBackend; "kernelbench": a KernelBench-format file, `reference` its path and
    `options` its check options; "spec": a CUDA file, `reference` its path, run as the kernel
    spec `options["spec"]` (a TOML file) says, on `options["runner"]`)."""

    name: str
    kind: str = "builtin"
    reference: str | None = None
    folder: str | None = None
    options: dict = field(default_factory=dict)

    @classmethod
    def of(cls, backend, dtype: str) -> "Target":
        """The target that rebuilds `backend` for problems of `dtype`; NotReproducible if none can."""
        from fa_verify.backends import CallableBackend, builtin_backends
        from fa_verify.backends.backward_callable import BackwardCallableBackend
        from fa_verify.backends.ragged_callable import RaggedCallableBackend
        from fa_verify.properties._subject import RunFunctionBackend

        from fa_verify.adapters.kernelbench import KernelBenchBackend
        from fa_verify.backends.spec_kernel import SpecKernelBackend

        if isinstance(backend, KernelBenchBackend):  # its file again, what was inferred declared
            return cls(backend.name, "kernelbench", backend.fn.path, None, backend.declarations())
        if isinstance(backend, SpecKernelBackend):
            return cls(backend.name, "spec", str(backend.source.resolve()), None, spec_options(backend))
        if isinstance(backend, BackwardCallableBackend):
            reference, folder = _reference(backend.fn, backend.name)
            options = {**callable_options(backend, dtype), "deterministic_dq": backend.deterministic_dq}
            return cls(backend.name, "backward", reference, folder, options)
        if isinstance(backend, RaggedCallableBackend):
            reference, folder = _reference(backend.fn, backend.name)
            return cls(backend.name, "ragged", reference, folder, ragged_callable_options(backend, dtype))
        if isinstance(backend, CallableBackend):
            reference, folder = _reference(backend.fn, backend.name)
            return cls(backend.name, "callable", reference, folder, callable_options(backend, dtype))
        if isinstance(backend, RunFunctionBackend):
            reference, folder = _reference(backend._fn, backend.name)
            return cls(backend.name, "run", reference, folder,
                       {"precision": precision_spec(backend.precision(dtype))})
        if any(type(b) is type(backend) and b.name == backend.name for b in builtin_backends()):
            return cls(backend.name)
        raise NotReproducible(f"{backend.name!r} is a {type(backend).__name__}: a reproducer rebuilds built-in "
                              "backends and functions importable as MODULE:FUNC only")

    @classmethod
    def from_dict(cls, data: dict) -> "Target":
        return cls(**data)

    def as_dict(self) -> dict:
        return asdict(self)

    def imports(self) -> str:
        return {"builtin": "from fa_verify.backends import get_backend",
                "callable": "from fa_verify.backends import CallableBackend, load_callable",
                "run": "from fa_verify.backends import load_callable\n"
                       "    from fa_verify.properties import as_backend",
                "ragged": "from fa_verify.backends import load_callable\n"
                          "    from fa_verify.backends.ragged_callable import RaggedCallableBackend",
                "backward": "from fa_verify.backends import load_callable\n"
                            "    from fa_verify.backends.backward_callable import BackwardCallableBackend",
                "kernelbench": "from fa_verify.targets import build_targets",
                "spec": "from fa_verify.targets import build_targets"}[self.kind]

    def expression(self) -> str:
        """Python that rebuilds the target (after `imports()`), one keyword argument a line."""
        if self.kind == "builtin":
            return f"get_backend({self.name!r})"
        if self.kind == "kernelbench":  # in this process, as every reproducer runs its target
            return f"build_targets([{self.reference!r}], {{**{self.options!r}, 'isolate': False}})[0]"
        if self.kind == "spec":
            options = self.options
            return (f"build_targets([{self.reference!r}], {{}}, spec={options['spec']!r}, runner={options['runner']!r}, "
                    f"arch={options['arch']!r})[0]")
        make = {"run": "as_backend", "callable": "CallableBackend", "ragged": "RaggedCallableBackend",
                "backward": "BackwardCallableBackend"}[self.kind]
        arguments = [f"load_callable({self.reference!r})", f"name={self.name!r}",
                     *(f"{k}={v!r}" for k, v in self.options.items())]
        return f"{make}(\n        " + ",\n        ".join(arguments) + ")"


# --- the inputs ---------------------------------------------------------------------------------

def save_problem(problem, path) -> None:
    """The problem's arrays and parameters (`problem.saved()`: q, k, v, bf16 as uint16 bits,
    the variants' slopes and sinks; a batch's sequences and page table), as an .npz file."""
    parameters, arrays = problem.saved()
    parameters["kind"] = problem.kind
    with open(path, "wb") as f:
        np.savez(f, parameters=np.array(json.dumps(parameters, default=str)), **arrays)


def load_problem(path):
    """The problem `save_problem` wrote, bit for bit (its kind's `from_saved`)."""
    from fa_verify.properties.kinds import KINDS

    with np.load(path, allow_pickle=False) as data:
        parameters = json.loads(str(data["parameters"]))
        # files written before problems named their kind: a batch named its layout
        kind = parameters.get("kind") or parameters.get("layout") or "dense"
        return KINDS[kind].problem_type.from_saved(parameters, data)


# --- the script ---------------------------------------------------------------------------------

def exit_status(results) -> int:
    """A reproducer's exit status: 1 if a property failed, 2 if one could not judge, else 0."""
    statuses = {r.status for r in results}
    return 1 if FAILED in statuses else 2 if NOT_APPLICABLE in statuses else 0


def _shortest(path: Path) -> str:
    """`path` relative to the current folder when it lies inside it, else absolute."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


@dataclass(frozen=True)
class Reproducer:
    """A written reproducer: the script and its inputs (absolute paths)."""

    script: Path
    inputs: Path

    @property
    def command(self) -> str:
        """The short command that runs it (a path relative to the current folder inside it)."""
        return f"python3 {shlex.quote(_shortest(self.script))}"

    def files(self) -> dict:
        return {"script": str(self.script), "inputs": str(self.inputs)}


_SCRIPT = '''\
#!/usr/bin/env python3
"""fa_verify reproducer: {about}
{failure}
Run it from any folder: python3 {script}
Exit 1: a property still fails (its verdict, or the target's traceback, is printed);
0: none does; 2: it cannot judge (not applicable, or the example cannot be rebuilt here).
The inputs are {inputs} beside this file (fa_verify.properties.reproduce.load_problem).
"""
import os
import sys

# Environment variables that were set when the example failed; re-executed so that they apply
# from the interpreter's start (PYTHONPATH, BLAS threads, TRITON_INTERPRET, ...).
ENVIRONMENT = {environment}
if any(os.environ.get(name) != value for name, value in ENVIRONMENT.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {{**os.environ, **ENVIRONMENT}})
# The folders fa_verify and the target were imported from.
sys.path[:0] = {path}

try:
    {imports}
    from {check_module} import {checks}
    from fa_verify.properties.reproduce import exit_status, load_problem

    problem = load_problem(os.path.join(os.path.dirname(os.path.abspath(__file__)), {inputs!r}))
    target = {target}
except Exception as exc:  # not the target's failure: the example cannot be rebuilt here
    print(f"cannot rebuild the example: {{type(exc).__name__}}: {{exc}}", file=sys.stderr)
    sys.exit(2)

results = [
{calls}
]
for result in results:
    print(result.message())
sys.exit(exit_status(results))
'''


def _fa_verify_folder() -> str:
    import fa_verify

    return _import_folder(fa_verify)


def _docstring_text(text: str) -> str:
    """`text` safe inside the script's docstring."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def write_reproducer(folder, target: Target, properties, problem, seed: int = 0,
                     failure: str = "", search_seed: int | None = None) -> Reproducer:
    """Write the script and inputs replaying `properties` (Property objects; seeded ones with
    `seed`) of `problem` on `target` into `folder` (created if missing); `failure` (what failed
    when it was written) and `search_seed` (the Hypothesis seed that found it) go into the
    script's docstring. The name's hash covers the target,
    properties, seed and inputs: the same failure overwrites its own reproducer."""
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    parts = problem.parts()
    digest = hashlib.sha256(json.dumps([target.as_dict(), [p.name for p in properties], seed,
                                        problem.describe(), parts[0].causal_alignment]).encode())
    for seq in parts:
        for x in (seq.q, seq.k, seq.v):
            digest.update(np.ascontiguousarray(x).tobytes())
    stem = f"repro_{'+'.join(p.name for p in properties)}_{digest.hexdigest()[:10]}"
    script, inputs = folder / f"{stem}.py", folder / f"{stem}.npz"
    save_problem(problem, inputs)
    path = [_fa_verify_folder()] + ([target.folder] if target.folder else [])
    calls = "\n".join(f"    {p.check.__name__}(target, problem{f', seed={seed}' if p.seeded else ''}),"
                      for p in properties)
    about = f"{', '.join(p.name for p in properties)} on {target.name}, {problem.describe()}"
    failure = "".join(f"When written: {line}\n" for line in failure.splitlines()[:1])
    if search_seed is not None:
        failure += f"Found by a search with Hypothesis seed {search_seed} (fa_verify check --seed {search_seed}).\n"
    script.write_text(_SCRIPT.format(
        about=_docstring_text(about), failure=_docstring_text(failure), script=_docstring_text(str(script)),
        inputs=inputs.name, environment=_dict_source(relevant_environment()), path=repr(list(dict.fromkeys(path))), imports=target.imports(),
        check_module=properties[0].check.__module__ if len({p.check.__module__ for p in properties}) == 1
        else "fa_verify.properties",
        checks=", ".join(sorted({p.check.__name__ for p in properties})), target=target.expression(),
        calls=calls))
    return Reproducer(script, inputs)


def _dict_source(mapping: dict) -> str:
    """A dict literal, one item per line (environment values are long)."""
    if not mapping:
        return "{}"
    return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in mapping.items()) + "}"
