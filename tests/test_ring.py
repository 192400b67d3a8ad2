"""The slot ring's contract: layout, state machine, fencing, liveness, space errors, idle waiting."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from common import ring as ring_mod
from common.batch import slot_tensor_specs
from common.cuda_host import CudaRegisterError, chunk_ranges, register_mapping
from common.liveness import LockHeld, RoleLock, _read_stat, pid_alive, process_start_time
from common.ring import (
    SLOT_ALIGN, ConsumerRing, ProducerRing, RingError, RingSpaceError, SlotState, StaleSlot, ring_path, slot_bytes,
)
from common.trust import Untrusted
from ring_procs import Child, payload_crc
from stranger import UID as STRANGER
from stranger import need_root
from machine_speed import scaled

MiB = 1 << 20


@pytest.fixture
def ring(shm_dir: str, ring_name: str) -> ProducerRing:
    r = ProducerRing.create(shm_dir, ring_name, 0, slot_count=3, slot_size=MiB, cuda_register="off")
    yield r
    r.close()


@pytest.fixture
def consumer(ring: ProducerRing) -> ConsumerRing:
    c = ConsumerRing.attach(ring.path, cuda_register="off")
    yield c
    c.close()


def publish(ring: ProducerRing, payload: bytes, **meta: object) -> tuple[int, int]:
    with ring.acquire(timeout=1) as slot:
        slot.tensor("data", torch.uint8, (len(payload),)).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        slot.publish(dict(meta))
    return slot.index, slot.pub_seq


def states(ring: ProducerRing) -> list[SlotState]:
    return [s.state for s in ring.slots()]


# -- data crosses the ring -----------------------------------------------------------------------
def test_ten_thousand_random_payloads_cross_between_processes_byte_exact(shm_dir: str, ring_name: str) -> None:
    rng = np.random.default_rng(1234)
    dtypes = list(ring_mod.DTYPES.values())
    producer = ProducerRing.create(shm_dir, ring_name, 0, slot_count=16, slot_size=MiB, cuda_register="off")
    producer.set_consumer_epoch(1)
    child = Child("consumer", shm_dir, ring_name, producer.path, "--quiet")
    try:
        child.expect("attached")
        for first in range(0, 10_000, 8):  # announce in batches of 8: fewer pipe writes, same ring traffic
            doorbell = []
            for i in range(first, first + 8):
                # the consumer's acks free slots; without ACK messages acquire() notices them by polling
                with producer.acquire(timeout=30) as slot:
                    views = {}
                    for k in range(int(rng.integers(1, 4))):
                        view = slot.tensor(f"t{k}", dtypes[int(rng.integers(len(dtypes)))], (int(rng.integers(0, 600)),))
                        view.view(torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, view.nbytes, dtype=np.uint8)))
                        views[f"t{k}"] = view
                    slot.publish({"i": i})
                doorbell.append(f"{slot.index} {slot.pub_seq} 1 {payload_crc(views)}")
            child.send("\n".join(doorbell))
        child.send("quit")
        assert child.expect("done", timeout=120) == ["done", "10000", "0", "0"]
        assert child.proc.wait(timeout=30) == 0
        # a consumer that exits normally (with a resource tracker running) unlinks nothing
        assert os.path.exists(producer.path)
        producer.reclaim()
        assert states(producer) == [SlotState.FREE] * 16
    finally:
        child.close()
        producer.close()


def test_slot_tensors_are_aligned_and_slot_bytes_fits_a_packed_batch(shm_dir: str, ring_name: str) -> None:
    specs = slot_tensor_specs(num_tokens=1000, num_docs=7, num_layers=5, hidden_size=64, hidden_dtype=torch.bfloat16)
    big = ProducerRing.create(shm_dir, ring_name, 1, slot_count=2, slot_size=slot_bytes(specs), cuda_register="off")
    try:
        with big.acquire(timeout=1) as slot:
            views = {name: slot.tensor(name, dtype, shape) for name, dtype, shape in specs}
            base = big._bytes.data_ptr()
            assert (views["hidden"].data_ptr() - base) % SLOT_ALIGN == 0
            assert all((v.data_ptr() - base) % 64 == 0 for v in views.values())
            with pytest.raises(RingError, match="does not fit"):
                slot.tensor("extra", torch.uint8, (big.slot_size,))
            with pytest.raises(RingError, match="not allowed"):
                slot.tensor("f64", torch.float64, (1,))
            with pytest.raises(RingError, match="new non-empty name"):
                slot.tensor("hidden", torch.uint8, (1,))
            slot.publish({"seq": 3})
    finally:
        big.close()


def test_views_keep_the_mapping_alive_after_close(ring: ProducerRing) -> None:
    index, pub_seq = publish(ring, b"abc" * 100)
    c = ConsumerRing.attach(ring.path, cuda_register="off")
    view = c.read(index, pub_seq)
    c.close()
    assert bytes(view.tensors["data"].numpy()) == b"abc" * 100  # no use-after-unmap
    assert not view.still_valid()


# -- the state machine ---------------------------------------------------------------------------
def test_leaving_the_with_block_without_publish_frees_the_slot(ring: ProducerRing) -> None:
    with ring.acquire(timeout=1) as slot:
        slot.tensor("data", torch.uint8, (10,))
        assert states(ring)[slot.index] is SlotState.WRITING
    assert states(ring) == [SlotState.FREE] * 3
    with pytest.raises(ZeroDivisionError):
        with ring.acquire(timeout=1) as slot:
            1 / 0
    assert states(ring) == [SlotState.FREE] * 3
    with pytest.raises(RingError, match="already published or returned"):
        slot.publish({})


def test_a_published_slot_cannot_be_published_again(ring: ProducerRing) -> None:
    with ring.acquire(timeout=1) as slot:
        slot.publish({"seq": 1})
        with pytest.raises(RingError, match="already published"):
            slot.publish({"seq": 2})
        with pytest.raises(RingError):
            slot.tensor("late", torch.uint8, (1,))
    assert states(ring).count(SlotState.READY) == 1


@pytest.mark.parametrize("meta, message", [({"seq": object()}, "msgpack"), ({"docs": {1: 2}}, "would not decode"),
                                           ([1, 2], "dict with str keys")])
def test_meta_a_consumer_could_not_read_is_refused_and_frees_the_slot(ring: ProducerRing, meta: object,
                                                                      message: str) -> None:
    with pytest.raises(RingError, match=message):
        with ring.acquire(timeout=1) as slot:
            slot.publish(meta)
    assert states(ring) == [SlotState.FREE] * 3


def test_ack_frees_a_slot_only_under_the_current_epoch_and_its_own_pub_seq(
        ring: ProducerRing, consumer: ConsumerRing) -> None:
    ring.set_consumer_epoch(5)
    index, pub_seq = publish(ring, b"x")
    consumer.ack(index, pub_seq, 4)          # an older consumer
    consumer.ack(index, pub_seq + 1, 5)      # a publication that does not exist
    assert ring.reclaim() == []
    assert [s.pub_seq for s in ring.ready()] == [pub_seq]
    consumer.ack(index, pub_seq, 5)
    assert ring.ready() == []
    assert ring.reclaim() == [index]
    assert states(ring)[index] is SlotState.FREE


def test_no_ack_frees_anything_before_a_consumer_epoch_is_set(ring: ProducerRing, consumer: ConsumerRing) -> None:
    index, pub_seq = publish(ring, b"x")
    consumer._words.store(consumer._hw(index, ring_mod._H.ACK), pub_seq)  # epoch 0 in the ack word
    assert ring.reclaim() == []
    with pytest.raises(RingError, match="consumer epoch"):
        consumer.ack(index, pub_seq, 0)


def test_pub_seqs_never_repeat_within_a_ring(ring: ProducerRing, consumer: ConsumerRing) -> None:
    ring.set_consumer_epoch(1)
    seen = []
    for i in range(20):
        if i % 3 == 0:
            with ring.acquire(timeout=1) as slot:  # abandoned: its pub_seq is burnt, not reused
                seen.append(slot.pub_seq)
            continue
        index, pub_seq = publish(ring, b"y")
        seen.append(pub_seq)
        consumer.ack(index, pub_seq, 1)
    assert len(set(seen)) == len(seen) and seen == sorted(seen)


def test_discard_frees_only_the_named_ready_publication(ring: ProducerRing) -> None:
    index, pub_seq = publish(ring, b"z")
    assert not ring.discard(index, pub_seq + 1)
    assert ring.discard(index, pub_seq)
    assert not ring.discard(index, pub_seq)
    assert states(ring) == [SlotState.FREE] * 3
    with pytest.raises(RingError, match="outside"):
        ring.discard(7, 1)


def test_ready_lists_unacked_slots_oldest_first_with_meta(ring: ProducerRing, consumer: ConsumerRing) -> None:
    ring.set_consumer_epoch(1)
    published = [publish(ring, b"a", seq=s) for s in (10, 11, 12)]
    consumer.ack(*published[1], 1)
    ready = ring.ready()
    assert [(s.index, s.pub_seq) for s in ready] == [published[0], published[2]]
    assert [s.meta for s in ready] == [{"seq": 10}, {"seq": 12}]


def test_consumer_epoch_only_moves_forward(ring: ProducerRing, consumer: ConsumerRing) -> None:
    ring.set_consumer_epoch(3)
    ring.set_consumer_epoch(3)
    with pytest.raises(RingError, match="backwards"):
        ring.set_consumer_epoch(2)
    with pytest.raises(RingError):
        ring.set_consumer_epoch(1 << 24)
    assert consumer.consumer_epoch == 3


def test_new_consumer_epoch_unacks_slots_acked_by_the_old_consumer(ring: ProducerRing, consumer: ConsumerRing) -> None:
    ring.set_consumer_epoch(1)
    index, pub_seq = publish(ring, b"q")
    consumer.ack(index, pub_seq, 1)
    ring.set_consumer_epoch(2)  # without reclaim(): the server re-decides from the new have set
    assert [(s.index, s.pub_seq) for s in ring.ready()] == [(index, pub_seq)]


def test_read_refuses_writing_freed_and_reused_slots(ring: ProducerRing, consumer: ConsumerRing) -> None:
    with ring.acquire(timeout=1) as slot:
        slot.tensor("data", torch.uint8, (4,))
        with pytest.raises(StaleSlot, match="WRITING"):
            consumer.read(slot.index, slot.pub_seq)
        slot.publish({})
    view = consumer.read(slot.index, slot.pub_seq)
    assert view.still_valid()
    ring.discard(slot.index, slot.pub_seq)
    assert not view.still_valid()
    with pytest.raises(StaleSlot, match="FREE"):
        consumer.read(slot.index, slot.pub_seq)
    for bad in ((-1, 1), (3, 1), (0, 0), ("0", 1)):
        with pytest.raises(StaleSlot, match="outside"):
            consumer.read(*bad)


def test_corrupt_table_words_are_stale_not_a_crash(ring: ProducerRing, consumer: ConsumerRing) -> None:
    index, pub_seq = publish(ring, b"t" * 64, seq=1)
    for word, value in ((ring_mod._H.TABLE_LEN, 0), (ring_mod._H.TABLE_LEN, 1 << 40),
                        (ring_mod._H.TABLE_OFFSET, ring.slot_size - 8), (ring_mod._H.TABLE_CRC, 12345)):
        hw = ring._hw(index, word)
        saved = ring._words.load(hw)
        ring._words.store(hw, value)
        with pytest.raises(StaleSlot):
            consumer.read(index, pub_seq)
        ring._words.store(hw, saved)
    assert consumer.read(index, pub_seq).meta == {"seq": 1}


# -- files, roles and liveness -------------------------------------------------------------------
def test_second_live_producer_of_a_worker_gets_lock_held_naming_the_pid(ring: ProducerRing, shm_dir: str,
                                                                        ring_name: str) -> None:
    with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
        ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
    other = ProducerRing.create(shm_dir, ring_name, 1, slot_count=2, slot_size=MiB, cuda_register="off")
    other.close()
    assert os.path.exists(ring.path)


def test_new_producer_replaces_a_dead_producers_file_and_touches_nothing_else(shm_dir: str, ring_name: str) -> None:
    old = ProducerRing.create(shm_dir, ring_name, 1, slot_count=2, slot_size=MiB, cuda_register="off")
    index, pub_seq = publish(old, b"old data")
    reader = ConsumerRing.attach(old.path, cuda_register="off")
    old.close(unlink=False)  # what a SIGKILL leaves: the file, no lock
    bystanders = [f"{ring_name}.w10.5", f"{ring_name}.w1.notanepoch", f"{ring_name}x.w1.5", f"other.w1.5"]
    for name in bystanders:
        open(os.path.join(shm_dir, name), "w").close()
    new = ProducerRing.create(shm_dir, ring_name, 1, slot_count=2, slot_size=MiB, cuda_register="off")
    try:
        assert new.producer_epoch > old.producer_epoch
        assert new.path == ring_path(shm_dir, ring_name, 1, new.producer_epoch)
        assert not os.path.exists(old.path)
        assert all(os.path.exists(os.path.join(shm_dir, n)) for n in bystanders)
        assert bytes(reader.read(index, pub_seq).tensors["data"].numpy()) == b"old data"  # mapping still valid
        assert not reader.producer_alive(max_heartbeat_age=0.0)
    finally:
        reader.close()
        new.close()


def test_epochs_of_successive_producers_increase_even_if_the_clock_is_behind(shm_dir: str, ring_name: str) -> None:
    future = ring_path(shm_dir, ring_name, 0, time.time_ns() + 10**12)
    open(future, "w").close()
    r = ProducerRing.create(shm_dir, ring_name, 0, slot_count=1, slot_size=MiB, cuda_register="off")
    assert r.producer_epoch == int(future.rsplit(".", 1)[1]) + 1
    r.close()


def test_attach_refuses_files_that_are_not_readable_rings(ring: ProducerRing, shm_dir: str) -> None:
    with pytest.raises(RingError, match="no ring at"):
        ConsumerRing.attach(os.path.join(shm_dir, "missing"))
    small = os.path.join(shm_dir, "small")
    with open(small, "wb") as f:
        f.write(b"\0" * 100)
    with pytest.raises(RingError, match="too small"):
        ConsumerRing.attach(small)
    junk = os.path.join(shm_dir, "junk")
    with open(junk, "wb") as f:
        f.write(b"\1" * 8192)
    with pytest.raises(RingError, match="not a dfpipe ring"):
        ConsumerRing.attach(junk)
    copy = os.path.join(shm_dir, "copy")
    with open(ring.path, "rb") as src, open(copy, "wb") as dst:
        dst.write(src.read())
    with open(copy, "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(8, "little"))
    with pytest.raises(RingError, match="layout version 99"):
        ConsumerRing.attach(copy)
    with open(copy, "r+b") as f:
        f.seek(8)
        f.write(ring_mod.LAYOUT_VERSION.to_bytes(8, "little"))
        f.truncate(os.path.getsize(copy) - SLOT_ALIGN)
    with pytest.raises(RingError, match="truncated"):
        ConsumerRing.attach(copy)


@pytest.mark.parametrize("kwargs, message", [
    ({"slot_count": 0}, "slot_count"), ({"slot_count": 10**6}, "slot_count"), ({"slot_size": 0}, "slot_size"),
    ({"slot_size": -5}, "slot_size"), ({"worker": -1}, "worker"), ({"name": "a/b"}, "ring name"),
    ({"cuda_register": "maybe"}, "cuda_register"), ({"shm_dir": "/nonexistent/dir"}, "does not exist"),
])
def test_create_refuses_nonsense_arguments(shm_dir: str, ring_name: str, kwargs: dict, message: str) -> None:
    args = dict(shm_dir=shm_dir, name=ring_name, worker=0, slot_count=2, slot_size=MiB, cuda_register="off")
    args.update(kwargs)
    with pytest.raises(RingError, match=message):
        ProducerRing.create(**args)
    assert not [n for n in os.listdir(shm_dir) if not n.endswith(".lock")]


def test_ring_refuses_to_run_where_store_ordering_is_not_tso(shm_dir: str, ring_name: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with pytest.raises(RingError, match="TSO"):
        ProducerRing.create(shm_dir, ring_name, 0, slot_count=1, slot_size=MiB, cuda_register="off")


@contextlib.contextmanager
def _small_shm(tmp_path: Any, size: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A folder with `size` of room: a real tmpfs when root may mount one; otherwise the
    allocation itself reports ENOSPC (`monkeypatch.undo()` then gives the room back)."""
    small = os.path.join(str(tmp_path), "small-shm")
    os.mkdir(small)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", small], capture_output=True).returncode == 0
    if not mounted:
        monkeypatch.setattr(ring_mod, "_check_space", lambda *a: None)
        monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    try:
        yield small
    finally:
        if mounted:
            subprocess.run(["umount", small], check=True)


def test_too_small_shm_dir_raises_ring_space_error_and_leaves_no_file(
        tmp_path: pytest.TempPathFactory, ring_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with _small_shm(tmp_path, "1m", monkeypatch) as small:
        with pytest.raises(RingSpaceError, match=r"needs \d+ bytes .* \d+ bytes are available"):
            ProducerRing.create(small, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
        assert os.listdir(small) == [], "a failed creation leaves no ring file and no lock file"
        assert not RoleLock.anyone_holds(small, f"{ring_name}.w0", "producer")


def test_a_ring_of_long_document_slots_that_shm_cannot_hold_says_what_it_needs(
        tmp_path: pytest.TempPathFactory, ring_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.batch import slot_tensor_specs

    # the worker's slot for 32,768-token batches at the 27B shape (5 planes of 5,120, bf16): the
    # planes, the token and document tables, the table reserve
    slot = slot_bytes(slot_tensor_specs(32768, 32768, 5, 5120, torch.bfloat16))
    planes = 5 * 32768 * 5120 * 2
    assert planes < slot < planes + 2 * MiB
    aligned = -(-slot // SLOT_ALIGN) * SLOT_ALIGN        # each slot starts 2 MiB-aligned
    with _small_shm(tmp_path, "1m", monkeypatch) as small:
        with pytest.raises(RingSpaceError, match=rf"needs \d+ bytes \(6 slots x {aligned} bytes .* Enlarge it"):
            ProducerRing.create(small, ring_name, 0, slot_count=6, slot_size=slot, cuda_register="off")
        assert os.listdir(small) == []


def test_enospc_from_posix_fallocate_is_a_space_error_with_no_file_left(
        shm_dir: str, ring_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(RingSpaceError, match="No space left"):
        ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
    assert os.listdir(shm_dir) == [], "a failed creation leaves no ring file and no lock file"
    monkeypatch.undo()
    ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off").close()


def test_a_role_taken_ahead_is_refused_to_a_second_producer_and_a_failed_create_gives_it_up(
        tmp_path: pytest.TempPathFactory, ring_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real 8 MiB tmpfs when root may mount one (room for a 1-slot ring, not a 4-slot one);
    # otherwise the allocation itself reports ENOSPC
    with _small_shm(tmp_path, "8m", monkeypatch) as small:
        role = ProducerRing.take_role(small, ring_name, 0)
        assert RoleLock.anyone_holds(small, f"{ring_name}.w0", "producer")
        code = ("import sys; from common.ring import ProducerRing; "
                f"ProducerRing.take_role({small!r}, {ring_name!r}, 0)")
        second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
        assert second.returncode != 0 and f"held by pid {os.getpid()}" in second.stderr, second.stderr
        with pytest.raises(RingSpaceError):
            ProducerRing.create(small, ring_name, 0, slot_count=4, slot_size=MiB, cuda_register="off", role=role)
        assert not role.held and os.listdir(small) == [], "the failed creation gave up the role and left nothing"
        monkeypatch.undo()
        ProducerRing.create(small, ring_name, 0, slot_count=1, slot_size=MiB, cuda_register="off").close()
        assert os.listdir(small) == []


def test_a_failure_after_the_file_is_made_leaves_no_ring_and_no_lock_file(
        shm_dir: str, ring_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_register(self: ProducerRing, mode: str) -> None:
        raise RingError("injected: registration failed")
    monkeypatch.setattr(ProducerRing, "_register", broken_register)
    with pytest.raises(RingError, match="injected"):
        ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
    assert os.listdir(shm_dir) == []
    assert not RoleLock.anyone_holds(shm_dir, f"{ring_name}.w0", "producer")


def test_role_lock_is_released_by_the_kernel_when_its_holder_is_killed(shm_dir: str) -> None:
    code = ("import sys, time; from common.liveness import RoleLock; "
            f"RoleLock({shm_dir!r}, 'svc', 'consumer').acquire(); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert proc.stdout.readline().strip() == "held"
        assert RoleLock.anyone_holds(shm_dir, "svc", "consumer")
        with pytest.raises(LockHeld, match=f"pid {proc.pid} \\(running"):
            RoleLock(shm_dir, "svc", "consumer").acquire(timeout=0.1)
        start = process_start_time(proc.pid)
        assert start is not None and pid_alive(proc.pid, start)
        proc.kill()
        proc.wait()
        assert not pid_alive(proc.pid, start)
        assert not RoleLock.anyone_holds(shm_dir, "svc", "consumer")
        lock = RoleLock(shm_dir, "svc", "consumer")
        lock.acquire()
        lock.release()
    finally:
        proc.kill()
        proc.stdout.close()


def test_pid_alive_rejects_a_reused_pid_and_a_zombie() -> None:
    me = os.getpid()
    start = process_start_time(me)
    assert start is not None and pid_alive(me, start)
    assert not pid_alive(me, start + 1)          # same pid, another process
    assert process_start_time(2**22 + 12345) is None
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    child_start = process_start_time(proc.pid)  # Popen.poll() would reap it, so only /proc is read
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _read_stat(proc.pid)[0] != "Z":
        time.sleep(0.01)
    assert child_start is not None and not pid_alive(proc.pid, child_start)  # exited, not yet reaped
    proc.wait()


def test_probe_disturbs_neither_a_holder_nor_a_starter(shm_dir: str) -> None:
    assert not RoleLock.anyone_holds(shm_dir, "svc", "trainer")
    assert not os.path.exists(os.path.join(shm_dir, "svc.trainer.lock"))  # a probe creates nothing
    ranks = [RoleLock(shm_dir, "svc", "trainer", shared=True) for _ in range(2)]
    for r in ranks:
        r.acquire()
    assert RoleLock.anyone_holds(shm_dir, "svc", "trainer")
    ranks[0].release()
    assert RoleLock.anyone_holds(shm_dir, "svc", "trainer")
    ranks[1].release()
    # a probe caught in the middle (it holds the lock for the moment between two system calls):
    # a starter that asked for no waiting at all still gets the role once the probe lets go
    path = os.path.join(shm_dir, "svc.producer.lock")
    open(path, "w").close()
    probe_fd = os.open(path, os.O_RDONLY)
    fcntl.flock(probe_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    threading.Timer(0.01, os.close, (probe_fd,)).start()
    lock = RoleLock(shm_dir, "svc", "producer")
    lock.acquire(timeout=0)
    lock.release()


def test_producer_alive_follows_heartbeat_and_process(ring: ProducerRing, consumer: ConsumerRing) -> None:
    assert consumer.producer_alive()
    time.sleep(0.05)
    assert not consumer.producer_alive(max_heartbeat_age=0.01)
    ring.heartbeat()
    assert consumer.producer_alive(max_heartbeat_age=1.0)
    pidw = ring_mod._C.PRODUCER_START
    ring._words.store(pidw, ring._words.load(pidw) + 1)  # as if the pid now belonged to another process
    assert not consumer.producer_alive()


# -- waiting for a free slot ---------------------------------------------------------------------
def test_full_ring_producer_sleeps_without_burning_cpu_and_wakes_when_a_slot_frees(
        ring: ProducerRing, consumer: ConsumerRing) -> None:
    ring.set_consumer_epoch(1)
    held = [publish(ring, b"full") for _ in range(3)]
    with pytest.raises(TimeoutError, match="no free slot"):
        with ring.acquire(timeout=0.05):
            pass
    got: list[tuple[int, float]] = []

    def worker() -> None:
        with ring.acquire(timeout=20) as slot:
            got.append((slot.index, time.monotonic()))
            slot.publish({})  # keeps the ring full for the next round

    for acked, wake in ((held[1], True), (held[0], False)):
        thread = threading.Thread(target=worker)
        cpu0, t0 = time.process_time(), time.monotonic()
        thread.start()
        time.sleep(1.0)
        blocked_cpu = time.process_time() - cpu0
        assert not got and thread.is_alive()
        assert blocked_cpu < 0.2, f"blocked producer used {blocked_cpu:.3f} s CPU in {time.monotonic() - t0:.2f} s"
        consumer.ack(*acked, 1)
        freed_at = time.monotonic()
        if wake:
            ring.wake()
        thread.join(timeout=20)
        assert got and got[-1][0] == acked[0]
        # bounded, not a benchmark: woken it returns at once, otherwise within the back-off cap;
        # the bound leaves room for a loaded CI machine
        assert got[-1][1] - freed_at < 1.0
        got.clear()


def test_backoff_wait_grows_to_its_cap_and_wake_cuts_it_short() -> None:
    b = ring_mod.Backoff(first=0.001, cap=0.004)
    for _ in range(5):
        b.arm()
        assert b.wait()
    assert b._delay == 0.004
    b.arm()
    b.wake()
    t0 = time.monotonic()
    assert b.wait()
    assert time.monotonic() - t0 < 0.004 and b._delay == 0.001
    assert not b.wait(deadline=time.monotonic() - 1)


# -- CUDA registration ---------------------------------------------------------------------------
def test_chunks_cut_on_slot_borders_and_never_exceed_the_limit() -> None:
    GiB = 1 << 30
    borders = [2 * MiB + i * 20 * GiB for i in range(10)]
    pieces = chunk_ranges(2 * MiB + 10 * 20 * GiB, borders)
    assert all(length <= 64 * GiB for _, length in pieces)
    assert all(off in borders or off == 0 for off, _ in pieces)
    assert sum(length for _, length in pieces) == 2 * MiB + 200 * GiB
    huge = chunk_ranges(150 * GiB, [0], limit=64 * GiB)  # one 150 GiB slot: cut inside it
    assert [length for _, length in huge] == [64 * GiB, 64 * GiB, 22 * GiB]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_cuda_register_modes_without_cuda(shm_dir: str, ring_name: str) -> None:
    with pytest.raises(CudaRegisterError, match="not available"):
        register_mapping(0, 4096, "require")
    assert register_mapping(0, 4096, "auto") is None
    with pytest.raises(RingError, match="require"):
        ProducerRing.create(shm_dir, ring_name, 0, slot_count=1, slot_size=MiB, cuda_register="require")
    assert os.listdir(shm_dir) == []  # a failed create leaves nothing behind
    ProducerRing.create(shm_dir, ring_name, 0, slot_count=1, slot_size=MiB, cuda_register="auto").close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_registered_ring_moves_slots_to_and_from_the_gpu(shm_dir: str, ring_name: str) -> None:
    producer = ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=8 * MiB, cuda_register="require")
    consumer = ConsumerRing.attach(producer.path, cuda_register="require")
    try:
        producer.set_consumer_epoch(1)
        source = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
        with producer.acquire(timeout=1) as slot:
            dst = slot.tensor("hidden", torch.bfloat16, tuple(source.shape))
            dst.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            slot.publish({"seq": 0})
        view = consumer.read(slot.index, slot.pub_seq)
        back = view.tensors["hidden"].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, source)
        consumer.ack(slot.index, slot.pub_seq, 1)
        assert producer.reclaim() == [slot.index]
    finally:
        consumer.close()
        producer.close()


def test_clean_close_leaves_no_file_and_the_role_can_be_taken_again(shm_dir: str, ring_name: str) -> None:
    import os

    from common.liveness import RoleLock
    from common.ring import ProducerRing

    ring = ProducerRing.create(shm_dir, ring_name, 0, 2, 1 << 16, cuda_register="off")
    ring.close()
    assert os.listdir(shm_dir) == []
    again = ProducerRing.create(shm_dir, ring_name, 0, 2, 1 << 16, cuda_register="off")
    try:
        with pytest.raises(Exception):
            RoleLock(shm_dir, f"{ring_name}.w0", "producer").acquire(timeout=0.1)
    finally:
        again.close()
    assert os.listdir(shm_dir) == []


def test_a_starter_waiting_on_a_lock_whose_file_gets_unlinked_locks_the_live_file(shm_dir: str) -> None:
    import threading

    from common.liveness import RoleLock

    first = RoleLock(shm_dir, "x", "producer")
    first.acquire()
    second = RoleLock(shm_dir, "x", "producer")
    got = threading.Event()
    t = threading.Thread(target=lambda: (second.acquire(timeout=5), got.set()))
    t.start()
    time.sleep(0.1)
    first.release(unlink=True)   # the waiter opened the old inode; it must notice and retry
    t.join(5)
    assert got.is_set()
    third = RoleLock(shm_dir, "x", "producer")
    with pytest.raises(Exception):
        third.acquire(timeout=0.1)  # the second holds the inode the path names now
    second.release(unlink=True)


# -- names another user made first, files removed from under a live ring ----------------------------
def test_a_lock_file_another_user_made_first_is_refused_naming_the_owner(shm_dir: str, ring_name: str) -> None:
    need_root()
    lock = os.path.join(shm_dir, f"{ring_name}.w0.producer.lock")
    with open(lock, "w"):
        pass
    os.chown(lock, STRANGER, STRANGER)
    with pytest.raises(Untrusted, match=rf"{lock} belongs to uid 65534"):
        ProducerRing.take_role(shm_dir, ring_name, 0)
    os.unlink(lock)
    os.symlink("/etc/passwd", lock)   # a link: never opened for writing
    with pytest.raises(Untrusted, match="symbolic link"):
        ProducerRing.take_role(shm_dir, ring_name, 0)


def test_a_ring_like_file_of_another_user_is_neither_removed_nor_counted_as_a_predecessor(
        shm_dir: str, ring_name: str) -> None:
    need_root()
    theirs = os.path.join(shm_dir, f"{ring_name}.w0.{10 ** 19 + 7}")
    with open(theirs, "wb") as f:
        f.write(b"not a ring")
    os.chown(theirs, STRANGER, STRANGER)
    ring = ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
    try:
        assert os.path.exists(theirs) and ring.producer_epoch < 10 ** 19
    finally:
        ring.close()
        os.unlink(theirs)


def test_a_shared_memory_folder_other_users_may_replace_names_in_is_refused(shm_dir: str, ring_name: str) -> None:
    os.chmod(shm_dir, 0o777)    # world-writable, not sticky: anyone could swap our files
    with pytest.raises(Untrusted, match="writable by other users"):
        ProducerRing.take_role(shm_dir, ring_name, 0)
    os.chmod(shm_dir, 0o1777)   # sticky, like /dev/shm itself: only a name's owner may remove it
    ProducerRing.take_role(shm_dir, ring_name, 0).release(unlink=True)


def test_a_consumer_maps_only_a_ring_of_a_trusted_user(ring: ProducerRing) -> None:
    need_root()
    os.chown(ring.path, STRANGER, STRANGER)
    with pytest.raises(RingError, match="belongs to uid 65534"):
        ConsumerRing.attach(ring.path, cuda_register="off")
    ConsumerRing.attach(ring.path, cuda_register="off", trusted=frozenset({0, STRANGER})).close()


@pytest.mark.parametrize("remove", ["ring and lock", "ring only", "lock only"])
def test_removed_files_are_noticed_and_the_renewed_ring_keeps_the_role(shm_dir: str, ring_name: str,
                                                                      remove: str) -> None:
    old = ProducerRing.create(shm_dir, ring_name, 0, slot_count=2, slot_size=MiB, cuda_register="off")
    lock = os.path.join(shm_dir, f"{ring_name}.w0.producer.lock")
    writing = old.acquire(timeout=1)
    slot = writing.__enter__()                            # a worker in the middle of a batch
    slot.tensor("data", torch.uint8, (4,)).fill_(1)
    assert old.removed_files() == []
    gone = {"ring and lock": [old.path, lock], "ring only": [old.path], "lock only": [lock]}[remove]
    for path in gone:
        os.unlink(path)
    assert old.removed_files() == gone
    new = old.renewed()
    try:
        old.retire()
        assert new.producer_epoch > old.producer_epoch and os.path.exists(new.path) and os.path.exists(lock)
        assert not os.path.exists(old.path), "an old file still there is swept with the renewal"
        assert new.removed_files() == [] and states(new) == [SlotState.FREE] * 2
        with pytest.raises(LockHeld):                     # still the one producer of that name
            ProducerRing.take_role(shm_dir, ring_name, 0)
        with pytest.raises(ring_mod.RingReplaced):        # the batch being written is dropped
            slot.publish({"seq": 0})
        writing.__exit__(None, None, None)
        with pytest.raises(ring_mod.RingReplaced):
            old.acquire(timeout=1).__enter__()
        old.close(unlink=False)
        assert os.path.exists(lock), "closing the retired ring leaves the role with the new one"
        publish(new, b"abcd", seq=0)
    finally:
        new.close()
    assert os.listdir(shm_dir) == []
