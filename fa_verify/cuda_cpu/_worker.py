"""The worker process that runs kernels for the parent: `python _worker.py READ_FD WRITE_FD`.

Why a separate process: a kernel under test may segfault, abort, corrupt memory or spin forever;
the test process must survive all of it and report a failing example. The parent kills and
restarts this worker as needed. Run by path, it imports only the standard library and its
neighbour _exec.py, and it dies with its parent (PR_SET_PDEATHSIG) even when stuck in a kernel.

Protocol (multiprocessing.connection framing over two pipes): the worker says ("ready", pid);
for each request it may say ("buffers", [(address, size), ...]) before launching, then replies
("done", result) or ("error", text).
"""

import ctypes
import os
import sys
from multiprocessing.connection import Connection

import _exec

_PR_SET_PDEATHSIG = 1


def main() -> None:
    inbox = Connection(int(sys.argv[1]), writable=False)
    outbox = Connection(int(sys.argv[2]), readable=False)
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
        try:
            result = _exec.launch_with_copies(request, announce=lambda table: outbox.send(("buffers", table)))
            reply = ("done", result)
        except Exception as exc:  # a library that does not load, an allocation that fails
            reply = ("error", f"{type(exc).__name__}: {exc}")
        sys.stdout.flush()
        outbox.send(reply)


if __name__ == "__main__":
    main()
