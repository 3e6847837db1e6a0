"""KernelBench-format problems: a Python file with a reference `Model`, a solution `ModelNew`,
`get_inputs()` and `get_init_inputs()`, checked as a callable target.

`ModelNew.forward(Q, K, V)` takes neither `causal` nor `scale`: what it must compute is whatever
the reference `Model` computes. That is inferred here by calling `Model` on probe tensors built
for the purpose (never by reading its source), and the solution is then checked by the one
callable path (`CallableBackend`, torch tensors) under what was inferred:

- dtype: the dtype of the tensors `get_inputs()` returns;
- GQA: K/V with fewer heads than Q in `get_inputs()` (the head axis is the one whose size
  differs); the group size is declared as a limit;
- layout: with V changed at (axis 1, axis 2) = (0, 0), the outputs that change are all along the
  sequence axis and only the first head (group) along the head axis: bhsd if axis 2 is the
  sequence, bshd if axis 1;
- causality: does output row 0 change when key 1's value changes? Then the alignment, where the
  Model runs Nq != Nk (row 0 of 2 queries over 3 keys sees key 1 bottom-right, not top-left);
  a Model that refuses Nq != Nk declares Nq = Nk;
- scale: the last query a*e0 over keys 0 and e0 with values 0 and e0 reads out
  sigmoid(scale*a); two magnitudes a (scores near 1 and 3) must read the same scale (else the Model is not
  softmax(scale QK^T) V), and a second head dim tells 1/sqrt(D) from a constant. A constant
  other than 1/sqrt(D) is a declared convention of the target (`ModelScale`): the problem judged
  carries the Model's scale, as `--scale-precision input` carries the rounded one.

Anything the probes cannot settle is refused (InvalidArgumentError, exit 2) naming what and the
option that declares it: --layout, --causal yes|no, --model-scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from fa_verify.backends.user_callable import CallableBackend, _import_file
from fa_verify.conventions import Conventions
from fa_verify.errors import InvalidArgumentError

#: The names a KernelBench-format module defines.
REQUIRED = ("Model", "ModelNew", "get_inputs")
_TORCH_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}
#: How --model-scale is spelled in refusals.
SCALE_OPTION = "--model-scale"


def is_kernelbench_file(name: str) -> bool:
    """Whether the target `name` is a path to a .py file (no ':FUNC'): a KernelBench module."""
    return isinstance(name, str) and ":" not in name and name.endswith(".py")


@dataclass(frozen=True)
class ModelScale(Conventions):
    """The conventions of a KernelBench solution whose Model uses a fixed scale: every problem is
    judged with that scale (reference, bound and target alike)."""

    model_scale: float | None = None

    def describe(self) -> str:
        rest = Conventions.describe(self)
        own = f"scale {self.model_scale:g} (the Model's)" if self.model_scale is not None else ""
        return ", ".join(filter(None, [own, "" if rest == "fa_verify's conventions" else rest])) or rest

    def problem(self, problem):
        if self.model_scale is not None:
            problem = problem.map_parts(
                lambda part: part if part.scale == self.model_scale else part.replace(scale=self.model_scale))
        return Conventions.problem(self, problem)


@dataclass(frozen=True)
class Inferred:
    """What the probes found about the reference Model."""

    dtype: str
    layout: str
    causal: bool
    #: None: 1/sqrt(D); else the fixed scale
    scale: float | None
    heads: int
    kv_heads: int
    head_dim: int
    causal_alignment: str = "bottom-right"
    equal_seq: bool = False
    #: the head dims the Model runs (None: any)
    head_dims: tuple | None = None
    declared: tuple = ()
    #: (B, H, Hkv, Nq, Nk, D) of get_inputs()
    task_shape: tuple = ()

    def describe(self) -> str:
        mark = lambda what: " (declared)" if what in self.declared else ""  # noqa: E731
        scale = "1/sqrt(D)" if self.scale is None else f"{self.scale:g}"
        if self.scale is None and self.head_dims:
            scale += f" ({1 / math.sqrt(self.head_dims[0]):g} at D={self.head_dims[0]})"
        causal = f"yes ({self.causal_alignment})" if self.causal and not self.equal_seq else (
            "yes" if self.causal else "no")
        parts = [f"layout {self.layout}{mark('layout')}", f"scale {scale}{mark('scale')}",
                 f"causal {causal}{mark('causal')}", f"dtype {self.dtype}"]
        if self.kv_heads != self.heads:
            parts.append(f"GQA {self.heads} query heads over {self.kv_heads} K/V heads")
        if self.head_dims:
            parts.append(f"head dim {', '.join(map(str, self.head_dims))} only")
        if self.equal_seq:
            parts.append("Nq = Nk only")
        return ", ".join(parts)


class KernelBenchSolution:
    """ModelNew as a protocol function `fn(q, k, v, *, causal, scale)`, torch tensors in, out.

    Picklable by its file (`portable`): an isolated worker imports the file and builds ModelNew
    (with get_init_inputs()) on its first call. On a machine with CUDA the tensors and the model
    go to the GPU and the output comes back."""

    portable = True

    def __init__(self, path: str, causal: bool, scale: float | None):
        self.path, self.causal, self.scale = str(Path(path).resolve()), causal, scale
        self._model = None

    def __getstate__(self):
        return {"path": self.path, "causal": self.causal, "scale": self.scale}

    def __setstate__(self, state):
        self.__dict__.update(state, _model=None)

    def __call__(self, q, k, v, *, causal, scale):
        import torch

        expected = 1 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        if causal != self.causal or not math.isclose(scale, expected, rel_tol=1e-12):
            raise ValueError(f"ModelNew computes causal={self.causal}, scale={expected!r}; it was asked for "
                             f"causal={causal}, scale={scale!r} (fa_verify should not draw such problems)")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if self._model is None:
            module = _import_file(self.path)
            init = module.get_init_inputs() if hasattr(module, "get_init_inputs") else []
            self._model = module.ModelNew(*init).to(device).eval()
        with torch.no_grad():
            out = self._model(q.to(device), k.to(device), v.to(device))
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.to("cpu") if isinstance(out, torch.Tensor) else out


class KernelBenchBackend(CallableBackend):
    """A KernelBench solution under what was inferred from its Model (`inferred`)."""

    def __init__(self, fn: KernelBenchSolution, inferred: Inferred, **options):
        self.inferred = inferred
        self.task_shapes = (inferred.task_shape,)
        super().__init__(fn, **options)
        if self._worker is not None:  # the worker runs the calls only, which are CallableBackend's
            self._worker.options["protocol"] = "CallableBackend"

    def declarations(self) -> dict:
        """`check`'s option values that rebuild this target without probing (a reproducer's)."""
        scale = "default" if self.inferred.scale is None else repr(self.inferred.scale)
        return {"layout": self.inferred.layout, "causal": "yes" if self.inferred.causal else "no",
                "model_scale": scale, "forbid": list(self.forbid) or ["none"]}

    def supports(self, problem):
        reason = super().supports(problem)
        if reason is None and self.inferred.scale is None and problem.scale is not None \
                and problem.scale != 1 / math.sqrt(problem.head_dim):
            reason = f"{self.name} computes scale 1/sqrt(D) (its Model's), not scale={problem.scale!r}"
        return reason


# --- building the target ---------------------------------------------------------------------

def kernelbench_target(path: str, options: dict, declared: dict, say):
    """The backend checking `path`'s ModelNew. `options` are the callable options (layout, array,
    limits, conventions, ... as `fa_verify.targets` builds them); `declared` the declarations given
    (layout, causal, model_scale; None: infer)."""
    try:
        module = _import_file(path)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # whatever the user's module raises on import
        raise InvalidArgumentError(f"{path}: cannot import it: {type(exc).__name__}: {exc}") from exc
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise InvalidArgumentError(
            f"{path} is not a KernelBench-format module: it lacks {', '.join(missing)} (it needs Model, ModelNew "
            "and get_inputs()); to check a function in it, name it as FILE.py:FUNC")
    if declared.get("array") not in (None, "torch"):
        raise InvalidArgumentError(f"{say(['array'])} {declared['array']}: a KernelBench ModelNew takes torch "
                                   f"tensors; drop {say(['array'])}")
    scale = declared.get("scale")
    if scale is not None and scale != "default":
        try:
            ok = math.isfinite(float(scale)) and float(scale) > 0
        except ValueError:
            ok = False
        if not ok:
            raise InvalidArgumentError(f"{SCALE_OPTION}={scale!r} is not valid: a positive number or 'default' "
                                       f"(1/sqrt(D)), e.g. {SCALE_OPTION} 0.125")
    inferred = infer(module, path, declared, say)
    limits = options["limits"]
    changes = {}
    if limits.dtypes is None:
        changes["dtypes"] = (inferred.dtype,)
    changes["causal"] = tuple(c for c in limits.causal if c == inferred.causal) or (inferred.causal,)
    if inferred.kv_heads == inferred.heads:
        changes["heads"] = ("mha",)
    else:
        changes["heads"] = ("mqa",) if inferred.kv_heads == 1 else ("gqa",)
        changes["group_sizes"] = (inferred.heads // inferred.kv_heads,)
    if inferred.head_dims and limits.head_dims is None:
        changes["head_dims"] = inferred.head_dims
    if inferred.equal_seq:
        changes["equal_seq"] = True
    conventions = options["conventions"]
    if inferred.scale is not None:
        conventions = ModelScale(**{f: getattr(conventions, f) for f in Conventions.__dataclass_fields__},
                                 model_scale=inferred.scale)
    rest = {k: v for k, v in options.items() if k not in ("layout", "array", "limits", "conventions",
                                                         "causal_alignment", "grad")}
    if options.get("grad"):
        raise InvalidArgumentError(f"{say(['grad'])}: a KernelBench target is checked forward only; drop it")
    return KernelBenchBackend(KernelBenchSolution(path, inferred.causal, inferred.scale), inferred,
                              name=f"{path}:ModelNew", layout=inferred.layout, array="torch",
                              causal_alignment=inferred.causal_alignment, limits=replace(limits, **changes),
                              conventions=conventions, **rest)


def _refuse(path: str, what: str, why: str, fix: str):
    raise InvalidArgumentError(f"{path}: cannot infer {what} from Model by probing: {why}; declare it with {fix}")


def infer(module, path: str, declared: dict, say) -> Inferred:
    """What `module.Model` computes (see the module's doc), with the `declared` values taken as given."""
    import torch

    init = module.get_init_inputs() if hasattr(module, "get_init_inputs") else []
    try:
        model = module.Model(*init).eval()
        inputs = list(module.get_inputs())
    except Exception as exc:  # the user's code
        raise InvalidArgumentError(f"{path}: building Model(*get_init_inputs()) or get_inputs() raised "
                                   f"{type(exc).__name__}: {exc}") from exc
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if len(inputs) != 3 or len(tensors) != 3 or any(t.dim() != 4 for t in tensors):
        raise InvalidArgumentError(f"{path}: get_inputs() must return three 4-D tensors Q, K, V (attention), "
                                   f"got {[tuple(getattr(x, 'shape', ())) or type(x).__name__ for x in inputs]}")
    q0, k0, _ = tensors
    dtype = _TORCH_DTYPES.get(str(q0.dtype))
    if dtype is None:
        raise InvalidArgumentError(f"{path}: get_inputs() returns {q0.dtype} tensors; fa_verify checks float16, "
                                   "bfloat16 and float32")
    probe = _Prober(model, path)
    declared_names = tuple(k for k in ("layout", "causal", "scale") if declared.get(k) is not None)
    layout, heads, kv_heads = _layout(probe, tuple(q0.shape), tuple(k0.shape), declared.get("layout"), path, say)
    d = q0.shape[-1]
    shape = dict(layout=layout, heads=heads, kv_heads=kv_heads)
    if declared.get("causal") is not None:
        causal = declared["causal"]
    else:
        causal = _causal(probe, shape, d, path, say)
    alignment, equal_seq = _alignment(probe, shape, d, causal)
    if declared.get("scale") is not None:
        scale, head_dims = (None if declared["scale"] == "default" else float(declared["scale"])), None
    else:
        scale, head_dims = _scale(probe, shape, d, path)
    seq_axis = 2 if layout == "bhsd" else 1
    task_shape = (q0.shape[0], heads, kv_heads, q0.shape[seq_axis], k0.shape[seq_axis], d)
    return Inferred(dtype=dtype, layout=layout, causal=causal, scale=scale, heads=heads, kv_heads=kv_heads,
                    head_dim=d, causal_alignment=alignment, equal_seq=equal_seq, head_dims=head_dims,
                    declared=declared_names, task_shape=tuple(int(n) for n in task_shape))


class _Prober:
    """Calls Model on probe tensors (float32 first, where the Model allows it)."""

    def __init__(self, model, path):
        self.model, self.path = model, path

    def __call__(self, q, k, v):
        """The Model's output as float64, or None when it raises on these shapes."""
        import torch

        try:
            with torch.no_grad():
                out = self.model(q, k, v)
        except Exception:  # noqa: BLE001 - a Model that does not run this probe shape
            return None
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.detach().to(torch.float64) if isinstance(out, torch.Tensor) else None


def _tensors(layout, b, h, n, d, generator):
    import torch

    shape = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _as_bhsd(x, layout):
    return x if layout == "bhsd" else x.transpose(1, 2)


def _layout(probe, qshape, kshape, declared, path, say):
    """(layout, H, Hkv): from the shapes get_inputs returns and which outputs change with V[:, 0, 0]."""
    import torch

    fix = f"{say(['layout'])} bhsd or {say(['layout'])} bshd"
    (_, a, b, d), (_, ka, kb, kd) = qshape, kshape
    differs = [axis for axis, (x, y) in ((1, (a, ka)), (2, (b, kb))) if x != y]
    if len(differs) == 2 or kd != d:
        _refuse(path, "the layout", f"K has shape {kshape} against Q's {qshape}: more than the head count differs",
                fix)
    candidates = ("bhsd", "bshd") if declared is None else (declared,)
    if differs:  # GQA: the axis whose size differs holds the heads
        candidates = tuple(c for c in candidates if (c == "bhsd") == (differs[0] == 1))
        if not candidates:
            _refuse(path, "the layout", f"--layout {declared} puts the heads on the axis where K and Q agree", fix)
    generator = torch.Generator().manual_seed(0)
    patterns = {}
    for layout in candidates:
        h, hkv, n = (a, ka, b) if layout == "bhsd" else (b, kb, a)
        if hkv == 0 or h % hkv:
            continue
        for probe_n in dict.fromkeys((min(n, 4), n)):
            q = _tensors(layout, 1, h, probe_n, d, generator)
            k, v = (_tensors(layout, 1, hkv, probe_n, d, generator) for _ in range(2))
            out = probe(q, k, v)
            if out is None:
                continue
            v2 = v.clone()
            v2[0, 0, 0, :] += 1.0
            out2 = probe(q, k, v2)
            if out2 is None or out2.shape != out.shape:
                break
            changed = (out2 != out).any(dim=-1)[0]  # [axis1, axis2]
            group = h // hkv
            expected = torch.zeros(changed.shape, dtype=torch.bool)
            if layout == "bhsd":
                expected[:group, :] = True
            else:
                expected[:, :group] = True
            patterns[layout] = bool((changed == expected).all())
            break
    matches = [layout for layout, ok in patterns.items() if ok]
    if declared is not None:
        layout = declared
    elif len(matches) == 1:
        layout = matches[0]
    else:
        why = ("the Model ran none of the probes" if not patterns else
               "changing V at index [0, 0, 0] changed outputs in a pattern that fits "
               + ("both layouts (an axis of size 1?)" if matches else "neither layout"))
        _refuse(path, "the layout", why, fix)
    h, hkv = (a, ka) if layout == "bhsd" else (b, kb)
    return layout, h, hkv


def _run(probe, shape, q, k, v):
    layout = shape["layout"]
    out = probe(*(x if layout == "bhsd" else x.transpose(1, 2).contiguous() for x in (q, k, v)))
    return None if out is None else _as_bhsd(out, layout)


def _causal(probe, shape, d, path, say):
    """Whether row 0 of two queries ignores key 1."""
    import torch

    g = torch.Generator().manual_seed(1)
    h, hkv = shape["heads"], shape["kv_heads"]
    q, k, v = (torch.randn((1, n, 2, d), generator=g) for n in (h, hkv, hkv))
    v2 = v.clone()
    v2[:, :, 1, :] += 1.0
    out, out2 = _run(probe, shape, q, k, v), _run(probe, shape, q, k, v2)
    fix = f"{say(['causal'])} yes or {say(['causal'])} no"
    if out is None or out2 is None:
        _refuse(path, "causality", "the Model raised on 2 queries over 2 keys", fix)
    row0, row1 = ((out2[:, :, i] != out[:, :, i]).any().item() for i in (0, 1))
    if not row1:
        _refuse(path, "causality", "the last query's output does not depend on the last key's value", fix)
    return not row0


def _alignment(probe, shape, d, causal):
    """(causal alignment, Nq = Nk only): 2 queries over 3 keys; row 0 sees key 1 bottom-right."""
    import torch

    g = torch.Generator().manual_seed(2)
    h, hkv = shape["heads"], shape["kv_heads"]
    q = torch.randn((1, h, 2, d), generator=g)
    k, v = (torch.randn((1, hkv, 3, d), generator=g) for _ in range(2))
    v2 = v.clone()
    v2[:, :, 1, :] += 1.0
    out, out2 = _run(probe, shape, q, k, v), _run(probe, shape, q, k, v2)
    if out is None or out2 is None or tuple(out.shape) != (1, h, 2, d):
        return "bottom-right", True
    if not causal:
        return "bottom-right", False
    return ("bottom-right" if (out2[:, :, 0] != out[:, :, 0]).any().item() else "top-left"), False


def _read_scale(probe, shape, d, a):
    """The scale read from sigmoid(scale * a), or None when the Model does not run head dim `d`."""
    import torch

    h, hkv = shape["heads"], shape["kv_heads"]
    q, k, v = torch.zeros((1, h, 2, d)), torch.zeros((1, hkv, 2, d)), torch.zeros((1, hkv, 2, d))
    q[:, :, 1, 0] = a
    k[:, :, 1, 0] = 1.0
    v[:, :, 1, 0] = 1.0
    out = _run(probe, shape, q, k, v)
    if out is None:
        return None
    p = out[:, :, 1, 0]
    if not torch.isfinite(p).all() or not ((p > 0) & (p < 1)).all() or (p.max() - p.min()).item() > 1e-6:
        return math.nan
    p = p.mean().item()
    return math.log(p / (1 - p)) / a


def _scale(probe, shape, d, path):
    """(None for 1/sqrt(D) or the fixed scale, the head dims it holds at or None)."""
    fix = f"{SCALE_OPTION} VALUE (or {SCALE_OPTION} default for 1/sqrt(D))"
    a = math.sqrt(d)
    first, second = _read_scale(probe, shape, d, a), _read_scale(probe, shape, d, 3 * a)
    if first is None or second is None:
        _refuse(path, "the scale", f"the Model raised on 2 queries over 2 keys of head dim {d}", fix)
    if not (math.isfinite(first) and math.isfinite(second) and first > 0) \
            or not math.isclose(first, second, rel_tol=2e-4):
        _refuse(path, "the scale", "the output is not softmax(scale * Q K^T) V for one scale (reading it at two "
                f"score magnitudes gave {first:.6g} and {second:.6g})", fix)
    other = 2 * d if d < 128 else d // 2
    at_other = _read_scale(probe, shape, other, math.sqrt(other))
    default = math.isclose(first, 1 / math.sqrt(d), rel_tol=1e-4)
    if at_other is not None and math.isfinite(at_other):
        if default and math.isclose(at_other, 1 / math.sqrt(other), rel_tol=1e-4):
            return None, None
        if math.isclose(at_other, first, rel_tol=1e-4):
            return float(f"{first:.6g}"), None
    # Known at the head dim of get_inputs only.
    return (None if default else float(f"{first:.6g}")), (d,)
