"""ROUTER/DEALER channels over real sockets: messages flow, bad frames are dropped, no wait is unbounded."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from common import channel as channel_module
from common.channel import (DRAIN_BYTES, MAX_DRAIN, QUIET_S, RCV_HWM, REPEAT_BYTES, REPEAT_S, ROUTER_RCV_HWM,
                            TRIM_BYTES, ChannelError, CurveKeys,
                            DealerChannel, RequestTimeout, RouterChannel, check_ipc_server, is_loopback,
                            make_curve_keys, request)
from common.config import Config, run_tag
from common.protocol import Ack, Control, Hello, Message, Ping, Pong, Reply, next_rid
from common.seqset import SeqSet
from common.trust import Untrusted
from stranger import UID as STRANGER
from stranger import Stranger, as_stranger, bind_router, need_root

HELLO = Hello(rid=1, job="job-1", secret="ab" * 16, rank=0, world=1, pid=os.getpid(), start_time=1,
              have=SeqSet([0, 1]), epochs=1, credit=2, heldout=False)


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # Not tmp_path: unix socket paths are limited to 107 bytes and pytest's are long.
    path = tempfile.mkdtemp(prefix="dfz", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request: pytest.FixtureRequest, sock_dir: str) -> str:
    return f"ipc://{sock_dir}/target.sock" if request.param == "ipc" else "tcp://127.0.0.1:*"


def _poll_until(router: RouterChannel, want: int = 1, timeout_s: float = 5.0) -> list[tuple[bytes, Message]]:
    got: list[tuple[bytes, Message]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += router.poll(0.05)
    return got


def test_messages_flow_both_ways(endpoint: str) -> None:
    router = RouterChannel(endpoint)
    dealer = DealerChannel(router.endpoint)
    try:
        assert dealer.send(HELLO)  # sent at once after connecting: queued until the link is up
        [(peer, msg)] = _poll_until(router)
        assert msg == HELLO
        pong = Pong(rid=5, t=1.5)
        assert router.send(peer, pong)
        assert dealer.recv(5.0) == pong
        assert router.bad_messages == {} and dealer.bad_messages == {}
    finally:
        dealer.close()
        router.close()


def test_garbage_from_a_peer_is_counted_and_dropped_and_the_server_keeps_serving(sock_dir: str) -> None:
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(router.endpoint)
    try:
        raw.send(b"\xc1 not msgpack")
        raw.send_multipart([b"", HELLO.encode()])           # a REQ-style delimiter frame: wrong framing
        raw.send(Ping(rid=1, t=0.0).encode()[:-2])          # truncated
        raw.send(Ping(rid=2, t=0.0).encode())
        got = _poll_until(router)
        assert [m for _, m in got] == [Ping(rid=2, t=0.0)]
        assert router.bad_messages == {"not_msgpack": 2, "framing": 1}
        # and it still answers the same peer
        peer = got[0][0]
        assert router.send(peer, Pong(rid=2, t=0.0))
        assert raw.poll(5000) and Pong(rid=2, t=0.0).encode() == raw.recv()
    finally:
        raw.close()
        router.close()


def test_dealer_drops_bad_frames_and_returns_the_next_good_message(sock_dir: str) -> None:
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    dealer = DealerChannel(router.endpoint)
    try:
        dealer.send(HELLO)
        [(peer, _)] = _poll_until(router)
        router.socket.send_multipart([peer, b"garbage"])
        router.socket.send_multipart([peer, b"a", b"b"])
        router.send(peer, Pong(rid=3, t=0.0))
        assert dealer.recv(5.0) == Pong(rid=3, t=0.0)
        assert dealer.bad_messages == {"not_msgpack": 1, "framing": 1}
    finally:
        dealer.close()
        router.close()


def test_send_to_a_vanished_peer_returns_false(sock_dir: str) -> None:
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    try:
        assert not router.send(b"never-connected", Pong(rid=1, t=0.0))
        dealer = DealerChannel(router.endpoint, identity=b"rank0-1234")
        dealer.send(HELLO)
        [(peer, _)] = _poll_until(router)
        assert peer == b"rank0-1234"
        dealer.close()
        deadline = time.monotonic() + 5.0
        while router.send(peer, Pong(rid=1, t=0.0)) and time.monotonic() < deadline:
            time.sleep(0.01)  # the disconnect reaches the ROUTER asynchronously
        assert not router.send(peer, Pong(rid=1, t=0.0))
        assert router.dropped_sends["gone"] >= 2
    finally:
        router.close()


def test_reconnecting_identity_takes_over_from_a_stale_connection(sock_dir: str) -> None:
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    old = DealerChannel(router.endpoint, identity=b"rank0")
    new = None
    try:
        old.send(HELLO)
        assert _poll_until(router)
        new = DealerChannel(router.endpoint, identity=b"rank0")  # e.g. restarted while the old one is stopped
        new.send(HELLO)
        assert _poll_until(router)
        assert router.send(b"rank0", Pong(rid=9, t=0.0))
        assert new.recv(5.0) == Pong(rid=9, t=0.0)
        assert old.recv(0.1) is None
    finally:
        old.close()
        if new is not None:
            new.close()
        router.close()


def test_bind_refuses_an_endpoint_a_live_server_holds(sock_dir: str) -> None:
    first = RouterChannel(f"ipc://{sock_dir}/s.sock")
    try:
        with pytest.raises(ChannelError, match="in use"):
            RouterChannel(f"ipc://{sock_dir}/s.sock")
        tcp = RouterChannel("tcp://127.0.0.1:*")
        try:
            with pytest.raises(ChannelError, match="in use"):
                RouterChannel(tcp.endpoint)
        finally:
            tcp.close()
    finally:
        first.close()


def test_stale_socket_file_is_replaced_and_close_removes_ours(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "sub", "s.sock")
    os.makedirs(os.path.dirname(path))
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a socket file whose process is gone: nobody listens
    stale.close()
    router = RouterChannel(f"ipc://{path}")
    dealer = DealerChannel(router.endpoint)
    try:
        dealer.send(HELLO)
        assert _poll_until(router)
    finally:
        dealer.close()
        router.close()
    assert not os.path.exists(path)


def test_bad_endpoints_are_clear_errors(sock_dir: str) -> None:
    with pytest.raises(ChannelError, match="longer than"):
        RouterChannel("ipc://" + sock_dir + "/" + "x" * 120)
    with pytest.raises(ChannelError, match="expected ipc"):
        DealerChannel("http://localhost:80")
    with open(os.path.join(sock_dir, "file"), "w"):
        pass
    with pytest.raises(ChannelError, match="not a socket"):
        RouterChannel(f"ipc://{sock_dir}/file")


def _serve(endpoint: str, handler: Callable[[RouterChannel, bytes, Message, int], None], ready: threading.Event,
           stop: threading.Event) -> None:
    router = RouterChannel(endpoint)
    ready.set()
    n = 0
    try:
        while not stop.is_set():
            for peer, msg in router.poll(0.05):
                n += 1
                handler(router, peer, msg, n)
    finally:
        router.close()


@pytest.fixture
def fake_server(sock_dir: str) -> Iterator[Callable[[Callable[..., None]], str]]:
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(handler: Callable[..., None]) -> str:
        endpoint = f"ipc://{sock_dir}/fake.sock"
        ready = threading.Event()
        t = threading.Thread(target=_serve, args=(endpoint, handler, ready, stop), daemon=True)
        t.start()
        threads.append(t)
        assert ready.wait(5)
        return endpoint

    yield start
    stop.set()
    for t in threads:
        t.join(5)


def test_request_to_nothing_times_out_with_a_clear_message(sock_dir: str) -> None:
    endpoint = f"ipc://{sock_dir}/nobody.sock"
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout) as e:
        request(endpoint, Control(rid=next_rid(), cmd="status", args={}), timeout_s=0.6, retries=1,
                peer="target server")
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 0.6 + 2.0
    assert f"target server at {endpoint} did not answer within 0.6 s" in str(e.value)
    assert "is it running?" in str(e.value)


def test_request_matches_its_rid_and_ignores_other_answers(fake_server: Callable[..., str]) -> None:
    def handler(router: RouterChannel, peer: bytes, msg: Message, n: int) -> None:
        assert isinstance(msg, Control)
        router.send(peer, Reply.success(msg.rid + 1, {"stale": True}))  # an answer to some other request
        router.send(peer, Ping(rid=msg.rid + 2, t=0.0))
        router.send(peer, Reply.success(msg.rid, {"state": "serving"}))

    endpoint = fake_server(handler)
    rid = next_rid()
    reply = request(endpoint, Control(rid=rid, cmd="status", args={}), timeout_s=5.0)
    assert reply == Reply.success(rid, {"state": "serving"})


def test_request_retries_on_a_fresh_socket_and_gets_the_late_answer(fake_server: Callable[..., str]) -> None:
    seen: list[tuple[bytes, int]] = []

    def handler(router: RouterChannel, peer: bytes, msg: Message, n: int) -> None:
        seen.append((peer, msg.rid))
        if n == 1:
            return  # the first attempt is lost
        router.send(peer, Reply.success(msg.rid, {"attempt": n}))

    endpoint = fake_server(handler)
    rid = next_rid()
    reply = request(endpoint, Control(rid=rid, cmd="pause", args={}), timeout_s=3.0, retries=1)
    assert reply == Reply.success(rid, {"attempt": 2})
    assert [r for _, r in seen] == [rid, rid] and seen[0][0] != seen[1][0]


def test_request_needs_a_rid() -> None:
    with pytest.raises(ValueError, match="rid"):
        request("ipc:///tmp/unused.sock", Ack(consumer_epoch=0, secret="ab" * 16, worker=0, slot=0, pub_seq=0, seq=0),
                timeout_s=0.1)


def test_oversized_frames_are_never_sent_and_never_buffered(sock_dir: str) -> None:
    router = RouterChannel(f"ipc://{sock_dir}/s.sock", max_bytes=2000)
    dealer = DealerChannel(router.endpoint, max_bytes=2000)
    other = DealerChannel(router.endpoint, max_bytes=2000)
    big = Reply.success(1, {"blob": "x" * 3000})
    try:
        assert not dealer.send(big)  # refused at the sender: the server would drop it
        assert dealer.dropped_sends["too_large"] == 1
        # a peer that ignores the limit anyway: libzmq drops its connection before buffering the frame
        dealer.socket.send(big.encode())
        other.send(Ping(rid=4, t=0.0))
        got = _poll_until(router)
        assert [m for _, m in got] == [Ping(rid=4, t=0.0)], "the server goes on serving its other peers"
        assert not router.bad_messages, "the frame was never taken, so never decoded"
        assert not router.send(got[0][0], big) and router.dropped_sends["too_large"] == 1
    finally:
        other.close()
        dealer.close()
        router.close()


def test_hello_sent_before_the_server_starts_arrives_once_it_binds(sock_dir: str) -> None:
    endpoint = f"ipc://{sock_dir}/later.sock"
    dealer = DealerChannel(endpoint)
    try:
        assert dealer.send(HELLO)  # queued: a trainer may start before the target server
        router = RouterChannel(endpoint)
        try:
            assert [m for _, m in _poll_until(router)] == [HELLO]
        finally:
            router.close()
    finally:
        dealer.close()


def test_immediate_dealer_reports_an_absent_server_instead_of_queueing(sock_dir: str) -> None:
    dealer = DealerChannel(f"ipc://{sock_dir}/absent.sock", immediate=True)
    try:
        t0 = time.monotonic()
        assert not dealer.send(HELLO, timeout_s=0.2)
        assert time.monotonic() - t0 < 2.0
        assert dealer.dropped_sends["no_peer"] == 1
    finally:
        dealer.close()


# ---- who may connect --------------------------------------------------------------------------------

def test_ipc_socket_and_its_folder_are_private_whatever_the_umask(sock_dir: str) -> None:
    made = os.path.join(sock_dir, "made", "s.sock")        # a folder the server creates
    own = os.path.join(sock_dir, "own", "s.sock")          # the service user's existing folder
    os.makedirs(os.path.dirname(own), mode=0o777)
    os.chmod(os.path.dirname(own), 0o777)
    old = os.umask(0)                                      # the worst umask: everything 0777
    try:
        routers = [RouterChannel(f"ipc://{made}"), RouterChannel(f"ipc://{own}")]
    finally:
        os.umask(old)
    try:
        for path in (made, own):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700, path
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) & 0o077 == 0, "a parent is never widened either"
    finally:
        for r in routers:
            r.close()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://[::]:*", "tcp://example.com:5555"])
def test_tcp_outside_loopback_is_refused_without_curve_keys(endpoint: str) -> None:
    with pytest.raises(ChannelError, match="outside loopback.*curve_server_key"):
        RouterChannel(endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://127.0.0.9:1", "tcp://[::1]:5555",
                                      "tcp://localhost:5555"])
def test_loopback_endpoints_are_loopback(endpoint: str) -> None:
    assert is_loopback(endpoint)


def test_curve_lets_in_the_configured_client_key_only(sock_dir: str) -> None:
    keys = CurveKeys(*make_curve_keys(os.path.join(sock_dir, "keys")))
    other = CurveKeys(keys.server_cert, make_curve_keys(os.path.join(sock_dir, "other"))[1])
    router = RouterChannel("tcp://0.0.0.0:*", curve=keys)
    port = router.endpoint.rsplit(":", 1)[1]
    answered: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for peer, msg in router.poll(0.05):
                answered.append(peer)
                router.send(peer, Reply.success(msg.rid, {"ok": 1}))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        target = f"tcp://127.0.0.1:{port}"
        reply = request(target, Control(rid=next_rid(), cmd="status", args={}), timeout_s=10, curve=keys)
        assert isinstance(reply, Reply) and reply.ok
        for stranger in (other, None):    # another client key; no CURVE at all
            with pytest.raises(RequestTimeout):
                request(target, Control(rid=next_rid(), cmd="shutdown", args={}), timeout_s=1.5, retries=0,
                        curve=stranger)
        assert len(answered) == 1, "only the configured client got through"
    finally:
        stop.set()
        thread.join()
        router.close()


def test_dfpipe_keys_writes_private_certificates_and_never_overwrites(sock_dir: str) -> None:
    folder = os.path.join(sock_dir, "keys")
    server, client = make_curve_keys(folder)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for secret in (server, client):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
        public, key = zmq.auth.load_certificate(secret)
        assert key and zmq.auth.load_certificate(secret.removesuffix("_secret"))[0] == public
    with pytest.raises(ChannelError, match="not overwriting"):
        make_curve_keys(folder)


# -- another user on the host ---------------------------------------------------------------------
def test_default_endpoints_live_in_a_private_per_user_folder_made_0700(monkeypatch: pytest.MonkeyPatch,
                                                                       sock_dir: str) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", sock_dir)        # a login's runtime folder: ours, 0700
    cfg = Config()
    svc, tag = cfg.service, run_tag(cfg.train.out_dir)      # each run's own names (test_config)
    assert (svc.target_endpoint, svc.trainer_endpoint) == (f"ipc://{sock_dir}/dfpipe/{tag}-target.sock",
                                                           f"ipc://{sock_dir}/dfpipe/{tag}-trainer.sock")
    router = RouterChannel(svc.target_endpoint)
    try:
        assert stat.S_IMODE(os.stat(os.path.join(sock_dir, "dfpipe")).st_mode) == 0o700
    finally:
        router.close()
    os.chmod(sock_dir, 0o755)                                # others may enter it: not private
    assert Config().service.target_endpoint == f"ipc:///tmp/dfpipe-{os.geteuid()}/{tag}-target.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert Config().service.trainer_endpoint == f"ipc:///tmp/dfpipe-{os.geteuid()}/{tag}-trainer.sock"


def test_an_endpoint_folder_or_socket_another_user_controls_is_refused_naming_them(sock_dir: str) -> None:
    need_root()
    theirs = os.path.join(sock_dir, "theirs")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, STRANGER, STRANGER)
    with pytest.raises(ChannelError, match=r"the folder .*/theirs belongs to uid 65534 \(nobody\).*"
                                           r"service.target_endpoint / service.trainer_endpoint"):
        RouterChannel(f"ipc://{theirs}/s.sock")
    RouterChannel(f"ipc://{theirs}/s.sock", allowed_uids=[STRANGER]).close()   # a user the config trusts
    os.chmod(theirs, 0o777)
    with pytest.raises(ChannelError, match="writable by other users"):
        RouterChannel(f"ipc://{theirs}/s.sock", allowed_uids=[STRANGER])
    shared = os.path.join(sock_dir, "shared")                # ours and sticky, like /tmp: names stay their owners'
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    RouterChannel(f"ipc://{shared}/s.sock").close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # another user's socket file at the path
    stale.bind(os.path.join(shared, "t.sock"))
    stale.close()
    os.chown(os.path.join(shared, "t.sock"), STRANGER, STRANGER)
    with pytest.raises(ChannelError, match=r"t.sock belongs to uid 65534 \(nobody\)"):
        RouterChannel(f"ipc://{shared}/t.sock")


def test_a_squatted_default_endpoint_is_untrusted_and_the_fix_it_names_is_another_folder_that_binds(
        monkeypatch: pytest.MonkeyPatch, sock_dir: str) -> None:
    need_root()
    monkeypatch.setenv("XDG_RUNTIME_DIR", sock_dir)          # the default endpoints' folder: <it>/dfpipe
    home = os.path.join(sock_dir, "home")
    os.mkdir(home, 0o700)
    monkeypatch.setenv("HOME", home)
    squatted = os.path.join(sock_dir, "dfpipe")
    os.mkdir(squatted, 0o755)
    os.chown(squatted, STRANGER, STRANGER)                  # another user made it first
    cfg = Config()
    default, name = cfg.service.target_endpoint, f"{run_tag(cfg.resolve(cfg.train.out_dir))}-target.sock"
    assert default == f"ipc://{sock_dir}/dfpipe/{name}"
    with pytest.raises(Untrusted) as refused:
        RouterChannel(default)
    message = str(refused.value)
    assert isinstance(refused.value, ChannelError)
    assert f"the folder {sock_dir}/dfpipe belongs to uid 65534 (nobody)" in message, message
    suggested = re.search(r"e\.g\. (ipc://\S+),", message).group(1)
    assert suggested == f"ipc://{home}/.dfpipe/{name}", "not the squatted default: a folder of our own"
    assert f"or have {sock_dir}/dfpipe removed" in message
    RouterChannel(suggested).close()                          # and it works
    assert os.stat(os.path.join(home, ".dfpipe")).st_uid == os.geteuid()
    # nothing of ours would do (no home, the default squatted): the fix is having it removed
    monkeypatch.setenv("HOME", os.path.join(sock_dir, "dfpipe", "nohome"))
    with pytest.raises(Untrusted, match=rf"Set .* to a socket in a folder of this user's own, or have "
                                        rf"{sock_dir}/dfpipe removed$"):
        RouterChannel(default)


def test_a_client_asks_the_kernel_who_bound_an_endpoint_and_takes_nothing_from_a_stranger(sock_dir: str) -> None:
    need_root()
    os.chmod(sock_dir, 0o1777)
    endpoint = f"ipc://{sock_dir}/s.sock"
    assert check_ipc_server(endpoint) is False, "nobody listens yet"
    with Stranger(bind_router, endpoint, Pong(rid=4, t=0.0).encode()) as stranger:
        _wait_for_file(os.path.join(sock_dir, "s.sock"))
        with pytest.raises(Untrusted, match=r"is bound by uid 65534 \(nobody\) \(pid \d+\).*or have "
                                            rf"{sock_dir}/s.sock removed"):
            check_ipc_server(endpoint)
        assert check_ipc_server(endpoint, allowed_uids=[STRANGER]) is True
        careful = DealerChannel(endpoint, allowed_uids=())   # a trainer's feed: only its own user and root
        trusting = DealerChannel(endpoint)                     # `dfpipe ctl`: whoever the endpoint is
        try:
            assert careful.send(Ping(rid=4, t=0.0)) and trusting.send(Ping(rid=4, t=0.0))
            assert trusting.recv(5.0) == Pong(rid=4, t=0.0)
            assert careful.recv(1.0) is None
            assert careful.bad_messages == {"foreign_uid": 1}
        finally:
            careful.close()
            trusting.close()
        assert stranger.stop()["frames"] == 2
    with pytest.raises(ChannelError, match=r"s.sock belongs to uid 65534"):   # its file stays (libzmq leaves it)
        RouterChannel(endpoint)
    os.unlink(os.path.join(sock_dir, "s.sock"))
    router = RouterChannel(endpoint)
    try:
        assert check_ipc_server(endpoint) is True
    finally:
        router.close()


def _send_frames(endpoint: str, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    for frame in frames:
        sock.send(frame)
    sock.close(linger=2000)
    ctx.term()


def test_messages_of_another_user_are_dropped_counted_and_logged(sock_dir: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    need_root()
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    os.chmod(sock_dir, 0o711)                                # a mistaken permission lets the stranger reach it
    os.chmod(os.path.join(sock_dir, "s.sock"), 0o666)
    dealer = DealerChannel(router.endpoint)
    try:
        as_stranger(_send_frames, router.endpoint, [Control(rid=1, cmd="shutdown", args={}).encode(), HELLO.encode()])
        dealer.send(Ping(rid=7, t=0.0))
        got = _poll_until(router)
        time.sleep(0.2)
        got += router.poll(0.2)
        assert [m for _, m in got] == [Ping(rid=7, t=0.0)]
        assert router.bad_messages == {"foreign_uid": 2}
        assert "sent by uid 65534 (nobody), pid" in caplog.text
    finally:
        dealer.close()
        router.close()


def test_receiving_is_bounded_in_bytes_before_anything_is_decoded(sock_dir: str) -> None:
    router = RouterChannel(f"ipc://{sock_dir}/s.sock", max_bytes=2 << 20)
    sent = DRAIN_BYTES // (1 << 20) + 4
    dealers = [DealerChannel(router.endpoint, max_bytes=2 << 20) for _ in range(sent)]
    try:
        for sock in (router.socket, dealers[0].socket):
            assert sock.getsockopt(zmq.MAXMSGSIZE) == 2 << 20, "a larger frame is never buffered"
        assert router.socket.getsockopt(zmq.RCVHWM) == ROUTER_RCV_HWM
        assert dealers[0].socket.getsockopt(zmq.RCVHWM) == RCV_HWM
        for dealer in dealers:
            dealer.socket.send(bytes(1 << 20))
        time.sleep(0.5)                                      # as many as the server's queues take arrive
        taken = len(router._drain(1.0))
        assert taken == DRAIN_BYTES // (1 << 20), "one poll holds at most DRAIN_BYTES of frames"
        assert DRAIN_BYTES <= router.peak_drain_bytes < DRAIN_BYTES + 1024   # and the identity frames
        deadline = time.monotonic() + 5
        while taken < sent and time.monotonic() < deadline:   # the rest waited in the queues: none lost
            taken += len(router._drain(0.1))
        assert taken == sent
    finally:
        for dealer in dealers:
            dealer.close()
        router.close()


def _rss_anon() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_a_server_holds_at_most_its_receive_bound_whatever_a_flood_of_connections_sends(sock_dir: str) -> None:
    """20 connections sending frames just under the limit to a server that does not read (its loop
    busy): libzmq holds ROUTER_RCV_HWM + 1 frames a connection and stops reading the rest, so this
    process grows by at most `receive_bound(20)` (69 MiB at 1 MiB frames; at RCV_HWM 8 a connection,
    the old bound, it held ~180 MiB). Bytes, not seconds: a slow host only sends less."""
    connections, size = 20, (1 << 20) - 64
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    assert router.receive_bound(connections) == connections * (ROUTER_RCV_HWM + 1) * (1 << 20) + DRAIN_BYTES + (1 << 20)
    flooder = subprocess.Popen([sys.executable, str(Path(__file__).parent / "flood.py"), router.endpoint,
                                str(connections), str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        idle, peak = _rss_anon(), 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            peak = max(peak, _rss_anon() - idle)
            time.sleep(0.05)
        sent = json.loads(flooder.communicate(timeout=60)[0])
        assert sent["frames"] >= connections * (ROUTER_RCV_HWM + 1), f"not a flood: {sent}"
        assert peak <= router.receive_bound(connections) - DRAIN_BYTES, (peak >> 20, sent)
        got = 0
        while router._drain(0.5):                             # what was held is there to take, then nothing
            got += 1
        assert 0 < got <= connections * (ROUTER_RCV_HWM + 1), got
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait()
        router.close()


def test_a_peer_re_sending_the_same_large_frame_is_decoded_once_a_repeat_window(sock_dir: str) -> None:
    """A HELLO with a long `have` set (~25 ms to decode at 143 KB) re-sent as fast as the queues take
    it: dropped undecoded (counted) within REPEAT_S of the one taken; another peer's, a different
    one, a small one and the same one after REPEAT_S are all taken."""
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    a, b = DealerChannel(router.endpoint, identity=b"a"), DealerChannel(router.endpoint, identity=b"b")

    def hello(rid: int) -> Hello:
        return Hello(rid=rid, job="j", secret="a" * 32, rank=0, world=1, pid=1, start_time=0,
                     have=SeqSet(range(0, 20_000, 2)), epochs=1, credit=2, heldout=False)

    def take(expected: int) -> list[tuple[bytes, Message]]:
        got: list[tuple[bytes, Message]] = []
        deadline = time.monotonic() + 5
        while len(got) < expected and time.monotonic() < deadline:
            got += router.poll(0.1)
        got += router.poll(0.3)                               # and nothing more
        return got

    try:
        big = hello(1)
        assert len(big.encode()) >= REPEAT_BYTES
        small = Control(rid=2, cmd="status", args={})
        for _ in range(5):
            assert a.send(big) and a.send(small)
        assert b.send(big) and a.send(hello(3))
        got = take(8)
        assert sorted((p, m.rid) for p, m in got if isinstance(m, Hello)) == [(b"a", 1), (b"a", 3), (b"b", 1)], got
        assert sum(isinstance(m, Control) for _, m in got) == 5, "small frames are never taken for repeats"
        assert router.repeats == 4
        time.sleep(REPEAT_S)
        assert a.send(hello(3))
        assert [m.rid for _, m in take(1)] == [3], "the same frame once REPEAT_S passed"
    finally:
        a.close()
        b.close()
        router.close()


def test_memory_goes_back_once_a_flood_has_been_quiet_not_while_it_lasts(sock_dir: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The give-back waits for QUIET_S without a frame (a flood's connections may still be closing and
    libzmq freeing what it queued for them), then trims once; the loop's idle turns are enough."""
    trims: list[float] = []
    monkeypatch.setattr(channel_module, "_malloc_trim", lambda: trims.append(time.monotonic()))
    router = RouterChannel(f"ipc://{sock_dir}/s.sock", max_bytes=2 << 20)
    dealer = DealerChannel(router.endpoint, max_bytes=2 << 20)
    try:
        frames = TRIM_BYTES // (1 << 20) + 2
        taken = 0
        for i in range(frames):
            dealer.socket.send(i.to_bytes(4, "big") + bytes((1 << 20) - 4))   # not repeats (REPEAT_S)
            taken += len(router.poll(0.5)) + router.bad_messages.total()   # raw bytes: counted as bad
            router.bad_messages.clear()
        assert taken == frames
        assert trims == [], "not while frames keep coming"
        last = time.monotonic()
        while time.monotonic() - last < QUIET_S * 0.8:
            router.give_back_memory()                # what a service's loop does between messages
            assert trims == []
            time.sleep(0.05)
        deadline = time.monotonic() + QUIET_S + 2
        while not trims and time.monotonic() < deadline:
            router.give_back_memory()
            time.sleep(0.05)
        assert len(trims) == 1 and trims[0] - last >= QUIET_S * 0.8, trims
        for _ in range(3):
            router.give_back_memory()
        assert len(trims) == 1, "once per flood"
    finally:
        dealer.close()
        router.close()


def test_memory_goes_back_after_a_flood_while_ordinary_traffic_goes_on(sock_dir: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A connected trainer sends PINGs and ACKs several times a second: the end of a flood is a
    second with little traffic, not one with none (waiting for none kept a flood's memory for as
    long as a trainer was connected)."""
    trims: list[float] = []
    monkeypatch.setattr(channel_module, "_malloc_trim", lambda: trims.append(time.monotonic()))
    router = RouterChannel(f"ipc://{sock_dir}/s.sock", max_bytes=2 << 20)
    dealer = DealerChannel(router.endpoint, max_bytes=2 << 20)
    try:
        for _ in range(TRIM_BYTES // (1 << 20) + 2):
            dealer.socket.send(bytes(1 << 20))
            router.poll(0.5)
        flood_over = time.monotonic()
        deadline = flood_over + QUIET_S + 5
        pings = 0
        while not trims and time.monotonic() < deadline:
            assert dealer.send(Ping(rid=next_rid(), t=0.0))   # a trainer's share: one every 0.1 s
            pings += len(router.poll(0.1))
            time.sleep(0.1)
        assert trims, f"memory never given back while {pings} pings came"
        assert trims[0] - flood_over >= QUIET_S * 0.8 and pings >= QUIET_S / 0.2, (trims[0] - flood_over, pings)
    finally:
        dealer.close()
        router.close()


def test_a_newcomer_waits_for_one_poll_and_one_frame_of_each_flooding_connection_at_most(sock_dir: str) -> None:
    """50 connections with 200 requests queued each, and a newcomer asking once (`dfpipe ctl` in a
    flood from the same user). A loop answers what one poll took before it polls again, so the
    requests answered before the newcomer's are the poll in hand when it came plus those taken
    ahead of it: at most MAX_DRAIN + one per connection (libzmq takes connections round-robin).
    Counted in requests, not seconds: at ~1 ms an answer, the 1,000 frames a poll used to take
    (1,050 answered first) kept the newcomer waiting a second."""
    connections, queued = 50, 200
    router = RouterChannel(f"ipc://{sock_dir}/s.sock")
    flooders = [DealerChannel(router.endpoint, hwm=queued) for _ in range(connections)]
    newcomer = DealerChannel(router.endpoint)
    try:
        time.sleep(0.5)                                  # every connection up
        for f in flooders:
            for _ in range(queued):
                assert f.send(Ping(rid=next_rid(), t=0.0))
        time.sleep(0.5)                                  # the server's queues full: RCV_HWM a connection
        in_hand = router.poll(5.0)                       # what the loop answers when the newcomer asks
        assert newcomer.send(Control(rid=next_rid(), cmd="status", args={}))
        time.sleep(1.0)                                  # its request at the server
        before = len(in_hand)
        while True:
            got = router.poll(5.0)
            assert got, "the newcomer's request never came"
            at = next((i for i, (_, msg) in enumerate(got) if isinstance(msg, Control)), None)
            if at is not None:
                before += at
                break
            before += len(got)
        # MAX_DRAIN + 50 (+ margin): at ~1 ms an answer on a loaded 2-core host, well under a second
        assert before <= 3 * connections, f"{before} requests answered before the newcomer's (MAX_DRAIN {MAX_DRAIN})"
    finally:
        for chan in (*flooders, newcomer):
            chan.close()
        router.close()


def _wait_for_file(path: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
