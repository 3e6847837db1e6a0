"""The worker process that runs kernels for the parent: `python _worker.py READ_FD WRITE_FD`.

Why a separate process: a kernel under test may segfault, abort, corrupt memory or spin forever;
the test process must survive all of it and report a failing example. The parent kills and
restarts this worker as needed. Run by path, it imports only the standard library, its
neighbour _exec.py and fa_verify/worker_loop.py (the request loop, shared with other workers),
and it dies with its parent (PR_SET_PDEATHSIG) even when stuck in a kernel.

Protocol (multiprocessing.connection framing over two pipes): the worker says ("ready", pid);
for each request it may say ("buffers", [(address, size), ...]) before launching, then replies
("done", result) or ("error", text).
"""

import sys
from pathlib import Path

import _exec

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # fa_verify/, for worker_loop alone
import worker_loop  # noqa: E402 - found through the line above


def main() -> None:
    def handle(request, send):
        try:
            result = _exec.launch_with_copies(request, announce=lambda table: send(("buffers", table)))
            reply = ("done", result)
        except Exception as exc:  # a library that does not load, an allocation that fails
            reply = ("error", f"{type(exc).__name__}: {exc}")
        sys.stdout.flush()
        return reply

    worker_loop.serve(int(sys.argv[1]), int(sys.argv[2]), handle)


if __name__ == "__main__":
    main()
