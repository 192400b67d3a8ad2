"""The DFlash drafter for Transformers' `trust_remote_code` path (imports torch and transformers only).

dfpipe copies this file verbatim into every export folder; config.json names it in `auto_map`, so

    draft = AutoModel.from_pretrained(export_dir, trust_remote_code=True)

builds this model from the exported weights. Without `trust_remote_code=True` Transformers reads
`model_type: "qwen3"` and builds a plain Qwen3Model instead (fc / hidden_norm dropped, random
embeddings): the `qwen3` model type and the `DFlashDraftModel` architecture are what SGLang and
vLLM read, so they stay.

The export holds the drafter's own weights only. Its token embedding and output head are the
target's and are never exported: set them with `set_target_embeddings` (from the target model
the drafter was trained for) before passing token ids or asking for logits; until then those
calls raise instead of computing with random weights.

What the drafter computes (the DFlash paper, arXiv 2602.06036):

    target_hidden  [T, k*H] (k captured target layers concatenated, in target_layer_ids order)
                   or [k, T, H] planes     -> fc -> hidden_norm                 = context [T, H]
    block tokens   [N, B]  (anchor token, then MASK x (B-1)) -> target embedding  = [N*B, H]
    num_hidden_layers x layer: queries from the block tokens only; keys / values from
                   [context ; block tokens] through the layer's k_proj / v_proj, then k_norm and
                   RoPE at each token's position
    -> norm -> [N, B, H]  (logits: the target's lm_head, `compute_logits`)

Who attends to whom, for block n with anchor position a = position_ids[n, 0]:
    context token j   when it belongs to the block's sequence and its position is < a
    block token       when it is in the same block (bidirectional inside the block)
    sliding_attention layers additionally: 0 <= query position - key position < sliding_window
One sequence at serve time needs no sequence ids: all context tokens precede the anchor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

SET_TARGET = "set_target_embeddings(target.get_input_embeddings(), target.get_output_embeddings())"


class DFlashRMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_theta_of(config: Qwen3Config) -> float:
    """The RoPE base; only the default (unscaled) RoPE is what DFlash drafters are trained with."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"DFlash drafter: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("DFlash drafter: config.json has no rope_theta")
    return float(theta)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, head_dim] cos and sin (fp32) for the rotate-half RoPE convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, heads, head_dim] rotated by per-row angles cos / sin [L, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :].to(x.dtype) + rotated * sin[:, None, :].to(x.dtype)


def dflash_attention_mask(context_position_ids: torch.Tensor, context_sequence_ids: torch.Tensor,
                          position_ids: torch.Tensor, block_sequence_ids: torch.Tensor,
                          sliding_window: int | None) -> torch.Tensor:
    """[N*B, T+N*B] bool: which of [context ; block tokens] each block token may attend to.

    context_position_ids / context_sequence_ids [T]; position_ids [N, B]; block_sequence_ids [N]
    (see the module docstring for the rule).
    """
    n, b = position_ids.shape
    device = position_ids.device
    query_pos = position_ids.reshape(-1)
    query_seq = block_sequence_ids.repeat_interleave(b)
    query_anchor = position_ids[:, 0].repeat_interleave(b)
    query_block = torch.arange(n, device=device).repeat_interleave(b)

    context = (context_sequence_ids[None, :] == query_seq[:, None]) \
        & (context_position_ids[None, :] < query_anchor[:, None])
    own_block = query_block[:, None] == query_block[None, :]
    mask = torch.cat([context, own_block], dim=1)
    if sliding_window is not None:
        distance = query_pos[:, None] - torch.cat([context_position_ids, query_pos])[None, :]
        mask &= (distance >= 0) & (distance < sliding_window)
    return mask


class DFlashAttention(nn.Module):
    """Block tokens attend to [context ; block tokens]; only block tokens make queries."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.sliding_window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = DFlashRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(hd, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        q_len, ctx_len = hidden_states.shape[0], context.shape[0]
        q_cos, q_sin, k_cos, k_sin = rope
        q = self.q_norm(self.q_proj(hidden_states).view(q_len, self.num_heads, self.head_dim))
        # Context and block keys / values share this layer's projections; k_norm and RoPE apply
        # to the concatenation, so context keys are rotated by their own positions.
        k = torch.cat([self.k_proj(context), self.k_proj(hidden_states)], dim=0)
        v = torch.cat([self.v_proj(context), self.v_proj(hidden_states)], dim=0)
        k = self.k_norm(k.view(ctx_len + q_len, self.num_kv_heads, self.head_dim))
        v = v.view(ctx_len + q_len, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, q_cos, q_sin).to(v.dtype), apply_rope(k, k_cos, k_sin).to(v.dtype)

        groups = self.num_heads // self.num_kv_heads
        q = q.transpose(0, 1).unsqueeze(0)                                      # [1, heads, N*B, d]
        k = k.transpose(0, 1).repeat_interleave(groups, dim=0).unsqueeze(0)    # [1, heads, T+N*B, d]
        v = v.transpose(0, 1).repeat_interleave(groups, dim=0).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.squeeze(0).transpose(0, 1).reshape(q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual layer; the context is not normalised here (hidden_norm did that once)."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor,
                rope: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), context, rope, mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(PreTrainedModel):
    """fc + hidden_norm + decoder layers + norm; the token embedding and lm_head are the target's.

    Weights: `fc.weight` [H, k*H], `hidden_norm.weight`, `layers.N.*`, `norm.weight`; nothing
    else is loaded and nothing is left to random initialisation.
    """

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
            raise ValueError("DFlash drafter: config.json needs dflash_config.target_layer_ids and .mask_token_id")
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(config.block_size)
        self.rope_theta = rope_theta_of(config)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        # The target's [V, H] matrices, held outside the module tree: they are neither part of
        # this checkpoint nor moved / saved with it.
        self._target_embed: torch.Tensor | None = None
        self._target_lm_head: torch.Tensor | None = None
        self.post_init()

    # -- the target's embedding and head -------------------------------------------------------
    def set_target_embeddings(self, embed_tokens: nn.Module | torch.Tensor,
                              lm_head: nn.Module | torch.Tensor | None = None) -> None:
        """Use the target's token embedding and output head (modules or [V, H] weights).

        E.g. `draft.set_target_embeddings(target.get_input_embeddings(), target.get_output_embeddings())`.
        lm_head None: the target ties its head to the embedding.
        """
        shape = (self.config.vocab_size, self.config.hidden_size)
        weights = []
        for name, w in (("embed_tokens", embed_tokens), ("lm_head", lm_head if lm_head is not None else embed_tokens)):
            w = w.weight if isinstance(w, nn.Module) else w
            if tuple(w.shape) != shape:
                raise ValueError(f"DFlash drafter: the target's {name} has shape {tuple(w.shape)}, "
                                 f"this drafter needs {list(shape)} (is it the target it was trained for?)")
            weights.append(w.detach())
        self._target_embed, self._target_lm_head = weights

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._target_embed is None:
            raise RuntimeError(f"DFlash drafter: the export has no token embedding, it is the target's: "
                               f"call {SET_TARGET} first, or pass inputs_embeds")
        vocab = self._target_embed.shape[0]
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            # on CUDA an out-of-range lookup is a device assert, not an exception
            raise ValueError(f"DFlash drafter: token ids in [{int(input_ids.min())}, {int(input_ids.max())}] "
                             f"outside the {vocab}-token vocabulary")
        return F.embedding(input_ids, self._target_embed)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits through the target's lm_head."""
        if self._target_lm_head is None:
            raise RuntimeError(f"DFlash drafter: the export has no lm_head, it is the target's: "
                               f"call {SET_TARGET} first")
        return F.linear(hidden_states.to(self._target_lm_head.dtype), self._target_lm_head)

    # -- forward -------------------------------------------------------------------------------
    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[T, k*H] or [k, T, H] captured target states -> [T, H] = hidden_norm(fc(concatenation))."""
        k, h = len(self.target_layer_ids), self.config.hidden_size
        if target_hidden.dim() == 3 and target_hidden.shape[0] == k and target_hidden.shape[2] == h:
            target_hidden = target_hidden.permute(1, 0, 2).reshape(target_hidden.shape[1], k * h)
        elif not (target_hidden.dim() == 2 and target_hidden.shape[1] == k * h):
            raise ValueError(f"DFlash drafter: target_hidden has shape {tuple(target_hidden.shape)}, expected "
                             f"[T, {k * h}] or [{k}, T, {h}] (target layers {self.target_layer_ids})")
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(self, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                context_position_ids: torch.Tensor | None = None,
                context_sequence_ids: torch.Tensor | None = None,
                block_sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[N, B, H] hidden states of N blocks of B tokens after the final norm.

        target_hidden         [T, k*H] or [k, T, H]: the target's hidden states at target_layer_ids
                              for the T context tokens.
        position_ids          [N, B]: each block token's position; position_ids[n, 0] is the anchor's.
        input_ids             [N, B]: anchor token then mask_token_id (needs set_target_embeddings),
          or inputs_embeds    [N, B, H]: the same tokens through the target's embedding.
        context_position_ids  [T]: position of each context token (default 0..T-1).
        context_sequence_ids  [T] and block_sequence_ids [N]: which packed sequence each context
                              token and each block belongs to (default: all one sequence).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("DFlash drafter: pass exactly one of input_ids and inputs_embeds")
        embeds = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if embeds.dim() != 3 or embeds.shape[:2] != position_ids.shape or embeds.shape[2] != self.config.hidden_size:
            raise ValueError(f"DFlash drafter: block tokens {tuple(embeds.shape)}, position_ids "
                             f"{tuple(position_ids.shape)}: expected [N, B] ids or [N, B, H] embeddings "
                             "and [N, B] positions")
        n, b = position_ids.shape
        context = self.project_context(target_hidden)
        t, device = context.shape[0], context.device
        if context_position_ids is None:
            context_position_ids = torch.arange(t, device=device)
        if context_sequence_ids is None:
            context_sequence_ids = torch.zeros(t, dtype=torch.long, device=device)
        if block_sequence_ids is None:
            block_sequence_ids = torch.zeros(n, dtype=torch.long, device=device)
        if context_position_ids.shape != (t,) or context_sequence_ids.shape != (t,) or block_sequence_ids.shape != (n,):
            raise ValueError(f"DFlash drafter: context_position_ids / context_sequence_ids must be [{t}], "
                             f"block_sequence_ids [{n}]")

        query_pos = position_ids.reshape(-1)
        key_pos = torch.cat([context_position_ids.to(query_pos.dtype), query_pos])
        cfg = self.config
        rope = (*rope_cos_sin(query_pos, cfg.head_dim, self.rope_theta),
                *rope_cos_sin(key_pos, cfg.head_dim, self.rope_theta))
        masks = {w: dflash_attention_mask(context_position_ids, context_sequence_ids, position_ids,
                                          block_sequence_ids, w)
                 for w in {layer.self_attn.sliding_window for layer in self.layers}}

        hidden_states = embeds.reshape(n * b, -1).to(self.fc.weight.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, rope, masks[layer.self_attn.sliding_window])
        return self.norm(hidden_states).view(n, b, -1)
