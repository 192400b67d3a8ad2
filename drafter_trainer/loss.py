"""The DFlash loss: decay-weighted cross-entropy through the frozen lm_head, computed in chunks.

With a 248K vocabulary the logits of all N*B block rows (8192 rows: 8 GB in fp32) dwarf the rest
of the drafter, so they never exist at once. Only rows with a positive weight reach the lm_head
(the anchor column and positions past a document end or outside the loss mask are dropped
first), and those go through `_ChunkedLinearCrossEntropy` `chunk` rows at a time:

    forward, per chunk:  logits = h_c @ W^T (fp32) -> weighted CE sum, argmax hits
                         and, when a gradient is needed, dCE/dh_c = w * (softmax - onehot) @ W
    backward:            the saved dCE/dh [R, H] times the incoming scalar gradient

so peak memory is one chunk of logits, and the head costs two matmuls per row (a checkpointed
chunk would cost three). The head is frozen: no gradient for W is ever formed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.batch import PackedBatch
from drafter_trainer.blocks import BlockBatch
from drafter_trainer.model import DFlashDraftModel
from drafter_trainer.target_head import TargetHeadError


@dataclass
class LossOutput:
    """One batch's loss and accuracy statistics.

    loss             scalar, differentiable: ce_sum / weight_sum (or / weight_norm when given)
    ce_sum           weighted cross-entropy sum (detached)
    weight_sum       sum of the loss weights of this batch (detached)
    correct_per_pos  [B] fp32 *unweighted* count of label positions whose argmax is the label
    count_per_pos    [B] fp32 unweighted count of label positions (weight > 0); index 0 is always 0
    num_anchors      real (non-padding) blocks in the batch
    """

    loss: torch.Tensor
    ce_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct_per_pos: torch.Tensor
    count_per_pos: torch.Tensor
    num_anchors: int

    @property
    def accuracy_per_pos(self) -> torch.Tensor:
        """[B] accuracy by block position (0 where nothing was counted, always at position 0)."""
        return self.correct_per_pos / self.count_per_pos.clamp_min(1)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_r w_r * CE(h_r @ W^T, y_r), chunk rows at a time; also returns per-row argmax hits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                row_weights: torch.Tensor, chunk: int, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # Autograd runs forward in no-grad mode, so the caller says whether a backward will come.
        need_grad = with_grad and ctx.needs_input_grad[0]
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h, y, w = hidden[rows].to(weight.dtype), labels[rows], row_weights[rows]
                # One [chunk, V] fp32 buffer holds the logits, then exp(logits - max), then the
                # softmax gradient, all in place (logsumexp alone would allocate two more).
                buf = (h @ weight.t()).float()
                target_logit = buf.gather(1, y[:, None]).squeeze(1)
                correct[rows] = buf.argmax(dim=-1) == y
                top = buf.amax(dim=-1, keepdim=True)
                sum_exp = buf.sub_(top).exp_().sum(dim=-1, keepdim=True)
                ce_sum += ((top + sum_exp.log()).squeeze(1) - target_logit).mul(w).sum()
                if need_grad:
                    buf.div_(sum_exp)                                     # softmax
                    buf[torch.arange(y.shape[0], device=y.device), y] -= 1.0
                    buf.mul_(w[:, None])
                    grad_hidden[rows] = (buf.to(weight.dtype) @ weight).to(hidden.dtype)
                del buf                     # before the next chunk's matmul allocates its own
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return ce_sum, correct

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_correct: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_ce.to(grad_hidden.dtype), None, None, None, None, None


def dflash_loss(model: DFlashDraftModel, batch: PackedBatch, blocks: BlockBatch, chunk: int,
                weight_norm: torch.Tensor | None = None, *, layer_ids: list[int] | None = None) -> LossOutput:
    """Forward the drafter over the blocks and compute the chunked, decay-weighted CE.

    weight_norm: the denominator to use instead of this batch's weight_sum, so that every rank's
    tokens weigh the same as in one big batch: all_reduce(weight_sum) when the ranks' gradients
    are summed, that divided by world_size when they are averaged (DDP).
    layer_ids: the capture's layer ids (slot metadata); when given, the model refuses planes from
    other layers or in another order (falls back to `batch.layer_ids` if the batch carries it).
    Raises ContextError for a batch that must be skipped (wrong layers, zero or non-finite
    states, token ids outside the vocabulary).
    """
    if chunk < 1:
        raise ValueError(f"loss chunk must be >= 1 row, got {chunk}")
    model.check_token_ids(batch.input_ids, "batch input_ids")       # the labels come from here
    if layer_ids is None:
        layer_ids = getattr(batch, "layer_ids", None)
    hidden = model(batch.hidden, blocks.block_input_ids, blocks, layer_ids=layer_ids)
    if not model.lm_head.loaded:
        raise TargetHeadError("the target's lm_head is not loaded (load_target_head / set_target_head)")
    n, b, h = hidden.shape
    weights = blocks.weights.reshape(-1)
    rows = (weights > 0).nonzero().squeeze(1)        # only rows that carry loss meet the lm_head
    # With no rows at all the (empty) selection still links every parameter into the graph, so
    # backward gives them zero gradients and DDP's reduction stays in step across ranks.
    ce_sum, correct = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(n * b, h)[rows], model.lm_head.weight, blocks.labels.reshape(-1)[rows], weights[rows],
        chunk, torch.is_grad_enabled() and hidden.requires_grad)
    weight_sum = weights.sum()
    norm = weight_norm if weight_norm is not None else weight_sum
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))
    position = rows % b
    correct_per_pos = torch.zeros(b, dtype=torch.float32, device=hidden.device)
    correct_per_pos.index_add_(0, position, correct.to(torch.float32))
    count_per_pos = torch.bincount(position, minlength=b).to(torch.float32)
    return LossOutput(
        loss=ce_sum / norm,
        ce_sum=ce_sum.detach(),
        weight_sum=weight_sum.detach(),
        correct_per_pos=correct_per_pos,
        count_per_pos=count_per_pos,
        num_anchors=int(blocks.valid.sum()),
    )


def implied_acceptance_length(acc_per_pos: torch.Tensor) -> float:
    """Expected tokens per draft-verify step: 1 + sum_{k>=1} prod_{j<=k} acc_j.

    acc_per_pos holds acc_1 .. acc_{B-1}, the accuracies of the drafted positions, without the
    anchor (LossOutput.accuracy_per_pos[1:]). Treats positions as independent (a product of
    marginal accuracies), so it estimates, not measures, the decode-time acceptance length tau.
    """
    acc = acc_per_pos.detach().to(torch.float64).flatten()
    return float(1.0 + torch.cumprod(acc, 0).sum())
