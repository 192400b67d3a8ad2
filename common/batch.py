"""The packed batch: what the target server writes into a slot and the trainer reads out of it.

One batch is one row of T real tokens made of D whole documents (no padding exists). Both sides
build and check it through this module so the slot payload has exactly one definition.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# name -> dtype of the token-level tensors; `hidden` is added with the target's capture dtype.
TOKEN_TENSORS: dict[str, torch.dtype] = {
    "input_ids": torch.int32,
    "loss_mask": torch.uint8,
    "position_ids": torch.int32,
    "doc_lens": torch.int32,
    "sample_ids": torch.int64,
    "doc_ids": torch.int64,
}
# the token tensors with one entry per document (the others have one per token)
DOC_TENSORS: tuple[str, ...] = ("doc_lens", "sample_ids", "doc_ids")
HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# every tensor of a slot's payload, in slot order
PAYLOAD_TENSORS: tuple[str, ...] = ("hidden", *TOKEN_TENSORS)


class BatchError(ValueError):
    """A batch whose tensors disagree with each other (shapes, lengths, positions)."""


@dataclass
class PackedBatch:
    """k captured layers of T packed tokens from D documents.

    hidden:       [k, T, H]  captured outputs, layer planes in `layer_ids` order
    input_ids:    [T]
    loss_mask:    [T]        1 on assistant tokens (the tokens the drafter learns to predict)
    position_ids: [T]        restart at 0 in every document
    doc_lens:     [D]        sum == T
    sample_ids:   [D]        the sample (source row) each document came from: a row the template
                             renders as several documents, or split, repeats its id
    doc_ids:      [D]        each document's own index in the prepared data (unique within an epoch)
    """

    hidden: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    doc_lens: torch.Tensor
    sample_ids: torch.Tensor
    doc_ids: torch.Tensor
    seq: int = -1
    epoch: int = -1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return PackedBatch(**moved, seq=self.seq, epoch=self.epoch)


def slot_tensor_specs(num_tokens: int, num_docs: int, num_layers: int, hidden_size: int,
                      hidden_dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors of one batch in slot order: the big hidden planes first (2 MiB-aligned DMA target)."""
    return [("hidden", hidden_dtype, (num_layers, num_tokens, hidden_size)),
            *((name, dtype, (num_docs if name in DOC_TENSORS else num_tokens,))
              for name, dtype in TOKEN_TENSORS.items())]


def check_batch(batch: PackedBatch, num_layers: int | None = None, hidden_size: int | None = None) -> None:
    """Raise BatchError unless every tensor agrees with the others (cheap: O(T) integer work)."""
    t = batch.num_tokens
    if batch.hidden.dtype not in HIDDEN_DTYPES:
        raise BatchError(f"hidden dtype {batch.hidden.dtype} not in {HIDDEN_DTYPES}")
    if batch.hidden.dim() != 3 or batch.hidden.shape[1] != t:
        raise BatchError(f"hidden shape {tuple(batch.hidden.shape)} is not [k, {t}, H]")
    if num_layers is not None and batch.hidden.shape[0] != num_layers:
        raise BatchError(f"hidden has {batch.hidden.shape[0]} layers, expected {num_layers}")
    if hidden_size is not None and batch.hidden.shape[2] != hidden_size:
        raise BatchError(f"hidden size {batch.hidden.shape[2]}, expected {hidden_size}")
    for name, dtype in TOKEN_TENSORS.items():
        x = getattr(batch, name)
        if x.dtype != dtype or x.dim() != 1:
            raise BatchError(f"{name}: expected 1-d {dtype}, got {x.dtype} {tuple(x.shape)}")
    for name in ("loss_mask", "position_ids"):
        if getattr(batch, name).shape[0] != t:
            raise BatchError(f"{name} has {getattr(batch, name).shape[0]} entries for {t} tokens")
    for name in DOC_TENSORS[1:]:
        if getattr(batch, name).shape[0] != batch.doc_lens.shape[0]:
            raise BatchError(f"{name} and doc_lens differ in length")
    if t == 0 or batch.doc_lens.numel() == 0:
        raise BatchError("empty batch")
    lens = batch.doc_lens.to(torch.int64)
    if bool((lens <= 0).any()) or int(lens.sum()) != t:
        raise BatchError(f"doc_lens {lens.tolist()[:8]}... must be positive and sum to {t}")
    if bool((batch.loss_mask > 1).any()):
        raise BatchError("loss_mask must be 0/1")
    if not torch.equal(batch.position_ids.to(torch.int64), document_positions(batch.doc_lens)):
        raise BatchError("position_ids do not restart at 0 in every document")


def document_positions(doc_lens: torch.Tensor) -> torch.Tensor:
    """Positions 0..len-1 for each document, concatenated (int64)."""
    lens = doc_lens.to(torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, lens)


def cu_seqlens(doc_lens: torch.Tensor) -> torch.Tensor:
    """[D+1] int32 document boundaries, the varlen-kernel convention."""
    out = torch.zeros(doc_lens.numel() + 1, dtype=torch.int32, device=doc_lens.device)
    out[1:] = torch.cumsum(doc_lens.to(torch.int32), 0)
    return out
