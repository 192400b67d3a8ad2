"""A real target server against peers that are not the trainer: HELLOs the plan cannot hold, and
strangers who know the session's job (shown in `ctl target status`) trying to join, widen, ack,
commit or fence it. None of them may change the trainer's session; each is refused and counted."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from common.channel import DealerChannel
from common.liveness import process_start_time
from common.protocol import Hello, Reply, next_rid
from common.seqset import SEQ_LIMIT, SeqSet
from e2e import Service, ctl, load, wait_for, write_config

pytestmark = pytest.mark.timeout(600)


def _serving(endpoint: str):
    s = ctl(endpoint, "status")
    return s if s and s.get("state") == "serving" else None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("trust")
    config = write_config(tmp, samples=40)
    cfg = load(config)
    service = Service("target-server", config, tmp)
    try:
        status = wait_for(lambda: _serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        yield cfg["service"]["target_endpoint"], service, status
    finally:
        service.stop()
    assert service.proc.returncode == 0, service.log()


def _answer(chan: DealerChannel, kind: type, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = chan.recv(timeout_s=0.5)
        if isinstance(msg, kind):
            return msg
    raise AssertionError(f"no {kind.__name__} within {timeout}s")


def test_a_hello_holding_seqs_beyond_the_plan_is_refused_and_the_server_keeps_serving(server) -> None:
    endpoint, service, status = server
    planned = sum(status["epoch_sizes"])
    stand_in = subprocess.Popen(["sleep", "600"])
    try:
        for have in (SeqSet.from_ranges([(0, SEQ_LIMIT)]), SeqSet([planned])):
            chan = DealerChannel(endpoint)
            chan.send(Hello(rid=next_rid(), job="greedy", rank=0, world=1, pid=stand_in.pid,
                            start_time=process_start_time(stand_in.pid), have=have, epochs=1, credit=2,
                            heldout=False))
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
