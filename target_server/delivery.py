"""Which batch seqs the connected trainer still needs, and where each one is on its way.

The target server keeps no durable state. Each trainer session says, in HELLO, which seqs are
already in its model (`have`); everything else of the epochs it asked for must reach it exactly
once. A seq moves through

    pending --take--> computing --publish--> READY slot --announce--> assigned --ack--> delivered

and a session that ends (trainer dead, hung, fenced, replaced) leaves READY slots behind for the
next session and turns its delivered-but-not-held seqs back into pending ones: the next HELLO's
`have` decides.

Two streams take that road: training batches (seq = global batch seq) and held-out batches
(seq = held-out index, evaluated, never trained). A stream is named by the `heldout` flag that
travels with it everywhere (`Work.heldout`, the slot meta, `Announce.heldout`); the same code
serves both, and they differ only in data: which seqs a session wants (the epochs it asked for /
all H held-out batches if rank 0 asked, none otherwise), and who receives them (any rank with
free credit / that rank 0, outside its credit, before training batches).

This module is the pure part of the server: `DeliveryCore` makes every exactly-once decision from
events (a HELLO, an ACK, time passing) and ring snapshots (`SlotView`), and returns what to do
(`Send`, `Free`, `SetConsumerEpoch`, `Replan`, `Scan`); `Dispatcher` is the thread-safe work
queue the target workers take from. No ZeroMQ, no rings, no clock of its own: the server (and the
tests) carry the actions out (`run_actions`).
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.cluster import host_shard, plan_shard
from common.protocol import (Ack, Announce, Commit, EpochEnd, Fenced, Hello, Message, Reply, RingInfo, Welcome,
                             same_secret, secret_tag)
from common.seqset import SeqSet

log = logging.getLogger(__name__)

TRAIN, HELDOUT = False, True     # the two streams: a stream id is its batches' `heldout` flag
STREAMS = (HELDOUT, TRAIN)       # in the order workers take them and slots are announced


@dataclass
class RankPeer:
    identity: bytes
    rank: int
    world: int
    pid: int
    start_time: int
    credit: int
    last_seen: float
    in_hand: set[tuple[int, int]] = field(default_factory=set)  # (worker, slot) announced, not yet freed

    @property
    def free_credit(self) -> int:
        return self.credit - len(self.in_hand)


@dataclass
class Assignment:
    worker: int
    slot: int
    pub_seq: int
    seq: int                 # batch seq, or held-out index when `heldout`
    peer: bytes
    sent_at: float = 0.0
    heldout: bool = False


@dataclass(frozen=True)
class Work:
    """One batch for a worker to compute: training batch `seq`, or held-out batch number `seq`."""

    seq: int
    heldout: bool = False


def _as_seqset(seqs: SeqSet | Iterable[int]) -> SeqSet:
    if isinstance(seqs, SeqSet):
        return seqs.copy()
    if isinstance(seqs, range) and seqs.step == 1:
        return SeqSet.from_ranges([(seqs.start, seqs.stop)])
    return SeqSet(seqs)


class Dispatcher:
    """Hands work to worker threads, one queue per stream (held-out first), seqs in ascending
    order; thread-safe. It also records what the workers quarantined, under the same lock, so a
    replan never queues a batch that was just quarantined."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # ranges, not one int per seq: a plan of millions of batches costs a few runs to hold and
        # to rebuild when a trainer says HELLO
        self._pending = {s: SeqSet() for s in STREAMS}
        self._computing: dict[bool, set[int]] = {s: set() for s in STREAMS}
        self._quarantined = {s: SeqSet() for s in STREAMS}
        self._news: list[tuple[bool, int, str]] = []   # (stream, seq, reason) the server has not heard of yet
        self.taken = SeqSet()        # every training seq ever handed out (ranges: stays small)
        self.recomputed = 0          # seqs handed out again: mostly batches a dead trainer trained, never checkpointed
        self.paused = False
        self.stopping = False

    @property
    def computing(self) -> set[int]:
        return self._computing[TRAIN]

    @property
    def computing_heldout(self) -> set[int]:
        return self._computing[HELDOUT]

    def reset(self, seqs: SeqSet | Iterable[int], stream: bool = TRAIN) -> None:
        with self._cond:
            self._pending[stream] = _as_seqset(seqs)
            self._cond.notify_all()

    def reset_heldout(self, indices: Iterable[int]) -> None:
        self.reset(indices, HELDOUT)

    def replan(self, todo: Callable[[set[int]], SeqSet | Iterable[int]], stream: bool = TRAIN) -> None:
        """Replace the stream's pending seqs with todo(busy), computed under the lock; busy = the
        seqs being computed or quarantined.

        No worker can take or finish a seq meanwhile, and a worker publishes a batch (its slot
        READY) before it reports the seq done: a seq outside `busy` here is still pending, in
        a slot or never taken, so `todo` (which reads the rings) sees every seq in exactly one
        place. Read outside the lock, a seq finishing in between was in neither the ring snapshot
        nor `computing` and was queued a second time.
        """
        with self._cond:
            busy = self._computing[stream] | set(self._quarantined[stream])
            self._pending[stream] = _as_seqset(todo(busy))
            self._cond.notify_all()

    def replan_heldout(self, todo: Callable[[set[int]], SeqSet | Iterable[int]]) -> None:
        self.replan(todo, HELDOUT)

    def pending(self, stream: bool = TRAIN) -> list[int]:
        with self._cond:
            return list(self._pending[stream])

    def pending_heldout(self) -> list[int]:
        return self.pending(HELDOUT)

    def pending_count(self, stream: bool = TRAIN) -> int:
        with self._cond:
            return self._pending[stream].size

    def take(self, timeout: float) -> Work | None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.stopping or (not self.paused and any(self._pending.values())), timeout)
            if not ok or self.stopping:
                return None
            stream = next(s for s in STREAMS if self._pending[s])
            seq = self._pending[stream].pop_first()
            self._computing[stream].add(seq)
            if stream == TRAIN:   # held-out batches are served to every session: never "recomputed"
                if seq in self.taken:
                    self.recomputed += 1
                else:
                    self.taken.add(seq)
            return Work(seq, heldout=stream)

    def quarantine(self, work: Work, reason: str) -> None:
        """A worker's audit refused `work`: never queue it again (call before `done`)."""
        with self._cond:
            self._quarantined[work.heldout].add(work.seq)
            self._news.append((work.heldout, work.seq, reason))

    def quarantined_news(self) -> list[tuple[bool, int, str]]:
        """(stream, seq, reason) of every quarantine since the last call."""
        with self._cond:
            news, self._news = self._news, []
            return news

    def done(self, work: Work) -> None:
        with self._cond:
            self._computing[work.heldout].discard(work.seq)
            self._cond.notify_all()

    def set_paused(self, paused: bool) -> None:
        with self._cond:
            self.paused = paused
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not any(self._computing.values()) and (not any(self._pending.values()) or self.paused)


class EpochPlan:
    """Dense global seqs: epoch e owns [starts[e], starts[e] + sizes[e]); this host serves
    `shard(e)` of it (all of it on one host: common.cluster.host_shard)."""

    def __init__(self, sizes: list[int], num_hosts: int = 1, host_rank: int = 0) -> None:
        self.sizes = list(sizes)
        self.num_hosts, self.host_rank = num_hosts, host_rank
        self.starts = [0, *itertools.accumulate(self.sizes)]

    @property
    def total(self) -> int:
        return self.starts[-1]

    def epoch_of(self, seq: int) -> int:
        for e in range(len(self.sizes)):
            if seq < self.starts[e + 1]:
                return e
        raise ValueError(f"seq {seq} beyond the planned {len(self.sizes)} epochs")

    def seqs(self, epoch: int) -> range:
        return range(self.starts[epoch], self.starts[epoch + 1])

    def shard(self, epoch: int) -> range:
        """The seqs of `epoch` this host serves."""
        return host_shard(self.seqs(epoch), self.num_hosts, self.host_rank)

    def served(self, epochs: int) -> SeqSet:
        """The seqs of the first `epochs` epochs that this host serves."""
        return plan_shard(self.sizes[:epochs], self.num_hosts, self.host_rank)


# A batch whose payload fails its checksum at a rank this many times is quarantined, not computed again.
CORRUPT_PAYLOADS_MAX = 3


# ---- the delivery core ----------------------------------------------------------------------------

@dataclass(frozen=True)
class SlotView:
    """One ring slot as the core sees it: what the server read from its header and table."""

    worker: int
    slot: int
    pub_seq: int
    ready: bool              # READY: published, not freed yet
    acked: bool = False      # its ack word matches the current consumer epoch (freed at the next reclaim)
    seq: int | None = None   # READY slots: the batch's seq; None when its table does not validate
    heldout: bool = False


@dataclass(frozen=True)
class Send:
    peer: bytes
    msg: Message


@dataclass(frozen=True)
class Free:
    """Free a READY slot without an ack (its batch is not needed, or not readable)."""

    worker: int
    slot: int
    pub_seq: int


@dataclass(frozen=True)
class SetConsumerEpoch:
    """Write the consumer epoch into every ring: acks written under an older one free nothing."""

    epoch: int


@dataclass(frozen=True)
class Replan:
    """Dispatcher.replan of the stream with `DeliveryCore.todo`, reading the rings under its lock."""

    stream: bool


@dataclass(frozen=True)
class Scan:
    """Reclaim acked slots, then `DeliveryCore.scan` a fresh snapshot of every slot."""


Action = Send | Free | SetConsumerEpoch | Replan | Scan


@dataclass
class StreamState:
    """What a session gets of one stream: `want` once each, minus what it had at HELLO."""

    want: SeqSet | None            # None: not decided yet (held-out: until rank 0 says HELLO)
    have: SeqSet = field(default_factory=SeqSet)
    delivered: SeqSet = field(default_factory=SeqSet)
    to: bytes | None = None        # the one rank it goes to, outside its credit; None: any rank with credit

    def needs(self, seq: int) -> bool:
        return self.want is not None and seq in self.want and seq not in self.have and seq not in self.delivered

    def missing(self) -> SeqSet:
        out = self.want.copy() if self.want is not None else SeqSet()
        out.difference_update(self.have)
        out.difference_update(self.delivered)
        return out


@dataclass
class Session:
    """One trainer process group, from its first HELLO to its death or fencing."""

    consumer_epoch: int
    job: str
    epochs: int
    world: int                        # ranks in the trainer's process group
    ranks_here: int                   # of them, those that say HELLO to this server (one host's)
    secret: str = field(repr=False)   # the trainer's session secret: needed to join, ack, commit, widen
    streams: dict[bool, StreamState] = field(default_factory=dict)
    peers: dict[bytes, RankPeer] = field(default_factory=dict)
    committed: SeqSet = field(default_factory=SeqSet)
    assigned: dict[tuple[int, int], Assignment] = field(default_factory=dict)
    epochs_ended: set[int] = field(default_factory=set)
    last_commit_step: int = -1

    @property
    def train(self) -> StreamState:
        return self.streams[TRAIN]

    @property
    def complete(self) -> bool:
        """Every rank of this server's said HELLO (all of the group's, on one host). Each rank's
        HELLO holds what that rank received (its checkpoint's set plus what it acked since), so only
        all of them together say what the group holds here: until then an announcement could hand
        one rank a batch another rank already has."""
        return len({p.rank for p in self.peers.values()}) >= self.ranks_here


class DeliveryCore:
    """Every exactly-once decision of the target server, without I/O.

    Each event method returns the actions the caller must carry out, in order (`run_actions`).
    `now` is the caller's monotonic clock; `pid_alive(pid, start_time)` says whether a rank's
    process still exists (None: not checkable, e.g. over tcp: silence alone decides).
    """

    def __init__(self, epoch_sizes: Callable[[int], list[int]], data_plan: dict[str, str | int], *,
                 lease_s: float, announce_retry_s: float, heldout_count: int = 0,
                 pid_alive: Callable[[int, int], bool] | None = None, num_hosts: int = 1,
                 host_rank: int = 0) -> None:
        self._epoch_sizes = epoch_sizes
        self.num_hosts, self.host_rank = num_hosts, host_rank   # this server serves its host's shard
        self.plan = EpochPlan(epoch_sizes(1), num_hosts, host_rank)
        self.data_plan = data_plan
        self.heldout_count = heldout_count
        self.lease_s, self.announce_retry_s = lease_s, announce_retry_s
        self.pid_alive = pid_alive
        self.target: dict[str, Any] = {}       # the target's shape, for WELCOME (set once serving)
        self.session: Session | None = None
        self.next_consumer_epoch = 1
        self.quarantined = {s: SeqSet() for s in STREAMS}
        self.quarantine_log: list[dict[str, Any]] = []
        self.counts = {s: collections.Counter() for s in STREAMS}   # per stream: announced, acked, discarded, ...
        self.events: collections.Counter[str] = collections.Counter()  # sessions, fenced, finished, corrupt_*
        # (stream, seq) -> payloads of it that failed their checksum at a rank (CORRUPT_PAYLOADS_MAX)
        self.corrupt_payloads: collections.Counter[tuple[bool, int]] = collections.Counter()
        # refused messages (who sent them or what they claim; malformed ones are the channel's
        # bad_messages), by reason; none of them changes a session
        self.refused: collections.Counter[str] = collections.Counter()
        # (worker, slot) -> pub_seq last announced from it: a publication lives in one slot until it
        # is acked or freed, so this tells a redelivery apart in bounded memory
        self.announced_from_slot: dict[tuple[int, int], int] = {}

    # ---- events -------------------------------------------------------------------------------
    def on_hello(self, peer: bytes, msg: Hello, now: float, slots: Sequence[SlotView],
                 rings: list[RingInfo]) -> list[Action]:
        if msg.plan and msg.plan != self.data_plan["id"]:
            # The HELLO's have set counts batches of another plan: here they hold other documents.
            # Refused before any session is touched; the trainer reads our plan from the refusal.
            return self._refuse(peer, msg.rid, "plan_changed",
                                f"hello refused: the trainer's checkpoint was trained on data plan {msg.plan}, this "
                                f"server serves data plan {self.data_plan['id']}", result={"plan": dict(self.data_plan)})
        s = self.session
        if s is not None and s.job == msg.job and not same_secret(msg.secret, s.secret):
            # The job is public (status shows it), the secret is not: whoever this is, it is not a
            # rank of that trainer. It must not join, widen, or become a peer whose death ends it.
            return self._refuse(peer, msg.rid, "not_member",
                                f"hello refused: not a member of trainer session {s.job} (wrong session secret)")
        if s is not None and s.job != msg.job:
            if alive := [p for p in s.peers.values() if self._alive(p, now)]:
                return self._refuse(peer, msg.rid, "busy",
                                    f"another trainer session ({s.job}, pid {alive[0].pid}) is active")
        if msg.epochs > len(self.plan.sizes):
            self.plan = EpochPlan(self._epoch_sizes(msg.epochs), self.num_hosts, self.host_rank)
        planned = self.plan.starts[msg.epochs]
        if msg.have.end > planned:
            # A have set is what the trainer trained of this plan: seqs beyond it are a stranger's
            # or another plan's, and would end epochs that were never trained.
            return self._refuse(peer, msg.rid, "out_of_plan",
                                f"hello refused: its have set reaches seq {msg.have.end - 1}, but {msg.epochs} "
                                f"epoch(s) of this plan (data plan {self.data_plan['id']}) hold seqs [0, {planned})")
        if self.num_hosts > 1 and not msg.have.issubset(self.plan.served(msg.epochs)):
            # Another host's seqs: that host's server delivers them; here they would only hide a
            # trainer that says HELLO to the wrong host's server.
            return self._refuse(peer, msg.rid, "out_of_shard",
                                f"hello refused: its have set holds seqs outside host {self.host_rank}'s shard of "
                                f"{self.num_hosts} hosts (cluster.host_rank / service.target_endpoint of the trainer "
                                f"and of this server must name the same host)")
        out: list[Action] = []
        if s is not None and s.job != msg.job:
            out += self._end_session("replaced by a new trainer session")
            s = None
        if s is None:
            s = self._start_session(msg, out)
        elif msg.epochs > s.epochs or not msg.have.issubset(SeqSet.union_of(s.train.have, s.train.delivered)):
            # A rank that joined late knows more (its have set is the union of the group's): widen.
            s.train.have.update(msg.have)
            s.epochs = max(s.epochs, msg.epochs)
            s.train.want = self.plan.served(s.epochs)
            out.append(Replan(TRAIN))
        known = s.peers.get(peer)
        s.peers[peer] = RankPeer(identity=peer, rank=msg.rank, world=msg.world, pid=msg.pid,
                                 start_time=msg.start_time, credit=msg.credit, last_seen=now)
        if known is not None:
            # A rank that says HELLO again may have lost announcements: announce its slots again
            # now. They stay its own: one it acked meanwhile (its ack word is written, its HELLO
            # may not hold it yet) must still count as delivered when it leaves READY.
            s.peers[peer].in_hand = known.in_hand
            for key in known.in_hand:
                s.assigned[key].sent_at = -math.inf
        if msg.rank == 0:   # rank 0 decides the held-out stream: all H batches, to itself, or none
            wanted = msg.heldout and self.heldout_count > 0
            heldout = s.streams[HELDOUT]
            heldout.want = SeqSet.from_ranges([(0, self.heldout_count)] if wanted else [])
            heldout.to = peer if wanted else None
            out.append(Replan(HELDOUT))
        ready = sorted(v.seq for v in slots if v.ready and not v.acked and v.seq is not None and not v.heldout)
        out.append(Send(peer, Welcome(rid=msg.rid, consumer_epoch=s.consumer_epoch, rings=rings, target=self.target,
                                      epoch_sizes=self.plan.sizes[: s.epochs], ready=ready,
                                      heldout_batches=self.heldout_count, plan=self.data_plan)))
        out.append(Scan())
        return out

    def on_ack(self, peer: bytes, msg: Ack, now: float) -> list[Action]:
        s = self.session
        if s is None or msg.consumer_epoch != s.consumer_epoch:
            return [Send(peer, Fenced(consumer_epoch=msg.consumer_epoch, reason="ack for a session that has ended"))]
        if not self._is_member(peer, msg.secret):
            return self._refuse(peer, None, "not_member", f"ack of slot {msg.slot} (worker {msg.worker}) from a "
                                                          f"connection that is no rank of session {s.job}")
        self.touch(peer, now)
        if msg.corrupt:
            return self._on_corrupt_payload(s, peer, msg)
        return [Scan()]   # the shared-memory ack is the truth: read it

    def on_commit(self, peer: bytes, msg: Commit, now: float) -> list[Action]:
        s = self.session
        if s is None or msg.consumer_epoch != s.consumer_epoch:
            return [Send(peer, Reply(rid=msg.rid, ok=False, result={}, error="fenced: session has ended"))]
        if not self._is_member(peer, msg.secret):
            return self._refuse(peer, msg.rid, "not_member",
                                f"commit refused: this connection is no rank of trainer session {s.job}")
        self.touch(peer, now)
        s.committed = msg.have.copy()
        s.last_commit_step = msg.step
        return [Send(peer, Reply(rid=msg.rid, ok=True, result={"committed": s.committed.size}, error=""))]

    def on_ring_renewed(self, worker: int, reason: str) -> list[Action]:
        """A worker's ring was made anew (its files had been removed): its slots, and what was
        announced from them, are gone. The session maps the old file: it is fenced (its ranks say
        HELLO again and get the new ring), and both streams are planned again from the rings as
        they are now, so the batches of the old slots are computed again."""
        for key in [k for k in self.announced_from_slot if k[0] == worker]:
            del self.announced_from_slot[key]
        return self._end_session(reason) + [Replan(stream) for stream in STREAMS]

    def touch(self, peer: bytes, now: float) -> None:
        """A message from `peer` (any kind): a rank of the session is alive."""
        if self.session is not None and peer in self.session.peers:
            self.session.peers[peer].last_seen = now

    def on_quarantined(self, stream: bool, seq: int, reason: str) -> None:
        """A worker's audit refused batch `seq` of `stream`: it is never served (and counted)."""
        self.quarantined[stream].add(seq)
        self.quarantine_log.append({"seq": seq, "heldout": stream, "reason": reason})
        self.counts[stream]["quarantined"] += 1

    def tick(self, now: float) -> list[Action]:
        """Liveness: a rank dead or silent for `lease_s` ends the session."""
        s = self.session
        if s is None:
            return []
        for p in s.peers.values():
            if not self._alive(p, now):
                if len(s.epochs_ended) >= s.epochs:
                    # every epoch delivered and acked: a trainer that goes away now finished its run
                    return self._end_session(f"training finished: every epoch of the plan delivered, then rank "
                                             f"{p.rank} (pid {p.pid}) exited (last commit: step "
                                             f"{s.last_commit_step}, {s.committed.size} batches)", finished=True)
                return self._end_session(f"rank {p.rank} (pid {p.pid}) is dead or silent for {self.lease_s}s")
        return []

    def scan(self, now: float, slots: Sequence[SlotView]) -> list[Action]:
        """A fresh look at the rings (after acked slots were reclaimed): free unreadable slots,
        count acked ones delivered, end finished epochs, announce READY slots."""
        out: list[Action] = []
        s = self.session
        for v in slots:
            if v.ready and v.seq is None:
                # Its table does not validate (its bytes changed under us: /dev/shm is writable by
                # its owner): freed, counted, and its batch computed again (it is in no slot now,
                # and an announcement of it is void).
                out.append(Free(v.worker, v.slot, v.pub_seq))
                self.events["corrupt_slots"] += 1
                log.error("worker %d slot %d (pub_seq %d): its table does not validate; slot freed, its batch "
                          "will be computed again", v.worker, v.slot, v.pub_seq)
                if s is not None:
                    self._unassign(s, (v.worker, v.slot))
        if s is None:
            return out
        if out:
            out += [Replan(stream) for stream in STREAMS]
        self._sync_deliveries(s, slots)
        out += self._end_epochs(s)
        if s.complete:
            out += self._announce(s, now, slots)
        return out

    def todo(self, stream: bool, busy: set[int], slots: Sequence[SlotView]) -> SeqSet:
        """What the stream's workers must compute: what the session misses (with no session: the
        first epoch, prefetched), minus what is quarantined, in a READY slot, or `busy` (being
        computed or quarantined: see `Dispatcher.replan`, which calls this under its lock)."""
        s = self.session
        if s is not None:
            out = s.streams[stream].missing()
        else:
            out = self.plan.served(1) if stream == TRAIN else SeqSet()
        out.difference_update(self.quarantined[stream])
        for v in slots:
            if v.ready and v.seq is not None and v.heldout == stream:
                out.discard(v.seq)
        for seq in busy:
            out.discard(seq)
        return out

    # ---- status -------------------------------------------------------------------------------
    def peers(self) -> list[bytes]:
        return list(self.session.peers) if self.session is not None else []

    def session_status(self) -> dict[str, Any] | None:
        s = self.session
        if s is None:
            return None
        return {"job": s.job, "ranks": sorted(p.rank for p in s.peers.values()), "epochs": s.epochs,
                "have": s.train.have.size, "delivered": s.train.delivered.size, "committed": s.committed.size,
                "last_commit_step": s.last_commit_step, "in_flight": len(s.assigned),
                "heldout_acked": s.streams[HELDOUT].delivered.size}

    # ---- decisions ----------------------------------------------------------------------------
    def _start_session(self, hello: Hello, out: list[Action]) -> Session:
        epoch = self.next_consumer_epoch
        self.next_consumer_epoch += 1
        train = StreamState(want=self.plan.served(hello.epochs), have=hello.have.copy())
        s = Session(consumer_epoch=epoch, job=hello.job, epochs=hello.epochs, world=hello.world,
                    ranks_here=hello.ranks_here or hello.world, secret=hello.secret,
                    streams={TRAIN: train, HELDOUT: StreamState(want=None)})   # held-out: rank 0 decides
        self.session = s
        self.events["sessions"] += 1
        out += [SetConsumerEpoch(epoch), Replan(HELDOUT), Replan(TRAIN)]
        log.info("trainer session %s (secret #%s): consumer epoch %d, %d of %d seqs already held",
                 hello.job, secret_tag(hello.secret), epoch, train.have.size, self.plan.starts[hello.epochs])
        return s

    def _end_session(self, reason: str, finished: bool = False) -> list[Action]:
        """End the session (fence it): `finished` when its trainer ended normally, after every epoch."""
        s = self.session
        if s is None:
            return []
        log.log(logging.INFO if finished else logging.WARNING, "trainer session %s (consumer epoch %d) ended: %s",
                s.job, s.consumer_epoch, reason)
        if finished:
            self.events["finished"] += 1
        out: list[Action] = [Send(p, Fenced(consumer_epoch=s.consumer_epoch, reason=reason)) for p in s.peers]
        self.session = None
        self.events["fenced"] += 1
        # Fence: from here on, acks written under the old epoch can free nothing.
        self.next_consumer_epoch += 1
        out.append(SetConsumerEpoch(self.next_consumer_epoch - 1))
        return out

    def _on_corrupt_payload(self, s: Session, peer: bytes, msg: Ack) -> list[Action]:
        """The rank read the slot and its payload failed the checksum: the batch never reached
        it. Free the slot and compute the batch again; it is not delivered."""
        key = (msg.worker, msg.slot)
        a = s.assigned.get(key)
        if a is None or a.peer != peer or a.pub_seq != msg.pub_seq:
            return self._refuse(peer, None, "not_announced", f"corrupt-payload ack of slot {msg.slot} (worker "
                                                             f"{msg.worker}, pub_seq {msg.pub_seq}): not announced to it")
        self._unassign(s, key)
        self.events["corrupt_payloads"] += 1
        what = f"{'held-out batch' if a.heldout else 'seq'} {a.seq}"
        self.corrupt_payloads[(a.heldout, a.seq)] += 1
        times = self.corrupt_payloads[(a.heldout, a.seq)]
        if times < CORRUPT_PAYLOADS_MAX:
            log.error("rank of session %s: payload of worker %d slot %d (%s) fails its checksum; slot freed, "
                      "batch computed again", s.job, msg.worker, msg.slot, what)
        else:
            # The same batch arrived corrupt every time: something keeps damaging it (a failing
            # device or host memory, a writer in /dev/shm). Computing it forever would stall its
            # epoch; it is quarantined instead, like a batch that fails its audit: counted, in the
            # status and the quarantine log, and its epoch ends without it.
            log.error("rank of session %s: payload of worker %d slot %d (%s) fails its checksum for the %d-th "
                      "time; slot freed, batch quarantined", s.job, msg.worker, msg.slot, what, times)
            self.on_quarantined(a.heldout, a.seq, f"its payload failed the checksum {times} times at a rank")
        return [Free(msg.worker, msg.slot, msg.pub_seq), Replan(a.heldout), Scan()]

    def _unassign(self, s: Session, key: tuple[int, int]) -> Assignment | None:
        a = s.assigned.pop(key, None)
        if a is not None and a.peer in s.peers:
            s.peers[a.peer].in_hand.discard(key)
        return a

    def _sync_deliveries(self, s: Session, slots: Sequence[SlotView]) -> None:
        """Assigned slots that left READY were acked (the shared-memory ack is the truth)."""
        current = {(v.worker, v.slot): v for v in slots}
        for key, a in list(s.assigned.items()):
            v = current.get(key)
            if v is not None and v.ready and v.pub_seq == a.pub_seq:
                continue
            self._unassign(s, key)
            s.streams[a.heldout].delivered.add(a.seq)
            self.counts[a.heldout]["acked"] += 1

    def _end_epochs(self, s: Session) -> list[Action]:
        held = SeqSet.union_of(s.train.have, s.train.delivered, self.quarantined[TRAIN])
        out: list[Action] = []
        for e in range(s.epochs):
            if e in s.epochs_ended:
                continue
            r = self.plan.shard(e)   # this host's part: the other hosts' servers end theirs
            if held.difference_ranges(r.start, r.stop):
                break  # epochs end in order
            s.epochs_ended.add(e)
            out += [Send(p, EpochEnd(consumer_epoch=s.consumer_epoch, epoch=e)) for p in s.peers]
        return out

    def _announce(self, s: Session, now: float, slots: Sequence[SlotView]) -> list[Action]:
        out: list[Action] = []
        ready = [v for v in slots if v.ready and not v.acked and v.seq is not None]
        ready.sort(key=lambda v: (STREAMS.index(v.heldout), v.seq))   # held-out first, then oldest seq
        for v in ready:
            key = (v.worker, v.slot)
            a = s.assigned.get(key)
            if a is not None:
                if a.pub_seq == v.pub_seq and now - a.sent_at > self.announce_retry_s:
                    # ZeroMQ is only the doorbell: an announcement may be lost; the rank ignores repeats
                    out.append(Send(a.peer, self._announcement(s, a)))
                    a.sent_at = now
                continue
            stream = s.streams[v.heldout]
            if stream.want is None:
                continue   # not decided yet: rank 0's HELLO says
            counts = self.counts[v.heldout]
            if not stream.needs(v.seq):
                out.append(Free(v.worker, v.slot, v.pub_seq))
                counts["discarded"] += 1
                continue
            peer = self._recipient(s, stream)
            if peer is None:
                continue
            a = Assignment(v.worker, v.slot, v.pub_seq, v.seq, peer.identity, now, heldout=v.heldout)
            s.assigned[key] = a
            peer.in_hand.add(key)
            out.append(Send(peer.identity, self._announcement(s, a)))
            counts["announced"] += 1
            if self.announced_from_slot.get(key) == v.pub_seq:
                counts["redelivered"] += 1
            self.announced_from_slot[key] = v.pub_seq
        return out

    @staticmethod
    def _recipient(s: Session, stream: StreamState) -> RankPeer | None:
        if stream.to is not None:
            return s.peers.get(stream.to)
        candidates = [p for p in s.peers.values() if p.free_credit > 0]
        return min(candidates, key=lambda p: (len(p.in_hand), p.rank), default=None)

    def _announcement(self, s: Session, a: Assignment) -> Announce:
        return Announce(consumer_epoch=s.consumer_epoch, worker=a.worker, slot=a.slot, pub_seq=a.pub_seq,
                        seq=a.seq, epoch=0 if a.heldout else self.plan.epoch_of(a.seq), heldout=a.heldout)

    def _alive(self, p: RankPeer, now: float) -> bool:
        if now - p.last_seen > self.lease_s:
            return False
        return self.pid_alive is None or self.pid_alive(p.pid, p.start_time)

    def _is_member(self, peer: bytes, secret: str) -> bool:
        """A rank of the current session: it joined with a HELLO (so its connection is a peer) and
        this message carries the session's secret."""
        s = self.session
        return s is not None and peer in s.peers and same_secret(secret, s.secret)

    def _refuse(self, peer: bytes, rid: int | None, reason: str, error: str,
                result: dict[str, Any] | None = None) -> list[Action]:
        """Count, log (the first few of each reason, then 1 in 1000) and answer a refused message
        (with `result`, what the sender needs to act on it); the session is not touched."""
        self.refused[reason] += 1
        n = self.refused[reason]
        if n <= 10 or n % 1000 == 0:
            log.warning("refused (%s, #%d): %s", reason, n, error)
        if rid is None:
            return []
        return [Send(peer, Reply(rid=rid, ok=False, result=result or {}, error=error))]


# ---- carrying actions out -------------------------------------------------------------------------

class Rings(Protocol):
    """What the core's actions need of the server's I/O (the server, or a test's fake)."""

    def send(self, peer: bytes, msg: Message) -> None: ...
    def free(self, worker: int, slot: int, pub_seq: int) -> None: ...
    def set_consumer_epoch(self, epoch: int) -> None: ...
    def snapshot(self, reclaim: bool) -> list[SlotView]: ...


def run_actions(core: DeliveryCore, dispatcher: Dispatcher, io: Rings, actions: list[Action], now: float) -> None:
    """Carry out `actions` in order, and those of every `Scan` they ask for."""
    queue = collections.deque(actions)
    while queue:
        a = queue.popleft()
        if isinstance(a, Send):
            io.send(a.peer, a.msg)
        elif isinstance(a, Free):
            io.free(a.worker, a.slot, a.pub_seq)
        elif isinstance(a, SetConsumerEpoch):
            io.set_consumer_epoch(a.epoch)
        elif isinstance(a, Replan):
            # the ring snapshot is read under the dispatcher's lock: see Dispatcher.replan
            dispatcher.replan(lambda busy, stream=a.stream: core.todo(stream, busy, io.snapshot(reclaim=False)),
                              a.stream)
        elif isinstance(a, Scan):
            queue.extend(core.scan(now, io.snapshot(reclaim=True)))
        else:
            raise TypeError(f"not an action: {a!r}")
