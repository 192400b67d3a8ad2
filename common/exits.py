"""The exit statuses of both services (`dfpipe target-server`, `dfpipe trainer`, `dfpipe torchrun`),
and which of them a restart cannot fix.

The deployments read this set: systemd's `RestartPreventExitStatus` in both units lists `FINAL_EXITS`
(tests/test_deploy.py checks it), and under Docker Compose, whose `restart: on-failure` restarts
every non-zero status, a service started with FINAL_AS_SUCCESS=1 in its environment ends with 0 on
a final status instead (`as_supervised`), its last line saying which status and why.
"""
from __future__ import annotations

import errno
import os
import sys
from collections.abc import Mapping

EXIT_OK = 0                       # finished, or stopped on request (the trainer after its final checkpoint)
EXIT_FAILED = 1                   # anything else (a crash, a lost peer, a bug): a restart may help
EXIT_CONFIG = 2                   # a setting this host cannot run, or a bad config: one line names the key
EXIT_BAD_STEPS = 3                # too many non-finite trainer steps in a row (it checkpointed first)
EXIT_DISK_FULL = 4                # train.out_dir cannot be written: a full or read-only disk, or not this user's to write
EXIT_OUT_DIR_IN_USE = 5           # another trainer holds train.out_dir
EXIT_PLAN_CHANGED = 6             # the target serves another data plan than the checkpoint's
EXIT_NO_CHECKPOINT_VERIFIES = 7   # there are checkpoints and none of them verifies
EXIT_UNTRUSTED = 8                # a path or name the service would use is another user's (common.trust.Untrusted)

# Each status's why, as the README's table and the supervisors' last line say it.
WHY: dict[int, str] = {
    EXIT_OK: "finished, or stopped on request",
    EXIT_FAILED: "failed (a crash, a lost peer, a bug): a restart may help",
    EXIT_CONFIG: "a setting this host cannot run or a bad config; the line names the key",
    EXIT_BAD_STEPS: "too many non-finite steps in a row (it checkpointed first)",
    EXIT_DISK_FULL: "train.out_dir cannot be written (a full or read-only disk, or not this user's), at start "
                    "or checkpoint after checkpoint",
    EXIT_OUT_DIR_IN_USE: "another trainer holds train.out_dir",
    EXIT_PLAN_CHANGED: "the target serves another data plan than the checkpoint's",
    EXIT_NO_CHECKPOINT_VERIFIES: "there are checkpoints and none verifies",
    EXIT_UNTRUSTED: "a path or name the service would use is owned or writable by another user",
}

# The statuses a restart cannot fix: it would meet the same setting, disk, data or file. The
# deployments never restart them.
FINAL_EXITS: frozenset[int] = frozenset({EXIT_CONFIG, EXIT_BAD_STEPS, EXIT_DISK_FULL, EXIT_OUT_DIR_IN_USE,
                                         EXIT_PLAN_CHANGED, EXIT_NO_CHECKPOINT_VERIFIES, EXIT_UNTRUSTED})

# In a service's environment under Docker Compose: end with 0 on a final status (Docker cannot be
# told which statuses not to restart; systemd can).
FINAL_AS_SUCCESS = "DFPIPE_FINAL_EXIT_AS_SUCCESS"


def as_supervised(status: int, who: str, environ: Mapping[str, str] | None = None) -> int:
    """The status `who` ends with: `status`, or 0 for a final one when FINAL_AS_SUCCESS=1 (compose),
    with one line on stderr saying which status it was and why."""
    environ = os.environ if environ is None else environ
    if status in FINAL_EXITS and environ.get(FINAL_AS_SUCCESS) == "1":
        print(f"{who}: exit status {status} ({WHY[status]}; restarting would not help: its log says why); ending "
              f"with 0 so that the container is not restarted ({FINAL_AS_SUCCESS})", file=sys.stderr)
        return EXIT_OK
    return status


# A disk that refuses writes: full, over quota, or mounted read-only. A restart meets the same disk.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
# A folder this user may not write in: the same, for a path inside train.out_dir.
DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM})


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def disk_error(error: BaseException, out_dir: str) -> OSError | None:
    """The OSError of a disk that refuses writes (DISK_ERRNOS), or of a path inside `out_dir` this
    user may not write (DENIED_ERRNOS), in `error`'s chain of causes (torch wraps a failed write in
    RuntimeError); None when there is none."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and (cause.errno in DISK_ERRNOS or (
                cause.errno in DENIED_ERRNOS and cause.filename and _inside(os.fsdecode(cause.filename), out_dir))):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def cannot_write(error: OSError, out_dir: str) -> str:
    """One line for a disk (`disk_error`) that refuses writes: the path (the error's, else the
    trainer's `out_dir`), what the disk said, and the fix."""
    path = os.fsdecode(error.filename) if error.filename else out_dir
    if error.errno == errno.EROFS:
        fix = "make it writable (it is mounted read-only)"
    elif error.errno in DENIED_ERRNOS:
        fix = f"make it writable by this service's user (uid {os.geteuid()})"
    else:
        fix = f"free space there (`df -h {path}`)"
    if _inside(path, out_dir):
        fix += ", or set train.out_dir to a disk with room"
    return (f"cannot write {path}: {error.strerror or os.strerror(error.errno or 0)} [errno {error.errno}]. "
            f"{fix[0].upper()}{fix[1:]}, and start it again: a restart before that meets the same disk "
            f"(exit status {EXIT_DISK_FULL})")
