"""The payload checksum of a slot: computed where the producer fills it, verified where the consumer
copied it to, with the same plain torch ops on CPU and CUDA.

Each tensor's bytes are read as little-endian 64-bit words w_0 .. w_{n-1} (the last one padded
with zero bytes) and summed two ways, modulo 2^64:

    s1 = sum(w_i)                s2 = sum((i + 1) * w_i)

Addition and multiplication modulo 2^64 are associative and commutative (torch's int64 arithmetic
wraps on both devices), so every reduction order — CPU threads, CUDA blocks, row lengths — gives
the same two numbers, and a GPU producer's sums equal a CPU consumer's exactly. What they catch:

  - any change confined to one word, so any single flipped bit: s1 moves by a non-zero amount;
  - two different words a < b swapped: s1 stays, s2 moves by (b - a)(w_a - w_b), which is 0
    modulo 2^64 only when 2^k divides b - a and the two words agree in their lowest 64 - k bits:
    never for adjacent words, and in a tensor under 1 GiB (k <= 26) only for words equal in
    their lowest 38 bits or more;
  - truncation or bytes from another publication, almost surely (a 128-bit sum of the content).

It is a corruption check, not a signature: whoever can write the slot can write its table too.

Why 64-bit words read in place rather than 32-bit words widened to int64: widening writes an int64
copy of the payload (three more passes over it); read in place, the payload is read twice (row
sums, column sums) and the only temporaries are one int64 per row of ROW_WORDS words. The cost on
a P2-size payload is measured by bench/gpu/checksum_bench.py.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

META_KEY = "checksum"          # slot meta: {tensor name: [s1, s2]}
ROW_WORDS = 1024               # words per row of the [rows, ROW_WORDS] view each tensor is reduced as
_WORD_BYTES = 8


class ChecksumMismatch(Exception):
    """The payload read differs from what its producer wrote (the message names the tensors)."""


def tensor_checksum(x: torch.Tensor, row_words: int = ROW_WORDS) -> torch.Tensor:
    """[s1, s2] (int64, on x's device) over x's bytes; queued on the current stream, no host sync.

    row_words only shapes the reduction (the result does not depend on it; tests vary it).
    """
    if row_words < 1:
        raise ValueError(f"row_words must be >= 1, got {row_words}")
    data = x.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = data.numel()
    whole = nbytes - nbytes % _WORD_BYTES
    words = data[:whole]
    if words.data_ptr() % _WORD_BYTES:   # an int64 load must be aligned on CUDA
        words = words.clone()
    words = words.view(torch.int64)
    sums = torch.zeros(2, dtype=torch.int64, device=x.device)
    rows = words.numel() // row_words
    if rows:
        sums += _block_sums(words[: rows * row_words].view(rows, row_words), first=0)
    rest = words[rows * row_words:]
    if whole < nbytes:
        last = torch.zeros(_WORD_BYTES, dtype=torch.uint8, device=x.device)
        last[: nbytes - whole] = data[whole:]
        rest = torch.cat([rest, last.view(torch.int64)])
    if rest.numel():
        sums += _block_sums(rest.view(1, -1), first=rows * row_words)
    return sums


def _block_sums(block: torch.Tensor, first: int) -> torch.Tensor:
    """[s1, s2] of a [R, L] int64 block whose word (r, c) is payload word first + r*L + c.

    Weight (first + 1 + r*L) + c splits into a per-row and a per-column part, so two plain sums
    (over rows, over columns) and two short dot products give s2 without a full-size temporary.
    """
    r, length = block.shape
    row_sums = block.sum(dim=1)
    col_sums = block.sum(dim=0)
    row_weights = torch.arange(first + 1, first + 1 + r * length, length, dtype=torch.int64, device=block.device)
    col_weights = torch.arange(length, dtype=torch.int64, device=block.device)
    s1 = row_sums.sum()
    s2 = (row_sums * row_weights).sum() + (col_sums * col_weights).sum()
    return torch.stack([s1, s2])


def payload_checksums(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[len(tensors), 2] int64 on the tensors' (one) device, in the mapping's order; no host sync."""
    return torch.stack([tensor_checksum(t) for t in tensors.values()])


def as_meta(names: Iterable[str], sums: torch.Tensor) -> dict[str, list[int]]:
    """{name: [s1, s2]} from payload_checksums' result (on the CPU), for the slot meta."""
    return dict(zip(names, sums.tolist()))


def check_payload(expected: object, names: Iterable[str], sums: torch.Tensor) -> None:
    """Compare the sums of the tensors read (payload_checksums, on the CPU) with the slot meta's.

    ChecksumMismatch when any differs; ValueError when the meta holds no usable checksum (a slot
    this build's producer did not write).
    """
    names = list(names)
    if not isinstance(expected, dict) or not all(
            isinstance(expected.get(n), list) and len(expected[n]) == 2 and all(type(v) is int for v in expected[n])
            for n in names):
        raise ValueError(f"slot meta has no payload checksum for {names} (got {str(expected)[:120]})")
    got = as_meta(names, sums)
    if bad := [n for n in names if got[n] != expected[n]]:
        raise ChecksumMismatch("payload checksum mismatch in " + ", ".join(
            f"{n} (expected {expected[n]}, read {got[n]})" for n in bad))
