"""The target server's delivery core (target_server/delivery.py) without sockets, rings or threads.

Unit tests pin its decisions one by one; `DeliveryMachine` (hypothesis) interleaves trainers,
strangers, kills, stops, target restarts, lost messages, corrupt slots and payloads, and checks
after every step that no batch is lost or doubled. Both drive the core through the same
`run_actions` the server uses, against `FakeRings`: rings reduced to their slot headers.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.protocol import (Ack, Announce, Commit, EpochEnd, Fenced, Hello, Message, ProtocolError, Reply, RingInfo,
                             Welcome, new_session_secret, plan_id)
from common.seqset import SeqSet
from target_server.delivery import (CORRUPT_PAYLOADS_MAX, HELDOUT, TRAIN, DeliveryCore, Dispatcher, Free, Replan, Scan, Send,
                                    SetConsumerEpoch, SlotView, run_actions)

SIZES = [5, 4]                      # batches per epoch
HELDOUT_COUNT = 2
WORKERS, SLOTS = 2, 2
LEASE_S, RETRY_S = 10.0, 2.0
PLAN = {"data": "fake", "id": plan_id({"data": "fake"})}
STRANGER = b"stranger"


@dataclass
class FakeSlot:
    ready: bool = False
    pub_seq: int = 0
    seq: int = 0
    heldout: bool = False
    ack: tuple[int, int] | None = None   # (consumer epoch, pub_seq) a consumer wrote
    corrupt: bool = False                # its table no longer validates


class FakeRings:
    """The server's side of the rings and the socket, as `run_actions` uses them, plus the
    workers' side (publish) and the consumers' (ack)."""

    def __init__(self) -> None:
        self.slots = [[FakeSlot() for _ in range(SLOTS)] for _ in range(WORKERS)]
        self.pub = [0] * WORKERS
        self.consumer_epoch = 0
        self.sent: list[tuple[bytes, Message]] = []

    def send(self, peer: bytes, msg: Message) -> None:
        msg.encode()   # everything the core says must go on the wire
        self.sent.append((peer, msg))

    def free(self, worker: int, slot: int, pub_seq: int) -> None:
        s = self.slots[worker][slot]
        if s.ready and s.pub_seq == pub_seq:
            s.ready = False

    def set_consumer_epoch(self, epoch: int) -> None:
        assert epoch >= self.consumer_epoch, "the consumer epoch never goes back"
        self.consumer_epoch = epoch

    def snapshot(self, reclaim: bool) -> list[SlotView]:
        out = []
        for w, ring in enumerate(self.slots):
            for i, s in enumerate(ring):
                acked = s.ready and s.ack == (self.consumer_epoch, s.pub_seq)
                if reclaim and acked:
                    s.ready, acked = False, False
                out.append(SlotView(w, i, s.pub_seq, ready=s.ready, acked=acked,
                                    seq=None if s.corrupt else s.seq, heldout=s.heldout))
        return out

    def publish(self, seq: int, heldout: bool) -> bool:
        for w, ring in enumerate(self.slots):
            for s in ring:
                if not s.ready:
                    self.pub[w] += 1
                    s.ready, s.pub_seq, s.seq, s.heldout, s.ack, s.corrupt = True, self.pub[w], seq, heldout, None, False
                    return True
        return False   # ring full: the worker waits with its batch

    def ready_seqs(self, heldout: bool) -> list[int]:
        """Seqs in READY slots whose ack has not been written under the current epoch."""
        return [s.seq for ring in self.slots for s in ring
                if s.ready and not s.corrupt and s.heldout == heldout and s.ack != (self.consumer_epoch, s.pub_seq)]

    def rings(self) -> list[RingInfo]:
        return [RingInfo(worker=w, path=f"/fake/ring-{w}", slot_count=SLOTS, slot_size=1, producer_epoch=1)
                for w in range(WORKERS)]


def make_core(dead: set[int] | None = None) -> DeliveryCore:
    dead = dead if dead is not None else set()
    core = DeliveryCore(lambda n: (SIZES * n)[:n], PLAN, lease_s=LEASE_S, announce_retry_s=RETRY_S,
                        heldout_count=HELDOUT_COUNT, pid_alive=lambda pid, start: pid not in dead)
    core.target = {"model_path": "fake", "hidden_size": 8}
    return core


def hello(job: str, secret: str, have: SeqSet | None = None, rank: int = 0, world: int = 1, pid: int = 100,
          epochs: int = 1, heldout: bool = False, credit: int = 2) -> Hello:
    return Hello(rid=1, job=job, secret=secret, rank=rank, world=world, pid=pid, start_time=1,
                 have=have or SeqSet(), epochs=epochs, credit=credit, heldout=heldout)


class Rig:
    """Core + dispatcher + fake rings, with the server's plumbing (run_actions) in between."""

    def __init__(self) -> None:
        self.dead: set[int] = set()
        self.core = make_core(self.dead)
        self.dispatcher = Dispatcher()
        self.io = FakeRings()
        self.holding: list = []   # works taken by a worker that waits for a free slot
        self.now = 0.0
        self.apply([Replan(TRAIN)])   # the prefetch the server starts with

    def apply(self, actions: list) -> list[tuple[bytes, Message]]:
        run_actions(self.core, self.dispatcher, self.io, actions, self.now)
        for stream, seq, reason in self.dispatcher.quarantined_news():
            self.core.on_quarantined(stream, seq, reason)
        sent, self.io.sent = self.io.sent, []
        return sent

    def hello(self, peer: bytes, msg: Hello) -> list[tuple[bytes, Message]]:
        return self.apply(self.core.on_hello(peer, msg, self.now, self.io.snapshot(reclaim=False), self.io.rings()))

    def compute(self, n: int = 1 << 30, poison: set[int] = frozenset()) -> list[tuple[bytes, Message]]:
        """Workers take up to n batches and publish them; a worker that finds the ring full
        waits with its batch (still `computing`) until a slot is free."""
        sent = []
        for _ in range(n):
            work = self.holding.pop(0) if self.holding else self.dispatcher.take(0)
            if work is None:
                break
            if not work.heldout and work.seq in poison:
                self.dispatcher.quarantine(work, "poison")
            elif not self.io.publish(work.seq, work.heldout):
                self.holding.insert(0, work)
                break
            self.dispatcher.done(work)
            sent += self.apply([Scan()])   # a publish wakes the server, which scans the rings
        return sent

    def scan(self) -> list[tuple[bytes, Message]]:
        return self.apply([Scan()])

    def ack(self, peer: bytes, secret: str, a: Announce, corrupt: bool = False) -> list[tuple[bytes, Message]]:
        if not corrupt:
            self.io.slots[a.worker][a.slot].ack = (a.consumer_epoch, a.pub_seq)
        return self.apply(self.core.on_ack(peer, Ack(consumer_epoch=a.consumer_epoch, secret=secret, worker=a.worker,
                                                     slot=a.slot, pub_seq=a.pub_seq, seq=a.seq, corrupt=corrupt),
                                           self.now))


def of(sent: list[tuple[bytes, Message]], kind: type) -> list:
    return [m for _, m in sent if isinstance(m, kind)]


def consume(rig: Rig, peer: bytes, secret: str, sent: list[tuple[bytes, Message]],
            poison: set[int] = frozenset()) -> tuple[list[int], list[int]]:
    """A rank acking every announcement while the workers compute: (seqs got, epochs ended)."""
    got, ended = [], []
    for _ in range(50):
        ended += [m.epoch for m in of(sent, EpochEnd)]
        announced, sent = of(sent, Announce), []
        for a in announced:
            got.append(a.seq)
            sent += rig.ack(peer, secret, a)
        if not announced:
            sent = rig.compute(poison=poison) + rig.scan()
    return got, ended


# ---- decisions, one by one ------------------------------------------------------------------------

def test_a_hello_fences_old_acks_queues_what_the_trainer_lacks_and_announces_within_credit() -> None:
    rig = Rig()
    secret = new_session_secret()
    actions = rig.core.on_hello(b"r0", hello("job", secret, have=SeqSet([1, 2])), 0.0, [], rig.io.rings())
    kinds = [type(a) for a in actions]
    assert kinds == [SetConsumerEpoch, Replan, Replan, Replan, Send, Scan]   # held-out decided by rank 0
    assert actions[0] == SetConsumerEpoch(1)
    run_actions(rig.core, rig.dispatcher, rig.io, actions, 0.0)
    assert rig.dispatcher.pending() == [0, 3, 4] and rig.dispatcher.pending(HELDOUT) == []
    rig.io.sent.clear()
    announced = of(rig.compute() + rig.scan(), Announce)
    assert [a.seq for a in announced] == [0, 3], "oldest first, no more than the rank's credit"
    assert rig.core.counts[TRAIN]["announced"] == 2


def test_held_out_batches_go_first_to_rank_0_outside_its_credit_and_only_once() -> None:
    rig = Rig()
    secret = new_session_secret()
    rig.hello(b"r0", hello("job", secret, heldout=True, credit=1))
    assert rig.dispatcher.pending(HELDOUT) == [0, 1]
    announced = of(rig.compute() + rig.scan(), Announce)
    assert [(a.heldout, a.seq) for a in announced] == [(True, 0), (True, 1)], "the ring holds only those"
    sent = []
    for a in announced:
        sent += rig.ack(b"r0", secret, a)
    assert rig.core.session.streams[HELDOUT].delivered == SeqSet([0, 1])
    assert rig.core.session.train.delivered == SeqSet(), "held-out acks are no training deliveries"
    sent += rig.compute() + rig.scan()
    assert [(a.heldout, a.seq) for a in of(sent, Announce)] == [(False, 0)], "credit 1: one training batch"
    assert rig.dispatcher.pending(HELDOUT) == [] and rig.core.counts[HELDOUT]["announced"] == 2


def test_every_batch_once_then_epoch_end_and_a_silent_rank_is_fenced_after_the_lease() -> None:
    rig = Rig()
    secret = new_session_secret()
    got, ended = consume(rig, b"r0", secret, rig.hello(b"r0", hello("job", secret)))
    assert sorted(got) == list(range(SIZES[0])) and ended == [0]
    rig.now += LEASE_S / 2
    assert rig.core.tick(rig.now) == [], "silent for less than the lease"
    rig.now += LEASE_S
    sent = rig.apply(rig.core.tick(rig.now))
    assert rig.core.session is None and rig.core.events["finished"] == 1 and of(sent, Fenced)


def test_strangers_are_refused_and_counted_and_change_nothing() -> None:
    rig = Rig()
    secret = new_session_secret()
    rig.hello(b"r0", hello("job", secret))
    s = rig.core.session
    before = (s.consumer_epoch, set(s.peers), s.train.have.copy(), s.committed.copy())
    everything = SeqSet.from_ranges([(0, SIZES[0])])
    sent = rig.hello(STRANGER, hello("job", new_session_secret(), have=everything, pid=666))
    assert not of(sent, Reply)[0].ok and "not a member" in of(sent, Reply)[0].error
    sent = rig.hello(STRANGER, hello("other", new_session_secret(), pid=666))
    assert "another trainer session" in of(sent, Reply)[0].error
    sent = rig.hello(STRANGER, hello("job", secret, have=SeqSet([SIZES[0]]), pid=666))   # the secret, beyond the plan
    assert "have set reaches" in of(sent, Reply)[0].error
    sent = rig.apply(rig.core.on_commit(STRANGER, Commit(rid=2, consumer_epoch=s.consumer_epoch,
                                                         secret=new_session_secret(), have=everything, step=9), 0.0))
    assert not of(sent, Reply)[0].ok
    sent = rig.apply(rig.core.on_ack(STRANGER, Ack(consumer_epoch=s.consumer_epoch, secret=secret, worker=0, slot=0,
                                                   pub_seq=1, seq=0), 0.0))
    assert sent == [], "an ack from a connection that never joined: counted, unanswered"
    sent = rig.apply(rig.core.on_ack(STRANGER, Ack(consumer_epoch=99, secret=secret, worker=0, slot=0, pub_seq=1,
                                                   seq=0), 0.0))
    assert of(sent, Fenced), "an ack for another session is told so"
    assert rig.core.refused == {"not_member": 3, "busy": 1, "out_of_plan": 1}
    assert (s.consumer_epoch, set(s.peers), s.train.have, s.committed) == before and rig.core.session is s


def test_a_new_trainer_replaces_a_dead_one_and_gets_what_that_one_never_committed() -> None:
    rig = Rig()
    old = new_session_secret()
    rig.compute()
    sent = rig.hello(b"old", hello("old", old, pid=7))
    delivered = []
    for a in of(sent, Announce):
        rig.ack(b"old", old, a)
        delivered.append(a.seq)
    assert rig.core.session.train.delivered == SeqSet(delivered)
    rig.dead.add(7)
    sent = rig.hello(b"new", hello("new", new_session_secret(), pid=8))
    assert [p for p, m in sent if isinstance(m, Fenced)] == [b"old"]
    assert rig.core.session.job == "new" and rig.io.consumer_epoch == rig.core.session.consumer_epoch
    rig.compute()
    queued = rig.dispatcher.pending() + rig.io.ready_seqs(TRAIN) + sorted(rig.dispatcher.computing)
    assert sorted(queued) == list(range(SIZES[0])), \
        "nothing the dead trainer got is held now: all of it is queued again"


def test_nothing_is_announced_until_every_rank_said_what_it_holds() -> None:
    rig = Rig()
    secret = new_session_secret()
    rig.compute()
    sent = rig.hello(b"r0", hello("job", secret, world=2))
    assert of(sent, Welcome) and not of(sent, Announce), "rank 1 may hold any of these"
    sent = rig.hello(b"r1", hello("job", secret, have=SeqSet([0, 1]), rank=1, world=2))
    announced = of(sent, Announce)
    assert announced and not {a.seq for a in announced} & {0, 1}
    assert rig.core.counts[TRAIN]["discarded"] == 2, "the slots of what rank 1 holds are freed"


def test_on_a_cluster_the_gate_waits_for_this_hosts_ranks_only() -> None:
    """With cluster.num_hosts > 1 a server sees only its host's ranks of the group (HELLO's
    ranks_here): waiting for all of `world` would never announce anything."""
    rig = Rig()
    secret = new_session_secret()
    rig.compute()
    msg = hello("job", secret, rank=1, world=2)
    sent = rig.hello(b"r1", dataclasses.replace(msg, ranks_here=1))
    assert of(sent, Welcome) and of(sent, Announce)
    with pytest.raises(ProtocolError):
        dataclasses.replace(msg, ranks_here=3)


def test_a_rank_that_says_hello_again_keeps_its_slots_and_an_acked_one_counts_as_delivered() -> None:
    rig = Rig()
    secret = new_session_secret()
    rig.compute()
    first, second = of(rig.hello(b"r0", hello("job", secret)), Announce)
    rig.io.slots[first.worker][first.slot].ack = (first.consumer_epoch, first.pub_seq)   # its ACK message is lost
    rig.now += 0.1
    sent = rig.hello(b"r0", hello("job", secret))        # before it knew it holds `first`
    again = of(sent, Announce)
    assert [a.seq for a in again][:1] == [second.seq] and first.seq not in {a.seq for a in again}, \
        "the unacked one again at once; the acked one freed, not announced again"
    assert rig.core.session.train.delivered == SeqSet([first.seq])


def test_a_corrupt_payload_frees_its_slot_is_counted_and_its_batch_comes_again_never_delivered() -> None:
    rig = Rig()
    secret = new_session_secret()
    rig.compute()   # the prefetch of epoch 0, before any trainer
    sent = rig.hello(b"r0", hello("job", secret, credit=1))
    (a,) = of(sent, Announce)
    sent = rig.ack(b"r0", secret, a, corrupt=True)
    assert rig.core.events["corrupt_payloads"] == 1 and not rig.io.slots[a.worker][a.slot].ready
    assert a.seq not in rig.core.session.train.delivered and rig.core.counts[TRAIN]["acked"] == 0
    assert a.seq in rig.dispatcher.pending(), "computed again"
    # a corrupt ack of a slot that was not announced to this rank frees nothing
    sent += rig.ack(b"r0", secret, a, corrupt=True)
    assert rig.core.refused["not_announced"] == 1 and rig.core.events["corrupt_payloads"] == 1
    got, ended = consume(rig, b"r0", secret, sent)
    assert sorted(got) == list(range(SIZES[0])) and ended == [0], "the corrupt batch once more, the others once"
    assert rig.core.session.train.delivered == SeqSet(range(SIZES[0]))


def test_a_batch_corrupt_every_time_is_quarantined_after_the_cap_and_its_epoch_still_ends() -> None:
    rig = Rig()
    secret = new_session_secret()
    rig.compute()
    sent = rig.hello(b"r0", hello("job", secret, credit=1))
    bad = of(sent, Announce)[0].seq
    got, ended, corrupt = [], [], 0
    for _ in range(50):   # a rank whose copy of batch `bad` fails the checksum every time
        ended += [m.epoch for m in of(sent, EpochEnd)]
        announced, sent = of(sent, Announce), []
        for a in announced:
            if a.seq == bad:
                corrupt += 1
                sent += rig.ack(b"r0", secret, a, corrupt=True)
                assert (bad in rig.core.quarantined[TRAIN]) == (corrupt == CORRUPT_PAYLOADS_MAX)
            else:
                got.append(a.seq)
                sent += rig.ack(b"r0", secret, a)
        if not announced:
            sent = rig.compute() + rig.scan()
    assert corrupt == CORRUPT_PAYLOADS_MAX, "computed again until the cap, then never"
    assert rig.core.events["corrupt_payloads"] == CORRUPT_PAYLOADS_MAX
    assert rig.core.counts[TRAIN]["quarantined"] == 1 and bad not in rig.dispatcher.pending()
    assert rig.core.quarantine_log[-1]["reason"].startswith("its payload failed the checksum")
    assert sorted(got) == [s for s in range(SIZES[0]) if s != bad] and ended == [0]
    assert bad not in rig.core.session.train.delivered


def test_a_slot_whose_table_went_bad_is_freed_even_when_announced_and_its_batch_is_not_delivered() -> None:
    rig = Rig()
    secret = new_session_secret()
    rig.compute()
    (a,) = of(rig.hello(b"r0", hello("job", secret, credit=1)), Announce)
    rig.io.slots[a.worker][a.slot].corrupt = True
    sent = rig.scan()
    assert [x for x in rig.core.scan(0.0, []) if isinstance(x, Free)] == []
    assert rig.core.events["corrupt_slots"] == 1 and not rig.io.slots[a.worker][a.slot].ready
    assert a.seq not in rig.core.session.train.delivered and a.seq in rig.dispatcher.pending()
    assert not of(sent, EpochEnd)


def test_a_quarantined_batch_is_never_queued_again_and_its_epoch_still_ends() -> None:
    rig = Rig()
    secret = new_session_secret()
    got, ended = consume(rig, b"r0", secret, rig.hello(b"r0", hello("job", secret)), poison={3})
    rig.apply([Replan(TRAIN)])
    assert rig.dispatcher.pending() == [], "a replan does not queue the quarantined batch again"
    assert sorted(got) == [0, 1, 2, 4] and ended == [0] and rig.core.quarantined[TRAIN] == SeqSet([3])


# ---- the fuzzer ---------------------------------------------------------------------------------

@dataclass
class Trainer:
    """One trainer process group: its model state and each rank's connection state."""

    job: str
    pid: int
    world: int
    epochs: int
    heldout: bool
    base: set[int]                        # what its checkpoint held when it started
    committed: set[int]                   # what its last checkpoint holds
    secret: str = field(default_factory=new_session_secret)
    acked: list[set[int]] = field(default_factory=list)     # per rank: acked since the start (trained or not)
    queued: list[set[int]] = field(default_factory=list)    # per rank: acked, not trained yet
    heldout_got: set[int] = field(default_factory=set)      # this session's held-out batches
    consumer_epoch: list[int] = field(default_factory=list)  # per rank, -1 before a WELCOME
    superseded: list[int] = field(default_factory=list)      # per rank: the session a later HELLO replaced
    seen: list[set[tuple[int, int]]] = field(default_factory=list)
    inbox: list[list[Message]] = field(default_factory=list)
    alive: bool = True
    stopped: bool = False                 # SIGSTOP: alive, but silent

    def __post_init__(self) -> None:
        self.acked = [set() for _ in range(self.world)]
        self.queued = [set() for _ in range(self.world)]
        self.consumer_epoch = [-1] * self.world
        self.superseded = [-1] * self.world
        self.seen = [set() for _ in range(self.world)]
        self.inbox = [[] for _ in range(self.world)]

    def peer(self, rank: int) -> bytes:
        return f"{self.job}/{rank}".encode()

    @property
    def trained(self) -> set[int]:
        """In the model: the checkpoint it started from and every batch a rank trained since."""
        return self.base.union(*(a - q for a, q in zip(self.acked, self.queued)))

    @property
    def in_hand(self) -> set[int]:
        return set().union(*self.queued)

    def have(self, rank: int) -> SeqSet:
        """A rank's HELLO: its checkpoint's set plus everything it acked since (drafter_trainer/feed.py)."""
        return SeqSet(self.base | self.acked[rank])


def misplaced(places: list[str]) -> bool:
    """A batch is in exactly one place. One the trainer holds may also still be on a worker
    (taken before the HELLO said it is held; its slot is freed once published), but it is never
    queued, READY or quarantined."""
    held = [p for p in places if p == "trained" or p.startswith("queued")]
    elsewhere = [p for p in places if p not in held]
    if held:
        return len(held) != 1 or elsewhere not in ([], ["computing"])
    return len(elsewhere) != 1


class DeliveryMachine(RuleBasedStateMachine):
    """Random interleavings; after every step nothing lost or doubled, and at the end every batch
    of the plan in the trainer's model exactly once, every slot free."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig()
        self.jobs = itertools.count()
        self.pids = itertools.count(1000)
        self.trainer: Trainer | None = None
        self.poison: set[int] = set()
        # corrupt payloads this server lifetime, per (stream, seq); at CORRUPT_PAYLOADS_MAX the
        # batch is quarantined by this server (a restarted one computes it again)
        self.corrupt_sent: collections.Counter[tuple[bool, int]] = collections.Counter()

    def corrupt_every_time(self, stream: bool) -> set[int]:
        return {seq for (of_stream, seq), n in self.corrupt_sent.items()
                if of_stream == stream and n >= CORRUPT_PAYLOADS_MAX}

    def given_up(self, stream: bool) -> set[int]:
        """Seqs of `stream` this server may leave out: poisoned data, or a payload corrupt every time."""
        return self.corrupt_every_time(stream) | (self.poison if stream == TRAIN else set())

    # -- plumbing ---------------------------------------------------------------------------------
    def deliver(self, sent: list[tuple[bytes, Message]]) -> None:
        t = self.trainer
        for peer, msg in sent:
            if t is not None and t.alive:
                for r in range(t.world):
                    if peer == t.peer(r):
                        t.inbox[r].append(msg)

    def apply(self, actions: list) -> None:
        self.deliver(self.rig.apply(actions))

    def planned(self) -> int:
        return sum(SIZES[: self.trainer.epochs]) if self.trainer else SIZES[0]

    def joined(self) -> bool:
        """The trainer is up and every rank is in the core's current session."""
        t, s = self.trainer, self.rig.core.session
        return (t is not None and t.alive and s is not None and s.job == t.job
                and all(e == s.consumer_epoch for e in t.consumer_epoch))

    def new_trainer(self, world: int, epochs: int, heldout: bool, committed: set[int]) -> None:
        self.trainer = Trainer(job=f"job-{next(self.jobs)}", pid=next(self.pids), world=world, epochs=epochs,
                               heldout=heldout, base=set(committed), committed=set(committed))

    @initialize(world=st.integers(1, 2), epochs=st.integers(1, 2), heldout=st.booleans(),
                poison=st.sets(st.integers(0, sum(SIZES) - 1), max_size=1))
    def start(self, world: int, epochs: int, heldout: bool, poison: set[int]) -> None:
        self.poison = poison
        self.new_trainer(world, epochs, heldout, set())

    # -- trainer ----------------------------------------------------------------------------------
    @precondition(lambda self: self.trainer.alive and not self.trainer.stopped and not all(self.trainer.inbox))
    @rule(data=st.data())
    def say_hello(self, data: st.DataObject) -> None:
        """A rank says HELLO (first start, after a fence, after losing the server) with what it
        holds. Like drafter_trainer/feed.py, only once it has handled every message it received."""
        t = self.trainer
        self.hello_from(data.draw(st.sampled_from([r for r in range(t.world) if not t.inbox[r]])))

    def hello_from(self, r: int) -> None:
        t = self.trainer
        if t.consumer_epoch[r] >= 0:
            # this HELLO declares every batch in hand as held: a FENCED for the session it
            # replaces must not drop them (drafter_trainer/feed.py does the same)
            t.superseded[r] = t.consumer_epoch[r]
        self.deliver(self.rig.hello(t.peer(r), hello(t.job, t.secret, t.have(r), rank=r, world=t.world, pid=t.pid,
                                                     epochs=t.epochs, heldout=t.heldout and r == 0)))

    @precondition(lambda self: self.trainer.alive and not self.trainer.stopped and any(self.trainer.inbox))
    @rule(data=st.data(), lose=st.sampled_from(["no"] * 5 + ["message", "ack_message", "corrupt"]))
    def receive(self, data: st.DataObject, lose: str) -> None:
        """A rank handles its next message; `lose`: the message is lost, or the ACK message is,
        or the slot's payload fails its checksum."""
        t = self.trainer
        self.handle(data.draw(st.sampled_from([r for r in range(t.world) if t.inbox[r]])), lose)

    def handle(self, r: int, lose: str) -> None:
        t = self.trainer
        msg = t.inbox[r].pop(0)
        if lose == "message":
            return
        if isinstance(msg, Welcome):
            if msg.consumer_epoch != t.consumer_epoch[r]:
                t.seen[r].clear()
                if r == 0:
                    t.heldout_got.clear()
            t.consumer_epoch[r] = msg.consumer_epoch
        elif isinstance(msg, Fenced):
            if msg.consumer_epoch == t.consumer_epoch[r] and msg.consumer_epoch != t.superseded[r]:
                # a fenced rank drops what it has not trained and says HELLO again (say_hello)
                t.acked[r] -= t.queued[r]
                t.queued[r].clear()
                t.consumer_epoch[r] = -1
        elif isinstance(msg, EpochEnd):
            if msg.consumer_epoch == t.consumer_epoch[r]:
                epoch = range(sum(SIZES[: msg.epoch]), sum(SIZES[: msg.epoch + 1]))
                missing = set(epoch) - t.trained - t.in_hand - self.given_up(TRAIN)
                assert not missing, f"epoch {msg.epoch} ended without {sorted(missing)}"
        elif isinstance(msg, Announce) and msg.consumer_epoch == t.consumer_epoch[r]:
            slot = self.rig.io.slots[msg.worker][msg.slot]
            if (msg.worker, msg.pub_seq) in t.seen[r] or not slot.ready or slot.pub_seq != msg.pub_seq:
                return   # a repeat, or a slot that is gone
            if slot.corrupt:
                return   # the table does not validate: the rank cannot read it
            t.seen[r].add((msg.worker, msg.pub_seq))
            assert (slot.seq, slot.heldout) == (msg.seq, msg.heldout)
            if lose == "corrupt":
                self.corrupt_sent[(msg.heldout, msg.seq)] += 1
                self.apply(self.rig.core.on_ack(t.peer(r), Ack(
                    consumer_epoch=msg.consumer_epoch, secret=t.secret, worker=msg.worker, slot=msg.slot,
                    pub_seq=msg.pub_seq, seq=msg.seq, corrupt=True), self.rig.now))
                return
            if msg.heldout:
                assert r == 0 and t.heldout, "held-out batches go to the rank 0 that asked"
                assert msg.seq not in t.heldout_got, f"held-out batch {msg.seq} twice in one session"
                t.heldout_got.add(msg.seq)
            else:
                assert msg.seq not in t.trained | t.in_hand, f"seq {msg.seq} delivered twice"
                assert msg.seq not in self.poison
                t.queued[r].add(msg.seq)
                t.acked[r].add(msg.seq)
            slot.ack = (msg.consumer_epoch, msg.pub_seq)
            if lose != "ack_message":
                self.apply(self.rig.core.on_ack(t.peer(r), Ack(
                    consumer_epoch=msg.consumer_epoch, secret=t.secret, worker=msg.worker, slot=msg.slot,
                    pub_seq=msg.pub_seq, seq=msg.seq), self.rig.now))

    @precondition(lambda self: self.trainer.alive and not self.trainer.stopped)
    @rule(rounds=st.integers(1, 3))
    def serve_undisturbed(self, rounds: int) -> None:
        """A stretch of normal work (compute, every message handled, time passes): gets the run
        deep into its plan, so that kills and restarts find batches in every place."""
        t = self.trainer
        for _ in range(rounds):
            self.compute(2)
            while any(t.inbox):
                self.handle(next(r for r in range(t.world) if t.inbox[r]), "no")
            self.time_passes(0.5)

    @precondition(lambda self: self.trainer.alive and self.trainer.in_hand)
    @rule()
    def train(self) -> None:
        for q in self.trainer.queued:
            q.clear()

    @precondition(lambda self: self.trainer.alive and not self.trainer.stopped)
    @rule()
    def checkpoint(self) -> None:
        t = self.trainer
        t.committed = set(t.trained)
        s = self.rig.core.session
        epoch = t.consumer_epoch[0] if t.consumer_epoch[0] >= 0 else 1
        self.apply(self.rig.core.on_commit(t.peer(0), Commit(rid=3, consumer_epoch=epoch, secret=t.secret,
                                                             have=SeqSet(t.trained), step=1), self.rig.now))
        if self.joined():
            assert s.committed == SeqSet(t.trained)

    @precondition(lambda self: self.trainer.alive)
    @rule()
    def kill_trainer(self) -> None:
        """kill -9: its pid is gone; only its last checkpoint survives."""
        self.rig.dead.add(self.trainer.pid)
        self.trainer.alive = False

    @precondition(lambda self: not self.trainer.alive)
    @rule(world=st.integers(1, 2))
    def restart_trainer(self, world: int) -> None:
        t = self.trainer
        self.new_trainer(world, t.epochs, t.heldout, t.committed)

    @precondition(lambda self: self.trainer.alive)
    @rule()
    def stop_or_continue_trainer(self) -> None:
        """SIGSTOP / SIGCONT: silent while stopped (its lease runs out)."""
        self.trainer.stopped = not self.trainer.stopped

    # -- strangers ----------------------------------------------------------------------------------
    @precondition(lambda self: self.rig.core.session is not None)
    @rule(kind=st.sampled_from(["hello_job", "hello_beyond_plan", "hello_other_job", "ack", "ack_old", "commit"]),
          have=st.sets(st.integers(0, sum(SIZES) + 2), max_size=4))
    def stranger(self, kind: str, have: set[int]) -> None:
        rig, s = self.rig, self.rig.core.session
        before = (s.consumer_epoch, dict(s.peers), s.train.have.copy(), s.committed.copy(), s.train.delivered.copy())
        refused = sum(rig.core.refused.values())
        secret = new_session_secret()
        if kind == "hello_other_job" and not all(rig.core._alive(p, rig.now) for p in s.peers.values()):
            return   # no live trainer: a stranger may then start a session (the documented limit)
        if kind.startswith("hello"):
            job = "someone" if kind == "hello_other_job" else s.job
            if kind == "hello_beyond_plan":
                have.add(sum(SIZES) + 1)
            sent = rig.hello(STRANGER, hello(job, secret, SeqSet(have), pid=next(self.pids), epochs=2))
            assert [type(m) for _, m in sent] == [Reply] and not sent[0][1].ok
        elif kind == "commit":
            rig.apply(rig.core.on_commit(STRANGER, Commit(rid=4, consumer_epoch=s.consumer_epoch, secret=secret,
                                                          have=SeqSet(have), step=7), rig.now))
        else:
            epoch = s.consumer_epoch if kind == "ack" else s.consumer_epoch + 7
            sent = rig.apply(rig.core.on_ack(STRANGER, Ack(consumer_epoch=epoch, secret=secret, worker=0, slot=0,
                                                           pub_seq=1, seq=0), rig.now))
            assert all(isinstance(m, Fenced) and p == STRANGER for p, m in sent)
        assert rig.core.session is s
        assert (s.consumer_epoch, dict(s.peers), s.train.have, s.committed, s.train.delivered) == before
        assert kind == "ack_old" or sum(rig.core.refused.values()) == refused + 1

    # -- the target server ----------------------------------------------------------------------------
    @rule(n=st.integers(1, 4))
    def compute(self, n: int) -> None:
        """Workers take up to n batches and publish them (a full ring makes them wait)."""
        self.deliver(self.rig.compute(n, self.poison))

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, LEASE_S + 1]))
    def time_passes(self, dt: float) -> None:
        """The server's timers: rescan the headers, ping (live ranks answer), check liveness."""
        rig, t = self.rig, self.trainer
        rig.now += dt
        if t.alive and not t.stopped:
            for r in range(t.world):
                rig.core.touch(t.peer(r), rig.now)
        self.apply([Scan()])
        self.apply(rig.core.tick(rig.now))

    @precondition(lambda self: any(s.ready for ring in self.rig.io.slots for s in ring))
    @rule(data=st.data())
    def corrupt_a_table(self, data: st.DataObject) -> None:
        """A byte of a READY slot's table flips in /dev/shm; the server's next scan sees it."""
        slots = [s for ring in self.rig.io.slots for s in ring if s.ready]
        data.draw(st.sampled_from(slots)).corrupt = True
        self.apply([Scan()])

    @rule()
    def restart_target(self) -> None:
        """The target server is killed and started again: rings, queue and core from nothing.
        The trainer keeps what it holds and says HELLO again with it."""
        dead = self.rig.dead
        self.rig = Rig()
        self.rig.dead |= dead     # dead processes stay dead
        self.corrupt_sent.clear()
        t = self.trainer
        t.consumer_epoch = [-1] * t.world
        t.superseded = [-1] * t.world
        t.inbox = [[] for _ in range(t.world)]

    # -- invariants -----------------------------------------------------------------------------------
    @invariant()
    def nothing_doubled_or_lost(self) -> None:
        rig, t = self.rig, self.trainer
        if t is None:
            return
        computing = set(rig.dispatcher.computing)
        pending = rig.dispatcher.pending()
        ready = rig.io.ready_seqs(TRAIN)
        quarantined = set(rig.core.quarantined[TRAIN])
        # whatever the trainer does: the server never holds one batch in two places
        server = pending + ready + sorted(computing) + sorted(quarantined)
        assert len(server) == len(set(server)), f"a seq twice on the server: {sorted(server)}"
        assert self.corrupt_every_time(TRAIN) <= quarantined <= self.given_up(TRAIN)
        assert set(rig.core.quarantined[HELDOUT]) == self.corrupt_every_time(HELDOUT)
        if not self.joined():
            return   # a trainer dead, fenced or reconnecting: its next HELLO decides (checked at the end)
        where: dict[int, list[str]] = {seq: [] for seq in range(self.planned())}
        for name, seqs in (("trained", t.trained), *((f"queued by rank {r}", q) for r, q in enumerate(t.queued)),
                           ("pending", pending), ("computing", computing), ("ready", ready),
                           ("quarantined", quarantined)):
            for seq in seqs:
                if seq < self.planned():
                    where[seq].append(name)
        bad = {seq: places for seq, places in where.items() if misplaced(places)}
        assert not bad, f"seqs not in exactly one place: {bad}"
        s = rig.core.session
        assert set(s.train.delivered) <= t.trained | t.in_hand, "counted delivered, never received"
        if t.heldout:
            got = {i: [] for i in range(HELDOUT_COUNT)}
            for name, seqs in (("got", t.heldout_got), ("pending", rig.dispatcher.pending(HELDOUT)),
                               ("computing", rig.dispatcher.computing_heldout), ("ready", rig.io.ready_seqs(HELDOUT)),
                               ("quarantined", rig.core.quarantined[HELDOUT])):
                for i in seqs:
                    got[i].append(name)
            bad = {i: places for i, places in got.items() if len(places) != 1}
            assert not bad, f"held-out batches not in exactly one place: {bad}"

    def teardown(self) -> None:
        """Let the run finish undisturbed: the trainer's model holds every batch exactly once."""
        t = self.trainer
        if t is None:
            return
        if not t.alive:
            self.restart_trainer(t.world)
        t = self.trainer
        t.stopped = False
        for _ in range(100):
            while any(t.inbox):
                self.handle(next(r for r in range(t.world) if t.inbox[r]), "no")
            if not self.joined():
                for r in range(t.world):
                    self.hello_from(r)
            self.train()
            self.compute(8)
            self.time_passes(0.5)
            done = set(range(self.planned())) - self.given_up(TRAIN) <= t.trained
            heldout_done = len(t.heldout_got | self.given_up(HELDOUT)) == HELDOUT_COUNT
            if done and self.joined() and (not t.heldout or heldout_done):
                break
        assert t.trained == set(range(self.planned())) - self.given_up(TRAIN), \
            f"trained {sorted(t.trained)}, plan {self.planned()}, left out {self.given_up(TRAIN)}"
        self.time_passes(0.5)
        leaked = [(w, i) for w, ring in enumerate(self.rig.io.slots) for i, s in enumerate(ring) if s.ready]
        assert not leaked and not self.rig.holding, f"slots never freed: {leaked}"
        assert self.rig.dispatcher.pending() == [] and self.rig.dispatcher.pending(HELDOUT) == []


TestDeliveryMachine = DeliveryMachine.TestCase
# 500 runs of up to 60 steps: ~10 CPU-s (1,000 took 21)
TestDeliveryMachine.settings = settings(max_examples=500, stateful_step_count=60, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
