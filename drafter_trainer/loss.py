"""The DFlash loss: decay-weighted cross-entropy through the frozen lm_head, computed in chunks.

With a 248K vocabulary the logits of all N*B block rows (8192 rows: 8 GB in fp32) dwarf the rest
of the drafter, so they never exist at once. Only rows with a positive weight reach the lm_head
(the anchor column and positions past a document end or outside the loss mask are dropped
first), and those go through `_ChunkedLinearCrossEntropy` `chunk` rows at a time:

    forward, per chunk:  logits = h_c @ W^T (the head's dtype, in every drafter.precision: see fp8.py)
                         -> `softmax_cross_entropy`:
                         weighted CE sum, argmax hits and, when a gradient is needed,
                         dCE/dlogits = w * (softmax - onehot); then dCE/dh_c = that @ W
    backward:            the saved dCE/dh [R, H] times the incoming scalar gradient

so peak memory is one chunk of logits, and the head costs two matmuls per row (a checkpointed
chunk would cost three). The head is frozen: no gradient for W is ever formed.

Between the two matmuls lies only elementwise work over a [chunk, V] buffer, and at V = 248K it
is the largest elementwise cost of a step: run as separate eager kernels (cast, gather, argmax,
max, exp, sum, divide, one-hot, scale, cast back) it moves ~50 bytes per logit. On CUDA it is one
Triton kernel (`ce_kernel`: ~6 bytes per bf16 logit, and no compile, so the eager first steps
have it too), elsewhere `softmax_cross_entropy`; the matmuls stay in cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.batch import PackedBatch
from drafter_trainer import ce_kernel
from drafter_trainer.blocks import BlockBatch, chunk_bounds
from drafter_trainer.model import ContextError, DFlashDraftModel
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


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor,
                          need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's elementwise half of the loss head, in fp32 from `logits` [R, V]: (sum_r w_r * CE_r
    as an fp32 scalar, [R] bool argmax == label, and with need_grad dCE/dlogits = w * (softmax -
    onehot) written over the logits, the caller's scratch, and returned, so a chunk never holds a
    second [R, V] buffer in the matmul's dtype; else None). The eager spelling (CPU, and CUDA
    without Triton): in place on one fp32 buffer that holds the logits, then exp(logits - max),
    then the gradient (out of place would allocate three more)."""
    x = logits.float()                               # the logits themselves when they are fp32
    target_logit = x.gather(1, labels[:, None]).squeeze(1)
    correct = x.argmax(dim=-1) == labels
    top = x.amax(dim=-1, keepdim=True)
    shifted_exp = x.sub_(top).exp_()
    sum_exp = shifted_exp.sum(dim=-1, keepdim=True)
    ce_sum = ((top + sum_exp.log()).squeeze(1) - target_logit).mul(row_weights).sum()
    if not need_grad:
        return ce_sum, correct, None
    softmax = shifted_exp.div_(sum_exp)                                 # still the one buffer
    softmax[torch.arange(labels.shape[0], device=labels.device), labels] -= 1.0
    grad = softmax.mul_(row_weights[:, None])
    if grad.dtype != logits.dtype:
        logits.copy_(grad)
    return ce_sum, correct, logits


def cross_entropy_fn(device: torch.device):
    """The loss head's elementwise half for logits on `device`: the Triton kernel on CUDA
    (`ce_kernel`), else `softmax_cross_entropy`."""
    if device.type == "cuda" and ce_kernel.available():
        return ce_kernel.softmax_cross_entropy_kernel
    return softmax_cross_entropy


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_r w_r * CE(h_r @ W^T, y_r), chunk rows at a time; also returns per-row argmax hits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                row_weights: torch.Tensor, chunk: int, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # Autograd runs forward in no-grad mode, so the caller says whether a backward will come.
        need_grad = with_grad and ctx.needs_input_grad[0]
        cross_entropy = cross_entropy_fn(hidden.device)
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                logits = hidden[rows].to(head.dtype) @ head.t()
                chunk_ce, correct[rows], grad_logits = cross_entropy(logits, labels[rows], row_weights[rows],
                                                                     need_grad)
                ce_sum += chunk_ce
                if need_grad:
                    grad_hidden[rows] = (grad_logits @ head).to(hidden.dtype)
                del logits, grad_logits     # before the next chunk's matmul allocates its own
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return ce_sum, correct

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_correct: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_ce.to(grad_hidden.dtype), None, None, None, None, None


def auto_blocks_per_chunk(block_size: int) -> int:
    """drafter.blocks_per_chunk 0: blocks of AUTO_CHUNK_ROWS block tokens in all (768 blocks of
    16). Every GEMM of a chunk is a full-size one either way; each chunk also pays a fixed cost
    (every weight cast to bf16, every weight gradient summed into fp32 `.grad`, the key copies'
    gradient sums), so fewer chunks step faster, while the peak grows with the chunk. At the 27B
    width and the published density (H200, flash attention) 768 blocks stepped 2.4% faster than
    512, at a 57.5 GB peak against 53.0 (docs/benchmarks.md, P5d), under the 60 GB budget."""
    return max(1, AUTO_CHUNK_ROWS // block_size)


AUTO_CHUNK_ROWS = 12288


def dflash_loss(model: DFlashDraftModel, batch: PackedBatch, blocks: BlockBatch, chunk: int,
                weight_norm: torch.Tensor | None = None, *, layer_ids: list[int] | None = None,
                blocks_per_chunk: int = 0, backward: bool = False) -> LossOutput:
    """The drafter over the blocks and the chunked, decay-weighted CE, `blocks_per_chunk` blocks
    at a time (0: `auto_blocks_per_chunk`), each chunk attending to the slice of the context side
    (fc, hidden_norm, each layer's context keys and values; computed once a batch) that its blocks
    can see (`BlockBatch.chunks`).

    backward=False returns a differentiable loss (every chunk's graph kept: the reference, and the
    held-out eval under no_grad). backward=True runs the backward chunk by chunk, so only one
    chunk's activations exist at a time, and returns the loss detached: each chunk's backward stops
    at its detached context slice, and the slices' gradients, summed in fp32, flow through the
    context side once (`_context_side`). The same gradients as one backward over all blocks (tests),
    with memory that grows with the chunk and its context slice, not with the number of anchors.

    chunk: rows per lm_head chunk (`_ChunkedLinearCrossEntropy`). weight_norm: the denominator
    instead of this batch's weight_sum, all_reduce(weight_sum) when the ranks' gradients are
    summed, so every rank's tokens weigh as in one big batch. layer_ids: the capture's (default
    `batch.layer_ids`); given, the model refuses planes of other layers or in another order.
    ContextError: a batch that must be skipped (wrong layers, zero or non-finite states, token ids
    outside the vocabulary)."""
    target_hidden = _checked_context(model, batch, blocks, chunk, layer_ids)
    b = blocks.block_size
    device = target_hidden.device
    weight_sum = blocks.weights.sum()
    norm = weight_norm if weight_norm is not None else weight_sum
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))
    backward = backward and torch.is_grad_enabled()

    positions = blocks.context_positions
    projected, context_kv = _context_side(model, target_hidden, positions, backward)
    # With backward: per context key and value tensor, the fp32 sum of its gradient over the chunks
    # (bf16 partial sums over many chunks would round where one backward over all blocks does not).
    # A chunk attends to a detached slice of the context side's tensors, so its backward stops at
    # that slice: nothing of a chunk's backward is as long as the batch, however long its documents.
    grad_sums = [tuple(torch.zeros(t.shape, dtype=torch.float32, device=device) for t in kv)
                 for kv in context_kv] if backward else None
    ce_sum = torch.zeros((), dtype=torch.float32, device=device)
    correct_per_pos = torch.zeros(b, dtype=torch.float32, device=device)
    count_per_pos = torch.zeros(b, dtype=torch.float32, device=device)
    per_chunk = blocks_per_chunk or auto_blocks_per_chunk(b)
    for rows, (part, first, end) in zip(_loss_rows_by_chunk(blocks, per_chunk), blocks.chunks(per_chunk)):
        kv = [tuple(t[first:end].detach().requires_grad_() if backward else t[first:end] for t in pair)
              for pair in context_kv]
        part_ce, correct = _chunk_ce(model, part, kv, rows, chunk)
        if backward:
            (part_ce / norm).backward()
            part_ce = part_ce.detach()
            for pair, sums in zip(kv, grad_sums):
                for t, total in zip(pair, sums):
                    if t.grad is not None:
                        total[first:end] += t.grad
        ce_sum = ce_sum + part_ce
        position = rows % b
        correct_per_pos.index_add_(0, position, correct.to(torch.float32))
        count_per_pos.index_add_(0, position, torch.ones_like(position, dtype=torch.float32))   # bincount syncs
        del kv
    if grad_sums is not None:
        context_kv = model.context_kv_of(projected, positions)     # the same values, now with a graph
        tensors = [t for pair in context_kv for t in pair]
        sums = [total for pair in grad_sums for total in pair]
        torch.autograd.backward(tensors, [total.to(t.dtype) for t, total in zip(tensors, sums)])
    return LossOutput(loss=ce_sum / norm, ce_sum=ce_sum.detach(), weight_sum=weight_sum.detach(),
                      correct_per_pos=correct_per_pos, count_per_pos=count_per_pos,
                      num_anchors=int(blocks.valid.sum()))


def _context_side(model: DFlashDraftModel, target_hidden: torch.Tensor, positions: torch.Tensor, backward: bool
                  ) -> tuple[torch.Tensor | None, list]:
    """(fc's projection, each layer's context keys and values) of `dflash_loss`; the projection
    only with backward (None without).

    With backward, while the chunks run, the context side holds only fc's graph (its weight
    gradient needs fc's input: views of the captured planes with split_fc, else their
    concatenation); hidden_norm and the layers' context keys and values run without one, and once
    more with one for the context side's backward. That forward again costs 2*T*H*2*kv_dim per
    layer, under 2% of a long-document step, and frees what autograd would hold for them through
    every chunk: the norms' fp32 intermediates and RoPE's inputs, ~150 KB a context token at the
    27B shape (5 GB for a 32K-token batch)."""
    if not backward:
        return None, model.context_kv(target_hidden, positions)
    projected = model.fc_project(target_hidden)
    with torch.no_grad():
        return projected, model.context_kv_of(projected.detach(), positions)


def _checked_context(model: DFlashDraftModel, batch: PackedBatch, blocks: BlockBatch, chunk: int,
                     layer_ids: list[int] | None) -> torch.Tensor:
    """The batch's captured planes, refused when they cannot be trained on (ContextError), in the
    fc's dtype unless autocast casts them."""
    if chunk < 1:
        raise ValueError(f"loss chunk must be >= 1 row, got {chunk}")
    if not model.lm_head.loaded:
        raise TargetHeadError("the target's lm_head is not loaded (load_target_head / set_target_head)")
    if layer_ids is None:
        layer_ids = getattr(batch, "layer_ids", None)
    model.check_context(batch.hidden, layer_ids)
    model.check_token_ids(batch.input_ids, "batch input_ids")   # block inputs and labels come from here
    target_hidden = batch.hidden
    if target_hidden.shape[1] != blocks.num_context:
        raise ContextError(f"blocks describe {blocks.num_context} context tokens, the batch has {target_hidden.shape[1]}")
    if not torch.is_autocast_enabled(target_hidden.device.type):
        target_hidden = target_hidden.to(model.fc.weight.dtype)
    return target_hidden


def _chunk_ce(model: DFlashDraftModel, part: BlockBatch, kv: list[tuple[torch.Tensor, torch.Tensor]],
              rows: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of blocks through the layers and the head: its weighted CE sum and per-row hits."""
    n, b = part.num_blocks, part.block_size
    noise_embedding = model.embed(part.block_input_ids.reshape(n * b)).to(model.fc.weight.dtype)
    hidden = model.decode_blocks(noise_embedding, kv, part)
    # With no rows at all the (empty) selection still links every parameter into the graph, so
    # backward gives them zero gradients and DDP's reduction stays in step across ranks.
    return _ChunkedLinearCrossEntropy.apply(
        hidden[rows], model.lm_head.weight, part.labels.reshape(-1)[rows], part.weights.reshape(-1)[rows],
        chunk, torch.is_grad_enabled() and hidden.requires_grad)


def _loss_rows_by_chunk(blocks: BlockBatch, per_chunk: int) -> list[torch.Tensor]:
    """Per chunk, the indices of its block rows that carry loss (weight > 0), in the chunk's own
    numbering: only those rows meet the lm_head. Found for the whole batch with one host read: a
    nonzero() per chunk would wait for the device before every chunk, and the host could no longer
    prepare the next chunk's masks while the device runs the last one."""
    b = blocks.block_size
    rows = (blocks.weights.reshape(-1) > 0).nonzero().squeeze(1)
    first = [a for a, _ in chunk_bounds(blocks.num_blocks, per_chunk, b)]   # as BlockBatch.chunks cuts them
    # chunks start every per_chunk blocks: an arange made on the device, where a tensor of `first`
    # would be a host-to-device copy, which waits like a read
    starts = torch.arange(len(first), device=rows.device) * (per_chunk * b)
    bounds = [*torch.searchsorted(rows, starts).tolist(), rows.numel()]
    return [rows[bounds[i]:bounds[i + 1]] - a * b for i, a in enumerate(first)]


def implied_acceptance_length(acc_per_pos: torch.Tensor) -> float:
    """Expected tokens per draft-verify step, 1 + sum_{k>=1} prod_{j<=k} acc_j, of acc_1 .. acc_{B-1}
    (the drafted positions' accuracies, no anchor). Positions are taken as independent (a product of
    marginal accuracies): an estimate, not a measure, of the decode-time acceptance length tau."""
    acc = acc_per_pos.detach().to(torch.float64).flatten()
    return float(1.0 + torch.cumprod(acc, 0).sum())
