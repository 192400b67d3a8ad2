"""A trainer rank's feed: ZeroMQ doorbell + shared-memory slots -> packed batches on the device.

One I/O thread owns the DEALER socket (zmq sockets are not thread-safe) and does everything that
must keep happening while the training thread is busy in a step: answer PINGs, receive
ANNOUNCEs, copy announced slots to the device, ack them, notice a dead target server and
re-HELLO a new one. The training thread only calls `get()`.

    ANNOUNCE -> read slot (header checked) -> copy to device (own stream) + payload checksum
             there -> copy done -> checksum checked -> queue the batch -> ack in shared memory
             -> ACK message

A payload whose checksum differs from the one its producer put in the slot's meta is never
trained: no shared-memory ack, an ACK with `corrupt` set instead (the server frees the slot and
computes that batch again), one error line, counted in `corrupt_payloads`.

The batch is queued before the ACK goes out, so by the time the server can declare an epoch
over, every acked batch already sits in some rank's queue. `have()` is the set of seqs whose
effect is (or will be, once queued batches are trained) in this rank's model: the checkpoint's
set plus everything acked since. After FENCED (the server declared this session over) the
queued, untrained batches are dropped and forgotten: the next session re-delivers them.

Held-out batches (rank 0, when `train.eval_every` > 0): an ANNOUNCE with `heldout` set is copied
out the same way and acked at once, but the batch goes into `heldout_batches()` (by held-out
index, on the device), never into the training queue and never into `have()`. Every session
delivers them again; a repeat replaces the copy with the same index.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.batch import PAYLOAD_TENSORS, BatchError, PackedBatch, check_batch
from common.checksum import META_KEY, ChecksumMismatch, check_payload, payload_checksums
from common.channel import ChannelError, CurveKeys, DealerChannel, check_ipc_server
from common.config import Config
from common.liveness import process_start_time
from common.protocol import (Ack, Announce, Commit, EpochEnd, Fenced, Hello, Ping, Pong, ProtocolError, Reply,
                             Welcome, check_plan, next_rid)
from common.ring import ConsumerRing, ProducerRing, RingError, StaleSlot
from common.seqset import SeqSet
from common.trust import Untrusted, trusted_uids

log = logging.getLogger(__name__)

WAIT_LOG_S = 5.0        # a rank waiting for its target says so this often
WAIT_POLL_S = 0.1       # how soon a wait notices that the trainer was told to stop


@dataclass
class EpochEndMarker:
    epoch: int


class RingFeed:
    """Batches for one trainer rank, in the order the target server announced them."""

    def __init__(self, cfg: Config, rank: int, world: int, job: str, have: SeqSet, device: torch.device,
                 epochs: int, credit: int = 2, depth: int = 2, *, secret: str, plan: str = "") -> None:
        """secret: the trainer's session secret (rank 0 draws it, every rank passes the same; never logged);
        plan: the id of the data plan `have` was trained from ("": none known)."""
        self.plan = plan
        # the server's plan when it refused ours (state "plan_changed"): see restart_accounting
        self.refused_for_plan: dict[str, str | int] | None = None
        self.cfg = cfg
        self.rank, self.world, self.job = rank, world, job
        # the ranks that say HELLO to this host's server: torchrun's per-node count on a cluster
        self.ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if cfg.cluster.num_hosts > 1 else world
        self._secret = secret
        self.wants_heldout = rank == 0 and cfg.train.eval_every > 0   # asks for the held-out batches
        self._heldout: dict[int, PackedBatch] = {}   # held-out index -> batch on the device
        self.heldout_expected = 0                    # Welcome.heldout_batches of the current server
        self.device = device
        self.epochs = epochs
        self.credit = credit
        self._base_have = have.copy()
        self._acked = SeqSet()
        self._lock = threading.Lock()
        self._out: queue.Queue = queue.Queue(maxsize=depth + 2)  # batches + epoch markers
        self._depth = depth
        self._pending: deque = deque()          # Announce / EpochEndMarker not yet processed
        self._seen_pubs: set[tuple[int, int, int]] = set()
        self._corrupt_pubs: set[tuple[int, int, int]] = set()   # handed back for a checksum mismatch
        self._commits: queue.Queue = queue.Queue()
        self.state = "connecting"
        self.welcome: Welcome | None = None
        self.welcomed = threading.Event()
        self.consumer_epoch = -1
        self._superseded_epoch = -1
        self._awaiting_welcome = False   # a HELLO replacing our session is unanswered (see _hello)
        self.rings: dict[int, ConsumerRing] = {}
        self.counters = {"batches": 0, "stale_slots": 0, "bad_batches": 0, "fenced": 0, "duplicates": 0,
                         "reconnects": 0, "heldout": 0, "corrupt_payloads": 0}
        self.error: str = ""
        self.endpoint_untrusted = False   # `error` says another user has the target endpoint (see _hello_if_ours)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"feed-rank{rank}", daemon=True)
        self._copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._last_server = time.monotonic()

    # ---- training-thread API -----------------------------------------------------------------
    def launch(self) -> None:
        """Start connecting in the I/O thread; the caller may do other set-up until wait_welcome."""
        self._thread.start()

    def wait_welcome(self, stop: Callable[[], bool]) -> Welcome | None:
        """The first WELCOME; None when `stop()` turned true first (SIGTERM, Ctrl-C, ctl shutdown).
        Every WAIT_LOG_S the rank logs what it waits for (the server's last refusal, or silence)."""
        started = time.monotonic()
        next_log = started + WAIT_LOG_S
        while not self.welcomed.wait(WAIT_POLL_S):
            if stop():
                return None
            now = time.monotonic()
            if now >= next_log:
                next_log = now + WAIT_LOG_S
                log.info("rank %d: waiting %.0fs for the target server at %s: %s", self.rank, now - started,
                         self.cfg.service.target_endpoint, self.waiting_for())
        return self.welcome

    def waiting_for(self) -> str:
        """What this rank waits for, in a line: a target server that runs (its last refusal, e.g. still
        loading) or that none runs (a server holds its rings' producer role from start to exit: a role
        nobody holds is a server that exited or never started, whatever it answered last). An endpoint
        another user has comes first: this rank sees that there, and no server of ours can bind it."""
        r = self.cfg.ring
        if self.endpoint_untrusted:
            return f"not saying HELLO: {self.error}"
        if not ProducerRing.role_held(r.shm_dir, r.name, 0):
            return (f"no target server is running for ring {r.name!r} (none was started, or it exited: its "
                    f"console says why); start one with `dfpipe target-server -c CONFIG`, with the same "
                    f"train.out_dir as this trainer's where the ring and endpoints are not set (the defaults "
                    f"derive from it)")
        return f"it answered: {self.error}" if self.error else "no answer yet"

    def get(self, timeout: float) -> PackedBatch | EpochEndMarker | None:
        try:
            return self._out.get(timeout=timeout)
        except queue.Empty:
            return None

    def have(self) -> SeqSet:
        with self._lock:
            return SeqSet.union_of(self._base_have, self._acked)

    def heldout_batches(self) -> list[PackedBatch]:
        """The held-out batches received so far, by index (the server sends `heldout_expected`)."""
        with self._lock:
            return [self._heldout[i] for i in sorted(self._heldout)]

    def restart_accounting(self) -> None:
        """After a plan refusal: say HELLO again holding nothing, under no plan (the trainer chose to
        start a new accounting; its weights stay what they are)."""
        with self._lock:
            self._base_have, self._acked = SeqSet(), SeqSet()
        self.plan = ""
        self.refused_for_plan = None
        self.welcomed.clear()
        self.state = "connecting"   # last: the I/O thread re-HELLOs once it sees this

    def commit(self, have: SeqSet, step: int) -> None:
        """Tell the server what the checkpoint just written holds (status; HELLO carries the truth)."""
        self._commits.put((have.copy(), step))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for r in self.rings.values():
            r.close()
        self.rings.clear()

    # ---- I/O thread --------------------------------------------------------------------------
    def _run(self) -> None:
        svc = self.cfg.service
        # An identity nobody can guess: the server addresses this rank by it, and a connection that
        # claimed a known identity would take over the rank's announcements (ROUTER_HANDOVER).
        chan = DealerChannel(svc.target_endpoint, identity=f"rank{self.rank}-{secrets.token_hex(8)}".encode(),
                             max_bytes=svc.max_message_bytes, curve=CurveKeys.from_config(self.cfg),
                             allowed_uids=svc.allowed_uids)
        try:
            last_hello = time.monotonic() if self._hello_if_ours(chan) else -math.inf
            while not self._stop.is_set():
                msg = chan.recv(timeout_s=0.05 if self._pending else svc.rescan_s)
                while msg is not None:
                    self._last_server = time.monotonic()
                    self._on_message(chan, msg)
                    msg = chan.recv(timeout_s=0)
                self._drain_pending(chan)
                self._send_commits(chan)
                now = time.monotonic()
                server_gone = now - self._last_server > svc.lease_s or any(
                    not r.producer_alive() for r in self.rings.values())
                if (server_gone or self.state in ("fenced", "connecting")) and now - last_hello > svc.request_timeout_s:
                    if server_gone and self.state == "streaming":
                        log.warning("rank %d: target server gone (silent for %.1fs or its ring producer died); "
                                    "waiting for it", self.rank, now - self._last_server)
                        self.state = "waiting_for_target"
                    if self._hello_if_ours(chan):
                        last_hello = now
        except Exception as e:  # surfaced to the training thread through .error/.state
            log.exception("rank %d feed failed", self.rank)
            self.error = repr(e)
            self.state = "failed"
            self.welcomed.set()
        finally:
            chan.close()

    def _hello_if_ours(self, chan: DealerChannel) -> bool:
        """Say HELLO once the kernel says a process of a trusted user (ours, root, service.allowed_uids)
        bound the endpoint: a HELLO carries the session secret. False, nothing sent, while nobody
        listens there yet, or someone else does (said once, then in the wait's log: `error`)."""
        svc = self.cfg.service
        try:
            if not check_ipc_server(svc.target_endpoint, svc.allowed_uids):
                # what was said about a listener gone since is no longer so
                self.error, self.endpoint_untrusted = "", False
                return False
        except ChannelError as e:
            if str(e) != self.error:
                log.error("rank %d: not saying HELLO: %s", self.rank, e)
            self.error, self.endpoint_untrusted = str(e), isinstance(e, Untrusted)
            return False
        self.endpoint_untrusted = False
        self._hello(chan)
        return True

    def _hello(self, chan: DealerChannel) -> None:
        if self.state != "fenced" and self.consumer_epoch >= 0:
            # This HELLO declares every queued batch as held, so a FENCED for the session it replaces
            # (already on its way to us) must not drop them: the next session will not resend them.
            self._superseded_epoch = self.consumer_epoch
            # Until its answer, an announcement of that session may still be on its way (sent before
            # the server read this HELLO): taking it would ack under the session this HELLO replaces,
            # and a new session would deliver the batch again. If the session goes on, the server
            # announces our slots again after the HELLO.
            self._awaiting_welcome = True
        chan.send(Hello(rid=next_rid(), job=self.job, secret=self._secret, rank=self.rank, world=self.world,
                        pid=os.getpid(), start_time=process_start_time(os.getpid()) or 0, have=self.have(),
                        epochs=self.epochs, credit=self.credit, heldout=self.wants_heldout, plan=self.plan,
                        ranks_here=self.ranks_here))

    def _on_message(self, chan: DealerChannel, msg) -> None:
        if isinstance(msg, Welcome):
            self._on_welcome(msg)
        elif isinstance(msg, Announce):
            if msg.consumer_epoch != self.consumer_epoch or self._awaiting_welcome:
                return  # an announcement for a session that is over, or that our HELLO replaces
            key = self._pub_key(msg)
            if key in self._seen_pubs:
                if key in self._corrupt_pubs:   # our hand-back got lost (ZeroMQ is only the doorbell)
                    self._ack(chan, msg, corrupt=True)
                return  # re-announced after a lost ack message: already handled or queued
            self._seen_pubs.add(key)
            if msg.heldout:
                self._take_heldout(chan, msg)  # at once: never queued behind training batches
            else:
                self._pending.append(msg)
        elif isinstance(msg, EpochEnd):
            if msg.consumer_epoch == self.consumer_epoch:
                self._pending.append(EpochEndMarker(msg.epoch))
        elif isinstance(msg, Ping):
            chan.send(Pong(rid=msg.rid, t=msg.t))
        elif isinstance(msg, Pong):
            pass
        elif isinstance(msg, Fenced):
            if msg.consumer_epoch == self._superseded_epoch:
                log.info("rank %d: session %d ended (%s); already superseded by a new HELLO", self.rank,
                         msg.consumer_epoch, msg.reason)
            elif msg.consumer_epoch == self.consumer_epoch and self.state != "fenced":
                self._on_fenced(msg.reason)
        elif isinstance(msg, Reply):
            if not msg.ok:
                self.error = msg.error
                log.warning("rank %d: target server refused: %s", self.rank, msg.error)
                if "plan" in msg.result and self.plan:
                    self._on_plan_refused(msg.result["plan"])
        else:
            log.warning("rank %d: unexpected %s from the target server", self.rank, type(msg).__name__)

    def _on_plan_refused(self, plan: object) -> None:
        """The server serves another data plan than our `have` was trained from: stop saying HELLO
        and let the training thread decide (refuse to run, or `restart_accounting`)."""
        try:
            self.refused_for_plan = check_plan(plan, "reply.result.plan")
        except ProtocolError as e:
            log.warning("rank %d: the refusal's plan is malformed (%s); still waiting", self.rank, e)
            return
        self.state = "plan_changed"
        self.welcomed.set()

    def _on_welcome(self, msg: Welcome) -> None:
        self._awaiting_welcome = False
        known = {w: r.producer_epoch for w, r in self.rings.items()}
        fresh = {ri.worker: ri.producer_epoch for ri in msg.rings}
        # A session is (the server's rings, consumer epoch): a restarted server counts epochs from 1 again.
        if msg.consumer_epoch == self.consumer_epoch and known == fresh:
            return  # an answer to a repeated HELLO
        if known and known != fresh:
            self.counters["reconnects"] += 1
            log.info("rank %d: new target server rings %s", self.rank, [ri.path for ri in msg.rings])
        for w in list(self.rings):
            if fresh.get(w) != self.rings[w].producer_epoch:
                self.rings.pop(w).close()
        for ri in msg.rings:
            if ri.worker not in self.rings:
                try:
                    self.rings[ri.worker] = ConsumerRing.attach(ri.path, cuda_register=self.cfg.ring.cuda_register,
                                                                trusted=trusted_uids(self.cfg.service.allowed_uids))
                except RingError as e:
                    # e.g. its files were removed and the server has not noticed yet: it makes the ring
                    # anew and names the new one in its answer to the next HELLO
                    self.error = f"cannot map the ring the target server named for worker {ri.worker}: {e}"
                    log.error("rank %d: %s; saying HELLO again", self.rank, self.error)
                    self._awaiting_welcome = True   # still no session to take announcements under
                    self.state = "connecting"
                    return
        self.consumer_epoch = msg.consumer_epoch
        self._pending.clear()
        with self._lock:  # the new server may serve fewer held-out batches than the old one
            self.heldout_expected = msg.heldout_batches if self.wants_heldout else 0
            for i in [i for i in self._heldout if i >= self.heldout_expected]:
                del self._heldout[i]
        # Repeats are only repeats within a session: a new session re-announces READY slots
        # (same pub_seq) that this rank saw but never acked under the old epoch.
        self._seen_pubs.clear()
        self._corrupt_pubs.clear()
        self.welcome = msg
        self.plan = str(msg.plan["id"])   # what `have` is from now on; a later HELLO says so
        self.state = "streaming"
        self.error = ""
        self.welcomed.set()

    def _on_fenced(self, reason: str) -> None:
        """Our session is over: forget batches not yet handed to training; say HELLO again."""
        self.counters["fenced"] += 1
        log.warning("rank %d fenced by the target server: %s", self.rank, reason)
        self._pending.clear()
        while True:
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, PackedBatch):
                with self._lock:
                    self._acked.discard(item.seq)
        self._seen_pubs.clear()
        self._corrupt_pubs.clear()
        self.consumer_epoch = -1
        self.state = "fenced"

    def _drain_pending(self, chan: DealerChannel) -> None:
        while self._pending and self._out.qsize() < self._depth:
            item = self._pending.popleft()
            if isinstance(item, EpochEndMarker):
                self._out.put(item)
                continue
            self._take(chan, item)

    def _pub_key(self, a: Announce) -> tuple[int, int, int]:
        """(worker, producer epoch, pub_seq): one publication, across ring files of a worker."""
        return a.worker, self.rings[a.worker].producer_epoch if a.worker in self.rings else -1, a.pub_seq

    def _read(self, chan: DealerChannel, a: Announce) -> PackedBatch | None:
        """The announced slot's batch, copied to the device and checked against its payload
        checksum; None (counted, logged) when unusable, and handed back when corrupt."""
        what = f"held-out batch {a.seq}" if a.heldout else f"seq {a.seq}"
        ring = self.rings.get(a.worker)
        if ring is None:
            log.warning("rank %d: announce for unknown worker %d dropped", self.rank, a.worker)
            return None
        if a.slot < 0 or a.slot >= ring.slot_count:
            log.warning("rank %d: announce for slot %d outside ring of %d dropped", self.rank, a.slot, ring.slot_count)
            return None
        try:
            view = ring.read(a.slot, a.pub_seq)
            batch, checksums = self._copy_out(view, a)
            if not view.still_valid():   # before the checksum: a slot rewritten under us is stale, not corrupt
                raise StaleSlot(f"slot {a.slot} changed while it was copied")
            check_payload(view.meta.get(META_KEY), PAYLOAD_TENSORS, checksums)
            self._check(batch, view)
        except ChecksumMismatch as e:
            self.counters["corrupt_payloads"] += 1
            log.error("rank %d: %s (worker %d slot %d, pub_seq %d) not trained: %s; handed back to be computed "
                      "again (%d corrupt payload(s) so far)", self.rank, what, a.worker, a.slot, a.pub_seq, e,
                      self.counters["corrupt_payloads"])
            self._corrupt_pubs.add(self._pub_key(a))
            self._ack(chan, a, corrupt=True)
            return None
        except StaleSlot as e:
            self.counters["stale_slots"] += 1
            log.warning("rank %d: %s not taken: %s", self.rank, what, e)
            return None
        except (BatchError, RingError, KeyError, ValueError) as e:
            # A malformed slot is not acked: the server's audit/log sees it stay READY.
            self.counters["bad_batches"] += 1
            log.error("rank %d: slot %d (%s) unusable, not acked: %s", self.rank, a.slot, what, e)
            return None
        return batch

    def _ack(self, chan: DealerChannel, a: Announce, corrupt: bool = False) -> None:
        """Ack in shared memory and by message; a corrupt payload is handed back by the message alone
        (a shared-memory ack would count it delivered)."""
        if not corrupt:
            self.rings[a.worker].ack(a.slot, a.pub_seq, a.consumer_epoch)
        chan.send(Ack(consumer_epoch=a.consumer_epoch, secret=self._secret, worker=a.worker, slot=a.slot,
                      pub_seq=a.pub_seq, seq=a.seq, corrupt=corrupt))

    def _take(self, chan: DealerChannel, a: Announce) -> None:
        batch = self._read(chan, a)
        if batch is None:
            return
        duplicate = a.seq in self.have()
        if duplicate:
            self.counters["duplicates"] += 1
            log.warning("rank %d: seq %d already held; acked without training it again", self.rank, a.seq)
        else:
            self._out.put(batch)
            with self._lock:
                self._acked.add(a.seq)
        self._ack(chan, a)
        self.counters["batches"] += 1

    def _take_heldout(self, chan: DealerChannel, a: Announce) -> None:
        """A held-out batch: kept for evaluation (not for training), acked at once."""
        if not self.wants_heldout or a.seq >= self.heldout_expected:
            # not ours to keep (the server should not send it), but never leave a slot hanging
            log.warning("rank %d: unexpected held-out batch %d (expected %d); acked and dropped", self.rank,
                        a.seq, self.heldout_expected)
            if a.worker in self.rings and 0 <= a.slot < self.rings[a.worker].slot_count:
                self._ack(chan, a)
            return
        batch = self._read(chan, a)
        if batch is None:
            return
        with self._lock:
            self._heldout[a.seq] = batch
        self._ack(chan, a)
        self.counters["heldout"] += 1

    def _copy_out(self, view, a: Announce) -> tuple[PackedBatch, torch.Tensor]:
        """The slot's tensors on the device, and their payload checksums computed there (on the CPU)."""
        meta = view.meta
        if int(meta.get("seq", -1)) != a.seq:
            raise ValueError(f"slot holds seq {meta.get('seq')}, announced {a.seq}")
        if bool(meta.get("heldout", False)) != a.heldout:
            raise ValueError(f"slot heldout={meta.get('heldout')}, announced heldout={a.heldout}")
        t = view.tensors
        if self._copy_stream is None:
            moved = {k: t[k].clone() for k in PAYLOAD_TENSORS}
            checksums = payload_checksums(moved)
        else:
            with torch.cuda.stream(self._copy_stream):
                moved = {k: t[k].to(self.device, non_blocking=True) for k in PAYLOAD_TENSORS}
                # over the copies on the device, queued behind them; read back under the same wait
                checksums = payload_checksums(moved).to("cpu", non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            done.synchronize()
            main = torch.cuda.default_stream(self.device)
            for v in moved.values():
                v.record_stream(main)  # allocated on the copy stream, used on the training stream
        return PackedBatch(**moved, seq=a.seq, epoch=int(meta.get("epoch", a.epoch))), checksums

    def _check(self, batch: PackedBatch, view) -> None:
        """check_batch; on CUDA over the slot's token tensors (the bytes just checksummed on the
        device), so the check costs no device sync."""
        t = view.tensors
        check_batch(batch if self._copy_stream is None else PackedBatch(
            hidden=batch.hidden, **{k: t[k] for k in PAYLOAD_TENSORS if k != "hidden"}))

    def _send_commits(self, chan: DealerChannel) -> None:
        while True:
            try:
                have, step = self._commits.get_nowait()
            except queue.Empty:
                return
            if self.consumer_epoch >= 0:
                chan.send(Commit(rid=next_rid(), consumer_epoch=self.consumer_epoch, secret=self._secret,
                                 have=have, step=step))
