"""The shared-memory slot ring between one target worker (producer) and the trainer (consumer).

One ring file per target worker and producer lifetime, `<shm_dir>/<name>.w<worker>.<producer_epoch>`,
created O_EXCL with mode 0600, posix_fallocate'd (so a full /dev/shm is an error at start, never a
SIGBUS later) and mapped MAP_SHARED by both sides. All words are little-endian uint64::

    offset 0  ┌─ control page (4 KiB) ─ written only by the producer ─────────────────────────┐
              │ magic "DFPRING\\1" │ layout version │ slot_count │ slot_size │ header_offset  │
              │ data_offset │ file_size │ header_stride │ producer epoch │ producer pid      │
              │ producer start time │ producer pid namespace │ heartbeat (CLOCK_MONOTONIC ns) │
              │ consumer_epoch │ next_pub_seq                                                 │
    4096      ├─ slot headers: 128 B per slot, i.e. two cache lines ──────────────────────────┤
              │ slot i, line 1 (producer): stamp = pub_seq << 8 | state │ table_offset │      │
              │                            table_len │ table_crc │ payload_len                │
              │ slot i, line 2 (consumer): ack = consumer_epoch << 40 | pub_seq               │
    data_off  ├─ slot 0 data: slot_size bytes, starts 2 MiB-aligned in the file ─────────────┤
              │ tensor 0 @ 0 │ tensor 1 @ 64-aligned │ ... │ table (msgpack) │ unused         │
              ├─ slot 1 data ─────────────────────────────────────────────────────────────────┤
              │ ...                                                                           │
              └───────────────────────────────────────────────────────────────────────────────┘

The table is msgpack ``{"v": 1, "tensors": {name: [dtype, shape, offset]}, "meta": {...}}`` and
`table_crc` is crc32 over (pub_seq, table bytes), so a table can only validate for the publication
that wrote it. State and pub_seq share one word (the stamp), so they can never be read torn apart;
the ack packs (consumer_epoch, pub_seq) into one word for the same reason.

Slot states — every header word has exactly one writer process:

  1. FREE     the producer may take it. (Its stamp keeps the last pub_seq.)
  2. WRITING  the producer took it under a new pub_seq (`acquire`) and fills tensors by CPU copy
              or DMA. Consumers refuse to read it. Leaving the with-block without `publish()`
              (error, crash of the copy) turns it back to FREE; a producer killed here leaves it
              WRITING in a file the next producer unlinks.
  3. READY    `publish()` wrote the table and its checksum, then the stamp. The server announces
              (index, pub_seq) over ZeroMQ; a consumer reads it, copies it out, then acks.
  4. READY + ack == (current consumer_epoch, this pub_seq): done; `reclaim()` makes it FREE.
  5. READY + ack from an older consumer epoch, or garbage: exactly like 3. When a consumer dies
     or is fenced, the server bumps the consumer epoch; its slots stay READY, `ready()` lists them
     again for the next consumer, and its late acks free nothing, because the ack names an old
     epoch, and pub_seqs never repeat in a ring file, so no old ack can ever match a reused slot.
  Also READY -> FREE by `discard()`: the server drops a batch the consumer already has.

Ordering (see `common/atomics.py` for why plain stores suffice on x86-64):
  producer  payload (CPU copy, or DMA whose event has completed) -> table -> header words
            (table offset/len/crc, payload_len) -> stamp = READY. Taking a slot stores the stamp
            (new pub_seq, WRITING) before any payload byte, and freeing it stores FREE first too.
  consumer  load stamp (READY, pub_seq?) -> table bytes -> check crc -> load stamp again -> map
            tensors -> copy out -> `still_valid()` loads the stamp a third time -> ack.
  A consumer that saw stamp (READY, P) after its copy saw only bytes of publication P: any newer
  payload byte was stored after the stamp left (READY, P), and loads are not reordered with older
  loads. The ack is stored after the copy's loads, and loads are not reordered with later stores,
  so the producer, which reuses a slot only after seeing the ack, never overwrites bytes still
  being read. A CUDA consumer acks after the H2D copy's event has completed.

Crashes: a consumer that dies or hangs leaves its slots READY (case 5 above): nothing is lost and
nothing is freed early. A producer that dies leaves its file behind; the next producer of the same
name and worker takes the role lock, unlinks it and starts a new file under a larger producer
epoch. A consumer that still maps the old file keeps a valid mapping (unlinking never unmaps) and
learns the new path over ZeroMQ. Nobody but that next producer ever unlinks a ring file, and the
rings do not use multiprocessing.shared_memory, so its resource tracker never sees them.

Names in a shared folder: the shared-memory folder must be one only this user and root control
(/dev/shm is sticky: another user can add names but not remove or replace ours). A ring or lock
name that another user made first is never used: the producer role is refused naming that user
(`common.trust.Untrusted`), and a ring-like file of another user's is neither removed nor counted
as a predecessor. A consumer maps only a ring file of a trusted user's.

Files removed from under a live producer (an operator cleaning /dev/shm): `removed_files` says
so, `renewed` makes a new file under a larger producer epoch (taking the role again on a new lock
file if that went too), and `retire` makes the old ring refuse further slots (`RingReplaced`).
"""
from __future__ import annotations

import contextlib
import enum
import errno
import logging
import math
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import msgpack
import torch

from common.atomics import Words, ordering_problem
from common.cuda_host import MODES as CUDA_MODES
from common.cuda_host import CudaRegisterError, HostRegistration, register_mapping
from common.liveness import RoleLock, pid_alive, self_identity
from common.ring_limits import MAX_SLOT_SIZE, MAX_SLOTS
from common.trust import Untrusted, folder_problem, owner_problem, trusted_uids, who

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"DFPRING\x01", "little")
LAYOUT_VERSION = 1
TABLE_VERSION = 1
PAGE = 4096
SLOT_ALIGN = 2 << 20             # slot data starts (and so the first tensor, the DMA target)
TENSOR_ALIGN = 64                # later tensors and the table: one cache line
HEADER_STRIDE = 128              # producer line + consumer line per slot
TABLE_RESERVE = 64 << 10         # room slot_bytes() keeps for the table after the tensors
MAX_TABLE_BYTES = 1 << 20        # a consumer refuses larger tables without decoding them
MAX_TENSORS = 64
MAX_DIMS = 8
ACK_EPOCH_BITS, ACK_SEQ_BITS = 24, 40
MAX_CONSUMER_EPOCH = (1 << ACK_EPOCH_BITS) - 1
MAX_PUB_SEQ = (1 << ACK_SEQ_BITS) - 1
HEARTBEAT_STALE_S = 10.0         # ServiceConfig.lease_s default
BACKOFF_FIRST_S = 100e-6
BACKOFF_CAP_S = 0.01             # worst-case latency to notice a freed slot without wake()

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class _C:
    """Word indices in the control page."""
    MAGIC, VERSION, SLOT_COUNT, SLOT_SIZE, HEADER_OFFSET, DATA_OFFSET, FILE_SIZE, HEADER_STRIDE = range(8)
    PRODUCER_EPOCH, PRODUCER_PID, PRODUCER_START, PRODUCER_PIDNS, HEARTBEAT_NS = range(8, 13)
    CONSUMER_EPOCH, NEXT_PUB_SEQ = range(13, 15)


class _H:
    """Word indices inside one slot header (HEADER_STRIDE // 8 words)."""
    STAMP, TABLE_OFFSET, TABLE_LEN, TABLE_CRC, PAYLOAD_LEN = range(5)
    ACK = 8  # second cache line: the consumer's only word


class RingError(RuntimeError):
    """The ring cannot be created, attached or used as asked; the message says why."""


class RingSpaceError(RingError):
    """The shared-memory directory cannot hold the ring (sizes in the message)."""


class StaleSlot(RingError):
    """The slot no longer holds that publication as READY, or its table is invalid."""


class RingReplaced(RingError):
    """This ring was retired (its files were removed and a new ring replaces it): use the new one."""


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2


@dataclass(frozen=True)
class SlotInfo:
    index: int
    pub_seq: int
    state: SlotState
    acked: bool               # ack == (current consumer epoch, pub_seq)
    meta: dict | None         # the publisher's meta, READY slots only


class TensorEntry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int               # from the start of the slot's data
    nbytes: int


def ring_path(shm_dir: str, name: str, worker: int, producer_epoch: int) -> str:
    return os.path.join(shm_dir, f"{name}.w{worker}.{producer_epoch}")


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    if dtype not in DTYPE_NAMES:
        raise RingError(f"dtype {dtype} is not allowed in a slot (allowed: {', '.join(DTYPES)})")
    if len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
        raise RingError(f"shape {shape!r}: need at most {MAX_DIMS} non-negative ints")
    return math.prod(shape) * dtype.itemsize


def _place(end: int, first: bool) -> int:
    """Offset of the next tensor: the first at the slot start (2 MiB-aligned), later ones 64 B-aligned."""
    return 0 if first else _round_up(end, TENSOR_ALIGN)


def slot_bytes(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    """Data bytes one slot needs for these tensors, in this order, plus the table reserve."""
    end = 0
    for i, (_, dtype, shape) in enumerate(specs):
        end = _place(end, i == 0) + _tensor_nbytes(dtype, tuple(shape))
    return _round_up(end, TENSOR_ALIGN) + TABLE_RESERVE


def pack_ack(consumer_epoch: int, pub_seq: int) -> int:
    if not 0 < consumer_epoch <= MAX_CONSUMER_EPOCH:
        raise RingError(f"consumer epoch {consumer_epoch} outside 1..{MAX_CONSUMER_EPOCH}")
    if not 0 < pub_seq <= MAX_PUB_SEQ:
        raise RingError(f"pub_seq {pub_seq} outside 1..{MAX_PUB_SEQ}")
    return consumer_epoch << ACK_SEQ_BITS | pub_seq


def _stamp(pub_seq: int, state: SlotState) -> int:
    return pub_seq << 8 | int(state)


def _table_crc(pub_seq: int, blob: bytes) -> int:
    return zlib.crc32(blob, zlib.crc32(pub_seq.to_bytes(8, "little")))


def encode_table(entries: dict[str, TensorEntry], meta: dict) -> bytes:
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise RingError("slot meta must be a dict with str keys")
    table = {"v": TABLE_VERSION,
             "tensors": {n: [DTYPE_NAMES[e.dtype], list(e.shape), e.offset] for n, e in entries.items()},
             "meta": meta}
    try:
        return msgpack.packb(table, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise RingError(f"slot meta is not msgpack-serializable: {e}") from None


def _is_int(x: object) -> bool:
    return type(x) is int


def decode_table(blob: bytes, payload_limit: int) -> tuple[dict[str, TensorEntry], dict]:
    """Parse and validate a slot table; StaleSlot (never anything else) when it is not valid.

    payload_limit: bytes of the slot that tensors may occupy (the table's own offset).
    """
    def bad(why: str) -> StaleSlot:
        return StaleSlot(f"invalid slot table: {why}")

    if len(blob) > MAX_TABLE_BYTES:
        raise bad(f"{len(blob)} bytes > {MAX_TABLE_BYTES}")
    try:
        table = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # untrusted bytes: msgpack raises many types; all mean "not a table"
        raise bad(f"not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(table, dict) or set(table) != {"v", "tensors", "meta"}:
        raise bad("expected keys v, tensors, meta")
    if table["v"] != TABLE_VERSION or not _is_int(table["v"]):
        raise bad(f"table version {table['v']!r}, this build reads {TABLE_VERSION}")
    tensors, meta = table["tensors"], table["meta"]
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise bad("meta must be a map with str keys")
    if not isinstance(tensors, dict) or len(tensors) > MAX_TENSORS:
        raise bad(f"tensors must be a map of at most {MAX_TENSORS} entries")
    entries: dict[str, TensorEntry] = {}
    for name, spec in tensors.items():
        if not isinstance(name, str) or not name:
            raise bad(f"tensor name {name!r}")
        if not isinstance(spec, list) or len(spec) != 3:
            raise bad(f"{name}: expected [dtype, shape, offset]")
        dtype_name, shape, offset = spec
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise bad(f"{name}: dtype {dtype_name!r} not in {sorted(DTYPES)}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"{name}: shape {shape!r}")
        if not _is_int(offset) or offset < 0 or offset % TENSOR_ALIGN:
            raise bad(f"{name}: offset {offset!r} must be a non-negative multiple of {TENSOR_ALIGN}")
        dtype = DTYPES[dtype_name]
        nbytes = _tensor_nbytes(dtype, tuple(shape))
        if offset + nbytes > payload_limit:
            raise bad(f"{name}: bytes [{offset}, {offset + nbytes}) run past the payload ({payload_limit})")
        entries[name] = TensorEntry(dtype, tuple(shape), offset, nbytes)
    spans = sorted((e.offset, e.offset + e.nbytes, n) for n, e in entries.items() if e.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise bad(f"tensors {a} and {b} overlap")
    return entries, meta


class Backoff:
    """Idle waiting for a condition another thread or process makes true, without a busy core.

    Waits BACKOFF_FIRST_S, doubling up to `cap`, so a condition changed by another process is
    seen at most `cap` late; `wake()` from another thread of this process ends the current wait at
    once. Call `arm()` before checking the condition, so a wake() that lands between the check
    and the wait is not lost.
    """

    def __init__(self, first: float = BACKOFF_FIRST_S, cap: float = BACKOFF_CAP_S) -> None:
        self.first, self.cap = first, cap
        self._delay = first
        self._event = threading.Event()

    def reset(self) -> None:
        self._delay = self.first

    def arm(self) -> None:
        self._event.clear()

    def wait(self, deadline: float | None = None) -> bool:
        """Sleep one back-off step (less if woken); False once `deadline` (monotonic) has passed."""
        delay = self._delay
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            delay = min(delay, left)
        self._delay = self.first if self._event.wait(delay) else min(self._delay * 2, self.cap)
        return True

    def wake(self) -> None:
        self._event.set()


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _require_tso() -> None:
    if problem := ordering_problem():
        raise RingError(problem)


def _layout(slot_count: int, slot_size: int) -> tuple[int, int]:
    """(data_offset, file_size) for this many slots of this (2 MiB-multiple) size."""
    headers_end = PAGE + _round_up(slot_count * HEADER_STRIDE, PAGE)
    data_offset = _round_up(headers_end, SLOT_ALIGN)
    return data_offset, data_offset + slot_count * slot_size


_Ring = TypeVar("_Ring", bound="_RingMap")


class _RingMap:
    """One process's mapping of a ring file: words, header access, tensor views, CUDA registration."""

    # A READY slot whose table does not validate: corruption when the producer looks (it holds its
    # lock, nothing moves), an ordinary race when a consumer takes a snapshot.
    _bad_table_log_level = logging.DEBUG

    def __init__(self, path: str, mm: mmap.mmap, slot_count: int, slot_size: int, data_offset: int) -> None:
        self.path = path
        self.slot_count = slot_count
        self.slot_size = slot_size
        self._data_offset = data_offset
        self._mm = mm
        self._words = Words(mm, 0, data_offset // 8)
        # Zero-copy view of the whole file. Through a memoryview, because torch.frombuffer keeps
        # only a reference to the object it is given and releases the buffer: given the mmap
        # itself, mmap.close() would succeed under live slot tensors. The memoryview holds a
        # buffer export for as long as any tensor shares this storage, so close() cannot unmap it.
        self._bytes = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
        self._registration: HostRegistration | None = None
        self._closed = False

    def _register(self, mode: str) -> None:
        borders = [self._data_offset + i * self.slot_size for i in range(self.slot_count)]
        try:
            self._registration = register_mapping(self._bytes.data_ptr(), len(self._mm), mode, borders, self.path)
        except CudaRegisterError as e:
            raise RingError(str(e)) from None

    # -- header words ---------------------------------------------------------------------
    def _hw(self, index: int, word: int) -> int:
        return (PAGE + index * HEADER_STRIDE) // 8 + word

    def _load_stamp(self, index: int) -> int:
        return self._words.load(self._hw(index, _H.STAMP))

    def _state_of(self, stamp: int) -> SlotState | None:
        try:
            return SlotState(stamp & 0xFF)
        except ValueError:
            return None

    def _slot_start(self, index: int) -> int:
        return self._data_offset + index * self.slot_size

    def _check_index(self, index: int, exc: type[RingError]) -> None:
        if not _is_int(index) or not 0 <= index < self.slot_count:
            raise exc(f"slot index {index!r} outside 0..{self.slot_count - 1} of {self.path}")

    def _view(self, start: int, entry: TensorEntry) -> torch.Tensor:
        flat = self._bytes[start + entry.offset:start + entry.offset + entry.nbytes]
        return flat.view(entry.dtype).view(entry.shape)

    def _check_open(self) -> None:
        if self._closed:
            raise RingError(f"{self.path}: ring is closed")

    @property
    def consumer_epoch(self) -> int:
        self._check_open()
        return self._words.load(_C.CONSUMER_EPOCH)

    def _read_table(self, index: int, pub_seq: int) -> tuple[dict[str, TensorEntry], dict]:
        """The validated table of publication `pub_seq` in slot `index` (StaleSlot otherwise)."""
        want = _stamp(pub_seq, SlotState.READY)
        got = self._load_stamp(index)
        if got != want:
            state = self._state_of(got)
            raise StaleSlot(f"slot {index} is {state.name if state is not None else f'state {got & 0xFF}'} "
                            f"with pub_seq {got >> 8}, not READY with pub_seq {pub_seq}")
        offset = self._words.load(self._hw(index, _H.TABLE_OFFSET))
        length = self._words.load(self._hw(index, _H.TABLE_LEN))
        crc = self._words.load(self._hw(index, _H.TABLE_CRC))
        if not (0 < length <= MAX_TABLE_BYTES and offset % TENSOR_ALIGN == 0 and offset + length <= self.slot_size):
            raise StaleSlot(f"slot {index}: table at [{offset}, +{length}) is outside the slot")
        start = self._slot_start(index) + offset
        blob = self._mm[start:start + length]
        if _table_crc(pub_seq, blob) != crc:
            raise StaleSlot(f"slot {index}: table checksum mismatch for pub_seq {pub_seq}")
        entries, meta = decode_table(blob, offset)
        if self._load_stamp(index) != want:
            raise StaleSlot(f"slot {index} changed while its table was read (pub_seq {pub_seq})")
        return entries, meta

    def _slot_info(self, index: int, epoch: int) -> SlotInfo:
        stamp = self._load_stamp(index)
        pub_seq, state = stamp >> 8, self._state_of(stamp)
        if state is None:
            raise RingError(f"slot {index} of {self.path} has an invalid state word {stamp:#x}")
        ack = self._words.load(self._hw(index, _H.ACK))
        acked = epoch > 0 and pub_seq > 0 and ack == pack_ack(epoch, pub_seq)
        meta = None
        if state is SlotState.READY:
            try:
                meta = self._read_table(index, pub_seq)[1]
            except StaleSlot as e:
                log.log(self._bad_table_log_level, "%s: %s", self.path, e)
        return SlotInfo(index, pub_seq, state, acked, meta)

    def __enter__(self: _Ring) -> _Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()   # the producer's or the consumer's own

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, slots={self.slot_count}x{self.slot_size})"

    def _unmap(self) -> None:
        """Unregister from CUDA, then unmap (unless tensor views still use the mapping)."""
        if self._closed:
            return
        self._closed = True
        if self._registration is not None:
            self._registration.unregister()
            self._registration = None
        self._words.release()
        self._bytes = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:
            # Slot tensors handed out earlier still point into the mapping; unmapping now would
            # turn them into wild pointers. The mapping goes away with the last of them.
            log.warning("%s: slot tensors still alive; the mapping is released when they are", self.path)


class ProducerRing(_RingMap):
    """The producer side: owns the file, the control page and every header word except acks.

    Thread-safe for the two threads of a target worker: the worker thread runs
    ``with ring.acquire() as slot: ...; slot.publish(meta)`` (one acquiring thread per ring); the
    main thread calls reclaim(), ready(), discard(), set_consumer_epoch(), heartbeat() and wake().
    """

    _bad_table_log_level = logging.WARNING

    def __init__(self, path: str, mm: mmap.mmap, worker: int, slot_count: int, slot_size: int,
                 data_offset: int, producer_epoch: int, lock: RoleLock, name: str, cuda_register: str) -> None:
        super().__init__(path, mm, slot_count, slot_size, data_offset)
        self.worker = worker
        self.name = name
        self.producer_epoch = producer_epoch
        self._cuda_register = cuda_register
        self._role_lock: RoleLock | None = lock   # None once handed to the ring that renewed this one
        self._inode = os.stat(path).st_ino
        self._retired = False
        self._lock = threading.Lock()  # producer-side transitions between worker and main thread
        self._waiter = Backoff()
        pid, start = self_identity()
        w = self._words
        for word, value in ((_C.VERSION, LAYOUT_VERSION), (_C.SLOT_COUNT, slot_count), (_C.SLOT_SIZE, slot_size),
                            (_C.HEADER_OFFSET, PAGE), (_C.DATA_OFFSET, data_offset), (_C.FILE_SIZE, len(mm)),
                            (_C.HEADER_STRIDE, HEADER_STRIDE), (_C.PRODUCER_EPOCH, producer_epoch),
                            (_C.PRODUCER_PID, pid), (_C.PRODUCER_START, start),
                            (_C.PRODUCER_PIDNS, _pid_namespace()), (_C.CONSUMER_EPOCH, 0), (_C.NEXT_PUB_SEQ, 1)):
            w.store(word, value)
        self.heartbeat()
        w.store(_C.MAGIC, MAGIC)  # last: a half-initialised file never looks like a ring

    @staticmethod
    def take_role(shm_dir: str, name: str, worker: int) -> RoleLock:
        """The producer role for (name, worker), held, or LockHeld naming the live producer that has
        it. A producer that needs seconds or minutes before it knows its slot size (a target model
        to load) takes it first and hands it to `create`, so a second one is refused at once."""
        if not os.path.isdir(shm_dir):
            raise RingError(f"shared-memory directory {shm_dir} does not exist (is /dev/shm mounted?)")
        if problem := folder_problem(shm_dir, trusted_uids()):
            raise Untrusted(f"the shared-memory folder: {problem}")
        lock = RoleLock(shm_dir, f"{name}.w{worker}", "producer")
        lock.acquire()   # Untrusted when another user made the lock file first
        return lock

    @staticmethod
    def role_held(shm_dir: str, name: str, worker: int) -> bool:
        """Whether a live process holds the producer role for (name, worker): a target server for
        that ring runs (it takes the role first thing and gives it up last). A probe: it takes
        nothing from the holder (RoleLock.anyone_holds)."""
        try:
            return RoleLock.anyone_holds(shm_dir, f"{name}.w{worker}", "producer")
        except PermissionError:   # another user's lock file: its ring exists, so take its server as running
            return True

    @classmethod
    def create(cls, shm_dir: str, name: str, worker: int, slot_count: int, slot_size: int,
               cuda_register: str = "auto", role: RoleLock | None = None) -> "ProducerRing":
        """Take the producer role for (name, worker) (or use `role`, from `take_role`), remove its
        dead predecessor's file, create a new one. The ring owns the role from here on: `close`
        gives it up, and so does a failed creation, which leaves nothing behind (no ring file, no
        lock file).

        slot_size is rounded up to a multiple of 2 MiB (the `slot_size` attribute is the result).
        Raises LockHeld if a live producer has the role, RingSpaceError if the directory is too
        small, RingError for anything else that is wrong.
        """
        try:
            return cls._create(shm_dir, name, worker, slot_count, slot_size, cuda_register, role)
        except BaseException:
            if role is not None:
                role.release(unlink=True)
            raise

    @classmethod
    def _create(cls, shm_dir: str, name: str, worker: int, slot_count: int, slot_size: int,
                cuda_register: str, role: RoleLock | None) -> "ProducerRing":
        _require_tso()
        if not isinstance(name, str) or not name or "/" in name:
            raise RingError(f"ring name {name!r}: need a non-empty string without '/'")
        if not _is_int(worker) or worker < 0:
            raise RingError(f"worker {worker!r}: need an int >= 0")
        if not _is_int(slot_count) or not 1 <= slot_count <= MAX_SLOTS:
            raise RingError(f"slot_count {slot_count!r}: need an int in 1..{MAX_SLOTS}")
        if not _is_int(slot_size) or not 0 < slot_size <= MAX_SLOT_SIZE:
            raise RingError(f"slot_size {slot_size!r}: need an int in 1..{MAX_SLOT_SIZE} bytes")
        if cuda_register not in CUDA_MODES:
            raise RingError(f"cuda_register {cuda_register!r}: one of {CUDA_MODES}")
        if not os.path.isdir(shm_dir):
            raise RingError(f"shared-memory directory {shm_dir} does not exist (is /dev/shm mounted?)")
        slot_size = _round_up(slot_size, SLOT_ALIGN)
        data_offset, file_size = _layout(slot_count, slot_size)

        if role is not None and (not role.held
                                 or role.path != RoleLock(shm_dir, f"{name}.w{worker}", "producer").path):
            raise RingError(f"the producer role handed to create is not held, or is not ({shm_dir}, {name}, {worker})")
        lock = role if role is not None else ProducerRing.take_role(shm_dir, name, worker)
        path, mm = "", None
        try:
            newest = _remove_stale_rings(shm_dir, name, worker)
            epoch = max(time.time_ns(), newest + 1)
            path = ring_path(shm_dir, name, worker, epoch)
            _check_space(shm_dir, file_size, slot_count, slot_size)
            mm = _create_file(path, file_size, slot_count, slot_size)
            ring = cls(path, mm, worker, slot_count, slot_size, data_offset, epoch, lock, name, cuda_register)
            mm = None  # owned by the ring from here on
            try:
                ring._register(cuda_register)
            except BaseException:
                ring.close()
                raise
        except BaseException:
            if mm is not None:
                _close_quietly(mm)
                _unlink_quietly(path)
            lock.release(unlink=True)   # a failed start leaves no lock file behind either
            raise
        log.info("created ring %s: %d slots x %d bytes (%d bytes in all)", path, slot_count, slot_size, file_size)
        return ring

    # -- worker thread ------------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire(self, timeout: float | None = None) -> Iterator["SlotWriter"]:
        """Wait for a FREE slot (reclaiming acked ones), hold it as WRITING for the with-block.

        Leaving the block without `publish()` (including by an exception) makes the slot FREE
        again. TimeoutError if no slot frees within `timeout` seconds (None: wait forever).
        """
        writer = self._take_slot(timeout)
        try:
            yield writer
        finally:
            if not writer.published:
                self._abandon(writer)

    def _take_slot(self, timeout: float | None) -> "SlotWriter":
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiter.reset()
        while True:
            self._waiter.arm()
            with self._lock:
                self._check_open()
                self._check_current()
                self._reclaim_locked()
                for index in range(self.slot_count):
                    stamp = self._load_stamp(index)
                    if self._state_of(stamp) is SlotState.FREE:
                        pub_seq = self._words.load(_C.NEXT_PUB_SEQ)
                        if pub_seq > MAX_PUB_SEQ:
                            raise RingError(f"{self.path}: pub_seq space exhausted; restart the producer")
                        self._words.store(_C.NEXT_PUB_SEQ, pub_seq + 1)
                        self._words.store(self._hw(index, _H.STAMP), _stamp(pub_seq, SlotState.WRITING))
                        return SlotWriter(self, index, pub_seq)
            if not self._waiter.wait(deadline):
                raise TimeoutError(f"{self.path}: no free slot within {timeout} s "
                                   f"({self.slot_count} slots, none acked by consumer epoch {self.consumer_epoch})")

    def _abandon(self, writer: "SlotWriter") -> None:
        writer._finished = True
        with self._lock:
            if not self._closed and self._load_stamp(writer.index) == _stamp(writer.pub_seq, SlotState.WRITING):
                self._words.store(self._hw(writer.index, _H.STAMP), _stamp(writer.pub_seq, SlotState.FREE))
        log.debug("%s: slot %d (pub_seq %d) returned unpublished", self.path, writer.index, writer.pub_seq)

    def _write_table(self, writer: "SlotWriter", table_offset: int, blob: bytes) -> None:
        start = self._slot_start(writer.index)
        self._mm[start + table_offset:start + table_offset + len(blob)] = blob
        w = self._words
        w.store(self._hw(writer.index, _H.TABLE_OFFSET), table_offset)
        w.store(self._hw(writer.index, _H.TABLE_LEN), len(blob))
        w.store(self._hw(writer.index, _H.TABLE_CRC), _table_crc(writer.pub_seq, blob))
        w.store(self._hw(writer.index, _H.PAYLOAD_LEN), writer.payload_len)

    def _mark_ready(self, writer: "SlotWriter") -> None:
        with self._lock:
            self._check_open()
            self._check_current()   # nobody reads a retired ring: what was written there is dropped
            self._words.store(self._hw(writer.index, _H.STAMP), _stamp(writer.pub_seq, SlotState.READY))

    # -- main thread --------------------------------------------------------------------------
    def set_consumer_epoch(self, epoch: int) -> None:
        """Adopt a new consumer epoch: acks of older consumers stop freeing slots from now on.

        READY slots acked by the old consumer but not reclaimed yet count as un-acked again (the
        server decides from the new consumer's have set whether to re-deliver or discard them);
        call reclaim() first to free them instead.
        """
        if not _is_int(epoch) or not 0 < epoch <= MAX_CONSUMER_EPOCH:
            raise RingError(f"consumer epoch {epoch!r} outside 1..{MAX_CONSUMER_EPOCH}")
        with self._lock:
            current = self._words.load(_C.CONSUMER_EPOCH)
            if epoch < current:
                raise RingError(f"consumer epoch may not go backwards ({current} -> {epoch})")
            self._words.store(_C.CONSUMER_EPOCH, epoch)

    def reclaim(self) -> list[int]:
        """Free READY slots acked under the current consumer epoch; returns their indices."""
        with self._lock:
            self._check_open()
            freed = self._reclaim_locked()
        if freed:
            self.wake()
        return freed

    def _reclaim_locked(self) -> list[int]:
        epoch = self._words.load(_C.CONSUMER_EPOCH)
        if epoch == 0:
            return []
        freed = []
        for index in range(self.slot_count):
            stamp = self._load_stamp(index)
            if self._state_of(stamp) is SlotState.READY:
                pub_seq = stamp >> 8
                if self._words.load(self._hw(index, _H.ACK)) == pack_ack(epoch, pub_seq):
                    self._words.store(self._hw(index, _H.STAMP), _stamp(pub_seq, SlotState.FREE))
                    freed.append(index)
        return freed

    def discard(self, index: int, pub_seq: int) -> bool:
        """Free a READY slot without an ack (its batch is not needed); False if it is not READY with pub_seq."""
        self._check_index(index, RingError)
        with self._lock:
            self._check_open()
            if self._load_stamp(index) != _stamp(pub_seq, SlotState.READY):
                return False
            self._words.store(self._hw(index, _H.STAMP), _stamp(pub_seq, SlotState.FREE))
        self.wake()
        return True

    def ready(self) -> list[SlotInfo]:
        """READY slots not acked under the current consumer epoch, oldest pub_seq first."""
        infos = [i for i in self.slots() if i.state is SlotState.READY and not i.acked]
        return sorted(infos, key=lambda i: i.pub_seq)

    def slots(self) -> list[SlotInfo]:
        """Every slot's state, for status and tests."""
        with self._lock:
            self._check_open()
            epoch = self._words.load(_C.CONSUMER_EPOCH)
            return [self._slot_info(i, epoch) for i in range(self.slot_count)]

    def heartbeat(self) -> None:
        self._words.store(_C.HEARTBEAT_NS, time.monotonic_ns())

    # -- files removed from under it ------------------------------------------------------------
    def removed_files(self) -> list[str]:
        """This ring's file and its role's lock file, those no longer where they were (two stats)."""
        gone = []
        try:
            if os.stat(self.path).st_ino != self._inode:
                gone.append(self.path)
        except FileNotFoundError:
            gone.append(self.path)
        if self._role_lock is not None and not self._role_lock.still_linked():
            gone.append(self._role_lock.path)
        return gone

    def renewed(self) -> "ProducerRing":
        """A new ring (a new file, a larger producer epoch, all slots FREE) for this one's name and
        worker, after `removed_files`. It keeps the producer role: the same lock when its file is
        still there, else the role taken again on a new lock file (LockHeld when another producer
        took it meanwhile). Call `retire` on this one next."""
        role = self._role_lock
        shm_dir = os.path.dirname(self.path)
        if role is None or not role.still_linked():
            role = ProducerRing.take_role(shm_dir, self.name, self.worker)
        else:
            self._role_lock = None   # the new ring owns it now: closing this one must not release it
        return ProducerRing.create(shm_dir, self.name, self.worker, self.slot_count, self.slot_size,
                                   self._cuda_register, role)

    def retire(self) -> None:
        """From now on taking a slot or publishing one raises RingReplaced (the thread using the ring
        then drops that batch and closes the ring: it may still be writing into it)."""
        with self._lock:
            self._retired = True
        self.wake()

    def _check_current(self) -> None:
        if self._retired:
            raise RingReplaced(f"{self.path} was replaced by a new ring (its files had been removed)")

    def wake(self) -> None:
        """Cut short a wait in acquire() (call when an ACK message arrives)."""
        self._waiter.wake()

    def close(self, unlink: bool = True) -> None:
        """Unregister CUDA, unmap, unlink the file (unless unlink=False), give up the producer role."""
        with self._lock:
            if self._closed:
                return
            self._unmap()
        if unlink:
            _unlink_quietly(self.path)
        if self._role_lock is not None:
            self._role_lock.release(unlink=unlink)  # a clean exit leaves nothing in /dev/shm


class SlotWriter:
    """One WRITING slot: hands out zero-copy tensor views into it, then publishes it once.

    Fill the views (CPU copy, or DMA followed by waiting on its event), then publish(meta).
    The views must not be written after publish() or after the with-block ends.
    """

    def __init__(self, ring: ProducerRing, index: int, pub_seq: int) -> None:
        self.index = index
        self.pub_seq = pub_seq
        self.published = False
        self._finished = False  # published, or returned to FREE
        self._ring = ring
        self._entries: dict[str, TensorEntry] = {}
        self.payload_len = 0

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the next `shape` x `dtype` bytes of the slot (first one at the 2 MiB-aligned slot start)."""
        self._check_writable()
        self._ring._check_open()
        if not isinstance(name, str) or not name or name in self._entries:
            raise RingError(f"tensor name {name!r}: need a new non-empty name in this slot")
        if len(self._entries) >= MAX_TENSORS:
            raise RingError(f"at most {MAX_TENSORS} tensors per slot")
        shape = tuple(shape)
        nbytes = _tensor_nbytes(dtype, shape)
        offset = _place(self.payload_len, not self._entries)
        need = _round_up(offset + nbytes, TENSOR_ALIGN) + TABLE_RESERVE
        if need > self._ring.slot_size:
            raise RingError(f"tensor {name} {DTYPE_NAMES[dtype]}{list(shape)} does not fit: the slot needs "
                            f"{need} bytes with the table reserve, slots have {self._ring.slot_size} "
                            f"(size them with slot_bytes())")
        entry = TensorEntry(dtype, shape, offset, nbytes)
        self._entries[name] = entry
        self.payload_len = offset + nbytes
        return self._ring._view(self._ring._slot_start(self.index), entry)

    def publish(self, meta: dict) -> None:
        """Write the tensor table + meta and its checksum, then mark the slot READY.

        Every byte of the payload must be in place: CPU copies done, device copies' events completed.
        """
        self._check_writable()
        blob = encode_table(self._entries, meta)
        table_offset = _round_up(self.payload_len, TENSOR_ALIGN)
        try:  # never publish what every consumer would refuse (e.g. int keys deep inside meta)
            decode_table(blob, table_offset)
        except StaleSlot as e:
            raise RingError(f"slot meta would not decode on the consumer side: {e}") from None
        room = min(MAX_TABLE_BYTES, self._ring.slot_size - table_offset)
        if len(blob) > room:
            raise RingError(f"slot table of {len(blob)} bytes does not fit in the {room} bytes left (meta too large?)")
        self._ring._write_table(self, table_offset, blob)
        self._ring._mark_ready(self)
        self.published = self._finished = True

    def _check_writable(self) -> None:
        if self._finished:
            raise RingError(f"slot {self.index} (pub_seq {self.pub_seq}) was already published or returned")


class ConsumerRing(_RingMap):
    """A consumer's mapping of a ring: read announced slots, ack them. Never unlinks anything."""

    producer_epoch: int

    @classmethod
    def attach(cls, path: str, cuda_register: str = "auto", trusted: frozenset[int] | None = None) -> "ConsumerRing":
        """Map an existing ring file after checking that it is one this build can read, and that it
        belongs to a `trusted` user (default: this one and root; common.trust)."""
        _require_tso()
        if cuda_register not in CUDA_MODES:
            raise RingError(f"cuda_register {cuda_register!r}: one of {CUDA_MODES}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise RingError(f"no ring at {path} (producer gone? ask the server for the current path)") from None
        except OSError as e:
            raise RingError(f"cannot open ring {path}: {e}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid not in (trusted_uids() if trusted is None else trusted):
                raise RingError(f"{path} belongs to {who(st.st_uid)}, not to this service's user, root or one of "
                                "service.allowed_uids: not mapping it")
            size = st.st_size
            if size < PAGE:
                raise RingError(f"{path} is {size} bytes: too small to be a ring")
            mm = _map(fd, size)
        finally:
            os.close(fd)
        try:
            slot_count, slot_size, data_offset = _validate_control(path, struct.unpack_from("<16Q", mm, 0), size)
            ring = cls(path, mm, slot_count, slot_size, data_offset)
            ring.producer_epoch = ring._words.load(_C.PRODUCER_EPOCH)
        except BaseException:
            _close_quietly(mm)
            raise
        try:
            ring._register(cuda_register)
        except BaseException:
            ring.close()
            raise
        return ring

    def read(self, index: int, pub_seq: int) -> "SlotView":
        """Zero-copy view of publication `pub_seq` in slot `index`; StaleSlot unless it is READY and valid."""
        self._check_index(index, StaleSlot)
        if not _is_int(pub_seq) or not 0 < pub_seq <= MAX_PUB_SEQ:
            raise StaleSlot(f"pub_seq {pub_seq!r} outside 1..{MAX_PUB_SEQ}")
        self._check_open()
        entries, meta = self._read_table(index, pub_seq)
        start = self._slot_start(index)
        tensors = {name: self._view(start, e) for name, e in entries.items()}
        return SlotView(self, index, pub_seq, meta, tensors)

    def ack(self, index: int, pub_seq: int, consumer_epoch: int) -> None:
        """Say "copied out" for (index, pub_seq) as consumer `consumer_epoch`.

        Call only after the copy finished (for a device copy: after its event completed). The
        producer frees the slot only if the epoch is still current and the slot still holds pub_seq.
        """
        self._check_index(index, RingError)
        self._check_open()
        self._words.store(self._hw(index, _H.ACK), pack_ack(consumer_epoch, pub_seq))

    def slots(self) -> list[SlotInfo]:
        """Every slot's state as seen from here (a snapshot: the producer keeps changing it)."""
        epoch = self.consumer_epoch
        return [self._slot_info(i, epoch) for i in range(self.slot_count)]

    def producer_alive(self, max_heartbeat_age: float = HEARTBEAT_STALE_S) -> bool:
        """Producer process still the one that created the file, and its heartbeat fresh.

        The pid check applies only inside the producer's pid namespace (another container's pids
        mean nothing here); the heartbeat check always applies.
        """
        w = self._words
        pidns = w.load(_C.PRODUCER_PIDNS)
        if pidns and pidns == _pid_namespace() and not pid_alive(w.load(_C.PRODUCER_PID), w.load(_C.PRODUCER_START)):
            return False
        age_ns = time.monotonic_ns() - w.load(_C.HEARTBEAT_NS)
        return age_ns <= max_heartbeat_age * 1e9

    def close(self) -> None:
        """Unmap (after unregistering from CUDA); the file is the producer's and stays."""
        self._unmap()


class SlotView:
    """One publication as the consumer sees it; `tensors` are views valid until the slot is acked."""

    def __init__(self, ring: ConsumerRing, index: int, pub_seq: int, meta: dict,
                 tensors: dict[str, torch.Tensor]) -> None:
        self.index = index
        self.pub_seq = pub_seq
        self.meta = meta
        self.tensors = tensors
        self._ring = ring

    def still_valid(self) -> bool:
        """The slot still holds this publication as READY: check after copying out, before using the copy."""
        return not self._ring._closed and self._ring._load_stamp(self.index) == _stamp(self.pub_seq, SlotState.READY)

    def __repr__(self) -> str:
        return f"SlotView(slot={self.index}, pub_seq={self.pub_seq}, tensors={list(self.tensors)})"


# -- file helpers ------------------------------------------------------------------------------
def _map(fd: int, size: int) -> mmap.mmap:
    """MAP_SHARED, read-write, page tables filled now (MAP_POPULATE) rather than by page faults
    in the middle of the first copies into or out of each slot."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _close_quietly(mm: mmap.mmap) -> None:
    """Unmap on an error path; if a view of it still exists (e.g. in a traceback), the mapping is
    released when that view is."""
    with contextlib.suppress(BufferError):
        mm.close()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_stale_rings(shm_dir: str, name: str, worker: int) -> int:
    """Unlink `<name>.w<worker>.<epoch>` files (their producer is dead: we hold its role lock).

    Returns the largest epoch seen (0 if none), so the new epoch can be larger.
    """
    prefix = f"{name}.w{worker}."
    newest = 0
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            suffix = entry.name[len(prefix):]
            if not entry.name.startswith(prefix) or not suffix.isdigit() or not entry.is_file(follow_symlinks=False):
                continue
            # not a predecessor of ours: another user's file under our ring's name
            if problem := owner_problem(entry.path, entry.stat(follow_symlinks=False)):
                log.warning("ignoring %s: not a ring of this server's (%s)", entry.path, problem)
                continue
            newest = max(newest, int(suffix))
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise RingError(f"cannot remove the dead producer's ring {entry.path}: {e}") from None
            log.info("removed stale ring %s (its producer is gone)", entry.path)
    return newest


def _space_message(shm_dir: str, need: int, avail: int, slot_count: int, slot_size: int) -> str:
    return (f"{shm_dir} cannot hold the ring: it needs {need} bytes ({slot_count} slots x {slot_size} "
            f"bytes + {need - slot_count * slot_size} bytes of headers), {avail} bytes are available. "
            f"Enlarge it (docker: shm_size or ipc: host; tmpfs: size=) or use fewer/smaller slots. "
            f"An unlinked ring still mapped by some process keeps its memory until that process unmaps it.")


def _check_space(shm_dir: str, need: int, slot_count: int, slot_size: int) -> None:
    st = os.statvfs(shm_dir)
    avail = st.f_bavail * st.f_frsize
    if need > avail:
        raise RingSpaceError(_space_message(shm_dir, need, avail, slot_count, slot_size))


def _create_file(path: str, size: int, slot_count: int, slot_size: int) -> mmap.mmap:
    """O_EXCL + posix_fallocate + mmap; on any failure nothing is left behind."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        problem = owner_problem(path, os.lstat(path))
        raise RingError(f"{path} already exists although this process holds the producer role"
                        + (f": {problem}" if problem else "")) from None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                st = os.statvfs(os.path.dirname(path))
                raise RingSpaceError(_space_message(os.path.dirname(path), size, st.f_bavail * st.f_frsize,
                                                    slot_count, slot_size) + f" ({e.strerror})") from None
            raise RingError(f"posix_fallocate({path}, {size}) failed: {e}") from None
        return _map(fd, size)
    except BaseException:
        _unlink_quietly(path)
        raise
    finally:
        os.close(fd)


def _validate_control(path: str, w: tuple[int, ...], size: int) -> tuple[int, int, int]:
    """(slot_count, slot_size, data_offset) from the control page's words (written once, before
    the magic), or RingError naming what is wrong."""
    magic, version = w[_C.MAGIC], w[_C.VERSION]
    if magic != MAGIC:
        raise RingError(f"{path} is not a dfpipe ring (magic {magic:#018x}, expected {MAGIC:#018x}), "
                        f"or its producer has not finished creating it")
    if version != LAYOUT_VERSION:
        raise RingError(f"{path} has ring layout version {version}; this build reads version {LAYOUT_VERSION} "
                        f"(producer and consumer run different dfpipe versions)")
    slot_count, slot_size = w[_C.SLOT_COUNT], w[_C.SLOT_SIZE]
    if not 1 <= slot_count <= MAX_SLOTS or not 0 < slot_size <= MAX_SLOT_SIZE or slot_size % SLOT_ALIGN:
        raise RingError(f"{path}: nonsense geometry ({slot_count} slots x {slot_size} bytes)")
    data_offset, file_size = _layout(slot_count, slot_size)
    got = (w[_C.HEADER_OFFSET], w[_C.HEADER_STRIDE], w[_C.DATA_OFFSET], w[_C.FILE_SIZE])
    if got != (PAGE, HEADER_STRIDE, data_offset, file_size):
        raise RingError(f"{path}: header/data offsets or file size {got} disagree with the geometry "
                        f"{(PAGE, HEADER_STRIDE, data_offset, file_size)}")
    if size != file_size:
        raise RingError(f"{path} is {size} bytes but its control page says {file_size} (truncated?)")
    return slot_count, slot_size, data_offset
