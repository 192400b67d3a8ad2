"""A stranger on the host gets nothing (issue 30, parts 3-5), through the real services.

Another user (uid 65534, tests/stranger.py; root only, skipped otherwise) who makes an endpoint's
folder first, binds an endpoint while the target is down, sends messages to a socket it can reach,
or makes a ring's names in /dev/shm first: refused and named, never trusted. The operator removing
the ring files while both run: the target makes the ring anew and stays the one server of that
name. A peer that floods the endpoints: both services stay bounded in memory (tolerances from the
requirement: <= 256 MB over the idle size during the flood, back within 64 MB after) and give it
back within seconds although a trainer-like peer keeps pinging (issue 40); control is answered
while 10,000 queued requests drain; a HELLO of thousands of epochs never holds the target's loop
(a status answer within 1 s)."""
from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from bench.flood_bench import Pinger, request_flood, rss_anon, settled_rss
from common.channel import QUIET_S, RCV_HWM, DealerChannel
from common.exits import EXIT_UNTRUSTED
from common.liveness import process_start_time
from common.protocol import MAX_EPOCHS, Control, Hello, Ping, Reply, new_session_secret, next_rid
from common.seqset import SeqSet
from e2e import REPO, Service, assert_exactly_once, ctl, load, serving, wait_for, write_config
from stranger import Stranger, as_stranger, bind_router, need_root
from test_target_server import ScriptedConsumer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MB = 1 << 20
FLOOD_GROWTH_MB, FLOOD_AFTER_MB = 256, 64    # the requirement's bounds (issue 30, part 5)
LOOP_LATENCY_S = 1.0                          # no request holds the loop longer (issue 30, part 5)
GIVE_BACK_S = QUIET_S + 4.0                   # README: memory back after a quiet second (+ a loaded host's margin)
GIVEN_BACK_MB = 32                            # over idle once given back (measured: +2 MB; kept: 59-72 MB)


def flood(pid: int, endpoint: str, size: int, seconds: float, status_endpoint: str,
          connections: int = 12, growth_mb: int = FLOOD_GROWTH_MB) -> dict:
    """`connections` connections sending `size`-byte frames for `seconds` while a trainer-like peer
    pings the service every 0.3 s (so the end of the flood is never silence); the service's peak
    growth over its idle RssAnon, what is left after, how many seconds after the flood's end it was
    back within GIVEN_BACK_MB (inf: not within 10 s), and how long status took during the flood.
    Stops the flood early once the growth passes `growth_mb` (the machine is shared)."""
    pinger = Pinger(endpoint)
    pinger.start()
    try:
        idle = settled_rss(pid)
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "flood.py"), endpoint, str(connections),
                                 str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        peak, answers = idle, []
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and peak - idle <= growth_mb * MB:
                t0 = time.monotonic()
                answered = ctl(status_endpoint, "status", timeout=5.0) is not None
                answers.append(time.monotonic() - t0 if answered else float("inf"))
                for _ in range(5):
                    peak = max(peak, rss_anon(pid))
                    time.sleep(0.1)
        finally:
            out, _ = proc.communicate(timeout=30)   # closing its stdin stops it
        ended = time.monotonic()
        sent = json.loads(out)
        after, back_s = idle, float("inf")
        while time.monotonic() - ended < 10:   # freed memory goes back to the system within seconds
            after = rss_anon(pid)
            if after - idle <= GIVEN_BACK_MB * MB:
                back_s = time.monotonic() - ended
                break
            time.sleep(0.1)
    finally:
        pinger.halt.set()
        pinger.join(5)
    return {"growth_mb": (peak - idle) / MB, "after_mb": (after - idle) / MB, "back_s": back_s,
            "sent_mb": sent["bytes"] / MB, "status_s": max(answers)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("stranger")
    config = write_config(tmp, samples=40)
    cfg = load(config)
    service = Service("target-server", config, tmp)
    try:
        status = wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        yield {"config": config, "cfg": cfg, "service": service, "status": status, "tmp": tmp,
               "endpoint": cfg["service"]["target_endpoint"]}
    finally:
        service.stop()
    assert service.proc.returncode == 0, service.log()


# what the server may hold for 50 connections: RCV_HWM frames queued a connection and one being read
# by libzmq, plus a few frames in flight whatever the number of connections (the frame the serving
# thread holds and decodes, and freed ones glibc keeps in its arenas before it trims them): 16.
# 15 s floods (13 GB sent) level off there: peaks of 405, 449, 452 and 454 MiB were measured.
@pytest.mark.parametrize("size,connections,growth_mb", [(4 * MB, 12, FLOOD_GROWTH_MB), (MB - 64, 12, FLOOD_GROWTH_MB),
                                                        (MB - 64, 50, 50 * (RCV_HWM + 1) + 16)],
                         ids=["4MiB-frames", "frames-just-under-the-limit", "50-connections"])
def test_a_flood_of_large_frames_leaves_the_target_bounded_and_it_gives_the_memory_back(
        server, size: int, connections: int, growth_mb: int) -> None:
    service, endpoint = server["service"], server["endpoint"]
    got = flood(service.pid, endpoint, size, seconds=3, status_endpoint=endpoint, connections=connections,
                growth_mb=growth_mb)
    assert got["sent_mb"] > growth_mb, f"not a flood: {got}"
    assert got["growth_mb"] <= growth_mb, got
    assert got["after_mb"] <= FLOOD_AFTER_MB and got["back_s"] <= GIVE_BACK_S, got
    assert got["status_s"] < 5.0, f"the server stopped answering during the flood: {got}"
    after = ctl(endpoint, "status")
    assert after is not None and after["state"] == "serving" and after["pid"] == service.pid


def test_control_is_answered_while_thousands_of_queued_requests_drain(server) -> None:
    """50 connections with 200 status requests queued each (10,000: the same user's script gone
    wrong), and a probe asking status every 0.1 s on a fresh connection meanwhile, as `dfpipe ctl`
    does. Bounds in units of the server's own time per answer (per_request_ms, measured over the
    drain: the host's load scales both): fair turns make the probe wait for ~32 + 50 answers
    (bench/flood_bench.py: p50 0.08 s, p90 0.17 s at 1.3 ms an answer); 1,000-request polls made
    it wait for ~550 at the median (0.85 s) and 1,500 at p90."""
    got = request_flood(server["endpoint"], connections=50, requests=200)
    if got["answered"] != 10_000:   # where the answers went, as the server counts them
        status = ctl(server["endpoint"], "status")
        got = {**got, **{k: status.get(k) for k in ("dropped_sends", "bad_messages", "receive", "state")}}
    assert got["answered"] == got["requests"] == 10_000, got
    assert got["timeouts"] == 0 and got["probes"] >= 10, got
    per_request_s = got["per_request_ms"] / 1000
    assert got["probe_p50_s"] <= 150 * per_request_s + 0.1, got
    assert got["probe_p90_s"] <= 300 * per_request_s + 0.2, got
    assert ctl(server["endpoint"], "status")["state"] == "serving"


def test_a_hello_for_thousands_of_epochs_never_holds_the_loop(server) -> None:
    endpoint = server["endpoint"]
    stand_in = subprocess.Popen(["sleep", "600"])
    chan = DealerChannel(endpoint)
    try:
        chan.send(Hello(rid=next_rid(), job="many-epochs", secret=new_session_secret(), rank=0, world=1,
                        pid=stand_in.pid, start_time=process_start_time(stand_in.pid), have=SeqSet(),
                        epochs=MAX_EPOCHS, credit=2, heldout=False))
        latencies = []
        for _ in range(8):   # the server works through the epochs meanwhile (seconds on this data)
            t0 = time.monotonic()
            status = ctl(endpoint, "status", timeout=10.0)
            latencies.append(time.monotonic() - t0)
            assert status is not None and status["state"] == "serving"
            time.sleep(0.2)
        assert max(latencies) < LOOP_LATENCY_S, latencies
        answer = chan.recv(timeout_s=5.0)
        assert isinstance(answer, Reply) and not answer.ok and "packing" in answer.error, answer
        assert status["session"] is None, "no session for epochs whose sizes are not known yet"
    finally:
        chan.close()
        stand_in.kill()
        stand_in.wait()


def _send(endpoint: str, frames: list[bytes]) -> dict:
    """As the stranger: send `frames` to the endpoint and count what comes back within 2 s."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    for frame in frames:
        sock.send(frame)
    answers = 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if sock.poll(100):
            sock.recv_multipart()
            answers += 1
    sock.close()
    ctx.term()
    return {"answers": answers}


def test_messages_from_another_user_are_dropped_counted_and_logged(server) -> None:
    need_root()
    endpoint, service = server["endpoint"], server["service"]
    path = endpoint[len("ipc://"):]
    folder = os.path.dirname(path)
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in (folder, path)}
    os.chmod(folder, 0o711)   # a mistaken permission: the stranger can reach the socket
    os.chmod(path, 0o666)
    try:
        before = ctl(endpoint, "status")
        stand_in = os.getpid()
        frames = [Control(rid=next_rid(), cmd="shutdown", args={}).encode(),
                  Hello(rid=next_rid(), job="stranger", secret=new_session_secret(), rank=0, world=1, pid=stand_in,
                        start_time=process_start_time(stand_in), have=SeqSet(), epochs=1, credit=2,
                        heldout=False).encode(),
                  Ping(rid=next_rid(), t=0.0).encode()]
        got = as_stranger(_send, endpoint, frames)
        assert got == {"answers": 0}, got
        after = wait_for(lambda: (s := ctl(endpoint, "status")) and
                         s["foreign_messages"] >= before["foreign_messages"] + 3 and s, 10, "three messages dropped")
        assert after["foreign_messages"] == before["foreign_messages"] + 3
        assert after["state"] == "serving" and after["pid"] == service.pid, "the shutdown of a stranger is not taken"
        assert after["session"] is None and after["sessions"] == before["sessions"], "nor its HELLO"
        assert "sent by uid 65534 (nobody)" in service.log(tail=10_000)
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)


def test_ring_files_removed_while_serving_are_made_anew_and_a_second_server_stays_refused(server, tmp_path) -> None:
    endpoint, cfg, service = server["endpoint"], server["cfg"], server["service"]
    name, shm = cfg["ring"]["name"], "/dev/shm"
    before = wait_for(lambda: (s := ctl(endpoint, "status")) and s["session"] is None and s, 30, "no session")
    planned = sum(before["epoch_sizes"])
    stand_ins = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    identity = [(p.pid, process_start_time(p.pid)) for p in stand_ins]
    first = ScriptedConsumer(endpoint, SeqSet(), job="before-removal", identity=identity[0])
    try:
        got = first.take(1)
        removed = glob.glob(os.path.join(shm, f"{name}.w0.*"))
        assert sorted(os.path.basename(p) for p in removed) == sorted(
            [os.path.basename(before["ring"][0]["path"]), f"{name}.w0.producer.lock"])
        t0 = time.monotonic()
        for path in removed:   # an operator cleaning /dev/shm while both run
            os.unlink(path)
        after = wait_for(lambda: (s := ctl(endpoint, "status")) and s["ring_files_removed"] == 1 and s, 10,
                         "the removal noticed")
        assert time.monotonic() - t0 < 5.0
        ring = after["ring"][0]
        assert ring["path"] != before["ring"][0]["path"] and os.path.exists(ring["path"])
        assert ring["producer_epoch"] > before["ring"][0]["producer_epoch"]
        assert os.path.exists(os.path.join(shm, f"{name}.w0.producer.lock")), "the lock is taken again"
        assert after["state"] == "serving" and after["session"] is None, "the session on the old file is fenced"
        assert "ring files were removed" in service.log(tail=10_000)

        second = Service("target-server", write_config(tmp_path, samples=40, ring={"name": name}), tmp_path)
        try:
            assert second.wait(120) == 1
        finally:
            second.stop()
        assert "another target server serves ring" in second.log(), second.log()

        first.close()
        rest = ScriptedConsumer(endpoint, SeqSet(got), job="after-removal", identity=identity[1]).take(planned)
        assert sorted(got + rest) == list(range(planned)), "every batch once, those of the old slots included"
    finally:
        first.close()
        for p in stand_ins:
            p.kill()
            p.wait()
    # a trainer started now is told nothing odd: it trains the whole plan through the new ring
    wait_for(lambda: (s := ctl(endpoint, "status")) and s["session"] is None, 30, "the last session over")
    trainer = Service("trainer", server["config"], server["tmp"])
    assert trainer.wait(600) == 0, trainer.log()
    assert_exactly_once(server["config"])


def test_a_flood_of_large_frames_from_12_connections_leaves_the_trainer_bounded(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=10)    # no target server: the trainer waits, its control endpoint up
    endpoint = load(config)["service"]["trainer_endpoint"]
    trainer = Service("trainer", config, tmp_path)
    try:
        wait_for(lambda: ctl(endpoint, "status"), 120, "the trainer's control endpoint")
        got = flood(trainer.pid, endpoint, MB - 64, seconds=3, status_endpoint=endpoint)
        assert got["sent_mb"] > FLOOD_GROWTH_MB, f"not a flood: {got}"
        assert got["growth_mb"] <= FLOOD_GROWTH_MB, got
        assert got["after_mb"] <= FLOOD_AFTER_MB and got["back_s"] <= GIVE_BACK_S, got
        assert trainer.alive() and ctl(endpoint, "status") is not None
    finally:
        trainer.stop()


def test_a_stranger_bound_to_the_endpoint_while_the_target_is_down_never_hears_a_hello(tmp_path: Path) -> None:
    need_root()
    shared = tempfile.mkdtemp(prefix="dfsh", dir="/tmp")   # a shared sticky folder like /tmp
    os.chmod(shared, 0o1777)
    sock = os.path.join(shared, "target.sock")
    config = write_config(tmp_path, samples=10, service={"target_endpoint": f"ipc://{sock}"})
    services: list[Service] = []
    try:
        with Stranger(bind_router, f"ipc://{sock}") as stranger:
            wait_for(lambda: os.path.exists(sock) and os.stat(sock).st_uid == 65534, 10, "the stranger bound")
            trainer = Service("trainer", config, tmp_path)
            services.append(trainer)
            wait_for(lambda: "not saying HELLO" in trainer.log(tail=500), 120, "the trainer refusing to say HELLO")
            # several HELLO periods (service.request_timeout_s = 1), and a line of what it waits for
            waiting = f"for the target server at ipc://{sock}: not saying HELLO: endpoint ipc://{sock}: it is bound by"
            wait_for(lambda: waiting in trainer.log(tail=500), 60, "the trainer saying what it waits for")
            got = stranger.stop()
        assert got == {"frames": 0}, f"something reached the stranger: {got}"
        log = trainer.log(tail=500)
        assert "is bound by uid 65534 (nobody)" in log and log.count("rank 0: not saying HELLO") == 1, log
        assert "no target server is running" not in log, "it sees a server: another user's"
        assert trainer.alive(), "it waits for its target"
        # the stranger gone, its socket file stays (libzmq leaves it): the target refuses it, naming whose it is
        refused = Service("target-server", config, tmp_path)
        services.append(refused)
        assert refused.wait(120) == EXIT_UNTRUSTED, refused.log()
        assert f"{sock} belongs to uid 65534 (nobody)" in refused.log(), refused.log()
        assert f"or have {sock} removed" in refused.log(), refused.log()
        os.unlink(sock)   # the operator removes it: the real target binds the endpoint, the trainer joins it
        target = Service("target-server", config, tmp_path)
        services.append(target)
        session = wait_for(lambda: (s := ctl(f"ipc://{sock}", "status")) and s["session"], 180, "the trainer's session")
        assert session["ranks"] == [0] and trainer.alive()
    finally:
        for s in services[::-1]:
            s.stop()
        shutil.rmtree(shared, ignore_errors=True)


def test_a_stranger_who_made_the_endpoint_folder_first_is_named_and_neither_service_uses_it(tmp_path: Path) -> None:
    need_root()
    folder = f"/tmp/dfst-{os.getpid()}-{time.monotonic_ns()}"   # e.g. the old demo's /tmp/dfpipe-demo
    as_stranger(os.mkdir, folder, 0o777)
    services: list[Service] = []
    try:
        assert os.stat(folder).st_uid == 65534
        config = write_config(tmp_path, samples=10, service={"target_endpoint": f"ipc://{folder}/target.sock",
                                                             "trainer_endpoint": f"ipc://{folder}/trainer.sock"})
        for role, key in (("target-server", "service.target_endpoint"), ("trainer", "service.trainer_endpoint")):
            service = Service(role, config, tmp_path)
            services.append(service)
            assert service.wait(120) == EXIT_UNTRUSTED, service.log()   # refused by its preflight
            log = service.log()
            assert f"{key}: endpoint ipc://{folder}/" in log, log
            assert f"the folder {folder} belongs to uid 65534 (nobody)" in log, log
            assert "Traceback" not in log and "layers kept" not in log, log
            # the fix it names is a folder of this user's own, not the refused one
            suggested = re.search(r"e\.g\. ipc://(\S+)/\w+\.sock, or have (\S+) removed", log)
            assert suggested and suggested.group(2) == folder and not suggested.group(1).startswith(folder), log
        assert os.listdir(folder) == [], "nothing of ours was put there"
    finally:
        for s in services:
            s.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _squat(stopping, lock: str, ring: str) -> dict:
    """As the stranger: make a ring's lock file (and hold its lock) and a ring-like file first."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with open(ring, "wb") as f:
        f.write(b"not a ring")
    while not stopping():
        time.sleep(0.05)
    return {"held": True}


def test_ring_names_a_stranger_made_first_in_dev_shm_are_refused_or_ignored_never_used(tmp_path: Path) -> None:
    need_root()
    config = write_config(tmp_path, samples=10)
    cfg = load(config)
    lock = f"/dev/shm/{cfg['ring']['name']}.w0.producer.lock"
    squatted = f"/dev/shm/{cfg['ring']['name']}.w0.{10 ** 19 + 7}"   # beyond any producer epoch of ours
    services: list[Service] = []
    try:
        with Stranger(_squat, lock, squatted):
            wait_for(lambda: os.path.exists(squatted), 10, "the stranger's files")
            target = Service("target-server", config, tmp_path)
            services.append(target)
            assert target.wait(120) == EXIT_UNTRUSTED, target.log()
            log = target.log()
            assert f"{lock} belongs to uid 65534 (nobody)" in log and "set ring.name" in log, log
            assert "layers kept" not in log, "refused before the target model is loaded"
        os.unlink(lock)   # the operator removes it; the stranger's ring-like file stays
        target = Service("target-server", config, tmp_path)
        services.append(target)
        status = wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        assert os.path.exists(squatted) and os.stat(squatted).st_uid == 65534, "another user's file is not ours to remove"
        assert status["ring"][0]["producer_epoch"] < 10 ** 19, "nor does it decide our producer epoch"
        assert f"ignoring {squatted}" in target.log()
    finally:
        for s in services[::-1]:
            s.stop()
        for path in (lock, squatted):
            if os.path.exists(path):
                os.unlink(path)
