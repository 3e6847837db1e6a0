"""The worker process of an isolated callable target (`user_callable.isolated_worker` starts it).

Its own module, above both callable backends: the worker builds either, so neither imports the
other.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import warnings

from fa_verify.backends.backward_callable import BackwardCallableBackend
from fa_verify.backends.grad_callable import GradCallableBackend
from fa_verify.backends.ragged_callable import RaggedCallableBackend
from fa_verify.guards import install
from fa_verify.backends.user_callable import CallableBackend, _portable, _portable_warning, load_callable
from fa_verify.worker_loop import serve


def worker_main(inbox_fd: int, outbox_fd: int) -> None:
    """The worker process: ("load", sys.path, spec, options, memory_limit) -> ("ok", None) (a
    RaggedCallableBackend when options name a ragged layout, else the parent's class: a
    CallableBackend, a BackwardCallableBackend or a GradCallableBackend); then
    ("run", problem, *arguments) -> ("done", (its run_in_worker(problem, *arguments), warnings)) or
    ("raised", (_portable(...), warnings)),
    `warnings` those the call issued (_portable_warning); it exits after a MemoryError, whose
    process may be unfit to go on."""
    # Python's traceback goes to the log the parent reads on a crash, and before a hang is killed.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)
    state = {}

    def handle(request, send):
        if request[0] == "load":
            _, path, spec, options, state["limit"] = request
            sys.path[:] = path
            try:
                options = dict(options)
                if options.get("forbid"):  # before the target's module binds what it imports
                    install(options["forbid"])
                backend = _backend_class(options.pop("protocol", "CallableBackend"), options.get("layout"))
                state["backend"] = backend(load_callable(spec), **options)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                return "raised", _portable(exc, state["limit"])
            return "ok", None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every one to the parent, whose filters decide
            try:
                kind, payload = "done", state["backend"].run_in_worker(*request[1:])
            except MemoryError as exc:
                kind, payload = "out of memory", _portable(exc, state["limit"])
            except BaseException as exc:  # noqa: BLE001 - SystemExit included: whatever the target raises
                kind, payload = "raised", _portable(exc)
        return kind, (payload, [_portable_warning(w) for w in caught])

    serve(inbox_fd, outbox_fd, handle, exit_after=("out of memory",))


def _backend_class(protocol: str, layout: str | None) -> type:
    """The backend a worker builds: the parent's class (`protocol`), the ragged one for a varlen or
    paged layout."""
    if layout in ("varlen", "paged"):
        return RaggedCallableBackend
    return {c.__name__: c for c in (CallableBackend, BackwardCallableBackend, GradCallableBackend)}[protocol]
