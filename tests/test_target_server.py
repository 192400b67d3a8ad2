"""The target server as a process, driven by a scripted consumer (no trainer): replay by the
have set, several workers, bad messages, control commands, metrics, quarantine."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from common.channel import DealerChannel
from common.config import load_config
from common.liveness import process_start_time, self_identity
from common.metrics import StageTimes
from common.protocol import Ack, Announce, EpochEnd, Fenced, Hello, Reply, Welcome, new_session_secret, next_rid
from common.ring import ConsumerRing
from common.seqset import SeqSet
from e2e import Service, ctl, load, serving, wait_for, write_config, write_heldout
from target_server.delivery import Dispatcher
from target_server.worker import TargetWorker, audit_hidden
from machine_speed import scaled

pytestmark = pytest.mark.timeout(600)


class ScriptedConsumer:
    """A trainer rank reduced to the protocol: HELLO, read announced slots, ack some of them."""

    def __init__(self, endpoint: str, have: SeqSet, job: str, identity: tuple[int, int] | None = None,
                 heldout: bool = False, unacked_heldout: int = 0) -> None:
        """identity: the (pid, start time) the server watches for liveness (default: this process);
        heldout: ask for the held-out batches, and leave the first `unacked_heldout` of them unacked."""
        self.chan = DealerChannel(endpoint)
        pid, start = identity or self_identity()
        self.secret = new_session_secret()
        self.hello = Hello(rid=next_rid(), job=job, secret=self.secret, rank=0, world=1, pid=pid, start_time=start,
                           have=have, epochs=1, credit=2, heldout=heldout)
        self.chan.send(self.hello)
        self.welcome = self._expect(Welcome, 120)
        self.rings = {r.worker: ConsumerRing.attach(r.path, cuda_register="off") for r in self.welcome.rings}
        self.acked: list[int] = []
        self.heldout: list[Announce] = []      # every held-out announcement, acked or not
        self.unacked_heldout = unacked_heldout
        self.ended = False

    def _expect(self, kind: type, timeout: float):
        timeout = scaled(timeout)   # s on the reference machine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.chan.recv(timeout_s=0.5)
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, Reply) and not msg.ok:  # not serving yet: ask again, same question
                time.sleep(0.2)
                self.chan.send(self.hello)
        raise AssertionError(f"no {kind.__name__} within {timeout}s")

    def take(self, n: int, timeout: float = 120, heldout: int | None = None) -> list[int]:
        """Ack the next n announced batches (checking each slot's payload); returns their seqs.
        heldout: stop as soon as that many held-out batches were announced. `timeout`: s on the
        reference machine (scaled to this one)."""
        got: list[int] = []
        deadline = time.monotonic() + scaled(timeout)
        while len(got) < n and time.monotonic() < deadline and (heldout is None or len(self.heldout) < heldout):
            msg = self.chan.recv(timeout_s=0.5)
            if isinstance(msg, EpochEnd):
                self.ended = True
                if heldout is None:
                    break
                continue  # held-out batches may still come after the last training batch
            if not isinstance(msg, Announce):
                continue
            view = self.rings[msg.worker].read(msg.slot, msg.pub_seq)
            assert view.meta["seq"] == msg.seq and view.meta["heldout"] == msg.heldout
            if msg.heldout:
                if any((a.worker, a.pub_seq) == (msg.worker, msg.pub_seq) for a in self.heldout):
                    continue  # a repeat of an announcement not acked yet (ZeroMQ is only the doorbell)
                self.heldout.append(msg)
                if len(self.heldout) <= self.unacked_heldout:
                    continue
                self._ack(msg)
                continue
            assert int(view.tensors["doc_lens"].sum()) == view.tensors["input_ids"].shape[0]
            assert bool(torch.isfinite(view.tensors["hidden"]).all())
            self._ack(msg)
            got.append(msg.seq)
        self.acked += got
        return got

    def take_heldout(self, n: int, timeout: float = 120) -> list[int]:
        """Take announcements (acking training batches as they come) until n held-out ones arrived."""
        self.take(1 << 30, timeout, heldout=n)
        assert len(self.heldout) == n, f"{len(self.heldout)} of {n} held-out batches announced"
        return [a.seq for a in self.heldout]

    def _ack(self, msg: Announce) -> None:
        self.rings[msg.worker].ack(msg.slot, msg.pub_seq, msg.consumer_epoch)
        self.chan.send(Ack(consumer_epoch=msg.consumer_epoch, secret=self.secret, worker=msg.worker, slot=msg.slot,
                           pub_seq=msg.pub_seq, seq=msg.seq))

    def close(self) -> None:
        for r in self.rings.values():
            r.close()
        self.chan.close()


@pytest.fixture
def two_worker_server(tmp_path: Path):
    config = write_config(tmp_path, samples=60, target={"devices": ["cpu", "cpu"]})
    cfg = load(config)
    server = Service("target-server", config, tmp_path)
    try:
        status = wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        yield cfg, server, status
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log()


def test_a_new_session_gets_exactly_the_seqs_its_have_set_lacks(two_worker_server) -> None:
    cfg, server, status = two_worker_server
    endpoint = cfg["service"]["target_endpoint"]
    assert len(status["ring"]) == 2, "one ring per worker"
    total = sum(status["epoch_sizes"])
    assert total >= 6
    have = SeqSet([0, 2])

    # the first consumer's liveness is a stand-in process we can kill: it dies holding
    # announced-but-unacked slots
    stand_in = subprocess.Popen(["sleep", "600"])
    first = ScriptedConsumer(endpoint, have, job="first",
                             identity=(stand_in.pid, process_start_time(stand_in.pid)))
    assert len(first.welcome.rings) == 2
    got1 = first.take(3)
    assert len(got1) == 3
    stand_in.kill()
    stand_in.wait()
    first.close()

    have2 = SeqSet.union_of(have, SeqSet(got1))
    second = ScriptedConsumer(endpoint, have2, job="second")
    got2 = second.take(total)
    assert second.ended, "EPOCH_END after the last seq"
    second.close()

    assert not set(got1) & set(got2), "a seq acked in one session is never delivered again"
    assert not (set(got1) | set(got2)) & {0, 2}, "seqs in the have set are never delivered"
    assert sorted(set(got1) | set(got2) | {0, 2}) == list(range(total))
    assert len(got2) == len(set(got2))
    final = ctl(endpoint, "status")
    assert final["model_loads"] == 1 and final["pid"] == server.pid
    assert final["batches"]["quarantined"] == 0


def _slots_free(endpoint: str, slots: int):
    s = ctl(endpoint, "status")
    return s if s and all(r["slots"]["FREE"] == slots for r in s["ring"]) else None


def test_heldout_batches_reach_every_session_that_asks_and_are_never_delivered_as_training(tmp_path: Path) -> None:
    h = 3
    config = write_config(tmp_path, samples=30, data={"heldout_path": str(write_heldout(tmp_path))},
                          train={"eval_every": 2, "eval_batches": h})
    cfg = load(config)
    endpoint, slots = cfg["service"]["target_endpoint"], cfg["ring"]["slots"]
    server = Service("target-server", config, tmp_path)
    stand_ins: list[subprocess.Popen] = []

    def dying_identity() -> tuple[int, int]:
        stand_ins.append(subprocess.Popen(["sleep", "600"]))
        return stand_ins[-1].pid, process_start_time(stand_ins[-1].pid)

    def end(consumer: ScriptedConsumer) -> None:
        stand_ins[-1].kill()
        stand_ins[-1].wait()
        consumer.close()

    try:
        status = wait_for(lambda: serving(endpoint), 180, "target serving")
        total = sum(status["epoch_sizes"])
        assert status["heldout"]["batches"] == h and total >= 4

        # session 1 asks for held-out batches and leaves the first one announced unacked
        first = ScriptedConsumer(endpoint, SeqSet(), job="first", identity=dying_identity(), heldout=True,
                                 unacked_heldout=1)
        assert first.welcome.heldout_batches == h
        assert sorted(first.take_heldout(h)) == list(range(h))
        left = first.heldout[0]
        s1 = wait_for(lambda: (s := ctl(endpoint, "status")) and s["session"]["heldout_acked"] == h - 1 and s, 30,
                      "held-out acks seen")
        assert s1["session"]["delivered"] == len(first.acked), "held-out acks are not training deliveries"
        assert s1["batches"]["acked"] == len(first.acked)
        end(first)

        # session 2 asks again: all of them again, the left-over slot re-announced as it is
        second = ScriptedConsumer(endpoint, SeqSet(first.acked), job="second", identity=dying_identity(),
                                  heldout=True, unacked_heldout=1)
        assert sorted(second.take_heldout(h)) == list(range(h))
        assert (left.worker, left.slot, left.pub_seq, left.seq) in {
            (a.worker, a.slot, a.pub_seq, a.seq) for a in second.heldout}
        # its acks must reach the server before the session ends (acks of an ended session are void)
        wait_for(lambda: (s := ctl(endpoint, "status")) and s["session"]["heldout_acked"] == h - 1 and s, 30,
                 "second session's held-out acks seen")
        end(second)

        # session 3 does not ask: the slot session 2 left unacked is freed, it gets training batches only
        have = SeqSet(first.acked + second.acked)
        third = ScriptedConsumer(endpoint, have, job="third")
        assert third.welcome.heldout_batches == h
        third.take(total)
        assert third.ended and third.heldout == []
        third.close()
        trained = first.acked + second.acked + third.acked
        assert sorted(trained) == list(range(total)), "every training seq exactly once, nothing else"

        final = wait_for(lambda: _slots_free(endpoint, slots), 30, "every slot FREE again (no slot leaked)")
        assert final["batches"]["acked"] == total and final["session"]["delivered"] == len(third.acked)
        assert final["heldout"]["acked"] == 2 * (h - 1) and final["heldout"]["discarded"] == 1
        assert final["heldout"]["pending"] == 0 and final["heldout"]["quarantined"] == 0
        assert final["batches"]["quarantined"] == 0 and final["model_loads"] == 1
    finally:
        for p in stand_ins:
            p.kill()
            p.wait()
        server.stop()
    assert server.proc.returncode == 0, server.log()


def test_garbage_and_wrong_epoch_messages_are_counted_and_dropped(two_worker_server) -> None:
    cfg, server, _ = two_worker_server
    endpoint = cfg["service"]["target_endpoint"]
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    for junk in (b"", b"\x00\xff\x13", b"\x81\xa1v\x63", os.urandom(2048)):
        raw.send(junk)
    chan = DealerChannel(endpoint)
    chan.send(Ack(consumer_epoch=999, secret="ab" * 16, worker=0, slot=0, pub_seq=1, seq=0))  # a session that never was
    reply = None
    deadline = time.monotonic() + 10
    while reply is None and time.monotonic() < deadline:
        reply = chan.recv(timeout_s=0.5)
    assert isinstance(reply, Fenced)
    chan.close()
    raw.close()
    status = wait_for(lambda: (s := ctl(endpoint, "status")) and s["bad_messages"] >= 4 and s, 10,
                      "bad messages counted")
    assert status["state"] == "serving" and status["pid"] == server.pid
    assert sum(status["ring"][0]["slots"].values()) == cfg["ring"]["slots"]


def test_control_commands_and_clear_errors(two_worker_server, tmp_path: Path) -> None:
    cfg, server, _ = two_worker_server
    endpoint = cfg["service"]["target_endpoint"]
    config = tmp_path / "config.yaml"

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dfpipe", *args], capture_output=True, text=True,
                              timeout=timeout)

    assert ctl(endpoint, "pause")["state"] == "paused"
    assert ctl(endpoint, "status")["state"] == "paused"
    assert ctl(endpoint, "resume")["state"] == "serving"
    refused = run("ctl", "target", "checkpoint", "-c", str(config))
    assert refused.returncode != 0 and "no durable state" in refused.stderr + refused.stdout
    as_json = run("ctl", "target", "status", "--json", "-c", str(config))
    assert as_json.returncode == 0 and '"model_loads": 1' in as_json.stdout
    # what the WELCOME tells trainers, with the precision the target runs in (the tiny target: fp32)
    described = json.loads(as_json.stdout)["target"]
    assert described["precision"] == "fp32" and described["layer_ids"] and described["model_path"]
    bad = run("ctl", "target", "explode", "-c", str(config))
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    t0 = time.monotonic()
    silent = run("ctl", "trainer", "status", "-c", str(config), "--timeout", "1")
    assert silent.returncode != 0 and "did not answer within 1s" in silent.stderr
    assert time.monotonic() - t0 < 30
    top = run("top", "-c", str(config), "--iterations", "1")    # not a terminal: one summary line a refresh
    assert top.returncode == 0 and "target[serving]" in top.stdout and "trainer: not answering" in top.stdout
    frame = subprocess.run([sys.executable, "-m", "dfpipe", "top", "-c", str(config), "--once"], capture_output=True,
                           text=True, timeout=scaled(60), env={**os.environ, "COLUMNS": "80", "LINES": "24"})
    lines = frame.stdout.rstrip("\n").split("\n")
    assert frame.returncode == 0 and len(lines) <= 24 and max(map(len, lines)) <= 80, frame.stdout + frame.stderr
    assert "target server serving" in frame.stdout and "ring slots ready" in frame.stdout
    assert "trainer not answering" in frame.stdout
    down = run("ctl", "target", "shutdown", "-c", str(config))    # the answer says what happens next
    assert down.returncode == 0 and "state: stopping" in down.stdout, down.stdout + down.stderr
    assert server.wait(60) == 0
    # its log says who stopped it: the ctl process, from the kernel's credentials of its connection
    assert re.search(rf"target server stopping \(ctl shutdown from pid \d+ \(python\S* -m dfpipe ctl target "
                     rf"shutdown .*\), uid {os.geteuid()} ", server.log()), server.log()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_endpoint_exports_the_status_numbers(tmp_path: Path) -> None:
    port = _free_port()
    config = write_config(tmp_path, samples=20, service={"target_metrics_port": port})
    cfg = load(config)
    server = Service("target-server", config, tmp_path)
    try:
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "dfpipe_target_model_loads 1.0" in body
        assert "dfpipe_target_batches_produced" in body
        assert "dfpipe_target_stages_load_seconds" in body  # stage times (load is recorded before serving)
    finally:
        server.stop()


class _NaNOnThirdCall:
    """A stand-in target whose third batch comes out non-finite."""

    def __init__(self, hidden_size: int = 8) -> None:
        self.layer_ids, self.hidden_size, self.vocab_size = [1, 2], hidden_size, 64
        self.dtype, self.device, self.calls = torch.float32, torch.device("cpu"), 0

    def capture(self, input_ids, position_ids, doc_lens, out=None):
        self.calls += 1
        out = out if out is not None else torch.empty(2, input_ids.shape[0], self.hidden_size)
        out.copy_(torch.randn(out.shape))
        if self.calls == 3:
            out[1, 0, 0] = float("nan")
        return out


class _Packer:
    def __init__(self, n: int) -> None:
        self.n = n

    def batch(self, seq: int) -> list[int]:
        return [seq]

    def locate(self, seq: int) -> tuple[int, int]:
        return 0, seq


class _Dataset:
    def sample(self, i: int):
        return np.arange(5, dtype=np.int32), np.ones(5, dtype=np.uint8), 100 + i


def test_a_non_finite_batch_is_quarantined_and_never_published(shm_dir: str, ring_name: str, monkeypatch) -> None:
    import target_server.packer as packer_mod
    monkeypatch.setattr(packer_mod, "build_packed", lambda ds, docs: {
        "input_ids": np.arange(5, dtype=np.int32) + docs[0], "loss_mask": np.ones(5, np.uint8),
        "position_ids": np.arange(5, dtype=np.int32), "doc_lens": np.array([5], np.int32),
        "sample_ids": np.array([100 + docs[0]], np.int64), "doc_ids": np.array([docs[0]], np.int64)})
    cfg = load_config(None, [f"ring.name={ring_name}", f"ring.shm_dir={shm_dir}", "ring.slots=4",
                             "ring.cuda_register=off", "data.token_budget=16", "data.max_len=16",
                             "target.warmup=false", "target.audit_every=0"])
    dispatcher = Dispatcher()
    dispatcher.reset([0, 1, 2, 3])
    quarantined: list[tuple[int, str]] = []
    worker = TargetWorker(0, "cpu", cfg, lambda device: _NaNOnThirdCall(), _Dataset(), _Packer(4), dispatcher,
                          notify=lambda: None, on_quarantine=lambda seq, why: quarantined.append((seq, why)),
                          stages=StageTimes())
    worker.start()
    try:
        wait_for(lambda: worker.batches == 3 and dispatcher.idle(), 30, "worker done")
        published = sorted(int(info.meta["seq"]) for info in worker.ring.ready())
    finally:
        worker.stop()
        dispatcher.stop()
        worker.join(10)
        worker.close()
    assert [seq for seq, _ in quarantined] == [2]
    assert "non-finite" in quarantined[0][1]
    assert published == [0, 1, 3]


class _RecordingTarget(_NaNOnThirdCall):
    """A stand-in target that records the token counts of its packed and unpacked forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.packed: list[int] = []
        self.unpacked: list[int] = []

    def capture(self, input_ids, position_ids, doc_lens, out=None):
        self.packed.append(int(input_ids.shape[0]))
        return super().capture(input_ids, position_ids, doc_lens, out)

    def capture_unpacked(self, input_ids):
        self.unpacked.append(int(input_ids.shape[0]))
        return torch.zeros(2, input_ids.shape[0], self.hidden_size)


@pytest.mark.parametrize("audit_every, max_len, unpacked", [(5, 512, [127, 128]), (0, 512, []), (5, 64, [63, 64])])
def test_warmup_also_tunes_the_audits_reference_forward(audit_every: int, max_len: int, unpacked: list[int],
                                                         shm_dir: str, ring_name: str) -> None:
    cfg = load_config(None, [f"ring.name={ring_name}", f"ring.shm_dir={shm_dir}", "ring.slots=2",
                             "ring.cuda_register=off", "data.token_budget=512", f"data.max_len={max_len}",
                             "target.warmup=true", f"target.audit_every={audit_every}"])
    target = _RecordingTarget()
    dispatcher = Dispatcher()
    worker = TargetWorker(0, "cpu", cfg, lambda device: target, _Dataset(), _Packer(1), dispatcher,
                          notify=lambda: None, on_quarantine=lambda seq, why: None, stages=StageTimes())
    worker.start()
    try:
        assert worker.ready.wait(30) and worker.error is None, worker.error
        assert target.packed == [512]           # the token budget, packed, before serving
        assert target.unpacked == unpacked      # before serving too: nothing left to tune mid-run
        assert worker.state == "serving"
    finally:
        worker.stop()
        dispatcher.stop()
        worker.join(10)
        worker.close()


def test_audit_rejects_zero_rows_and_huge_norms() -> None:
    good = torch.randn(2, 6, 8)
    lens = np.array([6])
    assert audit_hidden(good, lens, 1e4).ok
    zero = good.clone()
    zero[0, 3] = 0
    assert "all-zero" in audit_hidden(zero, lens, 1e4).reason
    assert "RMS" in audit_hidden(good * 1e6, lens, 1e4).reason


def test_a_publisher_that_stopped_for_a_shutdown_is_not_a_failure() -> None:
    import queue
    import threading
    from types import SimpleNamespace

    from target_server.worker import TargetWorker

    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    worker = SimpleNamespace(_halt=threading.Event(), worker=0, error=None)
    full: queue.Queue = queue.Queue(maxsize=1)
    full.put("in flight")
    with pytest.raises(RuntimeError, match="publisher of worker 0 died"):
        TargetWorker._put_alive(worker, full, "batch", gone)   # died while serving: an error
    worker._halt.set()
    TargetWorker._put_alive(worker, full, "batch", gone)       # returned on stop: quiet


def test_a_second_server_is_refused_before_it_loads_and_a_hello_of_another_plan_touches_nothing(
        tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=40)
    cfg = load(config)
    endpoint = cfg["service"]["target_endpoint"]
    first = Service("target-server", config, tmp_path)
    try:
        status = wait_for(lambda: serving(endpoint), 180, "target serving")
        assert "loading the target" in first.log(tail=10_000)
        # the same rings, another endpoint: refused on the ring's producer role, before data or model
        second = Service("target-server", config, tmp_path,
                         overrides=[f"service.target_endpoint={endpoint.removesuffix('.sock')}-2.sock"])
        assert second.wait(120) != 0, second.log()
        refused = second.log(tail=10_000)
        assert f"another target server serves ring {cfg['ring']['name']!r}" in refused, refused
        assert f"held by pid {first.pid}" in refused, refused
        assert "loading the target" not in refused and "data plan" not in refused, refused
        assert first.alive() and ctl(endpoint, "status")["model_loads"] == 1

        # a HELLO whose have set is of another data plan: refused with our plan, no session touched
        plan = status["plan"]
        other = "0" * 16 if plan["id"] != "0" * 16 else "1" * 16
        chan = DealerChannel(endpoint)
        try:
            chan.send(Hello(rid=next_rid(), job="other-plan", secret=new_session_secret(), rank=0, world=1,
                            pid=os.getpid(), start_time=process_start_time(os.getpid()) or 0, have=SeqSet([0, 1]),
                            epochs=1, credit=2, heldout=False, plan=other))
            reply = chan.recv(timeout_s=10)
        finally:
            chan.close()
        assert isinstance(reply, Reply) and not reply.ok, reply
        assert f"data plan {other}" in reply.error and reply.result["plan"] == plan
        after = ctl(endpoint, "status")
        assert after["session"] is None and after["refused"] == {"plan_changed": 1} and after["sessions"] == 0
        consumer = ScriptedConsumer(endpoint, SeqSet(), job="no-plan-yet")   # plan "": a fresh trainer
        try:
            assert consumer.welcome.plan == plan
        finally:
            consumer.close()
    finally:
        first.stop()


def test_a_slot_whose_table_was_corrupted_is_freed_and_its_batch_computed_again(two_worker_server) -> None:
    """A byte of a READY slot's table flipped in /dev/shm: the server frees the slot and counts it
    (never crashes on it), and the batch reaches the trainer anyway, computed again, exactly once."""
    from common import ring as ring_mod
    from common.ring import SlotState

    cfg, server, status = two_worker_server
    endpoint = cfg["service"]["target_endpoint"]
    total = sum(status["epoch_sizes"])
    consumer = ScriptedConsumer(endpoint, SeqSet(), job="corrupt")
    announced: list[Announce] = []
    deadline = time.monotonic() + 120
    while len(announced) < 2 and time.monotonic() < deadline:   # its whole credit, left unacked
        msg = consumer.chan.recv(timeout_s=0.5)
        if isinstance(msg, Announce) and all((a.worker, a.slot) != (msg.worker, msg.slot) for a in announced):
            announced.append(msg)
    assert len(announced) == 2

    def unannounced_ready():
        for w, ring in consumer.rings.items():
            for info in ring.slots():
                if info.state is SlotState.READY and all((a.worker, a.slot) != (w, info.index) for a in announced):
                    return ring, info
        return None
    ring, victim = wait_for(unannounced_ready, 120, "a READY slot beyond the trainer's credit")
    table = ring._slot_start(victim.index) + ring._words.load(ring._hw(victim.index, ring_mod._H.TABLE_OFFSET))
    ring._mm[table + 3] ^= 0x5A

    for msg in announced:
        consumer._ack(msg)
    got = [a.seq for a in announced] + consumer.take(total)
    assert consumer.ended
    assert sorted(got) == list(range(total)), "every batch exactly once, the corrupted one computed again"
    final = ctl(endpoint, "status")
    assert final["batches"]["corrupt_slots"] == 1 and final["pid"] == server.pid
    consumer.close()
