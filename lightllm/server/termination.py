"""SIGTERM in the server's processes: exit through Python, and never lose the signal; child processes that die
with their parent.

Exiting through Python (SystemExit) runs the `finally` blocks that stop child processes and multiprocessing's
finalizers that release what they hold. Python runs a signal handler in the main thread between two bytecodes,
and those may be inside an object's finalizer during a garbage collection: an exception raised there is printed
("Exception ignored in ...") and dropped, and the process would go on as if no signal had come. So the handler
also records the signal, and the loops a process spends its life in (uvicorn's ticks, the engine's step loop)
stop once it is recorded.
"""

from __future__ import annotations

import ctypes
import signal

# per process, as signal dispositions are
_received = False


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises SystemExit(0) in the main thread and is recorded for `sigterm_received`."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def sigterm_received() -> bool:
    return _received


def _on_sigterm(signum, frame) -> None:
    global _received
    _received = True
    raise SystemExit(0)


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux), so no orphan keeps a device busy."""
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        # not Linux: the caller's own liveness checks (a parent-pid poll, a failed broadcast) end it
        pass
