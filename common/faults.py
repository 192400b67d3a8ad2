"""Named crash points for the restart tests: `DFPIPE_FAULT=<name>` kills the process there.

A `kill -9` from outside lands wherever the process happens to be; these points make the worst
moments (half-written checkpoint, slot written but not published) reproducible. Unset, a fault
point costs one dict lookup.
"""
from __future__ import annotations

import os
import signal


def fault_point(name: str) -> None:
    if os.environ.get("DFPIPE_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
