"""Named fault points for the restart tests. `DFPIPE_FAULT=<name>` kills the process at a crash
point; `DFPIPE_FAULT=<name>:<n>` makes the first n passes through an error point fail as a full
disk does, or (`fault_hit`) a step's gradient non-finite.

A `kill -9` from outside lands wherever the process happens to be; these points make the worst
moments (half-written checkpoint, slot written but not published) reproducible. Unset, a fault
point costs one dict lookup.
"""
from __future__ import annotations

import errno
import os
import signal


def fault_point(name: str) -> None:
    if os.environ.get("DFPIPE_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


_error_passes: dict[str, int] = {}


def fault_hit(name: str) -> bool:
    """True for the first n passes through `name` under `DFPIPE_FAULT=<name>:<n>`."""
    spec = os.environ.get("DFPIPE_FAULT", "")
    if not spec.startswith(name + ":"):
        return False
    passes = _error_passes[name] = _error_passes.get(name, 0) + 1
    return passes <= int(spec.split(":", 1)[1])


def fault_error(name: str) -> None:
    if fault_hit(name):
        spec = os.environ["DFPIPE_FAULT"]
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (DFPIPE_FAULT {spec}, pass {_error_passes[name]})")
