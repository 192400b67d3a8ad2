"""The prepared dataset: a prepared folder (layout in the package docstring), memory-mapped."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from target_server.data.rows import DataError

FORMAT = "dfpipe-prepared"
FORMAT_VERSION = 1
ARRAYS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "offsets": np.dtype(np.int64),
    "sample_ids": np.dtype(np.int64),
}


class PreparedDataset:
    """A prepared folder, memory-mapped: opening costs O(N) integer work, no token is read."""

    def __init__(self, path: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.path = path
        self.meta = meta
        self.input_ids = arrays["input_ids"]
        self.loss_mask = arrays["loss_mask"]
        self.offsets = arrays["offsets"]
        self.sample_ids = arrays["sample_ids"]
        self.lengths: np.ndarray = np.diff(self.offsets)  # int64 [N]

    @classmethod
    def open(cls, path: str) -> "PreparedDataset":
        meta_path = os.path.join(path, "meta.json")
        if not os.path.isdir(path):
            raise DataError(f"prepared dataset not found: {path}")
        if not os.path.isfile(meta_path):
            raise DataError(f"{path}: no meta.json, not a prepared dataset (run prepare-data)")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"{meta_path}: unreadable: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DataError(f"{meta_path}: not a {FORMAT} folder")
        if meta.get("version") != FORMAT_VERSION:
            raise DataError(f"{meta_path}: format version {meta.get('version')}, this code reads {FORMAT_VERSION}; "
                            "prepare the data again")
        arrays = {name: cls._load_array(path, name, dtype) for name, dtype in ARRAYS.items()}
        cls._check(path, meta, arrays)
        return cls(path, meta, arrays)

    @staticmethod
    def _load_array(path: str, name: str, dtype: np.dtype) -> np.ndarray:
        file = os.path.join(path, f"{name}.npy")
        if not os.path.isfile(file):
            raise DataError(f"{path}: missing {name}.npy")
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{file}: corrupt or truncated: {e}") from e
        if array.dtype != dtype or array.ndim != 1:
            raise DataError(f"{file}: expected 1-d {dtype}, got {array.ndim}-d {array.dtype}")
        return array

    @staticmethod
    def _check(path: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        offsets, n = arrays["offsets"], len(arrays["sample_ids"])
        if len(offsets) != n + 1:
            raise DataError(f"{path}: offsets has {len(offsets)} entries for {n} documents (expected {n + 1})")
        total = int(offsets[-1])
        if int(offsets[0]) != 0 or (n and not bool((np.diff(offsets) > 0).all())):
            raise DataError(f"{path}: offsets must start at 0 and strictly increase (every document non-empty)")
        for name in ("input_ids", "loss_mask"):
            if len(arrays[name]) != total:
                raise DataError(f"{path}: {name} has {len(arrays[name])} tokens, offsets say {total}")
        if meta.get("num_documents") != n or meta.get("num_tokens") != total:
            raise DataError(f"{path}: meta.json counts ({meta.get('num_documents')} documents, "
                            f"{meta.get('num_tokens')} tokens) disagree with the arrays ({n}, {total})")

    def __len__(self) -> int:
        """Documents (a row the template renders as several, or split, counts once per document)."""
        return len(self.sample_ids)

    @property
    def num_samples(self) -> int:
        """Source rows the documents come from (distinct sample ids)."""
        return len(np.unique(self.sample_ids))

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(input_ids int32, loss_mask uint8, sample_id) of document i: read-only views of the mapping."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range [0, {len(self)})")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b], int(self.sample_ids[i])
