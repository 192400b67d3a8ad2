"""Whom the services trust on one host: their own user, root, and the uids named in
`service.allowed_uids`; nobody else (docs/architecture.md, "Trust model").

What that means for a path: a folder the services put an endpoint or a ring in must belong to a
trusted user, and other users must not be able to create or replace names in it (not group- or
world-writable, unless sticky: then only a name's owner may remove or rename it, as in /tmp and
/dev/shm). A file the services create or lock there must be their own user's: a file of the same
name made first by another user is refused, naming that user, never used.

For a peer: the kernel's credentials of the process at the other end of a unix socket
(SO_PEERCRED: who bound the listening socket, for the side that connects), `listener`.

The default endpoints live in a private per-user folder (`private_dir`), never directly in a
shared sticky folder, where another user could take a socket's name while its server is down.
"""
from __future__ import annotations

import errno
import os
import pwd
import socket
import stat
import struct
from collections.abc import Iterable, Mapping
from typing import NamedTuple

_UCRED = struct.Struct("3i")      # struct ucred: pid, uid, gid


class Untrusted(RuntimeError):
    """A path or a peer that someone the service does not trust controls; the message says whose."""


class Peer(NamedTuple):
    uid: int
    gid: int
    pid: int


def trusted_uids(allowed: Iterable[int] = ()) -> frozenset[int]:
    """This process's user, root (who can read and write everything of ours anyway) and `allowed`."""
    return frozenset({os.geteuid(), 0, *allowed})


def who(uid: int) -> str:
    """'uid 65534 (nobody)', or 'uid 4242' for a uid without a name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def folder_problem(folder: str, trusted: frozenset[int]) -> str | None:
    """Why users outside `trusted` control `folder` (or what it names), or None when they do not.

    A symbolic link counts as its owner's (in a sticky folder only its owner can repoint it), and
    then the folder it points to is checked."""
    try:
        link = os.lstat(folder)
        st = os.stat(folder)
    except FileNotFoundError:
        return f"{folder} does not exist"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
        return f"{folder} is a symbolic link that belongs to {who(link.st_uid)}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid not in trusted:
        return f"the folder {folder} belongs to {who(st.st_uid)}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (f"the folder {folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}, not "
                "sticky): they can replace what is in it")
    return None


def owner_problem(path: str, st: os.stat_result) -> str | None:
    """Why the file `path` (stat `st`, not followed) is not this process's user's own, or None."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link of {who(st.st_uid)}"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to {who(st.st_uid)}, not to this service's user ({who(os.geteuid())})"
    return None


def private_dir(environ: Mapping[str, str] | None = None) -> str:
    """The per-user folder of the default endpoints: `$XDG_RUNTIME_DIR/dfpipe` when XDG_RUNTIME_DIR
    names a folder of this user's that no one else may enter (as the login manager makes it), else
    `/tmp/dfpipe-<uid>`. Only the path: the server creates it 0700 when it binds and refuses it if
    another user made it first (the endpoint check)."""
    environ = os.environ if environ is None else environ
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return os.path.join(runtime, "dfpipe")
    return f"/tmp/dfpipe-{os.geteuid()}"


def listener(address: str) -> Peer | None:
    """Who listens on the unix socket `address` (a path, or "\\0name" for an abstract one): the
    credentials the kernel recorded when that process bound it. None when nobody listens there."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(address)
        pid, uid, gid = _UCRED.unpack(probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return None
        raise
    finally:
        probe.close()
    return Peer(uid, gid, pid)
