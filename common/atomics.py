"""Aligned 64-bit words in shared memory, and why plain loads and stores are enough on x86-64.

The ring (`common/ring.py`) coordinates two processes through words in a MAP_SHARED mapping:
every word has exactly one writer, and the protocol only needs two properties:

1. **No torn words.** A reader sees either the old or the new value of a word, never a mix.
   `Words.load` / `Words.store` go through a native-endian, 8-byte-aligned numpy uint64 view; numpy's
   per-dtype getitem/setitem for such an array is a single C assignment of an `npy_uint64`, which
   compilers emit as one 8-byte `mov`. On x86-64 an aligned 8-byte access is atomic (Intel SDM vol.
   3A, 9.1.1 "Guaranteed Atomic Operations").

2. **Publication order.** When the writer stores A (the payload, the tensor table, its checksum)
   and then B (the slot's stamp = READY), a reader that loads B and then A, and sees the new B, sees
   the new A. On x86-64 this is the TSO memory model: stores become visible to other cores in
   program order, loads are not reordered with older loads, and loads are not reordered with later
   stores (so a consumer's copy-out completes before its ack store is visible). The remaining
   question is whether anything *before* the CPU can reorder our accesses:
   - the compiler: each `load`/`store` is a separate call from the interpreter into numpy's C code;
     the C compiler cannot move memory accesses of one opaque call across another;
   - bulk copies (torch `copy_`, `mmap` slice assignment) are ordinary stores, or glibc's
     non-temporal `memcpy` for large sizes, which ends with `sfence` so its weakly-ordered stores
     are globally visible before any later store;
   - CUDA device-to-host copies: the DMA engine's writes are visible to the host once the event
     recorded after them has completed (`cudaEventSynchronize` / a successful query), so the
     producer publishes only after the event.

   Weakly ordered CPUs (aarch64, ppc64le) give neither guarantee to plain accesses, and Python has
   no fence instruction to call, so the ring refuses to run there (`ordering_problem` says why)
   instead of failing silently under load.
"""
from __future__ import annotations

import platform
import sys

import numpy as np

_TSO_MACHINES = frozenset({"x86_64", "amd64"})


def ordering_problem() -> str | None:
    """None when the ordering argument above holds on this machine, else why it does not."""
    machine = platform.machine()
    if machine.lower() not in _TSO_MACHINES:
        return (f"the shared-memory ring relies on x86-64 store ordering (TSO); this machine is "
                f"{machine!r}, whose plain loads/stores may be reordered and Python has no fence to call")
    if sys.maxsize <= 2**32:
        return "the shared-memory ring needs a 64-bit interpreter (8-byte words must be single accesses)"
    return None


class Words:
    """`count` 64-bit words starting at byte `offset` of a writable buffer (e.g. an mmap).

    Single-writer discipline is the caller's job: every word has one process that stores to it.
    """

    def __init__(self, buffer: object, offset: int, count: int) -> None:
        if offset % 8:
            raise ValueError(f"word offset {offset} is not 8-byte aligned")
        self._a = np.frombuffer(buffer, dtype=np.uint64, count=count, offset=offset)  # type: ignore[call-overload]
        if self._a.ctypes.data % 8 or not self._a.dtype.isnative:
            raise ValueError("words must be native-endian and 8-byte aligned in memory")
        if not self._a.flags.writeable:
            raise ValueError("words need a writable buffer")

    def __len__(self) -> int:
        return len(self._a)

    def load(self, i: int) -> int:
        return self._a.item(i)

    def store(self, i: int, value: int) -> None:
        if not 0 <= value < 1 << 64:
            raise ValueError(f"word value {value} outside 0..2**64-1")
        self._a[i] = value

    def release(self) -> None:
        """Drop the view so the underlying mmap can be closed."""
        self._a = np.empty(0, dtype=np.uint64)
