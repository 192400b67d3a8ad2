"""The target's frozen token embedding and output head, read by tensor name from its checkpoint.

The drafter embeds its block tokens with the target's `embed_tokens` and scores its outputs with
the target's `lm_head`; both stay frozen and are never exported (a serving engine takes them from
the target it already holds). Only these two tensors are read: for a 27B target the rest of the
checkpoint is tens of GB the trainer must not touch.

Where the two tensors live depends on the architecture:

    text-only causal LM (Qwen3, Qwen3.5 text)   model.embed_tokens.weight                lm_head.weight
    multimodal wrapper (Qwen3.5 / 3.6 VL)        model.language_model.embed_tokens.weight lm_head.weight
    older VL layout                              language_model.model.embed_tokens.weight language_model.lm_head.weight

A checkpoint without an lm_head tensor and `tie_word_embeddings: true` uses the embedding as its
head (small Qwen3.5 models do); without the flag a missing head is an error, never a guess.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
LM_HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
)


class TargetHeadError(ValueError):
    """The target folder does not hold a usable embedding / lm_head pair."""


@dataclass
class TargetHead:
    """embed_tokens [V, H] and lm_head [V, H]; `tied` when lm_head is embed_tokens itself."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    tied: bool


class FrozenTargetWeight(nn.Module):
    """A frozen [V, H] target matrix held by the drafter; empty ([0, H]) until loaded.

    A module (not a bare tensor) so the state-dict names read `embed_tokens.weight` and
    `lm_head.weight`, and a parameter with requires_grad=False (not a buffer) so DDP neither
    reduces it nor re-broadcasts it every step.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, hidden_size), requires_grad=False)

    @property
    def loaded(self) -> bool:
        return self.weight.shape[0] > 0


def _target_config(target_dir: str) -> dict:
    path = os.path.join(target_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise TargetHeadError(f"{target_dir}: no config.json (not a Hugging Face model folder)") from None


def text_config(target_config: dict) -> dict:
    """The language-model part of a target config (multimodal configs nest it under text_config)."""
    return target_config.get("text_config") or target_config


def _tensor_files(target_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the shard index or the single file's header."""
    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise TargetHeadError(f"{index}: no weight_map")
        return {name: os.path.join(target_dir, file) for name, file in weight_map.items()}
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(target_dir) if f.endswith(".safetensors"))
    if not files:
        raise TargetHeadError(f"{target_dir}: no .safetensors files")
    names: dict[str, str] = {}
    for file in files:
        path = os.path.join(target_dir, file)
        with safe_open(path, framework="pt") as f:
            names.update({name: path for name in f.keys()})
    return names


def _read(path: str, name: str, device: str | torch.device) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device=str(device)) as f:
        return f.get_tensor(name)


def read_target_head(target_dir: str, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> TargetHead:
    """Load only embed_tokens and lm_head from a target checkpoint folder (sharded or not).

    dtype None keeps the checkpoint's dtype (bf16 for published targets: half the memory of fp32,
    and the drafter computes in bf16 on GPU anyway).
    """
    cfg = _target_config(target_dir)
    text = text_config(cfg)
    names = _tensor_files(target_dir)
    embed_name = next((n for n in EMBED_NAMES if n in names), None)
    if embed_name is None:
        raise TargetHeadError(f"{target_dir}: no embedding tensor among {EMBED_NAMES}")
    embed = _read(names[embed_name], embed_name, device)
    head_name = next((n for n in LM_HEAD_NAMES if n in names), None)
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if head_name is not None:
        head = _read(names[head_name], head_name, device)
        tied = False
    elif tie:
        head, tied = embed, True
    else:
        raise TargetHeadError(
            f"{target_dir}: no lm_head tensor among {LM_HEAD_NAMES} and tie_word_embeddings is not set")
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    for name, t in (("embed_tokens", embed), ("lm_head", head)):
        if t.dim() != 2 or (vocab is not None and t.shape[0] != vocab) or (hidden is not None and t.shape[1] != hidden):
            raise TargetHeadError(
                f"{target_dir}: {name} has shape {tuple(t.shape)}, config says [{vocab}, {hidden}]")
    if dtype is not None:
        embed = embed.to(dtype)
        head = embed if tied else head.to(dtype)
    return TargetHead(embed_tokens=embed, lm_head=head, tied=tied)
