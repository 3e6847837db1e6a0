"""The worker's side of fa_verify.isolation's protocol: the request loop of a worker process.

Standard library only: the CUDA-on-CPU worker, which must not import fa_verify (it runs under
AddressSanitizer with `python -S`), loads this file as a top-level module.
"""

import ctypes
import os
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1


def serve(inbox_fd: int, outbox_fd: int, handle, exit_after=()) -> None:
    """Say ("ready", pid), then answer each request with handle(request, send) -> (kind,
    payload), where send((kind, payload)) sends an interim message first, until the parent
    closes the pipe or a reply's kind is in `exit_after` (the process may be unfit to go on: it
    exits after replying). The worker dies with its parent, even when stuck in a call."""
    inbox = Connection(inbox_fd, writable=False)
    outbox = Connection(outbox_fd, readable=False)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, 9)  # SIGKILL when the parent goes away
    except (AttributeError, OSError):
        pass
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            request = inbox.recv()
        except (EOFError, OSError):
            return
        reply = handle(request, outbox.send)
        outbox.send(reply)
        if reply[0] in exit_after:
            return
