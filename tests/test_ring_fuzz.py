"""Fuzzing: the ring's state machine against a model, and the slot-table decoder against junk."""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common import ring as ring_mod
from common.ring import (
    MAX_CONSUMER_EPOCH, ConsumerRing, ProducerRing, RingError, SlotState, SlotWriter, StaleSlot, decode_table,
    pack_ack,
)

SLOTS = 3
SHM_BASE = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass
class ModelSlot:
    state: SlotState = SlotState.FREE
    pub_seq: int = 0
    payload: bytes = b""
    meta: dict = field(default_factory=dict)


class RingStateMachine(RuleBasedStateMachine):
    """Producer and consumer calls in any order, with right, stale and garbage arguments.

    The model says what every slot must be; after each step the ring must agree exactly, so a
    slot freed while un-acked, a read of a slot that is not READY, or a corrupted payload fails.
    """

    @initialize()
    def create(self) -> None:
        self.dir = os.path.join(SHM_BASE, f"dfpt-fuzz-{uuid.uuid4().hex[:10]}")
        os.makedirs(self.dir, mode=0o700)
        self.ring = ProducerRing.create(self.dir, "fuzz", 0, slot_count=SLOTS, slot_size=1, cuda_register="off")
        self.cons = ConsumerRing.attach(self.ring.path, cuda_register="off")
        self.model = [ModelSlot() for _ in range(SLOTS)]
        self.acks = [0] * SLOTS
        self.epoch = 0
        self.pub_seqs: list[int] = [1]  # candidates for stale/right pub_seq arguments
        self.issued = 0
        self.writing: tuple[AbstractContextManager[SlotWriter], SlotWriter, bytearray] | None = None

    def teardown(self) -> None:
        if hasattr(self, "ring"):
            if self.writing is not None:
                self.writing[0].__exit__(None, None, None)
            self.cons.close()
            self.ring.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _acked(self, i: int) -> bool:
        m = self.model[i]
        return self.epoch > 0 and m.pub_seq > 0 and self.acks[i] == pack_ack(self.epoch, m.pub_seq)

    def _model_reclaim(self) -> list[int]:
        freed = [i for i, m in enumerate(self.model) if m.state is SlotState.READY and self._acked(i)]
        for i in freed:
            self.model[i].state = SlotState.FREE
        return freed

    # -- producer, worker thread ------------------------------------------------------------
    @precondition(lambda self: self.writing is None)
    @rule()
    def acquire(self) -> None:
        cm = self.ring.acquire(timeout=0)
        self._model_reclaim()  # acquire reclaims acked slots before looking for a free one
        free = [i for i, m in enumerate(self.model) if m.state is SlotState.FREE]
        try:
            writer = cm.__enter__()
        except TimeoutError:
            assert not free, "acquire timed out with a free slot"
            return
        assert writer.index in free
        assert writer.pub_seq > self.issued  # pub_seqs never repeat (abandoned ones are burnt)
        self.issued = writer.pub_seq
        self.pub_seqs.append(writer.pub_seq)
        self.model[writer.index] = ModelSlot(SlotState.WRITING, writer.pub_seq)
        self.writing = (cm, writer, bytearray())

    @precondition(lambda self: self.writing is not None)
    @rule(data=st.binary(max_size=200))
    def write_tensor(self, data: bytes) -> None:
        _, writer, payload = self.writing
        view = writer.tensor(f"t{len(writer._entries)}", torch.uint8, (len(data),))
        if data:
            view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        payload += data

    @precondition(lambda self: self.writing is not None)
    @rule(seq=st.integers(0, 2**40))
    def publish(self, seq: int) -> None:
        cm, writer, payload = self.writing
        writer.publish({"seq": seq})
        cm.__exit__(None, None, None)
        self.writing = None
        self.model[writer.index] = ModelSlot(SlotState.READY, writer.pub_seq, bytes(payload), {"seq": seq})

    @precondition(lambda self: self.writing is not None)
    @rule(by_exception=st.booleans())
    def abandon(self, by_exception: bool) -> None:
        cm, writer, _ = self.writing
        if by_exception:
            err = RuntimeError("copy failed")
            try:
                cm.__exit__(RuntimeError, err, None)
            except RuntimeError as e:
                assert e is err
        else:
            cm.__exit__(None, None, None)
        self.writing = None
        self.model[writer.index].state = SlotState.FREE

    # -- producer, main thread --------------------------------------------------------------
    @rule()
    def reclaim(self) -> None:
        assert sorted(self.ring.reclaim()) == sorted(self._model_reclaim())

    @rule(index=st.integers(0, SLOTS - 1), pick=st.integers(0, 10**6), offset=st.sampled_from([0, 0, 1, -1]))
    def discard(self, index: int, pick: int, offset: int) -> None:
        pub_seq = max(1, self.pub_seqs[pick % len(self.pub_seqs)] + offset)
        m = self.model[index]
        expected = m.state is SlotState.READY and m.pub_seq == pub_seq
        assert self.ring.discard(index, pub_seq) == expected
        if expected:
            m.state = SlotState.FREE

    @rule(delta=st.integers(-1, 2))
    def set_consumer_epoch(self, delta: int) -> None:
        new = self.epoch + delta
        if new < max(1, self.epoch):
            try:
                self.ring.set_consumer_epoch(new)
            except RingError:
                return
            raise AssertionError(f"epoch {self.epoch} -> {new} accepted")
        self.ring.set_consumer_epoch(new)
        self.epoch = new

    # -- consumer ---------------------------------------------------------------------------
    @rule(index=st.integers(0, SLOTS - 1), pick=st.integers(0, 10**6), offset=st.sampled_from([0, 0, 1, -1]))
    def read(self, index: int, pick: int, offset: int) -> None:
        pub_seq = max(1, self.pub_seqs[pick % len(self.pub_seqs)] + offset)
        m = self.model[index]
        try:
            view = self.cons.read(index, pub_seq)
        except StaleSlot:
            assert not (m.state is SlotState.READY and m.pub_seq == pub_seq), "a READY slot was refused"
            return
        assert m.state is SlotState.READY and m.pub_seq == pub_seq, f"read a {m.state.name} slot"
        copied = b"".join(bytes(t.numpy()) for t in view.tensors.values())
        assert view.still_valid()
        assert copied == m.payload and view.meta == m.meta

    @rule(index=st.integers(0, SLOTS - 1), pick=st.integers(0, 10**6), offset=st.sampled_from([0, 0, 1, -1]),
          epoch_delta=st.sampled_from([0, 0, -1, 1]))
    def ack(self, index: int, pick: int, offset: int, epoch_delta: int) -> None:
        pub_seq = max(1, self.pub_seqs[pick % len(self.pub_seqs)] + offset)
        epoch = self.epoch + epoch_delta
        if not 0 < epoch <= MAX_CONSUMER_EPOCH:
            try:
                self.cons.ack(index, pub_seq, epoch)
            except RingError:
                return
            raise AssertionError(f"ack with epoch {epoch} accepted")
        self.cons.ack(index, pub_seq, epoch)
        self.acks[index] = pack_ack(epoch, pub_seq)

    @rule(index=st.integers(0, SLOTS - 1), value=st.integers(0, 2**64 - 1))
    def scribble_ack_word(self, index: int, value: int) -> None:
        """Garbage in the one word a consumer owns (a buggy or malicious consumer)."""
        self.cons._words.store(self.cons._hw(index, ring_mod._H.ACK), value)
        self.acks[index] = value

    # -- the ring agrees with the model after every step ------------------------------------
    @invariant()
    def slots_match_model(self) -> None:
        if not hasattr(self, "ring"):
            return
        for info, m in zip(self.ring.slots(), self.model):
            assert info.state is m.state, f"slot {info.index}: ring {info.state.name}, model {m.state.name}"
            if m.state is not SlotState.FREE:
                assert info.pub_seq == m.pub_seq
            if m.state is SlotState.READY:
                assert info.acked == self._acked(info.index) and info.meta == m.meta
                view = self.cons.read(info.index, info.pub_seq)
                assert b"".join(bytes(t.numpy()) for t in view.tensors.values()) == m.payload
        expected_ready = sorted((m.pub_seq, i) for i, m in enumerate(self.model)
                                if m.state is SlotState.READY and not self._acked(i))
        assert [(s.pub_seq, s.index) for s in self.ring.ready()] == expected_ready


TestRingStateMachine = RingStateMachine.TestCase
TestRingStateMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


# -- the table decoder ---------------------------------------------------------------------------
def _check_decoded(blob: bytes, limit: int) -> None:
    try:
        entries, meta = decode_table(blob, limit)
    except StaleSlot:
        return
    assert isinstance(meta, dict)
    spans = sorted((e.offset, e.offset + e.nbytes) for e in entries.values() if e.nbytes)
    assert all(end <= limit for _, end in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for e in entries.values():
        assert e.offset % ring_mod.TENSOR_ALIGN == 0 and e.dtype in ring_mod.DTYPE_NAMES


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=400), limit=st.integers(0, 1 << 22))
def test_table_decoder_survives_random_bytes(blob: bytes, limit: int) -> None:
    _check_decoded(blob, limit)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                     st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                       max_leaves=12)
_specs = st.lists(st.one_of(st.sampled_from(sorted(ring_mod.DTYPES)) | _scalars,
                            st.lists(st.integers(-2, 1 << 20) | _scalars, max_size=9),
                            st.integers(-64, 1 << 21).map(lambda x: x - x % 32) | _scalars), min_size=0, max_size=4)


@settings(max_examples=300, deadline=None)
@given(version=st.sampled_from([1, 1, 1, 2, "1", True]) | _scalars,
       tensors=st.dictionaries(st.text(max_size=6) | st.integers(), _specs | _values, max_size=5) | _values,
       meta=st.dictionaries(st.text(max_size=6), _values, max_size=3) | _values,
       limit=st.integers(0, 1 << 22))
def test_table_decoder_validates_structured_junk(version: object, tensors: object, meta: object, limit: int) -> None:
    try:
        blob = msgpack.packb({"v": version, "tensors": tensors, "meta": meta}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return  # not representable in msgpack at all (e.g. non-str map keys are fine, huge ints are not)
    _check_decoded(blob, limit)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_a_corrupted_table_byte_makes_the_slot_stale(shm_dir: str, ring_name: str, position: int, flip: int) -> None:
    ring = ProducerRing.create(shm_dir, ring_name, 0, slot_count=1, slot_size=1, cuda_register="off")
    try:
        cons = ConsumerRing.attach(ring.path, cuda_register="off")
        with ring.acquire(timeout=1) as slot:
            slot.tensor("ids", torch.int32, (16,)).fill_(3)
            slot.publish({"seq": 5, "layer_ids": [1, 9, 17]})
        hw = ring._hw(slot.index, ring_mod._H.TABLE_OFFSET)
        start = ring._slot_start(slot.index) + ring._words.load(hw)
        length = ring._words.load(ring._hw(slot.index, ring_mod._H.TABLE_LEN))
        at = start + position % length
        ring._mm[at] ^= flip
        try:
            cons.read(slot.index, slot.pub_seq)
            raise AssertionError("a corrupted table was accepted")
        except StaleSlot as e:
            assert "checksum" in str(e)
        cons.close()
    finally:
        ring.close()
