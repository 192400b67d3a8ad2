"""Is that process still the one we think it is, and who holds a role.

A pid alone is not an identity: pids are reused. (pid, start time) is — the kernel's start time of
a process (clock ticks since boot, `/proc/<pid>/stat` field 22) never changes and a new process with
the same pid has a later one.

A role (the producer of one ring, the consumer of a service) is held with `flock` on
`<directory>/<name>.<role>.lock`. The kernel drops the lock when the last descriptor of the holder
goes away, so a process killed with SIGKILL releases it at once; nothing has to be cleaned up and
nothing can be left held (which is why this is not a POSIX semaphore). The file records
"pid start_time" of the exclusive holder, for messages and for tools.

An exclusive holder that exits cleanly unlinks the file while it still holds the lock, so a clean
shutdown leaves nothing in /dev/shm. Unlinking a lock file naively lets two processes lock two
different inodes of one name; `acquire` closes that hole by checking, after the lock is granted,
that the path still names the inode it locked, and starting over if not. (A SIGKILLed holder
leaves the file behind; the next holder re-uses it.) A hung but alive process keeps its lock:
that case is caught by application heartbeats.

A lock file is this user's own: one that another user made first under the same name (in a shared
folder such as /dev/shm), or a symbolic link, is refused (`Untrusted`, naming its owner), never
opened for writing or locked.
"""
from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from common.trust import Untrusted, owner_problem

# A probe (anyone_holds) takes the lock for microseconds; a starter retries at least this long so a
# probe racing with it never makes it fail.
PROBE_GRACE_S = 0.05


def _from_stat(pid: int, parse: Callable[[list[bytes]], Any]) -> Any:
    """parse(/proc/<pid>/stat from field 3 (state) on); None if there is no such process, or its
    fields do not parse."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself contain ") ", so split after
    # the LAST ')'; the remaining fields start at field 3 (state).
    try:
        return parse(raw[raw.rindex(b")") + 2:].split())
    except (ValueError, IndexError):
        return None


def _read_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a process, None if there is no such process."""
    return _from_stat(pid, lambda rest: (rest[0].decode(), int(rest[19])))


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` (/proc/<pid>/stat field 4), None if there is no such process."""
    return _from_stat(pid, lambda rest: int(rest[1]))


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22); None if none."""
    stat = _read_stat(pid)
    return None if stat is None else stat[1]


def process_age_s() -> float | None:
    """Seconds since this process started (the kernel's clock, so interpreter start-up and imports
    count too); None without /proc."""
    stat = _read_stat(os.getpid())
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if stat is None else max(0.0, uptime - stat[1] / os.sysconf("SC_CLK_TCK"))


def pid_alive(pid: int, start_time: int) -> bool:
    """True if `pid` runs and is the same process (same start time); zombies count as dead."""
    stat = _read_stat(pid)
    return stat is not None and stat[1] == start_time and stat[0] not in ("Z", "X", "x")


def self_identity() -> tuple[int, int]:
    """(pid, start time) of this process."""
    pid = os.getpid()
    # /proc missing: identities degrade to pid only (start time 0), pid_alive() will say False
    return pid, process_start_time(pid) or 0


class LockHeld(RuntimeError):
    """Another process holds the role; the message says which pid (as recorded in the lock file)."""


def _lock_path(directory: str, name: str, role: str) -> str:
    for part, what in ((name, "name"), (role, "role")):
        if not part or "/" in part:
            raise ValueError(f"lock {what} {part!r}: need a non-empty string without '/'")
    return os.path.join(directory, f"{name}.{role}.lock")


def _recorded_holder(path: str) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            pid, start = f.read(64).split()[:2]
        return int(pid), int(start)
    except (OSError, ValueError):
        return None


class RoleLock:
    """flock on <directory>/<name>.<role>.lock; shared=True lets several processes (ranks) hold it.

    The descriptor is close-on-exec, so a program started with exec does not inherit the role; a
    plain os.fork() child does share it until it exits.
    """

    def __init__(self, directory: str, name: str, role: str, shared: bool = False) -> None:
        self.directory = directory
        self.path = _lock_path(directory, name, role)
        self.role = role
        self.shared = shared
        self._fd: int | None = None
        self._mutex = threading.Lock()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float = 0.0) -> None:
        """Take the lock, waiting up to `timeout` s (at least PROBE_GRACE_S); LockHeld if it stays taken,
        Untrusted if the lock file is another user's."""
        with self._mutex:
            if self._fd is not None:
                raise RuntimeError(f"{self.path}: already held by this RoleLock")
            if not os.path.isdir(self.directory):
                raise FileNotFoundError(f"lock directory {self.directory} does not exist")
            deadline = time.monotonic() + max(timeout, PROBE_GRACE_S)
            while True:
                fd = self._open()
                try:
                    self._lock(fd, max(0.0, deadline - time.monotonic()))
                except BaseException:
                    os.close(fd)
                    raise
                if self._still_linked(fd):
                    break
                os.close(fd)  # the holder we waited for unlinked this inode on its way out: retry
            try:
                if not self.shared:
                    pid, start = self_identity()
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{pid} {start}\n".encode(), 0)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd

    def _open(self) -> int:
        """The lock file, created 0600 when missing; Untrusted when it is another user's or a link."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM):
                raise
            try:
                problem = owner_problem(self.path, os.lstat(self.path))
            except FileNotFoundError:
                problem = None
            if problem is None:
                raise
            raise Untrusted(f"{self.role} lock file {problem}") from None
        if (problem := owner_problem(self.path, os.fstat(fd))) is not None:
            os.close(fd)
            raise Untrusted(f"{self.role} lock file {problem}")
        return fd

    def still_linked(self) -> bool:
        """The lock file is still there (someone may have removed it while we hold it)."""
        with self._mutex:
            return self._fd is not None and self._still_linked(self._fd)

    def _lock(self, fd: int, timeout: float) -> None:
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, mode)
                return
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            now = time.monotonic()
            if now >= deadline:
                raise LockHeld(self._held_message())
            time.sleep(min(delay, deadline - now))
            if now - start > PROBE_GRACE_S:  # retry every ms while a probe may be in the way, then back off
                delay = min(delay * 2, 0.05)

    def _held_message(self) -> str:
        holder = _recorded_holder(self.path)
        if holder is None:
            return f"{self.role} role is held by another process ({self.path}; holder not recorded)"
        pid, start = holder
        alive = "running" if pid_alive(pid, start) else "recorded holder gone; a shared holder has it"
        return f"{self.role} role is held by pid {pid} ({alive}; lock file {self.path})"

    def _still_linked(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self, unlink: bool = False) -> None:
        """Give the role up (idempotent). `unlink`: an exclusive holder removes the file first,
        while still holding the lock (see the module docstring for why that is safe)."""
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if unlink and not self.shared and self._still_linked(fd):
                    os.unlink(self.path)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "RoleLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def anyone_holds(directory: str, name: str, role: str) -> bool:
        """Probe whether any process (this one included) holds the role, shared or exclusive.

        Never creates or writes the file. It takes the lock for the few microseconds between two
        system calls: a holder is not affected at all, and a starter retries for PROBE_GRACE_S.
        """
        path = _lock_path(directory, name, role)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        finally:
            os.close(fd)  # closing the probe's descriptor also drops the probe's lock
        return False

    def __repr__(self) -> str:
        return f"RoleLock({self.path!r}, shared={self.shared}, held={self.held})"


PR_SET_PDEATHSIG = 1   # linux/prctl.h
_death_parent: int | None = None   # the parent whose death signals this process (signal_on_parent_death)


def signal_on_parent_death(sig: int, parent: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux prctl PDEATHSIG).

    For a worker whose launcher owns its lifetime (a torchrun rank; the services `dfpipe demo`
    starts, `stop_with_launcher`): torchrun starts every rank in a session of its own, so a
    SIGKILL of torchrun's process group (or an OOM kill of torchrun alone) leaves the ranks
    running, holding GPUs and the trainer's endpoints, and still attached to the target server.
    Returns False where prctl is unavailable. If the parent is already gone (died before the
    call, the process was re-parented), the signal is sent at once. `parent`: the pid the caller
    knows as its parent (it may have died before the call); default: the parent now.
    """
    import ctypes
    import signal

    global _death_parent
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    _death_parent = parent
    if parent == 1 or os.getppid() != parent:
        signal.raise_signal(sig)
    return True


# The pid of a launcher whose services stop with it (`dfpipe demo`), in the services' environment.
STOP_WITH_ENV = "DFPIPE_STOP_WITH"


def stop_with_launcher() -> None:
    """SIGTERM (a clean stop) when the launcher named in STOP_WITH_ENV dies, however it dies: a
    process arms this itself, first thing (a preexec_fn would run between fork and exec, where a
    multi-threaded launcher, e.g. a test runner, can deadlock). A launcher that died before the
    call stops it at once. The variable is not passed on to this process's own children."""
    import signal

    launcher = os.environ.pop(STOP_WITH_ENV, "")
    if launcher.isdigit():
        signal_on_parent_death(signal.SIGTERM, int(launcher))


def death_parent() -> int | None:
    """The parent whose death signals this process (`signal_on_parent_death`), None when not armed."""
    return _death_parent
