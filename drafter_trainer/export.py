"""Export a trained drafter in the folder format SGLang, vLLM and the z-lab loader read, and load it back.

    <out_dir>/
      config.json         architectures ["DFlashDraftModel"], model_type "qwen3", the shape fields,
                          layer_types, sliding_window, tie_word_embeddings false,
                          dflash_config {mask_token_id, target_layer_ids}
      model.safetensors   fc.weight, hidden_norm.weight, norm.weight,
                          layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight,
                          layers.N.mlp.{gate,up,down}_proj.weight,
                          layers.N.{input,post_attention}_layernorm.weight
                          (no embedding, no lm_head: they come from the target at load time)

The folder is written under a temporary name next to out_dir and renamed into place, so a
reader sees the old export, no export, or the complete new one, never a half-written one.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid

import torch

from drafter_trainer.checkpoint import fsync_path
from drafter_trainer.model import DFlashConfig, DFlashDraftModel, DrafterConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ExportError(ValueError):
    """A drafter that cannot be exported, or an export folder that cannot be loaded."""



def export_drafter(model: DFlashDraftModel, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write model's trainable weights (cast to dtype) and config to out_dir, atomically."""
    from safetensors.torch import save_file

    cfg = model.config
    if cfg.num_target_layers <= max(cfg.target_layer_ids):
        raise ExportError(f"num_target_layers ({cfg.num_target_layers}) must be the target's layer count; "
                          "build the config with DFlashConfig.from_target")
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in model.trainable_state_dict().items()}
    config = cfg.to_json_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = f"{out_dir}.tmp-{tag}"
    os.makedirs(tmp)
    try:
        save_file(state, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
        old = f"{out_dir}.old-{tag}" if os.path.exists(out_dir) else None
        if old:
            os.rename(out_dir, old)      # a directory cannot be renamed over a non-empty one
        os.rename(tmp, out_dir)
        fsync_path(parent)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_drafter(export_dir: str, target_dir: str | None, device: str | torch.device = "cpu",
                 attn_impl: str = "auto") -> DFlashDraftModel:
    """Rebuild a drafter from an export folder (fp32 parameters, eval mode).

    target_dir: the target checkpoint whose embed_tokens / lm_head the drafter uses; None leaves
    them unloaded (set_target_head later).
    """
    from safetensors.torch import load_file

    try:
        with open(os.path.join(export_dir, CONFIG_FILE), encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{export_dir}: no {CONFIG_FILE}") from None
    if "DFlashDraftModel" not in (config.get("architectures") or []):
        raise ExportError(f"{export_dir}: architectures {config.get('architectures')} is not a DFlash drafter")
    model = DFlashDraftModel(DFlashConfig.from_json_dict(config), attn_impl=attn_impl).to(device)
    state = load_file(os.path.join(export_dir, WEIGHTS_FILE), device=str(device))
    try:
        model.load_trainable_state_dict(state)
    except (DrafterConfigError, RuntimeError) as e:     # RuntimeError: a shape that disagrees with config.json
        raise ExportError(f"{export_dir}: weights do not match config.json: {e}") from None
    if target_dir is not None:
        model.load_target_head(target_dir)
    return model.eval()
