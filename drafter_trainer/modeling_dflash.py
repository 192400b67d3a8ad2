"""The DFlash drafter for Transformers' `trust_remote_code` path (imports torch, transformers and the
standard library only).

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

The reference loader's API (DFlash's own `model.py`, whose README usage runs on this export):

    output = draft.spec_generate(input_ids=input_ids, max_new_tokens=2048, temperature=0.0, target=target,
                                 stop_token_ids=[tokenizer.eos_token_id])     # [1, prompt + new tokens]
    hidden = draft(target_hidden=ctx [1, T, k*H], noise_embedding=[1, B, H] (block tokens through the target's
                   embedding), position_ids=[1, T + B] (the context's, then the block's),
                   past_key_values=DynamicCache | None, use_cache=...)   -> [1, B, H]
    logits = draft.compute_logits(hidden, target.get_output_embeddings())

With a cache, each call appends its context's and block's keys and values and attends to all it
holds (the earlier context, at the positions just before this call's); the caller crops the
block's entries away before the next call (`cache.crop(-B)`), as the reference's loop does.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config

SET_TARGET = "set_target_embeddings(target.get_input_embeddings(), target.get_output_embeddings())"


def _weight(module_or_tensor: nn.Module | torch.Tensor) -> torch.Tensor:
    return (module_or_tensor.weight if isinstance(module_or_tensor, nn.Module) else module_or_tensor).detach()


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep a cache's first `length` positions (a negative crop removes from the end, in every
    transformers release that has one)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's decoder layers (a CausalLM's `model.layers`, or its language model's)."""
    base = getattr(target, "model", target)
    base = getattr(base, "language_model", base)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ValueError(f"DFlash drafter: cannot find the decoder layers of {type(target).__name__}")
    return base.layers


def _target_cache(target: nn.Module) -> DynamicCache | None:
    """A KV cache for the target when a rejected draft can be cropped out of it: full attention
    layers only. A hybrid target (Gated DeltaNet's recurrent state, sliding windows) is run over the
    whole sequence at every step instead."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    types = getattr(text, "layer_types", None)
    return DynamicCache() if not types or set(types) == {"full_attention"} else None


def _one_greedy_prompt(input_ids, temperature: float) -> torch.Tensor:
    """spec_generate's prompt: [1, P] ids (or the BatchEncoding holding them), refused unless
    greedy and one prompt of at least one token."""
    if temperature > 0:
        raise ValueError(f"DFlash drafter: spec_generate decodes greedily (temperature=0.0), got temperature "
                         f"{temperature}; sample with a serving engine (SGLang, vLLM)")
    if not isinstance(input_ids, torch.Tensor) and "input_ids" in input_ids:
        input_ids = input_ids["input_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"DFlash drafter: input_ids {tuple(input_ids.shape)}: one prompt, [1, P] with P >= 1")
    return input_ids


def _reference_block(noise_embedding: torch.Tensor, position_ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference loader's call (one block, [1, B, H] noise_embedding, [1, T + B] positions) ->
    (inputs_embeds [1, B, H], context_position_ids [T], position_ids [1, B])."""
    b = noise_embedding.shape[1] if noise_embedding.dim() == 3 else 0
    t = position_ids.shape[-1] - b
    if not b or noise_embedding.shape[0] != 1 or position_ids.shape != (1, t + b) or t < 0:
        raise ValueError(f"DFlash drafter: noise_embedding {tuple(noise_embedding.shape)} and position_ids "
                         f"{tuple(position_ids.shape)}: expected [1, B, H] and [1, T + B] (the context's "
                         "positions, then the block's)")
    return noise_embedding, position_ids[0, :t], position_ids[:, t:]


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
        self.layer_idx = layer_idx
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
                mask: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
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
        if cache is not None:   # the earlier context's keys and values first, then this call's
            k, v = (x.squeeze(0).transpose(0, 1) for x in cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                                        self.layer_idx))

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
                rope: tuple[torch.Tensor, ...], mask: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), context, rope, mask,
                                                       cache)
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
    def _target_matrix(self, name: str, module_or_tensor: nn.Module | torch.Tensor) -> torch.Tensor:
        """The target's [V, H] embedding or head, refused when its shape is not this drafter's."""
        w = _weight(module_or_tensor)
        shape = (self.config.vocab_size, self.config.hidden_size)
        if tuple(w.shape) != shape:
            raise ValueError(f"DFlash drafter: the target's {name} has shape {tuple(w.shape)}, "
                             f"this drafter needs {list(shape)} (is it the target it was trained for?)")
        return w

    def set_target_embeddings(self, embed_tokens: nn.Module | torch.Tensor,
                              lm_head: nn.Module | torch.Tensor | None = None) -> None:
        """Use the target's token embedding and output head (modules or [V, H] weights).

        E.g. `draft.set_target_embeddings(target.get_input_embeddings(), target.get_output_embeddings())`.
        lm_head None: the target ties its head to the embedding.
        """
        self._target_embed = self._target_matrix("embed_tokens", embed_tokens)
        self._target_lm_head = self._target_matrix("lm_head", lm_head if lm_head is not None else embed_tokens)

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

    def compute_logits(self, hidden_states: torch.Tensor,
                       output_head: nn.Module | torch.Tensor | None = None) -> torch.Tensor:
        """Logits through the target's lm_head: `output_head` (the reference loader passes
        `target.get_output_embeddings()`), else the one `set_target_embeddings` gave."""
        head = self._target_matrix("lm_head", output_head) if output_head is not None else self._target_lm_head
        if head is None:
            raise RuntimeError(f"DFlash drafter: the export has no lm_head, it is the target's: "
                               f"call {SET_TARGET} first, or pass the target's output head")
        return F.linear(hidden_states.to(head.dtype), head)

    # -- forward -------------------------------------------------------------------------------
    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[T, k*H], [1, T, k*H] or [k, T, H] captured target states -> [T, H] = hidden_norm(fc(concatenation))."""
        k, h = len(self.target_layer_ids), self.config.hidden_size
        if target_hidden.dim() == 3 and target_hidden.shape[0] == 1 and target_hidden.shape[2] == k * h:
            target_hidden = target_hidden[0]            # the reference loader's batch of one
        elif target_hidden.dim() == 3 and target_hidden.shape[0] == k and target_hidden.shape[2] == h:
            target_hidden = target_hidden.permute(1, 0, 2).reshape(target_hidden.shape[1], k * h)
        if not (target_hidden.dim() == 2 and target_hidden.shape[1] == k * h):
            raise ValueError(f"DFlash drafter: target_hidden has shape {tuple(target_hidden.shape)}, expected "
                             f"[T, {k * h}], [1, T, {k * h}] or [{k}, T, {h}] (target layers {self.target_layer_ids})")
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(self, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                context_position_ids: torch.Tensor | None = None,
                context_sequence_ids: torch.Tensor | None = None,
                block_sequence_ids: torch.Tensor | None = None, *,
                noise_embedding: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: DynamicCache | None = None, use_cache: bool = False,
                is_causal: bool = False) -> torch.Tensor:
        """[N, B, H] hidden states of N blocks of B tokens after the final norm.

        target_hidden         [T, k*H] or [k, T, H]: the target's hidden states at target_layer_ids
                              for the T context tokens.
        position_ids          [N, B]: each block token's position; position_ids[n, 0] is the anchor's.
        input_ids             [N, B]: anchor token then mask_token_id (needs set_target_embeddings),
          or inputs_embeds    [N, B, H]: the same tokens through the target's embedding.
        context_position_ids  [T]: position of each context token (default 0..T-1).
        context_sequence_ids  [T] and block_sequence_ids [N]: which packed sequence each context
                              token and each block belongs to (default: all one sequence).

        The reference loader's keywords (module docstring) describe one sequence and one block:
        noise_embedding [1, B, H] for inputs_embeds, target_hidden [1, T, k*H], position_ids
        [1, T + B], past_key_values (its earlier context) and use_cache, which it needs not: a cache
        passed is used. attention_mask must stay None and is_causal False (the mask is the rule above).
        """
        if attention_mask is not None or is_causal:
            raise ValueError("DFlash drafter: it builds its own attention mask (the block sees its context and "
                             "itself, both ways): pass attention_mask=None and is_causal=False")
        if noise_embedding is not None:
            if input_ids is not None or inputs_embeds is not None:
                raise ValueError("DFlash drafter: pass noise_embedding or input_ids / inputs_embeds, not both")
            inputs_embeds, context_position_ids, position_ids = _reference_block(noise_embedding, position_ids)
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
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        if cached and (n != 1 or bool(context_sequence_ids.any())):
            raise ValueError("DFlash drafter: past_key_values holds one sequence's context: one block, no sequence ids")

        query_pos = position_ids.reshape(-1)
        context_position_ids = context_position_ids.to(query_pos.dtype)
        key_pos = torch.cat([context_position_ids, query_pos])
        cfg = self.config
        rope = (*rope_cos_sin(query_pos, cfg.head_dim, self.rope_theta),
                *rope_cos_sin(key_pos, cfg.head_dim, self.rope_theta))
        if cached:   # the cache's context sits at the positions just before this call's first
            first = context_position_ids[0] if t else query_pos[0]
            context_position_ids = torch.cat([first - cached + torch.arange(cached, device=device), context_position_ids])
            context_sequence_ids = torch.zeros(cached + t, dtype=torch.long, device=device)
        masks = {w: dflash_attention_mask(context_position_ids, context_sequence_ids, position_ids,
                                          block_sequence_ids, w)
                 for w in {layer.self_attn.sliding_window for layer in self.layers}}

        hidden_states = embeds.reshape(n * b, -1).to(self.fc.weight.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, rope, masks[layer.self_attn.sliding_window], past_key_values)
        return self.norm(hidden_states).view(n, b, -1)

    # -- the reference loader's decoding loop ------------------------------------------------------
    @torch.no_grad()
    def spec_generate(self, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0, *, mask_token_id: int | None = None) -> torch.Tensor:
        """DFlash speculative decoding of one prompt with `target`, greedy: [1, P + n], the prompt and
        what the target's plain greedy decoding generates, token for token (lossless), cut after the
        first stop token (kept) or at max_new_tokens.

        Each step drafts one block at the newest verified token (this model, its context the
        target's captured layers so far), runs the target once over it, keeps the drafts equal to the
        target's own choices and takes the target's next choice after them. The target keeps a KV
        cache when every layer is full attention (cropped past rejected drafts); a hybrid target is
        recomputed over the whole sequence each step. input_ids may be the BatchEncoding that
        `apply_chat_template(..., return_tensors="pt")` returns. top_p and top_k matter only when
        sampling, which this export does not do: temperature must be 0.
        """
        input_ids = _one_greedy_prompt(input_ids, temperature)
        self.eval()
        embed = self._target_matrix("embed_tokens", target.get_input_embeddings())
        head = self._target_matrix("lm_head", target.get_output_embeddings())
        mask = self.mask_token_id if mask_token_id is None else int(mask_token_id)
        stop = {int(i) for i in stop_token_ids or []}
        device = embed.device
        captured: dict[int, torch.Tensor] = {}
        layers = _decoder_layers(target)
        hooks = [layers[layer].register_forward_hook(
            lambda _m, _a, out, plane=plane: captured.__setitem__(plane, (out[0] if isinstance(out, tuple) else out)[0]))
            for plane, layer in enumerate(self.target_layer_ids)]
        target_cache, draft_cache = _target_cache(target), DynamicCache()
        # transformers renames the cache argument (`past_key_values`, then `cache`)
        cache_name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        cache_kwarg = {cache_name: target_cache} if target_cache is not None else {}

        def verify(sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
            """The target over the positions its cache lacks: (logits, captured context [L, k*H], first position)."""
            first = target_cache.get_seq_length() if target_cache is not None else 0
            ids = torch.tensor([sequence[first:]], device=device)
            logits = target(input_ids=ids, position_ids=torch.arange(first, len(sequence), device=device)[None],
                            use_cache=target_cache is not None, **cache_kwarg).logits[0]
            return logits, torch.cat([captured[p] for p in range(len(self.target_layer_ids))], dim=-1), first

        try:
            prompt = input_ids[0].tolist()
            logits, context, _ = verify(prompt)
            out = [int(logits[-1].argmax())]
            while out[-1] not in stop and len(out) < max_new_tokens:
                anchor = len(prompt) + len(out) - 1                  # the newest verified token's position
                block = torch.full((1, self.block_size), mask, device=device)
                block[0, 0] = out[-1]
                hidden = self(target_hidden=context[None], noise_embedding=F.embedding(block, embed),
                              position_ids=torch.arange(anchor - len(context), anchor + self.block_size,
                                                        device=device)[None],
                              past_key_values=draft_cache, use_cache=True)
                _crop(draft_cache, anchor)                           # the block's keys go; the context stays
                draft = self.compute_logits(hidden[0, 1:], head).argmax(-1).tolist()
                logits, features, first = verify(prompt + out + draft)
                choices = logits[anchor - first:].argmax(-1).tolist()   # the target's token after anchor + i
                accepted = 0
                while accepted < len(draft) and draft[accepted] == choices[accepted]:
                    accepted += 1
                out += draft[:accepted] + [choices[accepted]]
                context = features[anchor - first:anchor - first + accepted + 1]   # the verified positions
                if target_cache is not None:
                    _crop(target_cache, anchor + accepted + 1)          # the rejected drafts go
                if any(t in stop for t in out[-(accepted + 1):]):
                    break
        finally:
            for hook in hooks:
                hook.remove()
        out = out[:max_new_tokens]
        cut = next((i + 1 for i, t in enumerate(out) if t in stop), len(out))
        return torch.cat([input_ids, torch.tensor([out[:cut]], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
