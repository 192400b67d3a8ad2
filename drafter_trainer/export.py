"""Export a trained drafter in the folder format SGLang, vLLM, the z-lab loader and Transformers read.

    <out_dir>/            mode 0755, files 0644 (a serving process may run as another user)
      config.json         architectures ["DFlashDraftModel"], model_type "qwen3", the shape fields,
                          layer_types, sliding_window, tie_word_embeddings false,
                          dflash_config {mask_token_id, target_layer_ids},
                          auto_map {AutoModel: modeling_dflash.DFlashDraftModel},
                          dfpipe {target_config_sha256, target} when the target folder is known,
                          {target_precision} when the checkpoint records it
      modeling_dflash.py  the drafter for `AutoModel.from_pretrained(out_dir, trust_remote_code=True)`
                          (a copy of drafter_trainer/modeling_dflash.py: torch and transformers only)
      model.safetensors   fc.weight, hidden_norm.weight, norm.weight,
                          layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight,
                          layers.N.mlp.{gate,up,down}_proj.weight,
                          layers.N.{input,post_attention}_layernorm.weight
                          (no embedding, no lm_head: they come from the target at load time)

SGLang and vLLM pick their DFlash implementation from `architectures` (and the method named on
their command line) and read the rest as a Qwen3 config; the published z-lab drafters carry the
same `auto_map` with AutoModel only, so AutoConfig keeps returning a plain Qwen3Config and the
serving engines never run the remote code.

The `dfpipe` key is ours alone (no loader reads it): the fingerprint of the target's config.json
(`target_fingerprint`) and the folder it was read from, so `dfpipe eval` can tell a drafter paired
with its own target from one paired with another target of the same shape. It identifies the
target's configuration, not its weights: two fine-tunes of one base model share it.

The folder is written under a temporary name next to out_dir and renamed into place, so a
reader sees the old export, no export, or the complete new one, never a half-written one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Any

import torch

from drafter_trainer.checkpoint import fsync_path
from drafter_trainer.model import DFlashConfig, DFlashDraftModel, DrafterConfigError
from drafter_trainer.target_head import text_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODELING_FILE = "modeling_dflash.py"
MODELING_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), MODELING_FILE)
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
FILE_MODE, DIR_MODE = 0o644, 0o755
DFPIPE_KEY = "dfpipe"
# Left out of the fingerprint: written by whichever transformers saved the folder, not part of the
# model; and how its weights are stored (an FP8 checkpoint of a model is that model: the precision it
# ran in is recorded and compared on its own, `target_precision`).
NOT_FINGERPRINTED = ("transformers_version", "_name_or_path", "quantization_config")


class ExportError(ValueError):
    """A drafter that cannot be exported, or an export folder that cannot be loaded."""


def read_target_config(target_dir: str) -> dict[str, Any]:
    """The target folder's config.json as a dict; ExportError when there is none or it is not a JSON object."""
    path = os.path.join(target_dir, CONFIG_FILE)
    if not os.path.isdir(target_dir):
        raise ExportError(f"target {target_dir}: no such folder")
    try:
        with open(path, encoding="utf-8") as f:
            target = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"target {target_dir}: no {CONFIG_FILE} (not a Hugging Face model folder)") from None
    except ValueError as e:
        raise ExportError(f"target {path}: not JSON ({e})") from None
    if not isinstance(target, dict):
        raise ExportError(f"target {path}: not a JSON object")
    return target


def target_fingerprint(target_config: dict[str, Any]) -> str:
    """sha256 of a target's config.json content (key order, the writer's version fields and the
    quantization ignored)."""
    content = {k: v for k, v in target_config.items() if k not in NOT_FINGERPRINTED}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _save_weights(state: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' save_file, a failed write (a full disk) raised as the OSError it is: safetensors
    raises its own SafetensorError("... (os error 28)") instead."""
    from safetensors.torch import save_file

    try:
        save_file(state, path, metadata={"format": "pt"})
    except Exception as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from e


def export_drafter(model: DFlashDraftModel, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                   target_dir: str | None = None, target_precision: str = "") -> None:
    """Write model's trainable weights (cast to dtype) and config to out_dir, atomically. Recorded
    under the config's `dfpipe` key: the config fingerprint and path of `target_dir`, the target
    folder the drafter was trained on (None: not recorded, `dfpipe eval` then warns), and
    `target_precision`, the precision the target ran in ("": not recorded)."""
    cfg = model.config
    if cfg.num_target_layers <= max(cfg.target_layer_ids):
        raise ExportError(f"num_target_layers ({cfg.num_target_layers}) must be the target's layer count; "
                          "build the config with DFlashConfig.from_target")
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in model.trainable_state_dict().items()}
    config = cfg.to_json_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["auto_map"] = dict(AUTO_MAP)
    recorded: dict[str, str] = {}
    if target_dir is not None:
        recorded.update(target_config_sha256=target_fingerprint(read_target_config(target_dir)),
                        target=os.path.abspath(target_dir))
    if target_precision:
        recorded["target_precision"] = target_precision
    if recorded:
        config[DFPIPE_KEY] = recorded

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = f"{out_dir}.tmp-{tag}"
    os.makedirs(tmp)
    try:
        _save_weights(state, os.path.join(tmp, WEIGHTS_FILE))
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        shutil.copyfile(MODELING_SOURCE, os.path.join(tmp, MODELING_FILE))
        for name in (WEIGHTS_FILE, CONFIG_FILE, MODELING_FILE):
            # explicit modes: safetensors writes 0600 whatever the umask
            os.chmod(os.path.join(tmp, name), FILE_MODE)
            fsync_path(os.path.join(tmp, name))
        os.chmod(tmp, DIR_MODE)
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


def check_target(config: DFlashConfig, target_dir: str) -> None:
    """Refuse a target folder this drafter was not shaped for: its width, vocabulary and layer count
    must be the ones the drafter reads (fc input, mask / anchor token ids, target_layer_ids).
    A drafter config without the target's layer count (num_target_layers 0) is checked on its
    target_layer_ids alone: each must be a layer of the target."""
    target = read_target_config(target_dir)
    text = text_config(target)
    wanted = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    if config.num_target_layers:
        wanted["num_hidden_layers"] = config.num_target_layers
    found = {key: text.get(key, target.get(key)) for key in [*wanted, "num_hidden_layers"]}
    wrong = [f"{key} {found[key]} (the drafter's: {value})" for key, value in wanted.items() if found[key] != value]
    layers = found["num_hidden_layers"]
    if not wrong and not (isinstance(layers, int) and max(config.target_layer_ids) < layers):
        wrong.append(f"num_hidden_layers {layers}, but the drafter reads layers {config.target_layer_ids}")
    if wrong:
        raise ExportError(f"target {target_dir} is not the target this drafter was trained for: " + ", ".join(wrong))


def load_drafter(export_dir: str, target_dir: str | None, device: str | torch.device = "cpu",
                 attn_impl: str = "auto") -> DFlashDraftModel:
    """Rebuild a drafter from an export folder (fp32 parameters, eval mode), with the embed_tokens /
    lm_head of the target checkpoint `target_dir` (None: unloaded, for set_target_head later)."""
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
