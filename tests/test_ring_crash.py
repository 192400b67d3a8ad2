"""Processes that die or hang at the worst moment: nothing is lost, nothing is freed early, nothing leaks.

The test plays the target server (producer + lease logic); consumers and producers to be killed run
as real child processes (tests/ring_procs.py) that stop at a named point and wait for SIGKILL.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from common.liveness import RoleLock
from common.ring import ConsumerRing, ProducerRing, SlotState, StaleSlot
from ring_procs import PAYLOAD_BYTES, Child, payload_crc

MiB = 1 << 20


def publish_batch(ring: ProducerRing, seed: int) -> tuple[int, int, int]:
    """Publish one recognisable batch; returns (index, pub_seq, crc of its bytes)."""
    gen = torch.Generator().manual_seed(seed)
    with ring.acquire(timeout=5) as slot:
        hidden = slot.tensor("hidden", torch.float32, (5, 64, 32))
        hidden.copy_(torch.randn(hidden.shape, generator=gen))
        ids = slot.tensor("input_ids", torch.int32, (64,))
        ids.copy_(torch.randint(0, 1000, (64,), generator=gen, dtype=torch.int32))
        slot.publish({"seq": seed})
    return slot.index, slot.pub_seq, payload_crc({"hidden": hidden, "input_ids": ids})


def consume_in_process(path: str, index: int, pub_seq: int, epoch: int) -> int:
    """A restarted consumer: attach, read, copy out, ack; returns the crc of what it copied."""
    with ConsumerRing.attach(path, cuda_register="off") as ring:
        view = ring.read(index, pub_seq)
        copies = {name: t.clone() for name, t in view.tensors.items()}
        assert view.still_valid()
        ring.ack(index, pub_seq, epoch)
        del view
    return payload_crc(copies)


@pytest.mark.parametrize("stop_at", ["before_claim", "mid_read", "after_read"])
def test_killed_consumer_gets_same_seq_again(shm_dir: str, ring_name: str, stop_at: str) -> None:
    ring = ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
    consumer = Child("consumer", shm_dir, ring_name, ring.path, "--stop-at", stop_at)
    try:
        ring.set_consumer_epoch(1)
        index, pub_seq, crc = publish_batch(ring, seed=7)
        consumer.expect("attached")
        consumer.send(f"{index} {pub_seq} 1 {crc}")
        assert consumer.expect(f"at {stop_at}") == ["at", stop_at, str(index), str(pub_seq)]
        assert RoleLock.anyone_holds(shm_dir, ring_name, "consumer")
        consumer.kill9()

        # the server's view: the consumer role is free again, so its session is over
        assert not RoleLock.anyone_holds(shm_dir, ring_name, "consumer")
        assert os.path.exists(ring.path)  # a dying consumer (and its resource tracker) unlinks nothing
        ring.set_consumer_epoch(2)
        assert ring.reclaim() == []
        assert [(s.index, s.pub_seq, s.meta) for s in ring.ready()] == [(index, pub_seq, {"seq": 7})]

        assert consume_in_process(ring.path, index, pub_seq, epoch=2) == crc
        assert ring.reclaim() == [index]
        assert [s.state for s in ring.slots()] == [SlotState.FREE, SlotState.FREE]  # no slot leaked
        for seed in (8, 9):  # and both slots are usable again
            publish_batch(ring, seed)
    finally:
        consumer.close()
        ring.close()


@pytest.mark.parametrize("stop_at", ["mid_write", "mid_publish"])
def test_killed_producer_is_replaced_by_a_new_epoch_and_its_slot_is_never_read(
        shm_dir: str, ring_name: str, stop_at: str) -> None:
    producer = Child("producer", shm_dir, ring_name, "--stop-at", stop_at)
    reader = None
    try:
        _, old_path, old_epoch = producer.expect("path")
        _, _, index, pub_seq = producer.expect(f"at {stop_at}")
        index, pub_seq = int(index), int(pub_seq)
        reader = ConsumerRing.attach(old_path, cuda_register="off")
        assert reader.producer_alive()
        assert reader.slots()[index].state is SlotState.WRITING
        with pytest.raises(StaleSlot, match="WRITING"):
            reader.read(index, pub_seq)
        producer.kill9()

        assert not reader.producer_alive()
        with pytest.raises(StaleSlot, match="WRITING"):  # still never readable
            reader.read(index, pub_seq)
        new = ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=PAYLOAD_BYTES, cuda_register="off")
        try:
            assert new.producer_epoch > int(old_epoch)
            assert not os.path.exists(old_path)
            assert reader.slots()[index].state is SlotState.WRITING  # the old mapping is still valid
            reader.close()
            reader = ConsumerRing.attach(new.path, cuda_register="off")  # path learned from the new server
            new.set_consumer_epoch(1)
            i, p, crc = publish_batch(new, seed=3)
            assert consume_in_process(new.path, i, p, epoch=1) == crc
        finally:
            new.close()
    finally:
        if reader is not None:
            reader.close()
        producer.close()


def test_stopped_consumer_is_fenced_and_its_late_ack_frees_nothing(shm_dir: str, ring_name: str) -> None:
    lease_s = 0.3
    ring = ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
    consumer = Child("consumer", shm_dir, ring_name, ring.path, "--stop-at", "before_ack", "--heartbeat")
    try:
        ring.set_consumer_epoch(1)
        index, pub_seq, crc = publish_batch(ring, seed=11)
        consumer.expect("attached")
        consumer.send(f"{index} {pub_seq} 1 {crc}")
        consumer.expect("at before_ack")
        consumer.proc.send_signal(signal.SIGSTOP)

        # lease logic as the server runs it: the role is still held (the process exists) but no
        # heartbeat arrived for a lease period, so the session is presumed hung and fenced
        deadline = time.monotonic() + 30
        while time.monotonic() - consumer.last_line_at < lease_s:
            assert time.monotonic() < deadline, "heartbeats did not stop"
            time.sleep(0.05)
        assert RoleLock.anyone_holds(shm_dir, ring_name, "consumer")
        ring.set_consumer_epoch(2)
        assert [(s.index, s.pub_seq) for s in ring.ready()] == [(index, pub_seq)]

        consumer.send("ack")  # the hung consumer wakes up and acks what it read under epoch 1
        consumer.proc.send_signal(signal.SIGCONT)
        consumer.expect("acked")
        assert ring.reclaim() == []
        assert ring.slots()[index].state is SlotState.READY
        assert [(s.index, s.pub_seq) for s in ring.ready()] == [(index, pub_seq)]

        assert consume_in_process(ring.path, index, pub_seq, epoch=2) == crc  # the new session gets it
        assert ring.reclaim() == [index]
    finally:
        consumer.close()
        ring.close()
