"""A real target server against peers that are not the trainer: HELLOs the plan cannot hold, and
strangers who know the session's job (shown in `ctl target status`) trying to join, widen, ack,
commit or fence it. None of them may change the trainer's session; each is refused and counted."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.channel import CurveKeys, DealerChannel, make_curve_keys
from common.liveness import process_start_time
from common.protocol import Ack, Commit, Hello, Reply, new_session_secret, next_rid, secret_tag
from common.seqset import SEQ_LIMIT, SeqSet
from e2e import Service, assert_exactly_once, ctl, load, serving, wait_for, write_config
from test_target_server import ScriptedConsumer
from machine_speed import scaled

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("trust")
    config = write_config(tmp, samples=40)
    cfg = load(config)
    service = Service("target-server", config, tmp)
    try:
        status = wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        yield cfg["service"]["target_endpoint"], service, status, cfg["service"]
    finally:
        service.stop()
    assert service.proc.returncode == 0, service.log()


def _answer(chan: DealerChannel, kind: type, timeout: float = 10):
    timeout = scaled(timeout)   # s on the reference machine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = chan.recv(timeout_s=0.5)
        if isinstance(msg, kind):
            return msg
    raise AssertionError(f"no {kind.__name__} within {timeout}s")


def test_a_hello_holding_seqs_beyond_the_plan_is_refused_and_the_server_keeps_serving(server) -> None:
    endpoint, service, status, _ = server
    planned = sum(status["epoch_sizes"])
    stand_in = subprocess.Popen(["sleep", "600"])
    try:
        for have in (SeqSet.from_ranges([(0, SEQ_LIMIT)]), SeqSet([planned])):
            chan = DealerChannel(endpoint)
            chan.send(Hello(rid=next_rid(), job="greedy", secret=new_session_secret(), rank=0, world=1,
                            pid=stand_in.pid, start_time=process_start_time(stand_in.pid), have=have, epochs=1,
                            credit=2, heldout=False))
            reply = _answer(chan, Reply)
            chan.close()
            assert not reply.ok and "have set reaches" in reply.error and f"[0, {planned})" in reply.error
        after = ctl(endpoint, "status")
        assert after is not None, f"the server died of a HELLO:\n{service.log()}"
        assert after["pid"] == service.pid and after["state"] == "serving"
        assert after["refused"].get("out_of_plan") == 2
        assert after["session"] is None, "a refused HELLO starts no session"
    finally:
        stand_in.kill()
        stand_in.wait()


def test_a_stranger_who_knows_the_job_cannot_join_widen_fence_ack_or_commit(server) -> None:
    endpoint, service, status, svc = server
    planned = sum(status["epoch_sizes"])
    alive = subprocess.Popen(["sleep", "600"])      # the trainer's and a live stranger's liveness
    dead = subprocess.Popen(["true"])
    dead_identity = (dead.pid, process_start_time(dead.pid) or 1)
    dead.wait()
    trainer = ScriptedConsumer(endpoint, SeqSet(), job="trainer-job",
                               identity=(alive.pid, process_start_time(alive.pid)))
    try:
        got = trainer.take(1)
        before = ctl(endpoint, "status")
        session = before["session"]
        assert session["job"] == "trainer-job" and session["ranks"] == [0], "what a stranger reads in status"
        epoch = before["consumer_epoch"]
        stranger = DealerChannel(endpoint)

        def hello(pid: int, start: int, have: SeqSet) -> Reply:
            stranger.send(Hello(rid=next_rid(), job=session["job"], secret=new_session_secret(), rank=0, world=1,
                                pid=pid, start_time=start, have=have, epochs=1, credit=2, heldout=False))
            return _answer(stranger, Reply)

        # 1. the job and a dead pid: joining would make the dead pid end the trainer's session
        refused = hello(*dead_identity, SeqSet())
        assert not refused.ok and "not a member" in refused.error
        # 2. the job, a live pid and every seq: widening would end the epoch the trainer is training
        refused = hello(alive.pid, process_start_time(alive.pid), SeqSet.from_ranges([(0, planned)]))
        assert not refused.ok and "not a member" in refused.error
        # 3. a COMMIT claiming a checkpoint of everything
        stranger.send(Commit(rid=next_rid(), consumer_epoch=epoch, secret=new_session_secret(),
                             have=SeqSet.from_ranges([(0, planned)]), step=10 ** 6))
        refused = _answer(stranger, Reply)
        assert not refused.ok and "no rank of trainer session" in refused.error
        # 4. an ACK of a slot it was never announced
        stranger.send(Ack(consumer_epoch=epoch, secret=new_session_secret(), worker=0, slot=0, pub_seq=1, seq=0))
        counted = wait_for(lambda: (s := ctl(endpoint, "status")) and s["refused"].get("not_member", 0) >= 4 and s,
                           10, "the stranger's four messages refused")
        stranger.close()
        time.sleep(3 * svc["heartbeat_s"])  # a joined dead pid would have fenced the trainer by then

        after = ctl(endpoint, "status")
        assert after["refused"]["not_member"] == 4 == counted["refused"]["not_member"]
        assert after["consumer_epoch"] == epoch and after["fenced"] == before["fenced"]
        assert after["sessions"] == before["sessions"]
        assert after["session"]["ranks"] == [0] and after["session"]["have"] == 0
        assert after["session"]["committed"] == 0 and after["session"]["job"] == "trainer-job"
        # the trainer's session goes on untouched: every remaining seq once, the epoch ends after the last
        rest = trainer.take(planned)
        assert trainer.ended and sorted(got + rest) == list(range(planned))
        final = ctl(endpoint, "status")
        assert final["fenced"] == before["fenced"] and final["consumer_epoch"] == epoch
        shown = json.dumps(final) + service.log(tail=10_000)
        assert trainer.secret not in shown, "the session secret is never shown in status or logs"
        assert secret_tag(trainer.secret) in service.log(tail=10_000), "its short hash tells sessions apart"
    finally:
        trainer.close()
        alive.kill()
        alive.wait()


def test_a_target_server_on_a_public_tcp_endpoint_without_curve_keys_is_refused_at_start(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=10, service={"target_endpoint": "tcp://0.0.0.0:*"})
    service = Service("target-server", config, tmp_path)
    assert service.wait(120) == 1
    log = service.log()
    assert "outside loopback" in log and "curve_server_key" in log
    assert "layers kept" not in log, "refused before the target model is loaded"


def test_a_trainer_that_exits_after_the_last_epoch_is_logged_as_finished_not_dead(server) -> None:
    endpoint, service, status, svc = server
    planned = sum(status["epoch_sizes"])
    start = wait_for(lambda: (s := ctl(endpoint, "status")) and s["session"] is None and s, 30, "no session")
    finished_line, dead_line = "ended: training finished: every epoch of the plan delivered", "dead or silent"
    earlier = service.log(tail=10_000)
    stand_ins: list[subprocess.Popen] = []

    def run(have: SeqSet, n: int) -> ScriptedConsumer:
        stand_ins.append(subprocess.Popen(["sleep", "600"]))
        consumer = ScriptedConsumer(endpoint, have, job=f"run-{len(stand_ins)}",
                                    identity=(stand_ins[-1].pid, process_start_time(stand_ins[-1].pid)))
        consumer.take(n)
        stand_ins[-1].kill()
        stand_ins[-1].wait()
        consumer.close()
        return consumer

    try:
        killed = run(SeqSet(), 1)                                  # dies mid-epoch
        s = wait_for(lambda: (s := ctl(endpoint, "status")) and s["session"] is None and s, 30, "session fenced")
        assert s["finished"] == start["finished"] and s["fenced"] == start["fenced"] + 1
        done = run(SeqSet(killed.acked), planned)                  # trains the rest, then exits
        assert done.ended and sorted(killed.acked + done.acked) == list(range(planned))
        s = wait_for(lambda: (s := ctl(endpoint, "status")) and s["session"] is None and s, 30, "session ended")
        assert s["finished"] == start["finished"] + 1 and s["fenced"] == start["fenced"] + 2
        log = service.log(tail=10_000)
        assert log.count(finished_line) == earlier.count(finished_line) + 1, log
        assert log.count(dead_line) == earlier.count(dead_line) + 1, log
    finally:
        for p in stand_ins:
            p.kill()
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_both_services_on_public_tcp_endpoints_with_curve_keys_train_exactly_once(tmp_path: Path) -> None:
    server_cert, client_cert = make_curve_keys(str(tmp_path / "keys"))
    keys = CurveKeys(server_cert, client_cert)
    target_ep, trainer_ep = f"tcp://0.0.0.0:{_free_port()}", f"tcp://0.0.0.0:{_free_port()}"
    config = write_config(tmp_path, samples=40, service={
        "target_endpoint": target_ep, "trainer_endpoint": trainer_ep,
        "curve_server_key": server_cert, "curve_client_key": client_cert})
    services: list[Service] = []
    try:
        target = Service("target-server", config, tmp_path)
        services.append(target)
        wait_for(lambda: (s := ctl(target_ep, "status", curve=keys)) and s["state"] == "serving", 180,
                 "target serving (over CURVE)")
        assert ctl(target_ep, "status", timeout=1.0) is None, "a client without the keys gets no answer"
        trainer = Service("trainer", config, tmp_path)
        services.append(trainer)
        assert trainer.wait(300) == 0, trainer.log()
        assert_exactly_once(config)
        cli = subprocess.run([sys.executable, "-m", "dfpipe", "ctl", "target", "status", "--json", "-c", str(config)],
                             capture_output=True, text=True, timeout=scaled(60))
        assert cli.returncode == 0 and json.loads(cli.stdout)["pid"] == target.pid, cli.stderr   # ctl over CURVE
        # over tcp the server tells a gone trainer by its silence (lease_s), then ends the session as finished
        wait_for(lambda: (s := ctl(target_ep, "status", curve=keys)) and s["finished"] == 1, 30, "session finished")
    finally:
        for s in services[::-1]:
            s.stop()
