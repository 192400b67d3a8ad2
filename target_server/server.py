"""The target server: long-lived, owns the target GPUs, feeds trainer sessions exactly once.

Threads: one `TargetWorker` per device (forward -> slot -> publish) and this main thread, which
owns the ZeroMQ ROUTER and all bookkeeping:

    HELLO    -> new or joined session: consumer epoch bumped in every ring, READY slots the
                trainer already holds discarded, every other missing seq queued for compute;
                rank 0's `heldout` flag: queue the held-out batches this session lacks
    ANNOUNCE <- READY slots, oldest seq first, to ranks with free credit
    ACK      -> shared-memory ack checked (the headers are the truth), seq delivered
    COMMIT   -> the trainer's checkpoint holds these seqs (status only: HELLO carries the truth)
    PING/PONG both ways; a rank silent for `lease_s`, or whose pid died, ends the session
    CONTROL  -> status / pause / resume / drain / shutdown / checkpoint

ZeroMQ is only the doorbell: slot headers are re-scanned on a timer, so a lost message costs
latency, never a batch.

Held-out batches (`data.heldout_path`, the first `train.eval_batches` packed batches of that data)
share the workers, rings and ack path but none of the training bookkeeping: a READY slot whose meta
says `heldout` goes only to the rank 0 that asked for held-out batches, is announced before
training batches and outside its credit, and once acked is remembered in the session's
`heldout_acked`; a session that does not want it discards it, and one that ends leaves it for the
next session.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from typing import Any

import zmq

from common.channel import CurveKeys, RouterChannel
from common.cluster import plan_shard
from common.config import Config
from common.liveness import LockHeld, RoleLock, pid_alive
from common.metrics import StageTimes, start_metrics_server
from common.protocol import (Ack, Announce, Commit, Control, EpochEnd, Fenced, Hello, Ping, Pong, ProtocolError,
                             Reply, RingInfo, Welcome, next_rid, same_secret, secret_tag)
from common.ring import ProducerRing, SlotState
from common.seqset import SeqSet

from .delivery import Assignment, Dispatcher, EpochPlan, RankPeer, Session, outstanding
from .worker import TargetWorker

log = logging.getLogger(__name__)


class TargetServer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.state = "loading"
        self.started = time.time()
        self.stages = StageTimes()
        self.dispatcher = Dispatcher()
        self.session: Session | None = None
        self.next_consumer_epoch = 1
        self.quarantined = SeqSet()
        self.quarantine_log: list[dict[str, Any]] = []
        self.counters = {"produced": 0, "acked": 0, "announced": 0, "redelivered": 0,
                         "quarantined": 0, "discarded": 0, "sessions": 0, "fenced": 0, "finished": 0,
                         "bad_messages": 0, "corrupt_slots": 0, "corrupt_payloads": 0,
                         "heldout_announced": 0, "heldout_acked": 0, "heldout_discarded": 0}
        self.heldout_quarantined: set[int] = set()
        self._corrupt_seen = False   # a slot was freed for a bad table since the last replan
        # messages refused because of who sent them or what they claim (not malformed: those are
        # the channel's bad_messages), by reason; none of them changes a session
        self.refused: collections.Counter[str] = collections.Counter()
        # (worker, slot) -> (producer epoch, pub_seq) last announced from it: a publication lives in
        # one slot until it is acked or discarded, so this tells a redelivery apart in bounded memory
        self.announced_from_slot: dict[tuple[int, int], tuple[int, int]] = {}
        self._stop = False
        self._lock = threading.Lock()          # counters/quarantine touched by worker threads
        self._load_lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._wake_addr = f"inproc://dfpipe-wake-{id(self)}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_local = threading.local()
        self.dataset, self.packer, self.plan, self.target_info = None, None, EpochPlan([]), {}
        self.data_plan: dict[str, str | int] = {}   # what batch seq s holds, fingerprinted (packer.data_plan)
        self.role_locks: list[RoleLock] = []         # the producer role of every worker's ring
        self.heldout_dataset, self.heldout_packer, self.heldout_count = None, None, 0
        self.workers: list[TargetWorker] = []
        self.channel: RouterChannel | None = None
        self._announce_retry_s = max(2.0, 4 * cfg.service.rescan_s)

    # ---- wiring --------------------------------------------------------------------------------
    def _notify(self) -> None:
        """Wake the main loop from a worker thread (one PUSH socket per thread: zmq sockets are not thread-safe)."""
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._wake_addr)
            self._wake_local.sock = sock
        try:
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # the main loop is already behind on wake-ups; it will re-scan anyway

    def _on_quarantine(self, seq: int, reason: str) -> None:
        with self._lock:
            self.quarantined.add(seq)
            self.counters["quarantined"] += 1
            self.quarantine_log.append({"seq": seq, "reason": reason})
        log.error("batch seq %d quarantined, not published: %s", seq, reason)

    def _on_heldout_quarantine(self, index: int, reason: str) -> None:
        with self._lock:
            self.heldout_quarantined.add(index)
        log.error("held-out batch %d quarantined, not published (the trainer's eval will lack it): %s",
                  index, reason)

    def _load_data(self) -> None:
        from .data import ensure_prepared
        from .packer import Packer, data_plan
        d = self.cfg.data
        self.dataset = ensure_prepared(self.cfg)
        self.packer = Packer(self.dataset.lengths, d.token_budget, d.seed)
        self._plan_epochs(1)
        self.data_plan = data_plan(self.dataset, self.packer)
        log.info("data plan %s: %s", self.data_plan["id"],
                 ", ".join(f"{k}={v}" for k, v in self.data_plan.items() if k != "id"))
        if d.heldout_path:
            # Prepared and packed exactly like the training data; held-out batch i = its epoch-0 batch i.
            self.heldout_dataset = ensure_prepared(self.cfg, "heldout_path")
            self.heldout_packer = Packer(self.heldout_dataset.lengths, d.token_budget, d.seed)
            self.heldout_count = min(self.cfg.train.eval_batches, self.heldout_packer.epoch_size(0))
            log.info("held-out data %s: %d documents, serving %d held-out batch(es)", d.heldout_path,
                     len(self.heldout_dataset), self.heldout_count)

    def _plan_epochs(self, epochs: int) -> None:
        if epochs > len(self.plan.sizes):
            self.plan = EpochPlan(self.packer.epoch_sizes(epochs), self.cfg.cluster.num_hosts,
                                  self.cfg.cluster.host_rank)

    def _load_runner(self, device: str):
        from .target import TargetRunner
        from .tiny import resolve_target
        t = self.cfg.target
        # One load at a time: transformers' lazy imports are not thread-safe (two workers importing
        # at once fail with "cannot import name 'AutoConfig'"), and the built-in target is built once.
        with self._load_lock:
            path = resolve_target(self.cfg.resolve(t.model), self.cfg.resolve(t.cache_dir),
                                  tokenizer_dir=self.cfg.resolve(t.tokenizer) or None)
            return TargetRunner.load(path, device=device, dtype=t.dtype, layer_ids=t.layer_ids or None,
                                     num_capture_layers=t.num_capture_layers
                                     ).fix_linear_shape(self.cfg.data.token_budget)

    def _take_ring_roles(self) -> None:
        """The producer role of every worker's ring, before anything slow: a second server for the
        same rings is refused in milliseconds, not after loading its model (minutes for a large target)."""
        r = self.cfg.ring
        for worker in range(len(self.cfg.target.devices)):
            try:
                self.role_locks.append(ProducerRing.take_role(r.shm_dir, r.name, worker))
            except LockHeld as e:
                raise RuntimeError(f"another target server serves ring {r.name!r} (worker {worker}): {e}. One "
                                   f"server per ring.name: stop that one, or give this one another "
                                   f"ring.name") from None

    def start(self) -> None:
        t = self.cfg.target
        self._take_ring_roles()
        if t.triton_cache_dir:
            os.environ.setdefault("TRITON_CACHE_DIR", self.cfg.resolve(t.triton_cache_dir))
        self.channel = RouterChannel(self.cfg.service.target_endpoint,
                                     hwm=max(64, 4 * self.cfg.ring.slots * len(t.devices)),
                                     max_bytes=self.cfg.service.max_message_bytes,
                                     curve=CurveKeys.from_config(self.cfg))
        start_metrics_server(self.cfg.service.target_metrics_port, "dfpipe_target", self.status)
        with self.stages.time("data_prepare"):
            self._load_data()
        self.dispatcher.reset(self.plan.shard(0))  # prefetch this host's epoch 0 before any trainer connects
        for i, device in enumerate(t.devices):
            w = TargetWorker(i, device, self.cfg, self._load_runner, self.dataset, self.packer, self.dispatcher,
                             self._notify, self._on_quarantine, self.stages,
                             heldout_dataset=self.heldout_dataset, heldout_packer=self.heldout_packer,
                             on_heldout_quarantine=self._on_heldout_quarantine, role=self.role_locks[i])
            self.workers.append(w)
            w.start()

    # ---- status --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        rings = []
        for w in self.workers:
            counts = {s.name: 0 for s in SlotState}
            if w.ring is not None:
                for info in w.ring.slots():
                    counts[info.state.name] += 1
            rings.append({"worker": w.worker, "device": w.device, "state": w.state,
                          "path": w.ring.path if w.ring else "", "slots": counts})
        s = self.session
        with self._lock:
            counters = dict(self.counters)
            quarantined = self.quarantined.size
            heldout_quarantined = len(self.heldout_quarantined)
        counters["bad_messages"] = sum(self.channel.bad_messages.values()) if self.channel else 0
        return {
            "pid": os.getpid(),
            "state": self.state,
            "uptime_s": round(time.time() - self.started, 3),
            "model_loads": max((w.model_loads for w in self.workers), default=0),
            "workers": len(self.workers),
            "ring": rings,
            "consumer_epoch": s.consumer_epoch if s else self.next_consumer_epoch - 1,
            "batches": {"produced": sum(w.batches for w in self.workers), "acked": counters["acked"],
                        "redelivered": counters["redelivered"], "recomputed": self.dispatcher.recomputed,
                        "quarantined": quarantined, "discarded": counters["discarded"],
                        "corrupt_slots": counters["corrupt_slots"], "corrupt_payloads": counters["corrupt_payloads"]},
            "tokens": sum(w.tokens for w in self.workers),
            "epoch_sizes": self.plan.sizes,
            "cluster": {"num_hosts": self.plan.num_hosts, "host_rank": self.plan.host_rank,
                        "shard_sizes": [len(self.plan.shard(e)) for e in range(len(self.plan.sizes))]},
            "plan": dict(self.data_plan),
            "pending": self.dispatcher.pending_count(),
            "computing": len(self.dispatcher.computing),
            "heldout": {"batches": self.heldout_count, "produced": sum(w.heldout_batches for w in self.workers),
                        "announced": counters["heldout_announced"], "acked": counters["heldout_acked"],
                        "discarded": counters["heldout_discarded"], "quarantined": heldout_quarantined,
                        "pending": len(self.dispatcher.pending_heldout())},
            "session": None if s is None else {
                "job": s.job, "ranks": sorted(p.rank for p in s.peers.values()), "epochs": s.epochs,
                "have": s.have.size, "delivered": s.delivered.size, "committed": s.committed.size,
                "last_commit_step": s.last_commit_step, "in_flight": len(s.assigned),
                "heldout_acked": len(s.heldout_acked)},
            "sessions": counters["sessions"], "fenced": counters["fenced"], "finished": counters["finished"],
            "bad_messages": counters["bad_messages"],
            "refused": dict(self.refused),
            "stages": self.stages.snapshot(),
        }

    # ---- sessions ------------------------------------------------------------------------------
    def _ring_ready(self) -> list[tuple[TargetWorker, Any]]:
        """READY slots with a valid table. A READY slot whose table does not validate (its bytes
        changed under us: /dev/shm is writable by its owner) is freed, counted (`corrupt_slots`) and
        logged: its batch is then in no slot, so the next replan computes its seq again."""
        out = []
        for w in self.workers:
            if w.ring is None:
                continue
            for info in w.ring.ready():
                if info.meta is not None:
                    out.append((w, info))
                elif w.ring.discard(info.index, info.pub_seq):
                    self.counters["corrupt_slots"] += 1
                    self._corrupt_seen = True
                    log.error("worker %d slot %d (pub_seq %d): its table does not validate; slot freed, its batch "
                              "will be computed again", w.worker, info.index, info.pub_seq)
        return out

    @staticmethod
    def _is_heldout(info: Any) -> bool:
        return bool(info.meta.get("heldout", False))

    def _end_session(self, reason: str, finished: bool = False) -> None:
        """End the session (fence it): `finished` when its trainer ended normally, after every epoch."""
        s = self.session
        if s is None:
            return
        log.log(logging.INFO if finished else logging.WARNING, "trainer session %s (consumer epoch %d) ended: %s",
                s.job, s.consumer_epoch, reason)
        if finished:
            self.counters["finished"] += 1
        for peer in s.peers.values():
            self.channel.send(peer.identity, Fenced(consumer_epoch=s.consumer_epoch, reason=reason))
        self.session = None
        self.counters["fenced"] += 1
        # Fence first: from here on, acks written under the old epoch can free nothing.
        self.next_consumer_epoch += 1
        for w in self.workers:
            if w.ring is not None:
                w.ring.set_consumer_epoch(self.next_consumer_epoch - 1)

    def _start_session(self, hello: Hello, peer: bytes) -> Session:
        epoch = self.next_consumer_epoch
        self.next_consumer_epoch += 1
        for w in self.workers:
            if w.ring is not None:
                w.ring.set_consumer_epoch(epoch)
        self._plan_epochs(hello.epochs)
        s = Session(consumer_epoch=epoch, job=hello.job, epochs=hello.epochs, have=hello.have.copy(),
                    secret=hello.secret)
        self.session = s
        self.counters["sessions"] += 1
        self.dispatcher.reset_heldout([])  # until this session's rank 0 says whether it wants them
        self._replan()
        log.info("trainer session %s (secret #%s): consumer epoch %d, %d of %d seqs already held, %d to compute",
                 hello.job, secret_tag(hello.secret), epoch, s.have.size, self.plan.starts[hello.epochs],
                 self.dispatcher.pending_count())
        return s

    def _replan(self) -> None:
        """Queue every seq the session still needs that is neither in a slot nor being computed."""
        s = self.session
        plan = self.plan.first(s.epochs)

        def todo(computing: set[int]) -> list[int]:   # under the dispatcher's lock (Dispatcher.replan)
            in_ring = set()
            for w, info in self._ring_ready():
                if self._is_heldout(info):
                    continue  # not part of the plan: see _plan_heldout / _announce_heldout
                seq = int(info.meta["seq"])
                if s.holds(seq) or seq >= self.plan.starts[s.epochs]:
                    if w.ring.discard(info.index, info.pub_seq):
                        self.counters["discarded"] += 1
                else:
                    in_ring.add(seq)
            return outstanding(plan, SeqSet.union_of(s.have, s.delivered), self.quarantined, in_ring, computing)
        self.dispatcher.replan(todo)

    def _plan_heldout(self) -> None:
        """Queue the held-out batches the session wants and has not got, in no slot and not being computed."""
        s = self.session
        if not s.heldout_wanted:
            self.dispatcher.reset_heldout([])
            return

        def todo(busy: set[int]) -> list[int]:   # under the dispatcher's lock (Dispatcher.replan_heldout)
            in_ring = {int(info.meta["seq"]) for _, info in self._ring_ready() if self._is_heldout(info)}
            with self._lock:
                lost = set(self.heldout_quarantined)
            return [i for i in range(self.heldout_count)
                    if i not in s.heldout_acked and i not in in_ring and i not in busy and i not in lost]
        self.dispatcher.replan_heldout(todo)

    def _on_hello(self, peer: bytes, msg: Hello) -> None:
        if not self.target_info:
            # Not ready (loading / warming): the trainer repeats its HELLO until we are.
            self.channel.send(peer, Reply(rid=msg.rid, ok=False, result={},
                                          error=f"target server is {self.state}; not serving yet"))
            return
        if msg.plan and msg.plan != self.data_plan["id"]:
            # The HELLO's have set counts batches of another plan: here they hold other documents.
            # Refused before any session is touched; the trainer reads our plan from the refusal.
            self._refuse(peer, msg.rid, "plan_changed",
                         f"hello refused: the trainer's checkpoint was trained on data plan {msg.plan}, this "
                         f"server serves data plan {self.data_plan['id']}", result={"plan": dict(self.data_plan)})
            return
        s = self.session
        if s is not None and s.job == msg.job and not same_secret(msg.secret, s.secret):
            # The job is public (status shows it), the secret is not: whoever this is, it is not a
            # rank of that trainer. It must not join, widen, or become a peer whose death ends it.
            self._refuse(peer, msg.rid, "not_member",
                         f"hello refused: not a member of trainer session {s.job} (wrong session secret)")
            return
        if s is not None and s.job != msg.job:
            alive = [p for p in s.peers.values() if self._peer_alive(p)]
            if alive:
                self._refuse(peer, msg.rid, "busy", f"another trainer session ({s.job}, pid {alive[0].pid}) is active")
                return
        self._plan_epochs(msg.epochs)
        planned = self.plan.starts[msg.epochs]
        if msg.have.end > planned:
            # A have set is what the trainer trained of this plan: seqs beyond it are a stranger's
            # or another plan's, and would end epochs that were never trained.
            self._refuse(peer, msg.rid, "out_of_plan",
                         f"hello refused: its have set reaches seq {msg.have.end - 1}, but {msg.epochs} "
                         f"epoch(s) of this plan (data plan {self.data_plan['id']}) hold seqs [0, {planned})")
            return
        if self.plan.num_hosts > 1 and not msg.have.issubset(
                plan_shard(self.plan.sizes[: msg.epochs], self.plan.num_hosts, self.plan.host_rank)):
            # Another host's seqs: that host's server delivers them; here they would only hide a
            # trainer that says HELLO to the wrong host's server.
            self._refuse(peer, msg.rid, "out_of_shard",
                         f"hello refused: its have set holds seqs outside host {self.plan.host_rank}'s shard of "
                         f"{self.plan.num_hosts} hosts (cluster.host_rank / service.target_endpoint of the trainer "
                         f"and of this server must name the same host)")
            return
        if s is not None and s.job != msg.job:
            self._end_session("replaced by a new trainer session")
            s = None
        if s is None:
            s = self._start_session(msg, peer)
        elif msg.epochs > s.epochs or not msg.have.issubset(SeqSet.union_of(s.have, s.delivered)):
            # A rank that joined late knows more (its have set is the union of the group's): widen.
            s.have.update(msg.have)
            s.epochs = max(s.epochs, msg.epochs)
            self._plan_epochs(s.epochs)
            self._replan()
        known = s.peers.get(peer)
        if known is not None:
            # A rank that says HELLO again lost track of what it was announced: hand it out afresh
            # (a slot it already acked is freed by its shared-memory ack and counts as delivered).
            for key in known.in_hand:
                s.assigned.pop(key, None)
        s.peers[peer] = RankPeer(identity=peer, rank=msg.rank, world=msg.world, pid=msg.pid,
                                 start_time=msg.start_time, credit=msg.credit, last_seen=time.monotonic())
        if msg.rank == 0:
            s.heldout_wanted = msg.heldout and self.heldout_count > 0
            s.heldout_peer = peer if s.heldout_wanted else None
            self._plan_heldout()
        rings = [RingInfo(worker=w.worker, path=w.ring.path, slot_count=w.ring.slot_count,
                          slot_size=w.ring.slot_size, producer_epoch=w.ring.producer_epoch)
                 for w in self.workers if w.ring is not None]
        ready = sorted(int(info.meta["seq"]) for _, info in self._ring_ready() if not self._is_heldout(info))
        self.channel.send(peer, Welcome(rid=msg.rid, consumer_epoch=s.consumer_epoch, rings=rings,
                                        target=self.target_info, epoch_sizes=self.plan.sizes[: s.epochs],
                                        ready=ready, heldout_batches=self.heldout_count, plan=self.data_plan))
        self._announce()

    def _refuse(self, peer: bytes, rid: int | None, reason: str, error: str,
                result: dict[str, Any] | None = None) -> None:
        """Count, log (the first few of each reason, then 1 in 1000) and answer a refused message
        (with `result`, what the sender needs to act on it); the session is not touched."""
        self.refused[reason] += 1
        n = self.refused[reason]
        if n <= 10 or n % 1000 == 0:
            log.warning("refused (%s, #%d): %s", reason, n, error)
        if rid is not None:
            self.channel.send(peer, Reply(rid=rid, ok=False, result=result or {}, error=error))

    def _peer_alive(self, p: RankPeer) -> bool:
        if time.monotonic() - p.last_seen > self.cfg.service.lease_s:
            return False
        if self.cfg.service.target_endpoint.startswith("ipc://"):
            return pid_alive(p.pid, p.start_time)
        return True

    def _announcement(self, s: Session, a: Assignment) -> Announce:
        return Announce(consumer_epoch=s.consumer_epoch, worker=a.worker, slot=a.slot, pub_seq=a.pub_seq,
                        seq=a.seq, epoch=0 if a.heldout else self.plan.epoch_of(a.seq), heldout=a.heldout)

    def _announce(self) -> None:
        s = self.session
        if s is None or self.state not in ("serving", "paused", "draining", "drained"):
            return
        if self._corrupt_seen:   # a slot freed for a bad table took its batch with it: queue it again
            self._corrupt_seen = False
            self._replan()
            self._plan_heldout()
        # held-out slots first (few, acked at once), then training batches oldest seq first
        ready = sorted(self._ring_ready(), key=lambda wi: (not self._is_heldout(wi[1]), int(wi[1].meta["seq"])))
        peers = sorted(s.peers.values(), key=lambda p: p.rank)
        for w, info in ready:
            key = (w.worker, info.index)
            seq = int(info.meta["seq"])
            if key in s.assigned:
                a = s.assigned[key]
                if time.monotonic() - a.sent_at > self._announce_retry_s and a.pub_seq == info.pub_seq:
                    # ZeroMQ is only the doorbell: an announcement may be lost; the rank ignores repeats
                    self.channel.send(a.peer, self._announcement(s, a))
                    a.sent_at = time.monotonic()
                continue
            if self._is_heldout(info):
                self._announce_heldout(s, w, info)
                continue
            if s.holds(seq) or seq >= self.plan.starts[s.epochs]:
                if w.ring.discard(info.index, info.pub_seq):
                    self.counters["discarded"] += 1
                continue
            candidates = [p for p in peers if p.free_credit > 0]
            if not candidates:
                break
            peer = min(candidates, key=lambda p: (len(p.in_hand), p.rank))
            a = Assignment(w.worker, info.index, info.pub_seq, seq, peer.identity, time.monotonic())
            if not self.channel.send(peer.identity, self._announcement(s, a)):
                continue
            s.assigned[key] = a
            peer.in_hand.add(key)
            self.counters["announced"] += 1
            pub = (w.ring.producer_epoch, info.pub_seq)
            if self.announced_from_slot.get(key) == pub:
                self.counters["redelivered"] += 1
            self.announced_from_slot[key] = pub

    def _announce_heldout(self, s: Session, w: TargetWorker, info: Any) -> None:
        """A READY held-out slot: to the rank 0 that asked (outside its credit), kept, or discarded."""
        index = int(info.meta["seq"])
        if s.heldout_wanted is None:
            return  # rank 0 has not said HELLO yet: it decides
        if not s.heldout_wanted or index in s.heldout_acked or index >= self.heldout_count:
            if w.ring.discard(info.index, info.pub_seq):
                self.counters["heldout_discarded"] += 1
            return
        peer = s.peers.get(s.heldout_peer)
        if peer is None:
            return
        a = Assignment(w.worker, info.index, info.pub_seq, index, peer.identity, time.monotonic(), heldout=True)
        if not self.channel.send(peer.identity, self._announcement(s, a)):
            return
        s.assigned[(w.worker, info.index)] = a
        peer.in_hand.add((w.worker, info.index))
        self.counters["heldout_announced"] += 1

    def _sync_deliveries(self) -> None:
        """Assigned slots that left READY were acked (the shared-memory ack is the truth)."""
        s = self.session
        if s is None:
            return
        for w in self.workers:
            if w.ring is not None:
                w.ring.reclaim()
        current = {}
        for w in self.workers:
            if w.ring is not None:
                for info in w.ring.slots():
                    current[(w.worker, info.index)] = info
        for key, a in list(s.assigned.items()):
            info = current.get(key)
            if info is not None and info.state == SlotState.READY and info.pub_seq == a.pub_seq:
                continue
            del s.assigned[key]
            peer = s.peers.get(a.peer)
            if peer is not None:
                peer.in_hand.discard(key)
            if a.heldout:
                s.heldout_acked.add(a.seq)
                self.counters["heldout_acked"] += 1
                continue
            s.delivered.add(a.seq)
            self.counters["acked"] += 1
        self._end_epochs()

    def _end_epochs(self) -> None:
        s = self.session
        held = SeqSet.union_of(s.have, s.delivered, self.quarantined)
        for e in range(s.epochs):
            if e in s.epochs_ended:
                continue
            r = self.plan.shard(e)   # this host's part: the other hosts' servers end theirs
            if held.difference_ranges(r.start, r.stop):
                break  # epochs end in order
            s.epochs_ended.add(e)
            for p in s.peers.values():
                self.channel.send(p.identity, EpochEnd(consumer_epoch=s.consumer_epoch, epoch=e))

    def _on_ack(self, peer: bytes, msg: Ack) -> None:
        s = self.session
        if s is None or msg.consumer_epoch != s.consumer_epoch:
            self.channel.send(peer, Fenced(consumer_epoch=msg.consumer_epoch,
                                           reason="ack for a session that has ended"))
            return
        if not self._is_member(peer, msg.secret):
            self._refuse(peer, None, "not_member", f"ack of slot {msg.slot} (worker {msg.worker}) from a "
                                                   f"connection that is no rank of session {s.job}")
            return
        self._touch(peer)
        if msg.corrupt:
            self._drop_corrupt_payload(peer, msg)
        self._sync_deliveries()
        self._announce()

    def _drop_corrupt_payload(self, peer: bytes, msg: Ack) -> None:
        """The rank's copy of a slot it was announced failed the payload checksum: free the slot
        untrained, never count it delivered, and let the next replan compute its batch again."""
        s = self.session
        key = (msg.worker, msg.slot)
        a = s.assigned.get(key)
        if a is None or a.peer != peer or a.pub_seq != msg.pub_seq:
            return   # not a publication this rank holds (late or repeated): nothing to free
        ring = next(w.ring for w in self.workers if w.worker == msg.worker)
        if ring is None or not ring.discard(msg.slot, msg.pub_seq):
            return   # no longer READY: the shared-memory ack decides, as for any slot
        del s.assigned[key]
        s.peers[peer].in_hand.discard(key)
        self.counters["corrupt_payloads"] += 1
        self._corrupt_seen = True
        log.error("worker %d slot %d (pub_seq %d, %s %d): rank %d read a payload that fails its checksum; slot "
                  "freed, the batch will be computed again", msg.worker, msg.slot, msg.pub_seq,
                  "held-out batch" if a.heldout else "seq", a.seq, s.peers[peer].rank)

    def _on_commit(self, peer: bytes, msg: Commit) -> None:
        s = self.session
        if s is None or msg.consumer_epoch != s.consumer_epoch:
            self.channel.send(peer, Reply(rid=msg.rid, ok=False, result={}, error="fenced: session has ended"))
            return
        if not self._is_member(peer, msg.secret):
            self._refuse(peer, msg.rid, "not_member",
                         f"commit refused: this connection is no rank of trainer session {s.job}")
            return
        self._touch(peer)
        s.committed = msg.have.copy()
        s.last_commit_step = msg.step
        self.channel.send(peer, Reply(rid=msg.rid, ok=True, result={"committed": s.committed.size}, error=""))

    def _is_member(self, peer: bytes, secret: str) -> bool:
        """A rank of the current session: it joined with a HELLO (so its connection is a peer) and
        this message carries the session's secret."""
        s = self.session
        return s is not None and peer in s.peers and same_secret(secret, s.secret)

    def _touch(self, peer: bytes) -> None:
        if self.session is not None and peer in self.session.peers:
            self.session.peers[peer].last_seen = time.monotonic()

    # ---- control -------------------------------------------------------------------------------
    def _on_control(self, peer: bytes, msg: Control) -> None:
        ok, result, error = True, {}, ""
        if msg.cmd == "status":
            result = self.status()
        elif msg.cmd == "pause":
            self.dispatcher.set_paused(True)
            self.state = "paused" if self.state == "serving" else self.state
        elif msg.cmd == "resume":
            self.dispatcher.set_paused(False)
            if self.state in ("paused", "draining", "drained"):
                self.state = "serving"
        elif msg.cmd == "drain":
            self.dispatcher.set_paused(True)
            self.state = "draining"
        elif msg.cmd == "shutdown":
            self._stop = True
        elif msg.cmd == "checkpoint":
            ok, error = False, "the target server keeps no durable state; checkpoint the trainer (dfpipe ctl trainer checkpoint)"
        result.setdefault("state", self.state)
        try:
            reply = Reply(rid=msg.rid, ok=ok, result=result, error=error)
        except ProtocolError as e:  # a status field that cannot go on the wire must not stop the server
            log.exception("control reply for %s not encodable", msg.cmd)
            reply = Reply(rid=msg.rid, ok=False, result={}, error=f"internal: reply not encodable: {e}")
        self.channel.send(peer, reply)

    # ---- main loop -----------------------------------------------------------------------------
    def _check_workers(self) -> None:
        for w in self.workers:
            if w.error is not None:
                raise RuntimeError(f"target worker {w.worker} on {w.device} failed: {w.error!r}") from w.error
        if self.state in ("loading", "warming"):
            states = {w.state for w in self.workers}
            if states == {"serving"}:
                w0 = self.workers[0]
                r = w0.runner
                self.target_info = {"model_path": r.model_path, "hidden_size": r.hidden_size,
                                    "num_layers": r.num_layers, "layer_ids": list(r.layer_ids),
                                    "vocab_size": r.vocab_size, "dtype": str(r.dtype).replace("torch.", ""),
                                    "epoch_samples": len(self.dataset),
                                    "token_budget": self.cfg.data.token_budget,
                                    "num_hosts": self.plan.num_hosts, "host_rank": self.plan.host_rank}
                self.state = "serving"
                log.info("serving: %d worker(s), rings %s", len(self.workers), [w.ring.path for w in self.workers])
            elif "warming" in states:
                self.state = "warming"

    def _check_liveness(self, now: float) -> None:
        s = self.session
        if s is None:
            return
        for p in list(s.peers.values()):
            if not self._peer_alive(p):
                if len(s.epochs_ended) >= s.epochs:
                    # every epoch delivered and acked: a trainer that goes away now finished its run
                    self._end_session(f"training finished: every epoch of the plan delivered, then rank {p.rank} "
                                      f"(pid {p.pid}) exited (last commit: step {s.last_commit_step}, "
                                      f"{s.committed.size} batches)", finished=True)
                else:
                    self._end_session(f"rank {p.rank} (pid {p.pid}) is dead or silent for {self.cfg.service.lease_s}s")
                return

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_stop", True))
        svc = self.cfg.service
        last_scan = last_ping = 0.0
        try:
            self.start()   # inside the try: a failed start gives back what it took (roles, endpoint)
            poller = zmq.Poller()
            poller.register(self.channel.socket, zmq.POLLIN)
            poller.register(self._wake_pull, zmq.POLLIN)
            while not self._stop:
                events = dict(poller.poll(int(svc.rescan_s * 1000)))
                if self._wake_pull in events:
                    while True:
                        try:
                            self._wake_pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self._check_workers()
                if self.channel.socket in events:
                    for peer, msg in self.channel.poll(0):
                        self._dispatch(peer, msg)
                now = time.monotonic()
                if now - last_scan >= svc.rescan_s or self._wake_pull in events:
                    last_scan = now
                    for w in self.workers:
                        if w.ring is not None:
                            w.ring.heartbeat()
                    self._sync_deliveries()
                    self._announce()
                    if self.state == "draining" and self.dispatcher.idle() and (
                            self.session is None or not self._ring_ready()):
                        self.state = "drained"
                if now - last_ping >= svc.heartbeat_s:
                    last_ping = now
                    self._ping()
                    self._check_liveness(now)
        finally:
            self.shutdown()
        return 0

    def _ping(self) -> None:
        s = self.session
        if s is None:
            return
        for p in s.peers.values():
            self.channel.send(p.identity, Ping(rid=next_rid(), t=time.time()))

    def _dispatch(self, peer: bytes, msg: Any) -> None:
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
        elif isinstance(msg, Ack):
            self._on_ack(peer, msg)
        elif isinstance(msg, Commit):
            self._on_commit(peer, msg)
        elif isinstance(msg, Ping):
            self._touch(peer)
            self.channel.send(peer, Pong(rid=msg.rid, t=msg.t))
        elif isinstance(msg, Pong):
            self._touch(peer)
        elif isinstance(msg, Control):
            self._on_control(peer, msg)
        else:
            log.warning("unexpected %s from a peer; dropped", type(msg).__name__)
            self.counters["bad_messages"] += 1

    def shutdown(self) -> None:
        self.state = "stopping"
        self.dispatcher.stop()
        for w in self.workers:
            w.stop()
        for w in self.workers:
            try:
                w.join(timeout=30)
            finally:
                w.close()  # unlink the ring even if the worker misbehaved
        for lock in self.role_locks:
            lock.release(unlink=True)   # a role whose worker never started (idempotent otherwise)
        if self.channel is not None:
            self.channel.close()
        self._wake_pull.close(0)


def main(cfg: Config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s target %(levelname)s %(message)s")
    server = TargetServer(cfg)
    try:
        return server.run()
    except Exception as e:
        log.error("target server failed: %s", e)
        return 1
