"""Who or what told a service to stop, for the line it logs as it stops (which `dfpipe demo` quotes).

A `ctl shutdown` names its sender: the kernel's credentials of its ipc:// connection
(`RouterChannel.sender`). A signal is named without its sender: Python's signal handlers get no
siginfo, and waiting for the signal in a thread instead (sigwaitinfo) would need it blocked in
every thread, a mask every child process inherits across exec: a compile worker would then ignore
SIGTERM. What can be told is said: a signal that came because the launcher died.
"""
from __future__ import annotations

import os
import signal

from common.liveness import death_parent
from common.trust import Peer, who

COMMAND_CHARS = 80   # of a process's command line in a log line


def command_line(pid: int) -> str:
    """What `pid` runs, for a log line: its command line with the program's folder left out, cut
    to COMMAND_CHARS; "" when the process is gone (or hidden)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return ""
    argv = [a for a in argv if a]
    if not argv:
        return ""
    text = " ".join([os.path.basename(argv[0]), *argv[1:]])
    return text if len(text) <= COMMAND_CHARS else text[:COMMAND_CHARS - 3] + "..."


def sender_text(peer: Peer | None) -> str:
    """Who sent a message, for a log line: 'pid 4242 (python -m dfpipe ctl target shutdown), uid
    1000 (ana)' from the kernel's credentials of an ipc:// connection; where there are none (tcp://),
    says so."""
    if peer is None:
        return "a peer whose process is not known (not an ipc:// connection)"
    command = command_line(peer.pid)
    return f"pid {peer.pid}{f' ({command})' if command else ' (exited)'}, {who(peer.uid)}"


def stop_signal_text(signum: int) -> str:
    """Why a stop signal came: its name, and, where this process armed the parent-death signal
    and its parent is gone, that (the module docstring says why not its sender)."""
    name = signal.Signals(signum).name
    parent = death_parent()
    if parent is not None and os.getppid() != parent:
        return f"{name}: its launcher, pid {parent}, is gone (the parent-death signal)"
    return f"{name} (from outside: a kill, Ctrl-C at its terminal or its supervisor; Python does not name the sender)"
