"""ZeroMQ endpoints for the protocol: one ROUTER per server, DEALERs for its clients.

    target server  ROUTER  bind    <-- DEALER  connect   trainer ranks (long-lived session)
                                   <-- DEALER  connect   `dfpipe ctl`  (one request, `request()`)
    trainer rank 0 ROUTER  bind    <-- DEALER  connect   `dfpipe ctl`

Framing (no empty delimiter frame, DEALER <-> ROUTER needs none):

    DEALER sends   [payload]                 ROUTER receives [peer identity, payload]
    ROUTER sends   [peer identity, payload]  DEALER receives [payload]

Anything else (extra frames, a frame that does not decode) is logged, counted in
`bad_messages[code]` and dropped; a channel never raises for what a peer sent. ZeroMQ is only
the doorbell: a message dropped here (or by a full queue) costs latency, because both services
re-scan the shared-memory headers on a timer.

Sends never block: a full queue (high-water mark) or a vanished peer (ROUTER_MANDATORY turns
"unroutable" into EHOSTUNREACH instead of a silent drop) is a counted drop and `send` returns
False. A DEALER queues (up to its high-water mark) while the server is not yet, or no longer,
connected, and delivers once it is; the server treats what arrives late by consumer epoch and
rid like any other message.

Who may connect (see docs/architecture.md, "Trust model"): an ipc:// socket file is made 0600 and
a folder the server creates for it 0700, both set explicitly, not left to the umask, so only the
service user can connect. A folder another user owns or can write in (not sticky), or a socket
file of another user at the endpoint's path, is refused at bind (`EndpointUntrusted`: the services
exit with common.exits.EXIT_UNTRUSTED), naming that user and a folder of this user's own that
would do. Every message received on ipc:// carries the kernel's credentials of its sender
(libzmq's "Peer-Address" property, `localhost:uid:gid:pid`): one whose uid is not trusted (the
service's user, root, `service.allowed_uids`: common/trust.py) is dropped, counted
(`bad_messages["foreign_uid"]`) and logged. `check_ipc_server` asks the kernel who bound an
endpoint before a client sends it anything.
A tcp:// endpoint outside loopback is refused at bind unless ZeroMQ CURVE keys are configured
(`CurveKeys`: libzmq's own encryption and key authentication; the server lets in only the
configured client key).

What a peer can make a channel hold is bounded before anything is decoded: libzmq drops the
connection of a peer whose frame is larger than `max_bytes` (MAXMSGSIZE) before buffering it,
queues at most RCV_HWM frames per connection (ROUTER_RCV_HWM on a server's ROUTER; then stops
reading it: the sender waits) besides the one it is reading, and one `poll` takes at most
DRAIN_BYTES of frames (the rest wait in libzmq's queues). A server therefore holds at most
(ROUTER_RCV_HWM + 1) x max_bytes per open connection plus DRAIN_BYTES (`receive_bound`): 3 MiB a
connection at the defaults (issue 47: 100 connections of near-limit frames).

A peer re-sending the same large frame (at least REPEAT_BYTES: a HELLO with a long `have` set) is
not decoded again within REPEAT_S of the last one taken: a repeat carries the same rid, so the
answer to the first is the answer to it; dropped and counted (`repeats`). Decoding a 143 KB HELLO
costs ~25 ms, and 10 connections re-sending one kept `status` waiting seconds. A trainer never
sends the same frame twice (every HELLO has a new rid) and `request()` retries on a new connection.

No connection starves another, however much it queued: a ROUTER takes frames from its connections
round-robin, one frame per connection in turn (libzmq's fair queueing), and one `poll` takes at
most MAX_DRAIN frames, so a loop that answers them turn by turn answers a newcomer's request
after at most MAX_DRAIN + (connections) others: a `dfpipe ctl` request is answered while tens of
thousands of queued ones drain (bench/flood_bench.py). A connection's excess is not dropped: it
waits in its own queues (RCV_HWM here, then the sender's), so the flooder is slowed, not served
first.

Sockets are not thread-safe: one thread owns a channel. Services that wait on several sockets
register `channel.socket` with their own zmq.Poller and call `poll(0)` when it is readable.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import ipaddress
import logging
import os
import socket as pysocket
import stat
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from common.config import Config
from common.protocol import MAX_MESSAGE_BYTES, Message, ProtocolError, decode
from common.trust import Peer, Untrusted, folder_problem, listener, own_folder, owner_problem, trusted_uids, who

log = logging.getLogger("dfpipe.channel")

DEFAULT_HWM = 1000               # frames queued for sending (per peer)
RCV_HWM = 8                      # frames libzmq queues per connection on receiving (a DEALER: one peer)
# A ROUTER's: a server has as many connections as peers open, so what one may queue is what the
# server holds per connection (issue 47: 100 connections of 1 MiB frames at RCV_HWM held ~1 GB).
ROUTER_RCV_HWM = 2               # (1 stalls CURVE handshakes: test_curve_lets_in_the_configured_client_key_only)
REPEAT_BYTES = 16 << 10          # a frame at least this large, the same as the peer's last one ...
REPEAT_S = 1.0                   # ... taken less than this long ago, is dropped before decoding (`repeats`)
# frames taken per poll(): what a loop answers before it looks at its connections again. A turn
# of 1000 status requests (~1 ms each on a loaded 2-core host) kept a newcomer waiting a second.
MAX_DRAIN = 32
# bytes of frames taken per poll() (at least one frame): what one poll holds before decoding, and so
# what a control request behind it waits for. Decoding a 143 KB HELLO (a long `have` set) takes
# ~25 ms: at 8 MiB a poll of HELLOs was ~0.8 s of decoding, and `status` waited up to 1.4 s under
# 10 clients re-sending them; 1 MiB keeps a poll near 0.2 s.
DRAIN_BYTES = 1 << 20
TRIM_BYTES = 16 << 20            # bytes taken after which a quiet endpoint gives freed memory back
QUIET_S = 1.0                    # under QUIET_BYTES taken for this long: a flood is over (`give_back_memory`)
QUIET_BYTES = 1 << 20            # ordinary traffic (a trainer's ACKs, PINGs, a HELLO) stays under this a second
ENDPOINT_KEYS = "service.target_endpoint / service.trainer_endpoint"
_UNIX_PATH_MAX = 107             # sun_path is 108 bytes including the terminating NUL
_LOG_FIRST = 10                  # log every bad frame of a kind up to this many, then 1 in 1000


class ChannelError(RuntimeError):
    """An endpoint that cannot be bound or connected (bad address, in use, path too long, another
    user's folder or socket)."""


class EndpointUntrusted(ChannelError, Untrusted):
    """An ipc:// endpoint another user controls: its folder, its socket file, or the process bound to it."""


class RequestTimeout(TimeoutError):
    """`request()` got no matching answer in time."""


def _timeout_ms(timeout_s: float) -> int:
    if not timeout_s >= 0 or timeout_s == float("inf"):  # also rejects NaN
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout_s!r}")
    return int(timeout_s * 1000 + 0.999)  # round up so a tiny positive timeout still waits


def _ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ipc:// endpoint (None for other transports or abstract names)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if path.startswith("@") else path


def _check_endpoint(endpoint: str) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://", "inproc://")):
        raise ChannelError(f"endpoint {endpoint!r}: expected ipc://PATH, tcp://HOST:PORT or inproc://NAME")
    path = _ipc_path(endpoint)
    if path is not None and len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise ChannelError(f"endpoint {endpoint}: ipc path longer than {_UNIX_PATH_MAX} bytes "
                           "(a kernel limit of unix sockets); use a shorter path")


def _not_ours(endpoint: str, problem: str, path: str) -> EndpointUntrusted:
    """The refusal of `endpoint` because another user controls `path` (its folder, its socket file,
    or the socket: "\0name" for an abstract one), with a fix that works: a folder of this user's own
    that no one else has (never the refused one, which the default endpoint may well be), or having
    `path` removed."""
    if path.startswith("\0"):     # an abstract name: no file to remove, only a process to stop
        refused, remove = "", "or have the process bound to it stopped"
    else:
        refused = path if os.path.isdir(path) and not os.path.islink(path) else os.path.dirname(path)
        remove = f"or have {path} removed"
    own = own_folder(refused)
    name = os.path.basename(_ipc_path(endpoint) or "") or "target.sock"
    fix = (f"Set {ENDPOINT_KEYS} (whichever names it; the target's on both services) to a socket in a folder of "
           f"this user's own, e.g. ipc://{own}/{name}, {remove}" if own else
           f"Set {ENDPOINT_KEYS} (whichever names it) to a socket in a folder of this user's own, {remove}")
    return EndpointUntrusted(f"endpoint {endpoint}: {problem}; another user could take the endpoint or read what "
                             f"is sent to it. {fix}")


def _refuse_live_ipc(endpoint: str, path: str) -> None:
    """Raise unless `path` is free or a stale socket file of this user's.

    libzmq's bind silently replaces an existing socket file, which would steal the endpoint from
    a live server. A connect() to the file tells the two apart: a listener accepts, a stale file
    refuses (ECONNREFUSED). libzmq then replaces the stale file itself. Another user's socket file,
    live or stale, is refused: replacing it is not ours to do."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ChannelError(f"endpoint {endpoint}: {path} exists and is not a socket")
    if problem := owner_problem(path, st):
        raise _not_ours(endpoint, problem, path)
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            log.info("replacing stale socket file %s", path)
            return
        raise ChannelError(f"endpoint {endpoint}: cannot probe {path}: {e}") from None
    finally:
        probe.close()
    raise ChannelError(f"endpoint {endpoint} is in use by a live process (is another server running?)")


def _tcp_host(endpoint: str) -> str | None:
    """The host part of a tcp:// endpoint ("*" for every interface), None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(endpoint: str) -> bool:
    """True for tcp:// bound to a loopback address (127.0.0.0/8, ::1, localhost); a host name, an
    interface name or "*" counts as outside loopback."""
    host = _tcp_host(endpoint)
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class CurveKeys:
    """ZeroMQ CURVE for one endpoint: certificate files in libzmq's format (`dfpipe keys`).

    server_cert: on the server's host its secret certificate (`server.key_secret`), on a client's
    host its public one (`server.key`) or the secret one; client_cert: a client's secret
    certificate (`client.key_secret`); the server reads the public key from it (or `client.key`)
    and lets in that key only."""

    server_cert: str
    client_cert: str

    @classmethod
    def from_config(cls, cfg: Config) -> "CurveKeys | None":
        """service.curve_server_key / curve_client_key, relative to the config file; None when unset
        (the config's validation makes sure both or neither are set)."""
        svc = cfg.service
        if not svc.curve_server_key:
            return None
        return cls(cfg.resolve(svc.curve_server_key), cfg.resolve(svc.curve_client_key))

    @staticmethod
    def _load(path: str, need_secret: bool) -> tuple[bytes, bytes | None]:
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise ChannelError(f"CURVE certificate {path}: cannot read it: {e}") from None
        if need_secret and not secret:
            raise ChannelError(f"CURVE certificate {path} holds no secret key (use the .key_secret file)")
        return public, secret

    def apply_server(self, sock: zmq.Socket) -> None:
        public, secret = self._load(self.server_cert, need_secret=True)
        client_public, _ = self._load(self.client_cert, need_secret=False)
        _allow_client_key(sock.context, client_public)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True

    def apply_client(self, sock: zmq.Socket) -> None:
        server_public, _ = self._load(self.server_cert, need_secret=False)
        public, secret = self._load(self.client_cert, need_secret=True)
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = public, secret


def make_curve_keys(folder: str) -> tuple[str, str]:
    """A server and a client certificate (pyzmq's zmq.auth: a zmq.curve_keypair each, in libzmq's
    certificate format) in `folder`, made 0700 first so no one else can read a secret file even
    for a moment; the secret files are 0600. Returns the two secret certificate paths. Refuses to
    overwrite existing certificates: keys in use would silently stop matching."""
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o700)
    for name in ("server", "client"):
        for ext in ("", "_secret"):
            if os.path.exists(os.path.join(folder, f"{name}.key{ext}")):
                raise ChannelError(f"{os.path.join(folder, name)}.key{ext} exists: not overwriting keys that may be "
                                   "in use")
    paths = []
    for name in ("server", "client"):
        _, secret_file = zmq.auth.create_certificates(folder, name)
        os.chmod(secret_file, 0o600)
        paths.append(secret_file)
    return paths[0], paths[1]


class _KeyList:
    """ZAP credentials provider: the client public keys (z85) a CURVE server lets in."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


_zap_lock = threading.Lock()
_zap: dict[int, tuple[ThreadAuthenticator, _KeyList]] = {}   # id(context) -> its ZAP handler


def _allow_client_key(ctx: zmq.Context, public: bytes) -> None:
    """Start (once per context) the ZAP handler libzmq asks about every CURVE client, and let
    `public` in. Without a handler libzmq would let in any client that knows the server's key."""
    with _zap_lock:
        entry = _zap.get(id(ctx))
        if entry is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            keys = _KeyList()
            auth.configure_curve_callback(domain="*", credentials_provider=keys)
            entry = _zap[id(ctx)] = (auth, keys)
        entry[1].keys.add(public)


def _secure_ipc_folder(endpoint: str, path: str, trusted: frozenset[int]) -> None:
    """The socket's folder: created 0700 when missing; an existing one of the service user's own
    (not a shared sticky folder such as /tmp) set to 0700 too. The socket file itself is 0600.
    Refused (EndpointUntrusted naming the owner) when a user outside `trusted` owns it, or may create
    and replace names in it."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
    st = os.lstat(folder)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
        os.chmod(folder, 0o700)  # explicitly: mkdir's mode is filtered by the umask
    # a shared sticky folder (/tmp): the 0600 socket file is what keeps others out
    if problem := folder_problem(folder, trusted):
        raise _not_ours(endpoint, problem, folder)


def endpoint_problem(endpoint: str, allowed_uids: Iterable[int] = ()) -> tuple[ChannelError | None, str | None]:
    """Before binding (a service's preflight; nothing is created): why `endpoint` cannot be bound
    as the checks of `bind_router` would refuse it (its form, its ipc path's length, an existing
    folder of a user outside the trusted ones), or None; and the folder of an ipc:// endpoint, which
    the caller checks can be written in or made (None for other transports)."""
    try:
        _check_endpoint(endpoint)
    except ChannelError as e:
        return e, None
    path = _ipc_path(endpoint)
    if path is None:
        return None, None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(folder):
        if problem := folder_problem(folder, trusted_uids(allowed_uids)):
            return _not_ours(endpoint, problem, folder), None
    return None, folder


def _unix_address(endpoint: str) -> str | None:
    """The AF_UNIX address of an ipc:// endpoint (a path, or "\\0name" for ipc://@name), else None."""
    if not endpoint.startswith("ipc://"):
        return None
    name = endpoint[len("ipc://"):]
    return "\0" + name[1:] if name.startswith("@") else name


def ipc_listener(endpoint: str) -> Peer | None:
    """Who listens at an ipc:// endpoint (the kernel's credentials of the process that bound it);
    None when nobody does, it cannot be asked, or the endpoint is not ipc://."""
    address = _unix_address(endpoint)
    if address is None:
        return None
    try:
        return listener(address)
    except OSError:
        return None


def check_ipc_server(endpoint: str, allowed_uids: Iterable[int] = ()) -> bool:
    """Before a client sends an ipc:// server anything (a HELLO carries the session secret): True when
    a process of a trusted user (this one's, root, `allowed_uids`) listens at `endpoint`, False when
    nobody does yet. Raises EndpointUntrusted (a ChannelError and a common.trust.Untrusted) naming
    the user when someone else bound it, or owns or can write its folder. True for other transports
    (tcp: CURVE keys say who the server is)."""
    address = _unix_address(endpoint)
    if address is None:
        return True
    trusted = trusted_uids(allowed_uids)
    if not address.startswith("\0"):
        folder = os.path.dirname(os.path.abspath(address))
        if os.path.exists(folder) and (problem := folder_problem(folder, trusted)):
            raise _not_ours(endpoint, problem, folder)
    try:
        peer = listener(address)
    except PermissionError:
        st = os.stat(address)
        raise _not_ours(endpoint, f"its socket file belongs to {who(st.st_uid)} and refuses this user",
                        address) from None
    except OSError as e:
        raise ChannelError(f"endpoint {endpoint}: cannot ask who listens there: {e}") from None
    if peer is None:
        return False
    if peer.uid not in trusted:
        raise _not_ours(endpoint, f"it is bound by {who(peer.uid)} (pid {peer.pid}), not by this service's user, "
                                  "root or one of service.allowed_uids: sending it nothing", address)
    return True


def _peer(frame: zmq.Frame) -> Peer | None:
    """The sender of a frame received on ipc://, from libzmq's "Peer-Address" property
    ("localhost:uid:gid:pid": SO_PEERCRED of the connection); None when it is not there."""
    try:
        _host, uid, gid, pid = frame.get("Peer-Address").rsplit(":", 3)
        return Peer(int(uid), int(gid), int(pid))
    except (zmq.ZMQError, ValueError, AttributeError):
        return None


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): free pages of every malloc arena back to the system (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _common_options(sock: zmq.Socket, hwm: int, max_bytes: int, rcv_hwm: int = RCV_HWM) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # a closing service must never wait for an absent peer
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, rcv_hwm)
    # before buffering: a peer whose frame is larger is disconnected (frames of the protocol's own
    # messages are never larger: `Message.encode` refuses to build them)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def bind_router(endpoint: str, hwm: int = DEFAULT_HWM, max_bytes: int = MAX_MESSAGE_BYTES,
                curve: CurveKeys | None = None, allowed_uids: Iterable[int] = ()) -> zmq.Socket:
    """A bound ROUTER socket.

    ROUTER_MANDATORY: sending to a gone peer raises EHOSTUNREACH (counted by RouterChannel)
    instead of vanishing. ROUTER_HANDOVER: a client reconnecting with an identity still held by a
    dead or stopped connection takes it over (without it the newcomer would be ignored).
    MAXMSGSIZE, RCVHWM: see the module docstring. For ipc:// the parent folder is created (0700)
    and must be one only trusted users (this one, root, `allowed_uids`) control; a stale socket file
    of ours is replaced, but a live one, or another user's, is refused (see `_refuse_live_ipc`); the
    socket file is made 0600. tcp://HOST:* binds a free port: read `RouterChannel.endpoint`;
    outside loopback only with `curve` keys."""
    _check_endpoint(endpoint)
    if endpoint.startswith("tcp://") and not is_loopback(endpoint) and curve is None:
        raise ChannelError(f"endpoint {endpoint}: a tcp endpoint outside loopback would let anyone who can reach "
                           "it control the service; configure CURVE keys (service.curve_server_key and "
                           "service.curve_client_key, made by `dfpipe keys --out DIR`) or bind 127.0.0.1")
    path = _ipc_path(endpoint)
    if path is not None:
        _secure_ipc_folder(endpoint, path, trusted_uids(allowed_uids))
        _refuse_live_ipc(endpoint, path)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        _common_options(sock, hwm, max_bytes, ROUTER_RCV_HWM)
        if curve is not None:
            curve.apply_server(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close()
        hint = " (address in use: is another server running?)" if e.errno == errno.EADDRINUSE else ""
        raise ChannelError(f"cannot bind {endpoint}: {e}{hint}") from None
    except ChannelError:
        sock.close()
        raise
    if path is not None:
        os.chmod(path, 0o600)  # explicitly: libzmq creates it with whatever the umask allows
    return sock


def connect_dealer(endpoint: str, identity: bytes | None = None, hwm: int = DEFAULT_HWM,
                   immediate: bool = False, curve: CurveKeys | None = None,
                   max_bytes: int = MAX_MESSAGE_BYTES) -> zmq.Socket:
    """A DEALER connected (asynchronously: the peer may come up later) to `endpoint`.

    `identity`: how the ROUTER addresses this client; None lets ZeroMQ pick a random one. A
    long-lived client should include something unique per process (e.g. rank and pid), so a
    restarted process is never mistaken for its predecessor.
    `immediate`: False (default) queues up to `hwm` messages while no connection is up and
    delivers them once the server is there, so a HELLO sent right after connecting is not lost.
    True (ZMQ_IMMEDIATE) queues nothing for an absent server: sends fail at once instead."""
    _check_endpoint(endpoint)
    if identity is not None and not (isinstance(identity, bytes) and 0 < len(identity) <= 255
                                     and identity[0] != 0):
        raise ChannelError(f"identity must be 1..255 bytes not starting with NUL, got {identity!r}")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        _common_options(sock, hwm, max_bytes)
        sock.setsockopt(zmq.IMMEDIATE, 1 if immediate else 0)
        if curve is not None:
            curve.apply_client(sock)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close()
        raise ChannelError(f"cannot connect to {endpoint}: {e}") from None
    except ChannelError:
        sock.close()
        raise
    return sock


class _Channel:
    """What both ends share: decoding with the bad-frame policy and drop counters."""

    def __init__(self, sock: zmq.Socket, max_bytes: int, peers: frozenset[int] | None) -> None:
        """peers: the uids whose messages are taken (ipc:// only; None: whoever can connect)."""
        self.socket = sock
        self.max_bytes = max_bytes
        self.peers = peers
        # by ProtocolError.code, or "foreign_uid" (a sender outside `peers`)
        self.bad_messages: collections.Counter[str] = collections.Counter()
        self.dropped_sends: collections.Counter[str] = collections.Counter()  # "full", "gone", "no_peer"
        self._untrimmed = 0       # bytes taken since memory was last given back (`give_back_memory`)
        self._window_start = 0.0  # monotonic start of the current QUIET_S window of taken bytes
        self._window_bytes = 0    # bytes taken since _window_start
        self._last_busy = 0.0     # monotonic time a window last reached QUIET_BYTES (a flood was on)
        self.peak_drain_bytes = 0  # the most bytes of frames one poll held before decoding (<= DRAIN_BYTES + 1 frame)
        # ipc:// only: the kernel's credentials of each sender of the last drain, by identity (`sender`)
        self.senders: dict[bytes, Peer] = {}

    def fileno(self) -> int:
        """ZeroMQ's notification fd (edge-triggered: after it fires, drain with poll(0))."""
        return self.socket.getsockopt(zmq.FD)

    def _drain(self, timeout_s: float) -> list[list[bytes]]:
        """Wait up to timeout_s for traffic, then take the pending messages: up to MAX_DRAIN of them
        and DRAIN_BYTES (at least one); those of an untrusted sender are dropped here."""
        if not self.socket.poll(_timeout_ms(timeout_s), zmq.POLLIN):
            return []
        self.senders = {}
        out, taken = [], 0
        for _ in range(MAX_DRAIN):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            taken += sum(len(f) for f in frames)
            if self._trusted(frames):
                out.append([f.bytes for f in frames])
            if taken >= DRAIN_BYTES:
                break
        if taken:
            self.peak_drain_bytes = max(self.peak_drain_bytes, taken)
            self._note_taken(taken, time.monotonic())
        return out

    def _note_taken(self, taken: int, now: float) -> None:
        self._untrimmed += taken
        if now - self._window_start >= QUIET_S:
            self._window_start, self._window_bytes = now, 0
        self._window_bytes += taken
        if self._window_bytes >= QUIET_BYTES:
            self._last_busy = now

    def give_back_memory(self) -> None:
        """Once TRIM_BYTES were taken and then less than QUIET_BYTES for QUIET_S (a flood is over,
        its connections closed): glibc keeps the freed frames' memory in its arenas, scattered
        between live blocks, both ours and the frames libzmq still queued for the flooding
        connections and freed when they closed (after our last drain), so the process would stay
        that much larger; malloc_trim hands every free page back. Quiet is a rate, not silence: a
        trainer's PINGs and ACKs keep coming several times a second, and waiting for none at all
        kept a flood's hundreds of MB for as long as a trainer was connected. A service calls this
        every turn of its loop, traffic or not; ordinary traffic (KBs a message) reaches
        TRIM_BYTES rarely."""
        if self._untrimmed >= TRIM_BYTES and time.monotonic() - self._last_busy >= QUIET_S:
            _malloc_trim()
            self._untrimmed = 0

    def _trusted(self, frames: list[zmq.Frame]) -> bool:
        if self.peers is None:
            return True
        peer = _peer(frames[-1])
        if peer is not None and peer.uid in self.peers:
            if len(frames) > 1:     # a ROUTER's: the first frame is the sender's identity
                self.senders[frames[0].bytes] = peer
            return True
        sender = "an unknown sender" if peer is None else f"{who(peer.uid)}, pid {peer.pid}"
        self._bad("foreign_uid", f"sent by {sender}: not this service's user, root or one of service.allowed_uids",
                  frames[0].bytes if len(frames) > 1 else None)
        return False

    def _encode(self, msg: Message) -> bytes | None:
        # Too large for the peer's limit: a sender bug, but a service must not die of it.
        try:
            return msg.encode(self.max_bytes)
        except ProtocolError as e:
            self.dropped_sends["too_large"] += 1
            log.error("not sent: %s", e)
            return None

    def _decode(self, payload: bytes, peer: bytes | None) -> Message | None:
        try:
            return decode(payload, self.max_bytes)
        except ProtocolError as e:
            self._bad(e.code, f"{e}", peer)
            return None

    def _bad(self, code: str, detail: str, peer: bytes | None) -> None:
        self.bad_messages[code] += 1
        n = self.bad_messages[code]
        if n <= _LOG_FIRST or n % 1000 == 0:
            who = f" from {peer!r}" if peer is not None else ""
            log.warning("dropped bad message%s (%s, #%d): %s", who, code, n, detail)

    def _drop(self, kind: str, detail: str) -> None:
        self.dropped_sends[kind] += 1
        n = self.dropped_sends[kind]
        if n <= _LOG_FIRST or n % 1000 == 0:
            log.info("send dropped (%s, #%d): %s", kind, n, detail)

    def close(self) -> None:
        self.socket.close(linger=0)


class RouterChannel(_Channel):
    """The server end, bound to `endpoint` (see `bind_router`): many peers, each addressed by
    its identity. `endpoint` afterwards holds the bound address (the real port for tcp://H:*)."""

    def __init__(self, endpoint: str, hwm: int = DEFAULT_HWM, max_bytes: int = MAX_MESSAGE_BYTES,
                 curve: CurveKeys | None = None, allowed_uids: Iterable[int] = ()) -> None:
        """allowed_uids: on ipc://, whose messages are taken besides this user's and root's."""
        sock = bind_router(endpoint, hwm, max_bytes, curve, allowed_uids)
        super().__init__(sock, max_bytes, trusted_uids(allowed_uids) if endpoint.startswith("ipc://") else None)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        path = _ipc_path(self.endpoint)
        # Remember which socket file is ours so close() removes it, and only it (libzmq leaves it).
        self._ipc_inode = (path, os.stat(path).st_ino) if path and os.path.exists(path) else None
        self.repeats = 0          # large frames dropped undecoded as a peer's repeat (module docstring)
        self._last_large: dict[bytes, tuple[int, int, float]] = {}   # peer -> (size, digest, taken at)

    def receive_bound(self, connections: int) -> int:
        """Bytes of received frames this channel may hold with `connections` connections open."""
        return connections * (ROUTER_RCV_HWM + 1) * self.max_bytes + DRAIN_BYTES + self.max_bytes

    def _repeat(self, peer: bytes, payload: bytes, now: float) -> bool:
        """True (counted) when `payload` is a large frame the same as `peer`'s last one taken within REPEAT_S."""
        if len(payload) < REPEAT_BYTES:
            return False
        digest = zlib.crc32(payload)   # GB/s: a 1 MiB frame costs a fraction of its decoding
        last = self._last_large.get(peer)
        if last is not None and last[0] == len(payload) and last[1] == digest and now - last[2] < REPEAT_S:
            self.repeats += 1
            if self.repeats <= _LOG_FIRST or self.repeats % 1000 == 0:
                log.warning("dropped a repeat of %r's last %d-byte message (#%d): decoded once a %g s", peer,
                            len(payload), self.repeats, REPEAT_S)
            return True
        if len(self._last_large) >= 4096:   # peers on fresh connections: forget what is past REPEAT_S
            self._last_large = {p: v for p, v in self._last_large.items() if now - v[2] < REPEAT_S}
        self._last_large[peer] = (len(payload), digest, now)
        return False

    def poll(self, timeout_s: float) -> list[tuple[bytes, Message]]:
        """Wait up to timeout_s for traffic, then take the pending frames (up to MAX_DRAIN, taken
        round-robin over the connections: call again for the rest).
        Returns (peer identity, message) pairs in arrival order; bad frames are counted, dropped."""
        out: list[tuple[bytes, Message]] = []
        now = time.monotonic()
        for frames in self._drain(timeout_s):
            peer = frames[0]
            if len(frames) != 2:
                self._bad("framing", f"{len(frames) - 1} payload frames, expected 1", peer)
                continue
            if self._repeat(peer, frames[1], now):
                continue
            if (msg := self._decode(frames[1], peer)) is not None:
                out.append((peer, msg))
        self.give_back_memory()
        return out

    def sender(self, peer: bytes) -> Peer | None:
        """Who sent `peer`'s message of the last poll (ipc:// only): the process at the other end
        of its connection (SO_PEERCRED), for a service to say who told it to stop."""
        return self.senders.get(peer)

    def send(self, peer: bytes, msg: Message) -> bool:
        """Queue msg for peer without blocking. False (and counted) when the peer is gone or its
        queue is full; the caller relies on the header re-scan, or drops the session."""
        frame = self._encode(msg)
        if frame is None:
            return False
        try:
            self.socket.send_multipart([peer, frame], zmq.NOBLOCK)
        except zmq.Again:
            self._drop("full", f"{msg.TYPE} to {peer!r}: queue full")
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self._drop("gone", f"{msg.TYPE} to {peer!r}: peer not connected")
            return False
        return True

    def close(self) -> None:
        super().close()
        if self._ipc_inode is not None:
            path, inode = self._ipc_inode
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)


class DealerChannel(_Channel):
    """The client end, connected to one server (see `connect_dealer`)."""

    def __init__(self, endpoint: str, identity: bytes | None = None, hwm: int = DEFAULT_HWM,
                 max_bytes: int = MAX_MESSAGE_BYTES, immediate: bool = False, curve: CurveKeys | None = None,
                 allowed_uids: Iterable[int] | None = None) -> None:
        """allowed_uids: on ipc://, take messages only from this user, root and these (None: from
        whichever server it reaches; `dfpipe ctl` run by root talks to a service user's server)."""
        peers = trusted_uids(allowed_uids) if allowed_uids is not None and endpoint.startswith("ipc://") else None
        super().__init__(connect_dealer(endpoint, identity, hwm, immediate, curve, max_bytes), max_bytes, peers)
        self.endpoint = endpoint
        self._unsent = "no_peer" if immediate else "full"

    def send(self, msg: Message, timeout_s: float = 0.0) -> bool:
        """Send msg, waiting at most timeout_s for room. False (counted) when the queue stayed
        full ("full"), or, with immediate=True, when no connection came up in time ("no_peer")."""
        frame = self._encode(msg)
        if frame is None:
            return False
        if timeout_s > 0 and not self.socket.poll(_timeout_ms(timeout_s), zmq.POLLOUT):
            self._drop(self._unsent, f"{msg.TYPE} to {self.endpoint}: no room within {timeout_s} s")
            return False
        try:
            self.socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._drop(self._unsent, f"{msg.TYPE} to {self.endpoint}: not connected or queue full")
            return False
        return True

    def recv(self, timeout_s: float) -> Message | None:
        """The next valid message, or None when none arrived within timeout_s (bad frames are
        counted, dropped, and do not end the wait early)."""
        deadline = time.monotonic() + _timeout_ms(timeout_s) / 1000
        while True:
            left = deadline - time.monotonic()
            if not self.socket.poll(max(0, int(left * 1000 + 0.999)), zmq.POLLIN):
                return None
            if (msg := self._recv_one()) is not None:
                return msg
            if time.monotonic() >= deadline:
                return None

    def poll(self, timeout_s: float) -> list[Message]:
        """Wait up to timeout_s, then take every pending valid message (up to MAX_DRAIN)."""
        out: list[Message] = []
        for frames in self._drain(timeout_s):
            if (msg := self._check_frames(frames)) is not None:
                out.append(msg)
        self.give_back_memory()
        return out

    def _recv_one(self) -> Message | None:
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._check_frames([f.bytes for f in frames]) if self._trusted(frames) else None

    def _check_frames(self, frames: list[bytes]) -> Message | None:
        if len(frames) != 1:
            self._bad("framing", f"{len(frames)} frames, expected 1", None)
            return None
        return self._decode(frames[0], None)


def request(endpoint: str, msg: Message, timeout_s: float, retries: int = 1, peer: str = "server",
            max_bytes: int = MAX_MESSAGE_BYTES, curve: CurveKeys | None = None) -> Message:
    """Send one request and return the answer carrying the same rid (Lazy Pirate).

    The timeout_s budget is split over 1 + retries attempts; each attempt uses a fresh DEALER, so
    a late answer to an earlier attempt lands on a closed socket and cannot be mistaken for this
    one. Answers with another rid are ignored. The request is resent as is (same rid): a server
    may use the rid to recognise a repeat. Raises RequestTimeout naming the endpoint."""
    rid = getattr(msg, "rid", None)
    if rid is None:
        raise ValueError(f"{msg.TYPE} carries no rid and cannot be a request")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    _timeout_ms(timeout_s)
    msg.encode(max_bytes)  # a request too large for the limit is the caller's error, not a timeout
    attempts = retries + 1
    deadline = time.monotonic() + timeout_s
    for attempt in range(attempts):
        # Later attempts get whatever the earlier ones left, so the total stays within timeout_s.
        attempt_deadline = time.monotonic() + (deadline - time.monotonic()) / (attempts - attempt)
        channel = DealerChannel(endpoint, max_bytes=max_bytes, curve=curve)
        try:
            if not channel.send(msg, timeout_s=max(0.0, attempt_deadline - time.monotonic())):
                continue
            while True:
                left = attempt_deadline - time.monotonic()
                if left <= 0:
                    break
                answer = channel.recv(left)
                if answer is None:
                    break
                if getattr(answer, "rid", None) == rid:
                    return answer
                log.debug("request %d: ignoring %s (rid %s)", rid, answer.TYPE, getattr(answer, "rid", None))
        finally:
            channel.close()
        if attempt + 1 < attempts:
            log.info("%s at %s: no answer to %s (rid %d), retrying", peer, endpoint, msg.TYPE, rid)
    raise RequestTimeout(f"{peer} at {endpoint} did not answer within {timeout_s:g} s "
                         f"({attempts} attempt{'s' if attempts > 1 else ''}) — is it running?")
