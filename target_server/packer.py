"""The deterministic packer: documents -> batches of at most `token_budget` tokens, numbered densely.

Batch contents are a pure function of (lengths, token_budget, seed, epoch), so any batch seq can
be rebuilt at any time, by any process, and is the same list of documents. That is what lets a
restarted trainer say "I hold seqs S" and the target server recompute exactly the others.

One epoch, in four steps:

    1. shuffle    every document once, by a 64-bit hash key of (seed, epoch, doc index)
    2. windows    cut the shuffled order into windows of about `window_batches` batches of tokens
    3. pack       inside a window, longest document first (lengths rounded to 1/32 of the budget,
                  ties in shuffled order), each into the fullest batch it still fits in
                  (best-fit decreasing); a document is never split across batches
    4. order      the batches of the epoch are put in hash-key order of (seed, epoch, batch)

Windows keep batches random from epoch to epoch (a global sort by length would build nearly the
same batches every epoch) while still giving the bin packer enough choice to fill batches: with
64 batches per window, fill is about 98-99% on long-tailed length mixes.

The shuffle uses its own hash (splitmix64), not numpy's or Python's generators, whose streams may
change between versions: a numpy upgrade on the target host must not renumber an epoch that a
trainer checkpoint already half-covers.

Global seqs are dense across epochs (n_e = number of batches of epoch e):

    epoch 0: [0, n_0)   epoch 1: [n_0, n_0 + n_1)   epoch 2: [n_0 + n_1, ...)   ...
"""
from __future__ import annotations

import bisect
import hashlib
import json
import threading
from collections import OrderedDict

import numpy as np

from common.protocol import plan_id
from target_server.data import PreparedDataset

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM_SHUFFLE, _STREAM_ORDER = 1, 2


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on uint64 (wrapping arithmetic is the point)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def hash_keys(seed: int, epoch: int, stream: int, n: int) -> np.ndarray:
    """n uint64 keys, a fixed function of (seed, epoch, stream); sorting by them is a shuffle."""
    base = 0
    for part in (seed, epoch, stream):
        base = int(_splitmix64(np.array([(base ^ (part & _MASK64)) & _MASK64], dtype=np.uint64))[0])
    with np.errstate(over="ignore"):
        counters = np.uint64(base) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    return _splitmix64(counters)


def _shuffled(seed: int, epoch: int, stream: int, n: int) -> np.ndarray:
    return np.argsort(hash_keys(seed, epoch, stream, n), kind="stable")


def _best_fit_decreasing(docs: np.ndarray, lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    """Pack `docs` (indices into `lengths`) into batches; longest first, each into the fullest batch it fits.

    "Longest" is by length rounded down to 1/32 of the budget, keeping the shuffled order among
    equals: the fill stays that of exact sorting, but the batches differ from epoch to epoch even
    when one window holds the whole dataset.
    """
    quantum = max(1, token_budget // 32)
    by_size = docs[np.argsort(-(lengths[docs] // quantum), kind="stable")]
    batches: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, batch index), sorted: bisect finds the tightest fit
    for doc in by_size.tolist():
        size = int(lengths[doc])
        k = bisect.bisect_left(room, (size, -1))
        if k == len(room):
            batches.append([doc])
            free, b = token_budget - size, len(batches) - 1
        else:
            free, b = room.pop(k)
            batches[b].append(doc)
            free -= size
        if free > 0:
            bisect.insort(room, (free, b))
    return batches


class Packer:
    """Batches of document indices for any (epoch) or global seq; see the module docstring.

    lengths: tokens per document (e.g. `PreparedDataset.lengths`); every one must be <= token_budget.
    """

    def __init__(self, lengths: np.ndarray, token_budget: int, seed: int, window_batches: int = 64,
                 cache_epochs: int = 4) -> None:
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-d array, got shape {lengths.shape}")
        if not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"lengths must be integers, got {lengths.dtype}")
        if token_budget < 1 or window_batches < 1:
            raise ValueError(f"token_budget and window_batches must be >= 1, got {token_budget}, {window_batches}")
        if int(lengths.min()) < 1:
            raise ValueError(f"document {int(lengths.argmin())} has {int(lengths.min())} tokens; documents are non-empty")
        longest = int(lengths.argmax())
        if int(lengths[longest]) > token_budget:
            raise ValueError(f"document {longest} has {int(lengths[longest])} tokens > token_budget {token_budget}: "
                             f"a document is trained whole, in one batch. Prepare the data again with "
                             f"data.max_len <= {token_budget} (data.overlong cuts or skips longer ones), or raise "
                             f"data.token_budget to at least {int(lengths[longest])}")
        self.lengths = lengths.astype(np.int64)
        self.token_budget = int(token_budget)
        self.seed = int(seed)
        self.window_batches = int(window_batches)
        self._cache_epochs = max(1, int(cache_epochs))
        self._packed: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # LRU
        self._sizes: dict[int, int] = {}
        self._starts: list[int] = [0]  # _starts[e] = first seq of epoch e, for every epoch packed so far
        self._lock = threading.Lock()
        self._starts_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.lengths)

    # -- one epoch ------------------------------------------------------------------------------

    def _pack(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(docs, bounds): batch i of the epoch is docs[bounds[i]:bounds[i+1]]."""
        order = _shuffled(self.seed, epoch, _STREAM_SHUFFLE, len(self.lengths))
        window_tokens = self.window_batches * self.token_budget
        cum = np.cumsum(self.lengths[order])
        batches: list[list[int]] = []
        start = 0
        while start < len(order):
            # The window ends at the first document that brings it to window_tokens (or at the end).
            end = int(np.searchsorted(cum, (cum[start - 1] if start else 0) + window_tokens, side="left")) + 1
            batches += _best_fit_decreasing(order[start:end], self.lengths, self.token_budget)
            start = end
        permuted = [batches[i] for i in _shuffled(self.seed, epoch, _STREAM_ORDER, len(batches)).tolist()]
        docs = np.fromiter((d for b in permuted for d in b), dtype=np.int64, count=len(order))
        bounds = np.zeros(len(permuted) + 1, dtype=np.int64)
        bounds[1:] = np.cumsum([len(b) for b in permuted])
        return docs, bounds

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        epoch = int(epoch)
        with self._lock:
            if (hit := self._packed.get(epoch)) is not None:
                self._packed.move_to_end(epoch)
                return hit
        packed = self._pack(epoch)  # outside the lock: a pure function, a racing duplicate is harmless
        with self._lock:
            self._packed[epoch] = packed
            self._sizes[epoch] = len(packed[1]) - 1
            while len(self._packed) > self._cache_epochs:
                self._packed.popitem(last=False)
        return packed

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Document indices of every batch of the epoch, in seq order; each document exactly once."""
        docs, bounds = self._epoch(epoch)
        flat = docs.tolist()
        return [flat[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]

    def epoch_size(self, epoch: int) -> int:
        if epoch not in self._sizes:
            self._epoch(epoch)
        return self._sizes[epoch]

    def epoch_sizes(self, epochs: int) -> list[int]:
        """Number of batches of epochs 0..epochs-1."""
        return [self.epoch_size(e) for e in range(epochs)]

    def fill_ratio(self, epoch: int) -> float:
        """Real tokens / (batches x token_budget) for the epoch."""
        return float(self.lengths.sum()) / (self.epoch_size(epoch) * self.token_budget)

    def fingerprint(self, epoch: int) -> str:
        """sha256 of the epoch's batches: equal digests mean the same seq -> documents mapping."""
        docs, bounds = self._epoch(epoch)
        return hashlib.sha256(docs.astype("<i8").tobytes() + b"|" + bounds.astype("<i8").tobytes()).hexdigest()

    # -- global seqs ----------------------------------------------------------------------------

    def seq_range(self, epoch: int) -> tuple[int, int]:
        """[start, end) of the global seqs epoch `epoch` owns."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        with self._starts_lock:
            while len(self._starts) <= epoch:
                e = len(self._starts) - 1
                self._starts.append(self._starts[e] + self.epoch_size(e))
        start = self._starts[epoch]
        return start, start + self.epoch_size(epoch)

    def locate(self, seq: int) -> tuple[int, int]:
        """(epoch, index within the epoch) of a global seq."""
        if not isinstance(seq, (int, np.integer)) or seq < 0:
            raise ValueError(f"seq must be a non-negative integer, got {seq!r}")
        epoch = bisect.bisect_right(self._starts, seq) - 1  # the known epochs first, then walk forward
        while True:
            start, end = self.seq_range(epoch)
            if seq < end:
                return epoch, int(seq) - start
            epoch += 1

    def batch(self, seq: int) -> list[int]:
        """Document indices of global batch `seq`; the same list every time, in any process."""
        epoch, index = self.locate(seq)
        docs, bounds = self._epoch(epoch)
        return docs[bounds[index]:bounds[index + 1]].tolist()


def data_plan(dataset: PreparedDataset, packer: Packer) -> dict[str, str | int]:
    """The fingerprint of what the server serves as batch seq s: every input that decides it, named
    by the setting it comes from (so a trainer can say *what* changed), plus `id`, their hash.

    The data's own content and preparation come from the prepared folder's meta.json (what was
    served, even when data.train_path names a prepared folder made with other settings); the
    packing from the packer. `packing` is the hash of epoch 0's batches: it catches what the
    named settings do not (another packing algorithm, the same file prepared by other code).
    """
    meta = dataset.meta

    def digest(key: str) -> str:
        return str(meta.get(key) or "")[:16]
    components: dict[str, str | int] = {
        "data.train_path": digest("source_sha256"),
        "data.format": str(meta.get("source_format") or ""),
        "target.tokenizer": digest("tokenizer_sha256"),
        "data.chat_template": digest("chat_template_sha256"),
        "data.chat_template_kwargs": json.dumps(meta.get("chat_template_kwargs") or {}, sort_keys=True),
        "data.max_len": int(meta.get("max_len") or 0),
        "data.overlong": str(meta.get("overlong") or ""),
        "data.seed": packer.seed,
        "data.token_budget": packer.token_budget,
        "packing": packer.fingerprint(0)[:16],
    }
    return {**components, "id": plan_id(components)}


def build_packed(dataset: PreparedDataset, doc_indices: list[int]) -> dict[str, np.ndarray]:
    """The token tensors of one packed batch (the `common.batch.PackedBatch` layout, without `hidden`).

    input_ids int32 [T], loss_mask uint8 [T], position_ids int32 [T] (0.. in every document),
    doc_lens int32 [D], sample_ids int64 [D] (each document's source row), doc_ids int64 [D] (its index
    in the dataset).
    """
    if len(doc_indices) == 0:
        raise ValueError("a packed batch needs at least one document")
    docs = [dataset.sample(int(i)) for i in doc_indices]
    doc_lens = np.array([len(ids) for ids, _, _ in docs], dtype=np.int32)
    starts = np.cumsum(doc_lens, dtype=np.int64) - doc_lens
    total = int(doc_lens.sum(dtype=np.int64))
    return {
        "input_ids": np.concatenate([ids for ids, _, _ in docs]).astype(np.int32, copy=False),
        "loss_mask": np.concatenate([mask for _, mask, _ in docs]).astype(np.uint8, copy=False),
        "position_ids": (np.arange(total, dtype=np.int64) - np.repeat(starts, doc_lens)).astype(np.int32),
        "doc_lens": doc_lens,
        "sample_ids": np.array([sid for _, _, sid in docs], dtype=np.int64),
        "doc_ids": np.array(doc_indices, dtype=np.int64),
    }
