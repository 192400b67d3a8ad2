"""Which batch seqs the connected trainer still needs, and where each one is on its way.

The target server keeps no durable state. Each trainer session says, in HELLO, which seqs are
already in its model (`have`); everything else of the epochs it asked for must reach it exactly
once. A seq moves through

    pending --take--> computing --publish--> READY slot --announce--> assigned --ack--> delivered

and a session that ends (trainer dead, hung, fenced, replaced) leaves READY slots behind for the
next session and turns its delivered-but-not-held seqs back into pending ones: the next HELLO's
`have` decides. This module is pure bookkeeping (no ZeroMQ, no rings) so it can be tested alone.

Held-out batches (eval during training) take the same road to a slot, tagged `Work(i, heldout=True)`
with i the held-out index, but never enter the epoch plan, `have` or `delivered`: each session whose
rank 0 asks for them gets indices 0..H-1 once (`Session.heldout_acked`), workers take them before
training seqs, and a READY held-out slot left over from an ended session goes to the next session
that wants it, or is discarded.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from common.cluster import host_shard
from common.seqset import SeqSet


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
    """Hands work to worker threads: held-out batches first, then seqs in ascending order; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # ranges, not one int per seq: a plan of millions of batches costs a few runs to hold and
        # to rebuild when a trainer says HELLO
        self._pending = SeqSet()
        self._heldout: deque[int] = deque()
        self.computing: set[int] = set()
        self.computing_heldout: set[int] = set()
        self.taken = SeqSet()        # every training seq ever handed out (ranges: stays small)
        self.recomputed = 0          # seqs handed out again: mostly batches a dead trainer trained, never checkpointed
        self.paused = False
        self.stopping = False

    def reset(self, seqs: SeqSet | Iterable[int]) -> None:
        with self._cond:
            self._pending = _as_seqset(seqs)
            self._cond.notify_all()

    def reset_heldout(self, indices: list[int]) -> None:
        """The held-out batches still to compute (replaces the previous list)."""
        with self._cond:
            self._heldout = deque(sorted(indices))
            self._cond.notify_all()

    def replan(self, todo: Callable[[set[int]], SeqSet | Iterable[int]]) -> None:
        """Replace the pending seqs with todo(seqs being computed), computed under the lock.

        No worker can take or finish a seq meanwhile, and a worker publishes a batch (its slot
        READY) before it reports the seq done: a seq outside `computing` here is still pending, in
        a slot, quarantined or never taken, so `todo` (which reads the rings) sees every seq in
        exactly one place. Read outside the lock, a seq finishing in between was in neither the
        ring snapshot nor `computing` and was queued a second time.
        """
        with self._cond:
            self._pending = _as_seqset(todo(set(self.computing)))
            self._cond.notify_all()

    def replan_heldout(self, todo: Callable[[set[int]], list[int]]) -> None:
        """As `replan`, for the held-out indices."""
        with self._cond:
            self._heldout = deque(sorted(todo(set(self.computing_heldout))))
            self._cond.notify_all()

    def pending(self) -> list[int]:
        with self._cond:
            return list(self._pending)

    def pending_count(self) -> int:
        with self._cond:
            return self._pending.size

    def pending_heldout(self) -> list[int]:
        with self._cond:
            return list(self._heldout)

    def take(self, timeout: float) -> Work | None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.stopping or (not self.paused and bool(self._heldout or self._pending)), timeout)
            if not ok or self.stopping:
                return None
            if self._heldout:
                index = self._heldout.popleft()
                self.computing_heldout.add(index)
                return Work(index, heldout=True)
            seq = self._pending.pop_first()
            self.computing.add(seq)
            if seq in self.taken:
                self.recomputed += 1
            else:
                self.taken.add(seq)
            return Work(seq)

    def done(self, work: Work) -> None:
        with self._cond:
            (self.computing_heldout if work.heldout else self.computing).discard(work.seq)
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
            return (not self.computing and not self.computing_heldout
                    and (not (self._pending or self._heldout) or self.paused))


@dataclass
class Session:
    """One trainer process group, from its first HELLO to its death or fencing."""

    consumer_epoch: int
    job: str
    epochs: int
    have: SeqSet
    secret: str = field(repr=False)   # the trainer's session secret: needed to join, ack, commit, widen
    peers: dict[bytes, RankPeer] = field(default_factory=dict)
    delivered: SeqSet = field(default_factory=SeqSet)
    committed: SeqSet = field(default_factory=SeqSet)
    assigned: dict[tuple[int, int], Assignment] = field(default_factory=dict)
    epochs_ended: set[int] = field(default_factory=set)
    last_commit_step: int = -1
    heldout_peer: bytes | None = None     # the rank 0 that asked for held-out batches
    heldout_wanted: bool | None = None    # None until rank 0 said HELLO
    heldout_acked: set[int] = field(default_factory=set)  # held-out indices this session has

    def holds(self, seq: int) -> bool:
        return seq in self.have or seq in self.delivered


class EpochPlan:
    """Dense global seqs: epoch e owns [starts[e], starts[e] + sizes[e]); this host serves
    `shard(e)` of it (all of it on one host: common.cluster.host_shard)."""

    def __init__(self, sizes: list[int], num_hosts: int = 1, host_rank: int = 0) -> None:
        self.sizes = list(sizes)
        self.num_hosts, self.host_rank = num_hosts, host_rank
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)

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

    def first(self, epochs: int) -> "EpochPlan":
        """The plan of the first `epochs` epochs, on the same host."""
        return EpochPlan(self.sizes[:epochs], self.num_hosts, self.host_rank)


def outstanding(plan: EpochPlan, have: SeqSet, quarantined: SeqSet, in_ring: set[int],
                computing: set[int]) -> SeqSet:
    """Seqs of this host's shard that must still be computed for a session holding `have`: work in
    runs, not seqs."""
    todo = SeqSet.from_ranges(r for e in range(len(plan.sizes))
                              for r in have.difference_ranges(plan.shard(e).start, plan.shard(e).stop))
    todo.difference_update(quarantined)
    for seq in in_ring | computing:
        todo.discard(seq)
    return todo
