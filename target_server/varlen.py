"""Document-aware token mixers for one packed row: documents never see each other.

A packed row holds D whole documents back to back; `cu_seqlens` marks where each one starts:

    tokens      | d0 d0 d0 | d1 | d2 d2 d2 d2 d2 | ...          T tokens, batch size 1
    cu_seqlens  0          3    4                9   ...  T      [D+1]

Three token mixers must restart at every boundary. Stock transformers gets two of them wrong for
packed input (the attention layers are fine given restarting position_ids):

- the short causal conv in front of Gated DeltaNet (kernel 4) is never told the boundaries, so the
  first 3 tokens of a document mix in the last 3 tokens of the previous one;
- the gated delta rule's torch fallback ignores `cu_seqlens`, so the recurrent state flows across.

This module provides the three mixers with explicit boundaries, each with two backends:

    mixer              "torch" backend (CPU, and GPU without FLA)      "fla" backend (CUDA + FLA)
    short conv         K shifted multiply-adds, masked by position     fla causal_conv1d(cu_seqlens=)
    gated delta rule   transformers' chunked torch rule per document   fla chunk_gated_delta_rule(cu_seqlens=)
    attention          SDPA per document (is_causal)                   one flash varlen call per row

`gated_deltanet_forward` is the Gated DeltaNet token mixer of one Qwen3.5 layer, computed from that
layer's own weights with the document-aware conv and delta rule in place of the stock ones.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from common.batch import cu_seqlens as cu_seqlens_of
from common.batch import document_positions

log = logging.getLogger(__name__)

BACKENDS = ("torch", "fla")
# Name under which `packed_attention` is registered with transformers' attention registry, and the
# keyword that carries the document boundaries from our layer loop through HF's attention module.
ATTENTION_IMPL = "dfpipe_packed"
DOCS_KWARG = "dfpipe_docs"


@dataclass(frozen=True)
class PackedDocs:
    """Boundaries of the documents in one packed row, built once per batch and shared by all layers.

    bounds:        [(start, end)] per document as Python ints, so per-document loops never sync the GPU
    cu_seqlens:    [D+1] int64 (the varlen-kernel convention)
    doc_pos:       [T] int64, the position of each token inside its document
    chunk_indices: [chunks, 2] int64 (document, chunk within it) for FLA's varlen kernels, or None.
                   Left to FLA, it is derived from cu_seqlens on the GPU and its length read back:
                   a host sync in every batch (see `with_fla_chunks`).

    Built on the host (`from_doc_lens`) and moved with `to_device`, which never waits for the GPU.
    """

    bounds: tuple[tuple[int, int], ...]
    cu_seqlens: torch.Tensor
    doc_pos: torch.Tensor
    chunk_indices: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1][1]

    @property
    def max_len(self) -> int:
        """The longest document (the varlen attention kernel's tile bound)."""
        return max(e - s for s, e in self.bounds)

    @classmethod
    def from_doc_lens(cls, doc_lens: torch.Tensor, device: torch.device | str = "cpu") -> "PackedDocs":
        lens = [int(n) for n in doc_lens.tolist()]
        if not lens or min(lens) <= 0:
            raise ValueError(f"doc_lens must be non-empty and positive, got {lens[:8]}")
        host_lens = doc_lens.cpu()
        cu = cu_seqlens_of(host_lens).to(torch.int64)
        cu_list = cu.tolist()
        docs = cls(bounds=tuple(zip(cu_list[:-1], cu_list[1:])), cu_seqlens=cu,
                   doc_pos=document_positions(host_lens))
        return docs if torch.device(device).type == "cpu" else to_device(device, docs)[0]

    def padded(self, num_tokens: int) -> "PackedDocs":
        """These documents plus one padding document up to `num_tokens` (unchanged if already there).

        Some of FLA's Triton kernels key their autotuning on the row length (0.6.0: the l2norm and
        fused gated norm on cdiv(rows, 65536); older releases' causal_conv1d on cdiv(T, 1024)), so
        a packed row of a new length can re-tune them mid-run. Running the Gated DeltaNet kernels
        on one fixed length keeps a single tuned shape, tuned once by the warm-up.
        """
        t = self.num_tokens
        if num_tokens <= t:
            return self
        if self.chunk_indices is not None:
            raise ValueError("pad the documents before building their FLA chunk table")
        pad = num_tokens - t
        return PackedDocs(bounds=(*self.bounds, (t, num_tokens)),
                          cu_seqlens=torch.cat([self.cu_seqlens, self.cu_seqlens.new_full((1,), num_tokens)]),
                          doc_pos=torch.cat([self.doc_pos, torch.arange(pad, dtype=torch.int64,
                                                                        device=self.doc_pos.device)]))

    def with_fla_chunks(self) -> "PackedDocs":
        """These (host) documents with FLA's chunk table (for an FLA that takes one: `fla_takes_chunk_table`)."""
        if self.cu_seqlens.device.type != "cpu":
            raise ValueError("build the FLA chunk table on the host, before to_device")
        from fla.ops.utils import prepare_chunk_indices

        table = prepare_chunk_indices(self.cu_seqlens, FLA_CHUNK)
        return dataclasses.replace(self, chunk_indices=table)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.cu_seqlens, self.doc_pos, self.chunk_indices) if t is not None]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "PackedDocs":
        cu, pos, *table = tensors
        return dataclasses.replace(self, cu_seqlens=cu, doc_pos=pos, chunk_indices=table[0] if table else None)


# Chunk length (tokens) of FLA's varlen Gated DeltaNet kernels: the default of both its
# causal_conv1d and chunk_gated_delta_rule, the length their chunk table is built for.
FLA_CHUNK = 64
# int64 elements per 16 bytes: every tensor `to_device` sends starts 16-byte aligned in the one
# device buffer, as Triton specialises kernels on pointer alignment (an odd offset would compile a
# second variant of each kernel mid-run).
_ALIGN = 2


def to_device(device: torch.device | str, *items: "torch.Tensor | PackedDocs") -> list[Any]:
    """Integer tensors and PackedDocs of one batch onto `device` in a single copy that never waits.

    A plain `.to(cuda)` of a pageable tensor synchronises the stream, i.e. waits for everything
    queued before it (the previous batch's whole forward): the host then has no lead, and must
    launch the next forward's first kernels, against any other thread that wants the GIL, while
    the GPU waits. Here the tensors go through one pinned buffer with a non-blocking copy; torch's
    pinned allocator keeps that buffer until the copy has run. Tensors come back int64, in the
    order given; on the CPU the items are returned as they are.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return list(items)
    flat: list[torch.Tensor] = []
    for item in items:
        flat.extend(item.tensors() if isinstance(item, PackedDocs) else [item])
    offsets = [0, *itertools.accumulate(-(-t.numel() // _ALIGN) * _ALIGN for t in flat)]
    host = torch.empty(offsets[-1], dtype=torch.int64, pin_memory=True)
    for t, start in zip(flat, offsets):
        host[start:start + t.numel()].copy_(t.reshape(-1))
    on_device = host.to(device, non_blocking=True)
    views = iter([on_device[start:start + t.numel()].view(t.shape) for t, start in zip(flat, offsets)])
    return [item.with_tensors([next(views) for _ in item.tensors()]) if isinstance(item, PackedDocs)
            else next(views) for item in items]


def _import_first(candidates: tuple[str, ...], name: str) -> Callable[..., Any]:
    for module in candidates:
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    raise ImportError(f"{name} not found in any of {candidates}")


def fla_ops() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """FLA's varlen (causal_conv1d, chunk_gated_delta_rule), or None when FLA cannot be imported.

    FLA has moved the short conv between releases; these are the module paths it has lived under.
    """
    try:
        conv = _import_first(("fla.modules.convolution", "fla.modules.conv", "fla.modules.causal_conv1d"),
                             "causal_conv1d")
        rule = _import_first(("fla.ops.gated_delta_rule",), "chunk_gated_delta_rule")
    except ImportError:
        return None
    return conv, rule


def fla_takes_chunk_table() -> bool:
    """Whether the installed FLA's varlen conv and delta rule both accept a precomputed `chunk_indices`.

    Not cached: tests block and unblock FLA within one process."""
    ops = fla_ops()
    return ops is not None and all("chunk_indices" in inspect.signature(op).parameters for op in ops)


def _chunk_table(docs: PackedDocs) -> dict[str, torch.Tensor]:
    return {} if docs.chunk_indices is None else {"chunk_indices": docs.chunk_indices}


def _fla() -> tuple[Callable[..., Any], Callable[..., Any]]:
    ops = fla_ops()
    if ops is None:
        raise RuntimeError("flash-linear-attention is not importable")
    return ops


def resolve_backend(requested: str, device: torch.device) -> str:
    """"auto" -> "fla" on CUDA when FLA imports, else "torch"; an explicit choice is checked."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"linear backend {requested!r}: expected auto | torch | fla")
    if requested == "torch":
        return "torch"
    usable = device.type == "cuda" and fla_ops() is not None
    if requested == "fla" and not usable:
        raise RuntimeError("linear backend 'fla' needs a CUDA device and an importable flash-linear-attention")
    if requested == "auto" and device.type == "cuda" and not usable:
        log.warning("flash-linear-attention is not importable: Gated DeltaNet layers use the slow torch path")
    return "fla" if usable else "torch"


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, docs: PackedDocs,
                  activation: str | None = "silu", backend: str = "torch") -> torch.Tensor:
    """Depthwise causal conv over a packed row, zero history at every document start.

    x [T, C], weight [C, K] (tap K-1 multiplies the current token), bias [C] or None -> [T, C] in x's dtype.
    """
    if backend == "fla":
        conv, _ = _fla()
        result = conv(x=x.unsqueeze(0).contiguous(), weight=weight, bias=bias, activation=activation,
                      cu_seqlens=docs.cu_seqlens, **_chunk_table(docs))
        y = result[0] if isinstance(result, tuple) else result   # (y, final_state) in FLA >= 0.2
        return y.squeeze(0)
    k = weight.shape[1]
    xf, wf = x.float(), weight.float()
    y = xf * wf[:, k - 1]
    for shift in range(1, k):
        # token t reads token t-shift only when that token is in the same document
        in_doc = (docs.doc_pos[shift:] >= shift).unsqueeze(1)
        y[shift:] += torch.where(in_doc, xf[:-shift] * wf[:, k - 1 - shift], 0.0)
    if bias is not None:
        y = y + bias.float()
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return y.to(x.dtype)


def _torch_chunk_rule() -> Callable[..., Any]:
    """transformers' pure-torch chunked gated delta rule (unwrapped from its kernel-dispatch decorator)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    fn = modeling_qwen3_5.torch_chunk_gated_delta_rule
    return getattr(fn, "__wrapped__", fn)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     docs: PackedDocs, backend: str = "torch") -> torch.Tensor:
    """Chunked gated delta rule with a fresh state per document (q and k are L2-normalised inside).

    q, k [1, T, Hv, Dk] (key heads already repeated to the value heads), v [1, T, Hv, Dv],
    g (log decay, fp32) and beta [1, T, Hv] -> [1, T, Hv, Dv] in v's dtype.
    """
    if backend == "fla":
        _, rule = _fla()
        out, _ = rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=docs.cu_seqlens, **_chunk_table(docs))
        return out
    rule = _torch_chunk_rule()
    pieces = [rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                   use_qk_l2norm_in_kernel=True)[0] for s, e in docs.bounds]
    return torch.cat(pieces, dim=1).to(v.dtype)


def gated_deltanet_forward(gdn: torch.nn.Module, hidden: torch.Tensor, docs: PackedDocs,
                           backend: str = "torch") -> torch.Tensor:
    """One Qwen3.5 Gated DeltaNet token mixer over a packed row, documents kept apart.

    hidden [1, T, H] (after the layer's input norm) -> [1, T, H]. Reads the HF module's weights
    (in_proj_qkv/z/b/a, conv1d, A_log, dt_bias, norm, out_proj); the arithmetic follows
    transformers' Qwen3_5GatedDeltaNet.forward without a cache. `docs` may end with a padding
    document beyond T (PackedDocs.padded): the conv, delta rule and gated norm then run on that
    fixed length with zero rows appended after the projections, and only the T real rows go on.
    """
    _, real_t, _ = hidden.shape
    t = docs.num_tokens
    if t < real_t:
        raise ValueError(f"docs cover {t} tokens, hidden has {real_t}")
    mixed = gdn.in_proj_qkv(hidden)[0]                                    # [T, 2*key_dim + value_dim]
    z, b, a = gdn.in_proj_z(hidden), gdn.in_proj_b(hidden), gdn.in_proj_a(hidden)
    if t > real_t:   # rows of the padding document: zeros, their own document, dropped below
        mixed, z, b, a = (F.pad(x, (0, 0, 0, t - real_t)) for x in (mixed, z, b, a))
    mixed = causal_conv1d(mixed, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, docs,
                          activation=gdn.activation, backend=backend)
    q, k, v = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    q = q.reshape(1, t, -1, gdn.head_k_dim)
    k = k.reshape(1, t, -1, gdn.head_k_dim)
    v = v.reshape(1, t, -1, gdn.head_v_dim)
    beta = b.sigmoid()
    # fp32 decay: in half precision exp(A_log) can overflow to inf (transformers does the same)
    g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
    groups = gdn.num_v_heads // gdn.num_k_heads
    if groups > 1:
        # each key head serves `groups` consecutive value heads
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    core = gated_delta_rule(q, k, v, g, beta, docs, backend=backend)
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return gdn.out_proj(core.reshape(1, t, -1)[:, :real_t])


ATTENTION_PATHS = ("auto", "varlen", "per_document")
ATTENTION_PATH_KWARG = "dfpipe_attention"


def flash_varlen_usable(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether torch's flash kernel can take this row in one varlen call (CUDA, half precision,
    head_dim <= 256, query heads a multiple of key heads)."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
            and query.shape[1] % key.shape[1] == 0
            and hasattr(torch.ops.aten, "_flash_attention_forward"))


def flash_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: PackedDocs,
                           scaling: float | None) -> torch.Tensor:
    """Causal attention inside each document of the row in one flash call: [1, H, T, D] -> [1, T, H, D].

    One kernel launch per layer instead of one per document, and nothing keyed on the document
    lengths (a per-document SDPA call is a new shape for every new length). Forward only: the
    target never needs gradients. GQA is native to the kernel (key heads divide query heads).
    """
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))          # [T, H, D], strided views
    cu = docs.cu_seqlens.to(torch.int32)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, docs.max_len, docs.max_len, 0.0, True, False,
                                                  scale=scaling)[0]
    return out.unsqueeze(0)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention function for transformers' registry: causal attention inside each document.

    query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None). Without `dfpipe_docs`
    (the plain HF forward) it is exactly transformers' SDPA attention. `dfpipe_attention` picks
    "varlen" (one flash call for the row), "per_document" (one SDPA call per document) or "auto"
    (varlen where the flash kernel takes the row: CUDA, half precision).
    """
    docs: PackedDocs | None = kwargs.pop(DOCS_KWARG, None)
    path = kwargs.pop(ATTENTION_PATH_KWARG, "auto")
    if docs is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != docs.num_tokens:
        raise ValueError(f"packed attention expects one row of {docs.num_tokens} tokens, got {tuple(query.shape)}")
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention path {path!r}: one of {ATTENTION_PATHS}")
    usable = path != "per_document" and flash_varlen_usable(query, key)
    if path == "varlen" and not usable:
        raise ValueError(f"varlen attention needs torch's flash kernel: CUDA, fp16/bf16, head_dim <= 256 "
                         f"(got {query.device.type}, {query.dtype}, head_dim {query.shape[-1]})")
    if usable:
        return flash_varlen_attention(query, key, value, docs, scaling), None
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)
    for s, e in docs.bounds:
        out[:, :, s:e] = F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                                        is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register_packed_attention() -> str:
    """Make `ATTENTION_IMPL` a valid attn_implementation (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_IMPL, packed_attention)
    # HF's own forward (the audit's unpacked path, padded batches) then builds exactly the masks it
    # builds for "sdpa", which `packed_attention` hands to SDPA unchanged.
    AttentionMaskInterface.register(ATTENTION_IMPL, sdpa_mask)
    return ATTENTION_IMPL
