"""The DFlash draft model (arXiv 2602.06036) as the trainer runs it: Qwen3-style layers that read
the target's context, drawn in modeling_dflash.py's docstring (the exported, standalone copy).
The context enters the layers only as extra keys and values: it is never updated by a layer and
makes no queries; the target's lm_head is applied by the loss, in chunks. Who may see whom
(strictly-before-anchor context, same document, sliding window, no block sees another) is
defined once in `blocks.AttentionLayout`.

This module has no transformers dependency: the exported folder is what the serving engines
(SGLang, vLLM, the z-lab loader) read, and they bring their own implementation.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from common.config import DrafterConfig, default_layer_ids
from drafter_trainer.block_flash import (block_flash_attention, fold_queries, group_major, plan_of_blocks,
                                         unfold_queries)
from drafter_trainer.block_mask import block_mask_of_blocks, fa4_problem, masked_attention
from drafter_trainer.blocks import AttentionLayout, BlockBatch
from drafter_trainer.fp8 import linear
from drafter_trainer.target_head import FrozenTargetWeight, TargetHeadError, read_target_head, text_config

log = logging.getLogger("dfpipe.trainer")

LAYER_TYPES = ("full_attention", "sliding_attention")
ATTN_IMPLS = ("auto", "split", "sdpa", "flex", "flash", "fa4")
FOLDED_IMPLS = ("flash", "flex", "fa4")    # the paths that take queries folded (block_flash.fold_queries)
COMPILE_MODES = ("auto", "off", "on")
LAYER_COMPILE_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True}   # inductor's, for every compiled layer
LAYER_RECOMPILE_LIMIT = 32   # graphs of one layer's code before dynamo runs a new case eager (compile_for)


class DrafterConfigError(ValueError):
    """A drafter shape that cannot be built or does not fit its target."""


class ContextError(ValueError):
    """Captured target hidden states that must not be trained on (wrong layers, zero or non-finite rows)."""


@dataclass
class DFlashConfig:
    """The drafter's shape, in the exported config.json's names. num_target_layers is the *target's*
    decoder-layer count (as published DFlash configs and the SGLang/vLLM loaders mean it; 0:
    unknown, export refuses), not the captured layers' (`num_context_layers`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    max_position_embeddings: int = 32768
    num_target_layers: int = 0

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise DrafterConfigError(msg)

        need(self.num_hidden_layers >= 1, "num_hidden_layers must be >= 1")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types: one entry per drafter layer")
        need(all(t in LAYER_TYPES for t in self.layer_types), f"layer_types: each one of {LAYER_TYPES}")
        need("sliding_attention" not in self.layer_types or (self.sliding_window or 0) > 0,
             "sliding_window must be set when a layer is sliding_attention")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.head_dim % 2 == 0, "head_dim must be even (RoPE rotates pairs)")
        need(self.block_size >= 2, "block_size must be >= 2")
        need(0 <= self.mask_token_id < self.vocab_size,
             f"mask_token_id {self.mask_token_id} is not a row of the {self.vocab_size}-token embedding")
        need(len(self.target_layer_ids) >= 1 and len(set(self.target_layer_ids)) == len(self.target_layer_ids)
             and min(self.target_layer_ids) >= 0, f"target_layer_ids {self.target_layer_ids}: distinct, >= 0")
        need(self.num_target_layers == 0 or max(self.target_layer_ids) < self.num_target_layers,
             f"target_layer_ids {self.target_layer_ids} outside a {self.num_target_layers}-layer target")

    @property
    def num_context_layers(self) -> int:
        """k: captured target layers concatenated into the context."""
        return len(self.target_layer_ids)

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @classmethod
    def from_target(cls, target_config: dict[str, Any], drafter_cfg: DrafterConfig,
                    layer_ids: Sequence[int] | None, mask_token_id: int) -> "DFlashConfig":
        """Shape a drafter for a target from its HF config.json (text fields may sit under text_config):
        width and vocabulary the target's, heads, head_dim and MLP width too unless the drafter config
        overrides them; layer_ids None/empty: the DFlash default."""
        text = text_config(target_config)

        def get(key: str, default: Any = None) -> Any:
            value = text.get(key, target_config.get(key, default))
            if value is None:
                raise DrafterConfigError(f"target config has no {key!r}")
            return value

        hidden = int(get("hidden_size"))
        heads = drafter_cfg.num_heads or int(get("num_attention_heads"))
        rope = text.get("rope_parameters") or {}
        theta = text.get("rope_theta") or rope.get("rope_theta") or 1_000_000.0
        n_target = int(get("num_hidden_layers"))
        ids = list(layer_ids) if layer_ids else default_layer_ids(n_target, 5)
        if mask_token_id < 0:
            raise DrafterConfigError("mask_token_id must be resolved (from the tokenizer) before building the drafter")
        return cls(
            hidden_size=hidden,
            intermediate_size=drafter_cfg.intermediate_size or int(get("intermediate_size")),
            num_hidden_layers=drafter_cfg.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=drafter_cfg.num_kv_heads or int(text.get("num_key_value_heads") or heads),
            head_dim=drafter_cfg.head_dim or int(text.get("head_dim") or hidden // heads),
            vocab_size=int(get("vocab_size")),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            block_size=drafter_cfg.block_size,
            target_layer_ids=ids,
            mask_token_id=mask_token_id,
            layer_types=list(drafter_cfg.layer_types),
            sliding_window=drafter_cfg.sliding_window or None,
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            num_target_layers=n_target,
        )

    def to_json_dict(self) -> dict[str, Any]:
        """config.json as the serving engines read it (docs/architecture.md, "The DFlash drafter")."""
        d = asdict(self)
        dflash = {"mask_token_id": d.pop("mask_token_id"), "target_layer_ids": d.pop("target_layer_ids")}
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **d,
            # transformers >= 5 reads rope_parameters; rope_theta stays for older readers.
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "tie_word_embeddings": False,
            "dflash_config": dflash,
        }

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        dflash = d.get("dflash_config") or {}
        names = [f for f in cls.__dataclass_fields__ if f not in ("mask_token_id", "target_layer_ids")]
        kwargs = {k: d[k] for k in names if k in d}
        if "rope_theta" not in kwargs and "rope_theta" in (d.get("rope_parameters") or {}):
            kwargs["rope_theta"] = d["rope_parameters"]["rope_theta"]
        try:
            return cls(**kwargs, mask_token_id=dflash.get("mask_token_id", d.get("mask_token_id")),
                       target_layer_ids=dflash.get("target_layer_ids", d.get("target_layer_ids")))
        except TypeError as e:
            raise DrafterConfigError(f"config.json is missing drafter fields: {e}") from None


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, head_dim] cos and sin (fp32) for the rotate-half RoPE convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, heads, head_dim] rotated by per-row angles cos/sin [L, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotated * sin


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[tuple[int, int, int, int]],
                    masks: list[torch.Tensor], block_size: int) -> torch.Tensor:
    """Attention of each segment's queries over [its context keys ; own block], one softmax (CPU path).
    q [1, h, N*B, d]; k, v [1, h_kv, T+N*B, d]; segments and masks: AttentionLayout.split_masks.
    Scores are materialised per segment, [h, rows, ctx keys + B], not [h, N*B, T+N*B]: the keys left
    out (other documents, context from the segment's last anchor on, other blocks) are never visible.
    GQA without copying K/V: each kv head serves its g query heads as g*rows rows of one matmul."""
    _, h, n_q, d = q.shape
    h_kv = k.shape[1]
    g, ctx_len = h // h_kv, k.shape[2] - n_q
    q = q.view(h_kv, g, n_q, d) * d ** -0.5
    k, v = k[0], v[0]
    outs = []
    for (q0, q1, k0, k1), mask in zip(segments, masks):
        rows, n_ctx, n_blk = q1 - q0, k1 - k0, (q1 - q0) // block_size
        q_s = q[:, :, q0:q1]
        k_blk = k[:, ctx_len + q0:ctx_len + q1].reshape(h_kv, 1, n_blk, block_size, d)
        v_blk = v[:, ctx_len + q0:ctx_len + q1].reshape(h_kv, 1, n_blk, block_size, d)
        s_ctx = (q_s.reshape(h_kv, g * rows, d) @ k[:, k0:k1].transpose(1, 2)).view(h_kv, g, rows, n_ctx)
        s_blk = q_s.reshape(h_kv, g, n_blk, block_size, d) @ k_blk.transpose(-1, -2)
        scores = torch.cat([s_ctx, s_blk.view(h_kv, g, rows, block_size)], dim=-1)
        scores = scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        # split (not slicing): its backward concatenates the two gradients instead of
        # zero-filling a full-size buffer per slice.
        p_ctx, p_blk = probs.split([n_ctx, block_size], dim=-1)
        out = (p_ctx.reshape(h_kv, g * rows, n_ctx) @ v[:, k0:k1]).view(h_kv, g, rows, d)
        outs.append(out + (p_blk.reshape(h_kv, g, n_blk, block_size, block_size) @ v_blk).view(h_kv, g, rows, d))
    return torch.cat(outs, dim=2).view(1, h, n_q, d)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fused attention over all T+N*B keys with the dense mask (AttentionLayout.dense_mask)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        # Explicit expansion: SDPA's enable_gqa rules out the memory-efficient CUDA kernel, the
        # only fused one that takes an arbitrary mask.
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class SplitMask:
    """The split path's mask: AttentionLayout.window_segments and the split_masks of one window. A
    plain object, opaque to torch.compile: a compiled layer hands it to the eager split attention
    unopened, so it neither guards on nor recompiles for a batch's number of segments (a tuple
    would be unpacked and guarded on its length)."""

    __slots__ = ("segments", "masks")

    def __init__(self, segments: list[tuple[int, int, int, int]], masks: list[torch.Tensor]) -> None:
        self.segments, self.masks = segments, masks


def split_attention_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SplitMask,
                       block_size: int) -> torch.Tensor:
    return split_attention(q, k, v, mask.segments, mask.masks, block_size)


# What a layer calls for the split and flash paths. Never traced into a compiled layer: the loop
# over a batch's segments would be unrolled into the graph with the segment bounds as constants
# and recompiled for every batch (on torch 2.13, CPU, the second batch even got wrong gradients);
# the flash plan holds host integers likewise. compile_for puts torch.compiler.disable(...) of
# each here, not the import: that loads torch._dynamo (~1 s) into every process.
_layer_split_attention = split_attention_of
_layer_flash_attention = block_flash_attention
# The split path's query rows per segment, scored in one matmul: memory against launches. On the
# H200 (27B widths, published density, eager) 1,024 rows stepped in 7.4 s against 8.6 s with 256:
# a segment is a few small kernels, and 256-row segments are thousands a step.
SEGMENT_ROWS = {"cpu": 256, "cuda": 1024}


HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def flash_kernels_available() -> bool:
    """Whether torch's FlashAttention kernels run here (a CUDA build, an sm80 or newer GPU)."""
    return torch.cuda.is_available() and torch.backends.cuda.is_flash_attention_available() \
        and torch.cuda.get_device_capability()[0] >= 8


def resolve_attention(impl: str, device_type: str, head_dim: int, *, half: bool = True, compiled: bool = True) -> str:
    """The attention path "auto" stands for: split on the CPU (it scores only the visible keys
    and needs no compiler). On CUDA, where FlashAttention's kernels run (a head size they take, a
    multiple of 8 up to 256, and bf16 / fp16 compute, `half`): fa4, one masked FlashAttention 4 call
    a layer (block_mask.py), in a compiled model on an SM90 GPU where flash-attn-4 imports and its
    start-up probe agrees with FlashAttention 2 (`fa4_problem`; else one log line says why); flash,
    FlashAttention 2 over key runs (block_flash.py), otherwise (at the 27B shape and the published
    density 1.088x flex's step on the H200, docs/benchmarks.md). Without them flex, unless the
    head size is one flex has no kernel for (not a power of two >= 16): then sdpa. Any other value
    is returned as it is. (Under flash, sliding-window layers take `sliding_attention_path`.)"""
    if impl != "auto":
        return impl
    if device_type != "cuda":
        return "split"
    if half and head_dim % 8 == 0 and head_dim <= 256 and flash_kernels_available():
        return "fa4" if compiled and fa4_usable(head_dim) else "flash"
    return "flex" if head_dim >= 16 and head_dim & (head_dim - 1) == 0 else "sdpa"


_fa4_reported: set[int] = set()


def fa4_usable(head_dim: int) -> bool:
    """Whether `auto` takes fa4 here (`block_mask.fa4_problem`); the first time it does not, one
    log line says why."""
    problem = fa4_problem(head_dim)
    if problem is not None and head_dim not in _fa4_reported:
        _fa4_reported.add(head_dim)
        log.info("drafter attention: FlashAttention 2 (flash), not FlashAttention 4: %s", problem)
    return problem is None


def sliding_attention_path(device_type: str, compiled: bool) -> str:
    """The path of a sliding-window layer under flash, which has no mask for a window (its key
    runs would need one per query row): flex inside a compiled layer on CUDA, else split (eager
    flex would compile a kernel of its own, what an eager step must not wait for)."""
    return "flex" if device_type == "cuda" and compiled else "split"


class Linear(nn.Linear):
    """nn.Linear without bias whose matmuls run in the drafter's precision (`fp8.linear`): the
    plain one in the compute dtype, or scaled e4m3 (`DFlashDraftModel.precision`). State-dict
    names and checkpoints are nn.Linear's."""

    precision = "bf16"

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.precision)


class DFlashAttention(nn.Module):
    """Block tokens attend to [context ; block tokens]; only block tokens make queries."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.block_size = config.block_size
        self.sliding_window = config.layer_window(layer_idx)
        self.q_proj = Linear(h, self.num_heads * hd)
        self.k_proj = Linear(h, self.num_kv_heads * hd)
        self.v_proj = Linear(h, self.num_kv_heads * hd)
        self.o_proj = Linear(self.num_heads * hd, h)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values of the context [T, H]: k_norm and RoPE (context positions)
        applied, [T, kv heads, head_dim] each. They depend on the context alone, never on a block,
        so a batch computes them once and every chunk of its blocks attends to slices of them."""
        t = context.shape[0]
        k = self.k_norm(self.k_proj(context).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(context).view(t, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin).to(v.dtype), v

    def forward(self, hidden_states: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], mask: Any, attn_impl: str) -> torch.Tensor:
        q_len = hidden_states.shape[0]
        cos, sin = rope                      # the block positions: its queries' and its keys'
        folded = attn_impl in FOLDED_IMPLS
        g, h_kv = self.num_heads // self.num_kv_heads, self.num_kv_heads
        # flash, flex and fa4 fold each key head's g query heads into rows, a view when q's heads
        # come group-major: q_proj's rows reordered so (block_flash.group_major), o_proj's columns alike
        q_weight = group_major(self.q_proj.weight, h_kv, g, dim=0) if folded else self.q_proj.weight
        precision = self.q_proj.precision
        q = self.q_norm(linear(hidden_states, q_weight, precision).view(q_len, self.num_heads, self.head_dim))
        # Block keys/values go through the same projections, k_norm and RoPE as the context's
        # (context_kv) and are appended to them: [context ; block] keys, queries from the block only.
        k = self.k_norm(self.k_proj(hidden_states).view(q_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden_states).view(q_len, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        k = torch.cat([context_k.to(v.dtype), k], dim=0)
        v = torch.cat([context_v.to(v.dtype), v], dim=0)
        if folded:
            if attn_impl == "flash":            # mask: a FlashPlan over the folded query rows
                out = _layer_flash_attention(fold_queries(q, g), k, v, mask)
            else:                               # mask: a BlockMask over them (block_mask.py)
                out = masked_attention(fold_queries(q, g), k, v, mask, fa4=attn_impl == "fa4")
            return linear(unfold_queries(out, g), group_major(self.o_proj.weight, h_kv, g, dim=1), precision)

        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # [1, heads, L, head_dim]
        if attn_impl == "split":
            out = _layer_split_attention(q, k, v, mask, self.block_size)     # mask: a SplitMask
        else:
            out = sdpa_attention(q, k, v, mask)
        return self.o_proj(out.squeeze(0).transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual layer; the context is not normalised here (hidden_norm did that once)."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], mask: Any, attn_impl: str) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), context_k, context_v, rope, mask, attn_impl)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(nn.Module):
    """fc + hidden_norm + layers + norm (trainable) around the target's frozen embed_tokens / lm_head.
    The trainable state dict is exactly the export format (`fc.weight`, `hidden_norm.weight`,
    `layers.N....`, `norm.weight`). split_fc computes fc as sum_i fc_i(h_i) over column blocks
    of the same `fc.weight`, so it never builds the [T, k*H] concatenation (and autograd saves
    views of the planes instead of a copy): a compute choice, not a different model.
    attn_impl: "split" (`split_attention`; fastest on CPU), "sdpa" (a dense boolean mask), "flex"
    and "fa4" (one block-sparse masked call on flex's Triton or FlashAttention 4's kernels,
    block_mask.py), "flash" (FlashAttention 2 over key runs, block_flash.py); "auto":
    `resolve_attention`. All evaluate AttentionLayout.visible and agree numerically (tests)."""

    FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")

    def __init__(self, config: DFlashConfig, split_fc: bool = False, attn_impl: str = "auto",
                 precision: str = "bf16") -> None:
        super().__init__()
        if attn_impl not in ATTN_IMPLS:
            raise DrafterConfigError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        self.config = config
        self.split_fc = split_fc
        self.attn_impl = attn_impl
        self.checkpoint_layers = False      # recompute layer activations in backward (GPU memory)
        self.segment_rows = 0               # split path: query rows scored per segment; 0: SEGMENT_ROWS by device
        self.compiled = False               # set by compile_for
        self.attention_ran: str | None = None   # the path(s) the last forward's attention took (trainer status)
        h = config.hidden_size
        self.fc = Linear(config.num_context_layers * h, h)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.embed_tokens = FrozenTargetWeight(h)
        self.lm_head = FrozenTargetWeight(h)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        self.precision = precision

    @property
    def precision(self) -> str:
        """The matmul precision of every linear layer and of the loss head: "bf16" (the compute
        dtype), "fp8" or "fp8-emulated" (`fp8.py`); resolved, never "auto" (fp8.resolve_precision)."""
        return self.fc.precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in ("bf16", "fp8", "fp8-emulated"):
            raise DrafterConfigError(f"precision must be bf16, fp8 or fp8-emulated (resolved), got {value!r}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.precision = value

    @contextlib.contextmanager
    def as_served(self) -> Iterator[None]:
        """The drafter's matmuls as serving runs them (the compute dtype, no FP8) inside the block,
        whatever precision trains it: held-out eval measures the drafter that will be exported,
        not FP8's rounding of its logits."""
        trained = self.precision
        self.precision = "bf16"
        try:
            yield
        finally:
            self.precision = trained

    # -- the target's frozen head ------------------------------------------------------------
    def set_target_head(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Install the target's [V, H] embedding and head (None: tied to the embedding)."""
        shape = (self.config.vocab_size, self.config.hidden_size)
        for name, w in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if w is not None and tuple(w.shape) != shape:
                raise TargetHeadError(f"{name} has shape {tuple(w.shape)}, the drafter needs {list(shape)}")
        device = self.fc.weight.device
        embed = nn.Parameter(embed_tokens.detach().to(device), requires_grad=False)
        self.embed_tokens.weight = embed
        self.lm_head.weight = embed if lm_head is None else nn.Parameter(lm_head.detach().to(device),
                                                                         requires_grad=False)

    def load_target_head(self, target_dir: str, dtype: torch.dtype | None = None) -> None:
        """Read only embed_tokens and lm_head from the target checkpoint (see target_head.py)."""
        head = read_target_head(target_dir, device=self.fc.weight.device, dtype=dtype)
        self.set_target_head(head.embed_tokens, None if head.tied else head.lm_head)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The state to checkpoint and export: everything except the frozen target tensors."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.FROZEN_PREFIXES)}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict on the trainable keys; the frozen head is loaded separately from the target."""
        expected = set(self.trainable_state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise DrafterConfigError(f"drafter state mismatch: missing {missing[:6]}, unexpected {unexpected[:6]}")
        self.load_state_dict(state, strict=False)

    # -- execution -----------------------------------------------------------------------------
    def compile_for(self, device: torch.device | str, mode: str = "auto") -> bool:
        """Compile (or, with "off", stop compiling) each decoder layer and hidden_norm / norm in place;
        whether the model is compiled now. Asking again for the current state changes nothing (a
        second Module.compile would trace anew).

        Around the GEMMs a layer is a chain of small elementwise kernels (fp32 RMSNorm: cast,
        square, mean, rsqrt, scale, cast; RoPE: concatenated halves, two products and a sum;
        SwiGLU; residual adds; autocast's casts), each one a pass over the activations in memory;
        compiled, inductor fuses each chain into a kernel or two. The GEMMs and attention stay
        what they were (cuBLAS, the SDPA kernels; flex becomes part of the layer's graph). The
        math is unchanged (tests compare with eager): emulate_precision_casts makes a fused kernel
        round to bf16 wherever eager does (RMSNorm's cast before the fp32 gain, SwiGLU's silu),
        where inductor would keep the fp32 intermediate. Module.compile keeps the modules: state
        dict keys, checkpoints and export are the eager model's. "auto" compiles on CUDA only: on
        the CPU (tests, the demo) the compile time is not repaid. Shapes are dynamic (T changes with
        every batch); split and flash attention run eager between a layer's compiled graphs
        (`_layer_split_attention`)."""
        global _layer_split_attention, _layer_flash_attention
        if mode not in COMPILE_MODES:
            raise DrafterConfigError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
        on = mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")
        if on == self.compiled:
            return on
        if on and _layer_split_attention is split_attention_of:
            _layer_split_attention = torch.compiler.disable(split_attention_of)
            _layer_flash_attention = torch.compiler.disable(block_flash_attention)
            from torch._dynamo import config as dynamo_config

            # One layer's code serves inputs with and without grad (layer 0 takes the frozen
            # embedding), the warm-up's and the batches' shapes, eval: on the H100 the trainer's
            # fa4 layer passed dynamo's default of 8 graphs, past which a new case runs eager.
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, LAYER_RECOMPILE_LIMIT)
        for module in (self.hidden_norm, *self.layers, self.norm):
            if on:
                module.compile(dynamic=True, options=dict(LAYER_COMPILE_OPTIONS))
            else:
                module._compiled_call_impl = None      # what Module.compile set; eager again
        self.compiled = on
        return on

    # -- forward -------------------------------------------------------------------------------
    def check_context(self, target_hidden: torch.Tensor, layer_ids: Sequence[int] | None) -> None:
        """Refuse captured states from the wrong layers, or with zero / non-finite token rows: an
        all-zero row is never a real hidden state (the residual stream carries the embedding) but a
        capture that did not happen (hybrid-layer hooks, padding rows of a batched forward). Costs
        one O(k*T*H) reduction and one device sync per batch."""
        k, h = self.config.num_context_layers, self.config.hidden_size
        if target_hidden.dim() != 3 or target_hidden.shape[0] != k or target_hidden.shape[2] != h:
            raise ContextError(f"target_hidden shape {tuple(target_hidden.shape)}, expected [{k}, T, {h}] "
                               f"(planes for target layers {self.config.target_layer_ids})")
        if layer_ids is not None and [int(i) for i in layer_ids] != self.config.target_layer_ids:
            raise ContextError(f"captured layers {list(layer_ids)} are not the drafter's target_layer_ids "
                               f"{self.config.target_layer_ids} (same ids, same order)")
        row_max = torch.linalg.vector_norm(target_hidden, ord=float("inf"), dim=-1)   # [k, T]
        bad = ~(row_max > 0) | ~torch.isfinite(row_max)
        if bool(bad.any()):
            plane, token = (int(x) for x in bad.nonzero()[0])
            zero = int((row_max == 0).sum())
            raise ContextError(f"{int(bad.sum())} captured rows are all-zero ({zero}) or non-finite; first: "
                               f"layer {self.config.target_layer_ids[plane]} token {token}")

    def check_token_ids(self, ids: torch.Tensor, what: str) -> None:
        """Refuse ids outside the embedding: on CUDA an out-of-range lookup is a device assert
        that kills the process instead of skipping one batch."""
        if not ids.numel():
            return
        low, high = torch.stack(torch.aminmax(ids)).tolist()   # one device read, not two
        if low < 0 or high >= self.config.vocab_size:
            raise ContextError(f"{what}: token ids in [{low}, {high}] outside the {self.config.vocab_size}-token "
                               "vocabulary")

    def fc_project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[k, T, H] captured planes -> [T, H] = fc(concat of the planes), concatenated or split."""
        k, t, h = target_hidden.shape
        if not self.split_fc:
            return self.fc(target_hidden.permute(1, 0, 2).reshape(t, k * h))
        fc_i = self.fc.weight.view(h, k, h).unbind(1)            # column block i multiplies plane i
        if self.precision != "bf16":
            return sum(linear(target_hidden[i], fc_i[i], self.precision) for i in range(k))
        context = F.linear(target_hidden[0], fc_i[0])
        for i in range(1, k):
            context = torch.addmm(context, target_hidden[i], fc_i[i].t())
        return context

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The context features every layer reads: hidden_norm(fc(target_hidden))."""
        return self.hidden_norm(self.fc_project(target_hidden))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.embed_tokens.loaded:
            raise TargetHeadError("the target's embed_tokens is not loaded (load_target_head / set_target_head)")
        return F.embedding(input_ids, self.embed_tokens.weight)

    def forward(self, target_hidden: torch.Tensor, block_input_ids: torch.Tensor, blocks: BlockBatch,
                *, layer_ids: Sequence[int] | None = None) -> torch.Tensor:
        """[N, B, H] block hidden states after the final norm (logits: `compute_logits`) of
        target_hidden [k, T, H] planes in target_layer_ids order (pass the capture's layer_ids to
        have the order checked), block_input_ids [N, B] and the blocks' positions, documents and
        validity (build_blocks)."""
        self.check_context(target_hidden, layer_ids)
        self.check_token_ids(block_input_ids, "block_input_ids")
        n, b = block_input_ids.shape
        if (n, b) != (blocks.num_blocks, blocks.block_size) or target_hidden.shape[1] != blocks.num_context:
            raise ContextError(f"blocks describe {blocks.num_blocks}x{blocks.block_size} blocks over "
                               f"{blocks.num_context} tokens; got {n}x{b} over {target_hidden.shape[1]}")
        dtype = self.fc.weight.dtype
        if not torch.is_autocast_enabled(target_hidden.device.type):
            target_hidden = target_hidden.to(dtype)
        noise_embedding = self.embed(block_input_ids.reshape(n * b)).to(dtype)
        context_kv = self.context_kv(target_hidden, blocks.context_positions)
        return self.decode_blocks(noise_embedding, context_kv, blocks).view(n, b, -1)

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context's keys and values: hidden_norm(fc(target_hidden)) through the
        layer's k_proj / k_norm / RoPE and v_proj. positions [T]: each context token's position in
        its document."""
        return self.context_kv_of(self.fc_project(target_hidden), positions)

    def context_kv_of(self, projected: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`context_kv` from fc's output [T, H] on: hidden_norm, then each layer's keys and values."""
        context = self.hidden_norm(projected)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def decode_blocks(self, noise_embedding: torch.Tensor, context_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      blocks: BlockBatch) -> torch.Tensor:
        """[N*B, H] embedded block tokens + each layer's context keys/values -> [N*B, H] after the
        final norm. `context_kv` covers exactly the context tokens of `blocks` (a batch's, or a
        chunk's slice: `BlockBatch.chunks`). No input checks: the trainer's kernel warm-up runs it
        on random inputs before the target's head is loaded."""
        device = noise_embedding.device
        segment_rows = self.segment_rows or SEGMENT_ROWS.get(device.type, SEGMENT_ROWS["cpu"])
        layout = AttentionLayout.from_blocks(blocks, segment_rows)
        cfg = self.config
        rope = rope_cos_sin(layout.query_pos, cfg.head_dim, cfg.rope_theta)
        windows = {layer.self_attn.sliding_window for layer in self.layers}
        half = noise_embedding.dtype in HALF_DTYPES or (
            torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) in HALF_DTYPES)
        impl = resolve_attention(self.attn_impl, device.type, cfg.head_dim, half=half, compiled=self.compiled)
        if impl in ("flash", "fa4") and device.type == "cuda" and not half:
            raise DrafterConfigError(f"drafter.attn {impl} runs FlashAttention's kernels: on CUDA they need bf16 or "
                                     "fp16 compute (train.compute_dtype), not fp32")
        sliding = sliding_attention_path(device.type, self.compiled)
        impls = {w: sliding if impl == "flash" and w is not None else impl for w in windows}
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        make_mask = {"split": lambda w: SplitMask(layout.window_segments(w), layout.split_masks(w)),
                     "sdpa": layout.dense_mask,
                     "flex": lambda w: block_mask_of_blocks(blocks, groups, w, static=self.compiled),
                     "fa4": lambda w: block_mask_of_blocks(blocks, groups, w, static=self.compiled),
                     "flash": lambda w: plan_of_blocks(blocks, max(1, segment_rows // cfg.block_size), groups)}
        masks = {w: make_mask[impls[w]](w) for w in windows}
        self.attention_ran = "+".join(sorted(set(impls.values())))

        hidden_states = noise_embedding
        for layer, (context_k, context_v) in zip(self.layers, context_kv):
            window = layer.self_attn.sliding_window
            args = (hidden_states, context_k, context_v, rope, masks[window], impls[window])
            if self.checkpoint_layers and torch.is_grad_enabled():
                hidden_states = checkpoint(layer, *args, use_reentrant=False)
            else:
                hidden_states = layer(*args)
        return self.norm(hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits through the frozen lm_head (decode/eval; training uses the chunked loss)."""
        if not self.lm_head.loaded:
            raise TargetHeadError("the target's lm_head is not loaded (load_target_head / set_target_head)")
        return F.linear(hidden.to(self.lm_head.weight.dtype), self.lm_head.weight)
