"""Forbidden calls: a target that calls a framework's own attention, softmax or matmul fails.

`--forbid NAME` (a MODULE:FUNC target option, like --timeout; `default` names
`default_forbidden()`, what `check --grading` forbids) lists framework functions by dotted name
(`torch.nn.functional.scaled_dot_product_attention`). Two mechanisms, both only while the target
is being called (`guarded(fn, names)`):

* **wrappers**: each name's attribute is replaced by a wrapper that records the call and raises
  `ForbiddenCallError`. In the worker process of an isolated target they are installed before
  the target's module is imported (`install`), so `from torch.nn.functional import
  scaled_dot_product_attention` binds the wrapper; a framework imported later is patched when
  its import finishes (a `sys.meta_path` hook), so a numpy target never pays for importing torch.
* **a profile hook** (`sys.setprofile`): a call of an original object that was bound before the
  wrappers were installed (`--no-isolate`, whose module the parent imported first; a
  `torch._C._nn` alias) is recorded from its 'c_call' event (builtins) or 'call' event (Python
  functions, by code object).

While a guarded target runs, the checker is also kept out of its sight where a kernel would
look for it: fa_verify's modules are out of `sys.modules` and `FA_VERIFY*` variables out of the
environment (`checker_unseen`), put back when it returns, and the target is called on a thread
of its own from a trampoline compiled under no file of fa_verify's, so its call stack shows
threading's frames and that trampoline only (a PyCUDA context current on the calling thread is
made current there too). A kernel that walks every thread's frames (`sys._current_frames`),
reads its parent's command line or times itself still finds the checker: in-process, nothing
hides it.

A recorded call fails the example after the target returns, even if the target caught the
wrapper's exception. The originals are put back when the last guarded call returns (in the
worker: never; the process ends).

What it cannot see: operators (`q @ k.T` is a slot call, no call event: torch.Tensor.__matmul__
and numpy's matmul run), calls made from C or C++ (a compiled extension, a Triton or CUDA kernel,
torch's own C++ dispatch), methods of C types that are not listed (`x.matmul(y)`), a function
reached through ctypes or loaded from a shared library, threads the target starts (the profile
hook is per thread; the wrappers still apply), and numpy: not a framework here, numpy targets are
reference models.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass

from fa_verify.errors import InvalidArgumentError, KernelRunError

#: --forbid's value that names `default_forbidden()`; --forbid none forbids nothing.
DEFAULT, NONE = "default", "none"
#: The attention, softmax and matmul entry points of each framework (`--forbid default`).
FRAMEWORK_ENTRY_POINTS = {
    "torch": ("torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.softmax",
              "torch.nn.functional.log_softmax", "torch.nn.functional.multi_head_attention_forward",
              "torch.softmax", "torch.log_softmax", "torch.matmul", "torch.bmm", "torch.baddbmm", "torch.mm",
              "torch.einsum", "torch.Tensor.softmax", "torch.Tensor.log_softmax", "torch.Tensor.matmul",
              "torch.Tensor.bmm"),
    "jax": ("jax.nn.dot_product_attention", "jax.nn.softmax", "jax.nn.log_softmax", "jax.numpy.matmul",
            "jax.numpy.einsum"),
}


class ForbiddenCallError(KernelRunError):
    """The target called a function `--forbid` names."""


def default_forbidden() -> tuple:
    """The entry points of the frameworks importable here (found, not imported)."""
    return tuple(name for package, names in FRAMEWORK_ENTRY_POINTS.items()
                 if importlib.util.find_spec(package) is not None for name in names)


def forbidden_names(values) -> tuple:
    """--forbid's values (each may be comma-separated; `default` expands, `none` clears) as
    a tuple of dotted names; InvalidArgumentError for a name that is not dotted."""
    names = []
    for value in values or ():
        for name in (part.strip() for part in str(value).split(",")):
            if name == DEFAULT:
                names += default_forbidden()
            elif name == NONE:
                names = []
            elif name:
                if "." not in name or not all(part.isidentifier() for part in name.split(".")):
                    raise InvalidArgumentError(
                        f"--forbid {name!r} is not a dotted name of a function; give e.g. "
                        f"--forbid torch.nn.functional.scaled_dot_product_attention, or --forbid {DEFAULT}")
                names.append(name)
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class Call:
    """One forbidden call: the name and where it was made (file:line of the caller)."""

    name: str
    where: str

    def describe(self) -> str:
        return f"{self.name} (called at {self.where})"


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.installs = 0
        self.names: tuple = ()
        self.patched: dict = {}    # name -> (owner, attribute, original, whether owner held it itself)
        self.pending: set = set()  # names whose package is not imported yet
        self.armed = 0
        self.calls: list = []
        self.builtins: dict = {}   # id(original C function) -> name
        self.codes: dict = {}      # original Python function's code object -> name
        self.finder = None


_STATE = _State()
_HERE = __file__


def _resolve(name: str):
    """(owner, attribute, object) for a dotted name whose package is imported; None when its
    top package is not imported yet; InvalidArgumentError when it does not exist."""
    parts = name.split(".")
    if parts[0] not in sys.modules:
        return None
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:-1]:
                owner = getattr(owner, attribute)
            return owner, parts[-1], getattr(owner, parts[-1])
        except AttributeError:
            break
    raise InvalidArgumentError(f"--forbid {name!r}: no such function here (a typo? check the framework's "
                               "version); name it as the framework spells it")


def _where(frame) -> str:
    """file:line of the first frame, from `frame` outward, that is not this module's."""
    while frame is not None and frame.f_code.co_filename == _HERE:
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _record(name: str, frame) -> Call:
    call = Call(name, _where(frame))
    _STATE.calls.append(call)
    return call


def _wrapper(name: str, original):
    def forbidden(*args, **kwargs):
        if not _STATE.armed:  # the harness's own calls, outside the target's
            return original(*args, **kwargs)
        call = _record(name, sys._getframe(1))
        raise ForbiddenCallError(f"the target called the forbidden {call.describe()} (--forbid)")

    forbidden.__name__ = getattr(original, "__name__", name.rsplit(".", 1)[-1])
    forbidden.__qualname__ = getattr(original, "__qualname__", forbidden.__name__)
    forbidden.__doc__ = getattr(original, "__doc__", None)
    forbidden.__wrapped__ = original
    forbidden.fa_verify_forbidden = name
    return forbidden


def _patch_imported() -> None:
    """Patch every pending name whose package is imported now."""
    for name in sorted(_STATE.pending):
        found = _resolve(name)
        if found is None:
            continue
        owner, attribute, original = found
        _STATE.pending.discard(name)
        original = getattr(original, "__wrapped__", original) if getattr(original, "fa_verify_forbidden", None) \
            else original
        code = getattr(original, "__code__", None)
        if code is not None:
            _STATE.codes[code] = name
        else:
            _STATE.builtins[id(original)] = name
        own = attribute in getattr(owner, "__dict__", {})  # a class may inherit it (torch.Tensor.softmax)
        try:
            setattr(owner, attribute, _wrapper(name, original))
        except (AttributeError, TypeError):  # a C type's attribute: the profile hook still sees it
            continue
        _STATE.patched[name] = (owner, attribute, original, own)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches the pending names when a package they belong to finishes importing."""

    def find_spec(self, fullname, path, target=None):
        if "." in fullname or not any(n.split(".")[0] == fullname for n in _STATE.pending):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        with _STATE.lock:
            if _STATE.installs:
                _patch_imported()

    def __getattr__(self, attribute):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self.loader, attribute)


def install(names) -> None:
    """Install the wrappers of `names` (reference counted: `uninstall` puts the originals back
    when the last install is undone)."""
    with _STATE.lock:
        if _STATE.installs and tuple(names) != _STATE.names:
            raise InvalidArgumentError(f"--forbid: already installed for {_STATE.names}, not {tuple(names)}")
        _STATE.installs += 1
        if _STATE.installs > 1:
            return
        _STATE.names, _STATE.pending = tuple(names), set(names)
        _STATE.finder = _AfterImport()
        sys.meta_path.insert(0, _STATE.finder)
        try:
            _patch_imported()
        except BaseException:
            uninstall()
            raise


def uninstall() -> None:
    with _STATE.lock:
        _STATE.installs -= 1
        if _STATE.installs:
            return
        for owner, attribute, original, own in _STATE.patched.values():
            if own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)
        if _STATE.finder in sys.meta_path:
            sys.meta_path.remove(_STATE.finder)
        _STATE.patched, _STATE.pending, _STATE.builtins, _STATE.codes = {}, set(), {}, {}
        _STATE.names, _STATE.finder = (), None


def _profile(frame, event, arg):
    if event == "c_call":
        name = _STATE.builtins.get(id(arg))
        if name is not None:
            _record(name, frame)
    elif event == "call":
        name = _STATE.codes.get(frame.f_code)
        if name is not None:
            _record(name, frame.f_back)


@contextlib.contextmanager
def checker_unseen():
    """fa_verify's modules out of sys.modules and FA_VERIFY* out of the environment while the block
    runs, put back after (a module the block imports anew is dropped for the original)."""
    modules = {name: sys.modules.pop(name) for name in [n for n in sys.modules
                                                        if n == "fa_verify" or n.startswith("fa_verify.")]}
    variables = {name: os.environ.pop(name) for name in [n for n in os.environ if n.startswith("FA_VERIFY")]}
    try:
        yield
    finally:
        sys.modules.update(modules)
        os.environ.update(variables)


def guarded(fn, names):
    """`fn` called with the calls of `names` forbidden: a call fails it with ForbiddenCallError
    naming the call and where it was made."""
    names = tuple(names)

    def call(*args, **kwargs):
        install(names)
        try:
            with _STATE.lock:
                _STATE.armed += 1
                _STATE.calls = []
            try:
                with checker_unseen():
                    result = _called_out_of_sight(fn, args, kwargs)
            finally:
                _STATE.armed -= 1
            calls = list(dict.fromkeys(_STATE.calls))
        finally:
            uninstall()
        if calls:  # also when the target caught the wrapper's exception
            raise ForbiddenCallError("the target called the forbidden " + "; ".join(c.describe() for c in calls)
                                     + " (--forbid)")
        return result

    call.__wrapped__ = call.fa_verify_guards = fn
    return call


#: What a guarded target is called from: a function compiled under a name that is no file of
#: fa_verify's, run as a thread's target, so the target's stack holds threading's frames and this.
_TRAMPOLINE = compile("def call_target(enter, fn, args, kwargs, leave, box):\n"
                      "    enter()\n"
                      "    try:\n"
                      "        box.append((True, fn(*args, **kwargs)))\n"
                      "    except BaseException as error:\n"
                      "        box.append((False, error))\n"
                      "    finally:\n"
                      "        leave()\n", "<target call>", "exec")
_NAMESPACE: dict = {}
exec(_TRAMPOLINE, _NAMESPACE)


def _called_out_of_sight(fn, args, kwargs):
    """fn(*args, **kwargs) on a thread of its own, from the trampoline, under the profile hook and
    in the calling thread's PyCUDA context; its result returned or its exception raised here."""
    driver = sys.modules.get("pycuda.driver")
    context = driver.Context.get_current() if driver is not None else None

    def enter():
        if context is not None:
            context.push()
        sys.setprofile(_profile)

    def leave():
        sys.setprofile(None)
        if context is not None:
            driver.Context.pop()

    box = []
    thread = threading.Thread(target=_NAMESPACE["call_target"], args=(enter, fn, args, kwargs, leave, box),
                              name="guarded target", daemon=True)
    thread.start()
    thread.join()
    returned, value = box[0]
    if not returned:
        raise value
    return value


def description(names) -> dict:
    """The guard's part of a JSON verdict: what is forbidden and what the guard cannot see."""
    return {"forbid": list(names), "blind_spots": list(BLIND_SPOTS)}


#: What --forbid cannot see (the module's doc, one line each).
BLIND_SPOTS = (
    "operators: q @ k.T (torch.Tensor.__matmul__, numpy) raise no call event",
    "calls made from C/C++: compiled extensions, Triton or CUDA kernels, a framework's own dispatch",
    "methods of C types that are not listed (x.matmul is, x.mm is not)",
    "functions reached through ctypes or a shared library",
    "threads the target starts (the profile hook is per thread; the wrappers still apply)",
    "every thread's frames (sys._current_frames) show the checker waiting for the target",
    "numpy: not a framework here; numpy targets are reference models",
)
