"""The target server: long-lived, owns the target GPUs, feeds trainer sessions exactly once.

Threads: one `TargetWorker` per device (forward -> slot -> publish) and this main thread, which
owns the ZeroMQ ROUTER and the rings' consumer side:

    HELLO    -> new or joined session: consumer epoch bumped in every ring, READY slots the
                trainer already holds discarded, every other missing seq queued for compute;
                rank 0's `heldout` flag: queue the held-out batches this session lacks
    ANNOUNCE <- READY slots, held-out first, then oldest seq first, to ranks with free credit
    ACK      -> shared-memory ack checked (the headers are the truth), seq delivered;
                `corrupt`: the slot is freed and its batch computed again
    COMMIT   -> the trainer's checkpoint holds these seqs (status only: HELLO carries the truth)
    PING/PONG both ways; a rank silent for `lease_s`, or whose pid died, ends the session
    CONTROL  -> status / pause / resume / drain / shutdown / checkpoint

Every delivery decision is `DeliveryCore`'s (delivery.py), which has no I/O: this class is the
shell around it. It turns messages and timers into core events, gives the core snapshots of the
ring headers (`snapshot`), and carries out what the core returns (send, free a slot, set the
consumer epoch, replan the work queue, scan again: `run_actions`).

Nothing a peer sends holds the loop: what it may send is bounded in bytes before decoding (the
channel), a HELLO asking for epochs whose sizes are not known yet is answered "packing" while
`EpochPlanner` packs them behind (each epoch once per server lifetime), and it says HELLO again.

Ring files removed while serving (an operator cleaning /dev/shm): the re-scan timer, and every
HELLO before it is answered, checks that each ring's file and lock file are still there. If not,
the ring is made anew (new file, larger producer epoch: `ProducerRing.renewed`), the trainer's
session is fenced (it maps the old file) and the batches that were in the old slots are computed
again; counted in status `ring_files_removed` and logged. The lock file is taken again with it, so
a second server for the same `ring.name` stays refused. Making the ring anew keeps the loaded
target and needs nothing of the operator; stopping instead would cost a model load.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import zmq

from common.channel import DRAIN_BYTES, ROUTER_RCV_HWM, CurveKeys, RouterChannel
from common.config import Config, ConfigError
from common.exits import EXIT_FAILED, EXIT_OK, EXIT_UNTRUSTED
from common.liveness import LockHeld, RoleLock, pid_alive
from common.metrics import StageTimes, TokenRate, start_metrics_server
from common.protocol import (Ack, Commit, Control, Hello, Message, Ping, Pong, ProtocolError, Reply, RingInfo,
                             next_rid)
from common.ring import ProducerRing, SlotState
from common.stopping import sender_text, stop_signal_text
from common.trust import Untrusted

from .delivery import HELDOUT, TRAIN, Action, DeliveryCore, Dispatcher, Replan, Scan, SlotView, Work, run_actions
from .preflight import preflight
from .worker import TargetWorker

log = logging.getLogger(__name__)

STOP_REPORT_S = 10.0   # while stopping, say every this often which worker is still computing


class EpochPlanner:
    """The sizes of the plan's epochs, packed in a background thread: an epoch's size is known only
    once it is packed (tens of milliseconds for the demo data, seconds for millions of documents),
    and a HELLO may ask for up to the protocol's MAX_EPOCHS. The loop asks `sizes` and answers
    "packing" until they are known; the packer keeps every size it learnt, so whatever HELLOs ask
    for, each epoch is packed once per server lifetime."""

    def __init__(self, packer) -> None:
        self._packer = packer
        self._cond = threading.Condition()
        self.known = 0       # epochs 0 .. known-1 have their sizes
        self.wanted = 0
        threading.Thread(target=self._run, name="epoch-planner", daemon=True).start()

    def sizes(self, epochs: int) -> list[int] | None:
        """Sizes of epochs 0 .. epochs-1 when known (cheap); else None, and they are packed behind."""
        with self._cond:
            if epochs > self.known:
                self.wanted = max(self.wanted, epochs)
                self._cond.notify()
                return None
        return self._packer.epoch_sizes(epochs)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.wanted > self.known)
                epoch = self.known
            try:
                self._packer.epoch_size(epoch)
            except Exception:   # a bug: said once, and status `epochs_packed` stays where it is
                log.exception("packing epoch %d failed: HELLOs asking for it are not answered", epoch)
                return
            with self._cond:
                self.known = epoch + 1


class TargetServer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.state = "loading"
        self.started = time.time()
        self.stages = StageTimes()
        self.rate = TokenRate()   # of the tokens produced: status tokens_per_s (top, ctl)
        self.dispatcher = Dispatcher()
        self.core: DeliveryCore | None = None   # made once the data plan is known (start)
        self._stop = False
        self.stop_reason = ""                        # who or what told it to stop (_told_to_stop)
        self._load_lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._wake_addr = f"inproc://dfpipe-wake-{id(self)}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_local = threading.local()
        self.dataset, self.packer = None, None
        self.data_plan: dict[str, str | int] = {}   # what batch seq s holds, fingerprinted (packer.data_plan)
        self.role_locks: list[RoleLock] = []         # the producer role of every worker's ring
        self.heldout_dataset, self.heldout_packer, self.heldout_count = None, None, 0
        self.workers: list[TargetWorker] = []
        self.channel: RouterChannel | None = None
        self.planner: EpochPlanner | None = None
        self.ring_files_removed = 0                  # times a ring's files were found removed (ring made anew)

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

    def _on_quarantine(self, work: Work, reason: str) -> None:
        """A worker's audit refused a batch (worker thread): recorded under the dispatcher's lock
        before the worker reports the work done, so no replan queues it again."""
        self.dispatcher.quarantine(work, reason)
        what = f"held-out batch {work.seq} (the trainer's eval will lack it)" if work.heldout else f"batch seq {work.seq}"
        log.error("%s quarantined, not published: %s", what, reason)

    def _load_data(self) -> None:
        from .data import ensure_prepared
        from .packer import Packer, data_plan
        d = self.cfg.data
        self.dataset = ensure_prepared(self.cfg)
        self.packer = Packer(self.dataset.lengths, d.token_budget, d.seed)
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
            except Untrusted as e:
                raise Untrusted(f"ring {r.name!r} (worker {worker}) refused: {e}. Another user took this name "
                                f"or controls this folder: set ring.name to another name, or ring.shm_dir to a "
                                f"folder of this user's own (or have that file removed)") from None

    def start(self) -> None:
        t = self.cfg.target
        preflight(self.cfg)   # every config problem at once, before anything is taken or loaded
        self._take_ring_roles()
        if t.triton_cache_dir:
            os.environ.setdefault("TRITON_CACHE_DIR", self.cfg.resolve(t.triton_cache_dir))
        self.channel = RouterChannel(self.cfg.service.target_endpoint,
                                     hwm=max(64, 4 * self.cfg.ring.slots * len(t.devices)),
                                     max_bytes=self.cfg.service.max_message_bytes,
                                     curve=CurveKeys.from_config(self.cfg), allowed_uids=self.cfg.service.allowed_uids)
        start_metrics_server(self.cfg.service.target_metrics_port, "dfpipe_target", self.status)
        with self.stages.time("data_prepare"):
            self._load_data()
        self.planner = EpochPlanner(self.packer)
        self.planner.sizes(self.cfg.train.epochs)   # the configured run's epochs, packed before a trainer asks
        svc = self.cfg.service
        self.core = DeliveryCore(self.packer.epoch_sizes, self.data_plan, lease_s=svc.lease_s,
                                 announce_retry_s=max(2.0, 4 * svc.rescan_s), heldout_count=self.heldout_count,
                                 pid_alive=pid_alive if svc.target_endpoint.startswith("ipc://") else None,
                                 num_hosts=self.cfg.cluster.num_hosts, host_rank=self.cfg.cluster.host_rank)
        self._apply([Replan(TRAIN)])   # prefetch this host's epoch 0 before any trainer connects
        for i, device in enumerate(t.devices):
            w = TargetWorker(i, device, self.cfg, self._load_runner, self.dataset, self.packer, self.dispatcher,
                             self._notify, lambda seq, why: self._on_quarantine(Work(seq), why), self.stages,
                             heldout_dataset=self.heldout_dataset, heldout_packer=self.heldout_packer,
                             on_heldout_quarantine=lambda i, why: self._on_quarantine(Work(i, HELDOUT), why),
                             role=self.role_locks[i])
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
                          "path": w.ring.path if w.ring else "", "slots": counts,
                          "producer_epoch": w.ring.producer_epoch if w.ring else 0})
        core = self.core
        s = core.session if core else None
        train, held = (core.counts[TRAIN], core.counts[HELDOUT]) if core else ({}, {})
        events, quarantined = (core.events, core.quarantined) if core else ({}, {TRAIN: (), HELDOUT: ()})
        bad_messages = sum(self.channel.bad_messages.values()) if self.channel else 0
        return {
            "pid": os.getpid(),
            "state": self.state,
            "uptime_s": round(time.time() - self.started, 3),
            "model_loads": max((w.model_loads for w in self.workers), default=0),
            # what WELCOME tells trainers: folder, layers, dtype, precision (fp8-block, bf16, ...); {} until serving
            "target": dict(core.target) if core else {},
            "workers": len(self.workers),
            "ring": rings,
            "consumer_epoch": s.consumer_epoch if s else (core.next_consumer_epoch - 1 if core else 0),
            "batches": {"produced": sum(w.batches for w in self.workers), "acked": train.get("acked", 0),
                        "redelivered": train.get("redelivered", 0), "recomputed": self.dispatcher.recomputed,
                        "quarantined": len(quarantined[TRAIN]), "discarded": train.get("discarded", 0),
                        "corrupt_slots": events.get("corrupt_slots", 0),
                        "corrupt_payloads": events.get("corrupt_payloads", 0)},
            "tokens": sum(w.tokens for w in self.workers),
            "tokens_per_s": self.rate.per_s(time.monotonic()),
            "epoch_sizes": core.plan.sizes if core else [],
            "cluster": {"num_hosts": self.cfg.cluster.num_hosts, "host_rank": self.cfg.cluster.host_rank,
                        "shard_sizes": [len(core.plan.shard(e)) for e in range(len(core.plan.sizes))] if core else []},
            "plan": dict(self.data_plan),
            "pending": self.dispatcher.pending_count(),
            "computing": len(self.dispatcher.computing),
            "heldout": {"batches": self.heldout_count, "produced": sum(w.heldout_batches for w in self.workers),
                        "announced": held.get("announced", 0), "acked": held.get("acked", 0),
                        "discarded": held.get("discarded", 0), "quarantined": len(quarantined[HELDOUT]),
                        "pending": self.dispatcher.pending_count(HELDOUT)},
            "session": core.session_status() if core else None,
            "sessions": events.get("sessions", 0), "fenced": events.get("fenced", 0),
            "finished": events.get("finished", 0),
            "bad_messages": bad_messages,
            "foreign_messages": self.channel.bad_messages["foreign_uid"] if self.channel else 0,
            # answers and deliveries not sent: "full" (the peer's queue), "gone" (it disconnected), "too_large"
            "dropped_sends": dict(self.channel.dropped_sends) if self.channel else {},
            # what peers can make the loop hold (common/channel.py): at most (rcv_hwm + 1) frames of
            # max_message_bytes per connection in libzmq, and drain_bytes (+ one frame) taken per poll
            "receive": {"rcv_hwm": ROUTER_RCV_HWM, "max_message_bytes": self.cfg.service.max_message_bytes,
                        "drain_bytes": DRAIN_BYTES,
                        "peak_drain_bytes": self.channel.peak_drain_bytes if self.channel else 0,
                        "repeats": self.channel.repeats if self.channel else 0},
            "ring_files_removed": self.ring_files_removed,
            "epochs_packed": self.planner.known if self.planner else 0,
            "refused": dict(core.refused) if core else {},
            "stages": self.stages.snapshot(),
        }

    # ---- delivery: the core decides, this shell reads and writes rings and sockets --------------
    def _ring(self, worker: int) -> ProducerRing | None:
        return self.workers[worker].ring if 0 <= worker < len(self.workers) else None

    def send(self, peer: bytes, msg: Message) -> None:
        # False (counted by the channel) when the peer is gone or its queue is full: the core
        # announces again after `announce_retry_s`, and a gone rank's silence ends its session
        self.channel.send(peer, msg)

    def free(self, worker: int, slot: int, pub_seq: int) -> None:
        if (ring := self._ring(worker)) is not None:
            ring.discard(slot, pub_seq)

    def set_consumer_epoch(self, epoch: int) -> None:
        for w in self.workers:
            if w.ring is not None:
                w.ring.set_consumer_epoch(epoch)

    def snapshot(self, reclaim: bool) -> list[SlotView]:
        """Every slot of every ring as the core sees it (after freeing acked slots when `reclaim`)."""
        out = []
        for w in self.workers:
            if w.ring is None:
                continue
            if reclaim:
                w.ring.reclaim()
            for info in w.ring.slots():
                meta = info.meta if isinstance(info.meta, dict) else {}
                seq = meta.get("seq")
                out.append(SlotView(w.worker, info.index, info.pub_seq, ready=info.state is SlotState.READY,
                                    acked=info.acked, seq=seq if type(seq) is int and seq >= 0 else None,
                                    heldout=meta.get("heldout") is True))
        return out

    def _apply(self, actions: list[Action]) -> None:
        run_actions(self.core, self.dispatcher, self, actions, time.monotonic())

    def _on_hello(self, peer: bytes, msg: Hello) -> None:
        if not self.core.target:
            # Not ready (loading / warming): the trainer repeats its HELLO until we are.
            self.channel.send(peer, Reply(rid=msg.rid, ok=False, result={},
                                          error=f"target server is {self.state}; not serving yet"))
            return
        if self.planner.sizes(msg.epochs) is None:
            self.channel.send(peer, Reply(rid=msg.rid, ok=False, result={},
                                          error=f"target server is packing the {msg.epochs} epochs asked for "
                                                f"({self.planner.known} known); not serving them yet"))
            return
        self._check_ring_files()   # never name a ring file that is gone
        rings = [RingInfo(worker=w.worker, path=w.ring.path, slot_count=w.ring.slot_count,
                          slot_size=w.ring.slot_size, producer_epoch=w.ring.producer_epoch)
                 for w in self.workers if w.ring is not None]
        self._apply(self.core.on_hello(peer, msg, time.monotonic(), self.snapshot(reclaim=False), rings))

    def _check_ring_files(self) -> None:
        """Make anew every ring whose file or lock file was removed (see the module docstring)."""
        for w in self.workers:
            old = w.ring
            gone = old.removed_files() if old is not None else []
            if not gone:
                continue
            self.ring_files_removed += 1
            try:
                new = old.renewed()
            except LockHeld as e:
                raise RuntimeError(f"worker {w.worker}'s ring files were removed ({', '.join(gone)}) and another "
                                   f"target server has since taken ring.name {self.cfg.ring.name!r}: {e}. Stopping: "
                                   f"one server per ring.name") from None
            w.ring = new
            old.retire()
            w.retired.append(old)
            reason = (f"worker {w.worker}'s ring files were removed ({', '.join(gone)}): made anew as {new.path}; "
                      f"batches in the old slots are computed again")
            log.error("%s (%d time(s) so far)", reason, self.ring_files_removed)
            self._apply(self.core.on_ring_renewed(w.worker, reason))

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
            self._told_to_stop(f"ctl shutdown from {sender_text(self.channel.sender(peer))}")
            self.state = "stopping"   # what the reply says: the loop stops before it serves again
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
            if isinstance(w.error, ConfigError):
                raise w.error   # its message names the key that fixes it
            if w.error is not None:
                raise RuntimeError(f"target worker {w.worker} on {w.device} failed: {w.error!r}") from w.error
        if self.state in ("loading", "warming"):
            states = {w.state for w in self.workers}
            if states == {"serving"}:
                w0 = self.workers[0]
                r = w0.runner
                self.core.target = {"model_path": r.model_path, "hidden_size": r.hidden_size,
                                    "num_layers": r.num_layers, "layer_ids": list(r.layer_ids),
                                    "vocab_size": r.vocab_size, "dtype": str(r.dtype).replace("torch.", ""),
                                    "precision": r.precision,
                                    "epoch_samples": self.dataset.num_samples,
                                    "epoch_documents": len(self.dataset),
                                    "token_budget": self.cfg.data.token_budget,
                                    "num_hosts": self.cfg.cluster.num_hosts, "host_rank": self.cfg.cluster.host_rank}
                self.state = "serving"
                log.info("serving: %d worker(s), rings %s", len(self.workers), [w.ring.path for w in self.workers])
            elif "warming" in states:
                self.state = "warming"

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._told_to_stop(stop_signal_text(signum)))
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
                    # control first: a `dfpipe ctl` request waits for no HELLO or ACK of the same poll
                    for peer, msg in sorted(self.channel.poll(0), key=lambda pm: not isinstance(pm[1], Control)):
                        self._dispatch(peer, msg)
                now = time.monotonic()
                for stream, seq, reason in self.dispatcher.quarantined_news():
                    self.core.on_quarantined(stream, seq, reason)
                if now - last_scan >= svc.rescan_s or self._wake_pull in events:
                    last_scan = now
                    self._check_ring_files()
                    self.channel.give_back_memory()   # after a flood: see common/channel.py
                    for w in self.workers:
                        if w.ring is not None:
                            w.ring.heartbeat()
                    self.rate.mark(now, sum(w.tokens for w in self.workers))
                    self._apply([Scan()])
                    if self.state == "draining" and self.dispatcher.idle() and (
                            self.core.session is None or not any(v.ready and not v.acked for v in self.snapshot(reclaim=False))):
                        self.state = "drained"
                if now - last_ping >= svc.heartbeat_s:
                    last_ping = now
                    for peer in self.core.peers():
                        self.channel.send(peer, Ping(rid=next_rid(), t=time.time()))
                    self._apply(self.core.tick(now))
            log.info("target server stopping (%s)", self.stop_reason)
        finally:
            self.shutdown()
        return EXIT_OK

    def _told_to_stop(self, reason: str) -> None:
        """Stop at the main loop's next turn; `reason` (who or what asked, the first to ask) goes
        in the log line the server writes as it stops, which `dfpipe demo` quotes."""
        if not self._stop:
            self.stop_reason = reason
        self._stop = True

    @staticmethod
    def _wait_for(worker: TargetWorker) -> None:
        """Until the worker's thread has ended, however long its step takes (it stops at its next
        check of the halt flag, after the forward it is in). No time limit: a forward cannot be cut
        short, a thread still inside torch at interpreter exit aborts the process (pthread_exit
        unwinding through torch's C++ frames: std::terminate, exit status 134), and a 32K-token CPU
        forward outlasted a 30 s limit, the ring closed under its slot views ("slot tensors still
        alive"). A device that never returns is SIGKILL's (systemd's TimeoutStopSec, compose's stop_grace_period)."""
        t0 = time.monotonic()
        while True:
            worker.join(timeout=STOP_REPORT_S)
            if not worker.is_alive():
                return
            log.info("stopping: worker %d on %s is still in its step (%.0f s so far); waiting for it to end",
                     worker.worker, worker.device, time.monotonic() - t0)

    def _dispatch(self, peer: bytes, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
        elif isinstance(msg, Ack):
            self._apply(self.core.on_ack(peer, msg, now))
        elif isinstance(msg, Commit):
            self._apply(self.core.on_commit(peer, msg, now))
        elif isinstance(msg, Ping):
            self.core.touch(peer, now)
            self.channel.send(peer, Pong(rid=msg.rid, t=msg.t))
        elif isinstance(msg, Pong):
            self.core.touch(peer, now)
        elif isinstance(msg, Control):
            self._on_control(peer, msg)
        else:
            log.warning("unexpected %s from a peer; dropped", type(msg).__name__)
            self.channel.bad_messages["unexpected"] += 1

    def shutdown(self) -> None:
        self.state = "stopping"
        self.dispatcher.stop()
        for w in self.workers:
            w.stop()
        for w in self.workers:
            try:
                self._wait_for(w)
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
    except ConfigError:
        raise   # the command line prints it as one line (exit status 2)
    except Untrusted as e:   # another user's endpoint, folder or ring file: the line names it and the fix
        log.error("target server refused: %s", e)
        return EXIT_UNTRUSTED
    except Exception as e:
        log.error("target server failed: %s", e)
        return EXIT_FAILED
