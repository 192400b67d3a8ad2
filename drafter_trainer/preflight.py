"""The trainer's preflight: every problem the config and this host show, before the trainer joins
its ranks, locks train.out_dir, binds its endpoint or waits for a target server
(common/preflight.py). The trainer reads the target's folder itself (config.json, embedding,
lm_head, the tokenizer's mask token), so a local target.model is checked here as well as on the
server. And the mask token, which the drafter's block positions after the anchor hold: the target
tokenizer's, from target.tokenizer when set (the folder the server prepares data with), else from
the model folder.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os

import torch

from common.config import Config, ConfigError, check_devices
from common.preflight import (Problems, check_capture_layers, check_endpoint, check_target_folders, local_model,
                              model_folder_problem, port_problem, tokenizer_folder, writable_folder_problem)

from .block_mask import fa4_missing
from .fp8 import resolve_precision
from .step import rank_device

MASK_TOKENS = ("<|mask|>", "<|MASK|>", "<mask>")


def added_token_ids(target_dir: str) -> dict[str, int]:
    """content -> id of a tokenizer folder's added tokens, read from its JSON files."""
    found: dict[str, int] = {}
    unreadable = (OSError, ValueError, KeyError, TypeError, AttributeError)
    config = os.path.join(target_dir, "tokenizer_config.json")
    with contextlib.suppress(*unreadable), open(config, encoding="utf-8") as f:
        for tid, tok in (json.load(f).get("added_tokens_decoder") or {}).items():
            found.setdefault(str(tok["content"]), int(tid))
    with contextlib.suppress(*unreadable), open(os.path.join(target_dir, "tokenizer.json"), encoding="utf-8") as f:
        for tok in json.load(f).get("added_tokens") or []:
            found.setdefault(str(tok["content"]), int(tok["id"]))
    return found


def _embedding_rows(model_dir: str) -> int | None:
    """The target's vocab_size (rows of its embedding), from its config.json; None when unknown."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        return int((config.get("text_config") or config)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@functools.lru_cache(maxsize=8)
def find_mask_token(tokenizer_dir: str, model_dir: str) -> int:
    """The id of the mask token of the tokenizer in `tokenizer_dir` (cached: the preflight and the
    drafter's build both ask). ConfigError when it has none, with the id to set: the first id past
    the tokenizer's tokens, when the target's embedding (`model_dir`'s config.json) has that row."""
    found = added_token_ids(tokenizer_dir)
    for t in MASK_TOKENS:
        if t in found:
            return found[t]
    # not an added token: ask the tokenizer itself (importing transformers costs seconds of a restart)
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"drafter.mask_token_id: no tokenizer loads from {tokenizer_dir} to find the mask token "
                          f"in ({e}); set target.tokenizer to the target's tokenizer folder, or "
                          f"drafter.mask_token_id") from None
    for t in MASK_TOKENS:
        tid = tok.convert_tokens_to_ids(t)
        if isinstance(tid, int) and tid >= 0 and tid != tok.unk_token_id:
            return tid
    size, rows = len(tok), _embedding_rows(model_dir) if model_dir else None
    if rows is None or size < rows:
        hint = (f"set drafter.mask_token_id to an id no text encodes, e.g. {size}: the first id past this "
                f"tokenizer's {size} tokens" + (f", a row of the target's {rows}-row embedding" if rows else ""))
    else:
        hint = (f"its {size} tokens fill the target's {rows}-row embedding: set drafter.mask_token_id to the id "
                f"of a token the training data never holds")
    raise ConfigError(f"drafter.mask_token_id: the target tokenizer in {tokenizer_dir} has no mask token "
                      f"{MASK_TOKENS}; {hint}")


def mask_token_id(cfg: Config, model_dir: str) -> int:
    """drafter.mask_token_id, or the mask token of the target's tokenizer: target.tokenizer when
    set, else the model folder `model_dir` (the one the server runs)."""
    if cfg.drafter.mask_token_id >= 0:
        return cfg.drafter.mask_token_id
    tokenizer_dir = cfg.resolve(cfg.target.tokenizer) if cfg.target.tokenizer else model_dir
    return find_mask_token(tokenizer_dir, model_dir)


def _check_device(cfg: Config, problems: Problems) -> torch.device | None:
    """This rank's device, checked (None when it is not usable here)."""
    t = cfg.train
    key, value = ("train.devices", t.devices) if t.devices else ("train.device", t.device)   # devices: the placement
    if not problems.check(check_devices, key, value):
        return None
    try:
        return rank_device(t.device, t.devices, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as e:
        problems.add(f"train.devices: {e}")
        return None


def _check_mask_token(cfg: Config, problems: Problems) -> None:
    if cfg.drafter.mask_token_id >= 0:
        return
    model = local_model(cfg)
    if model and model_folder_problem(model):
        return                   # the folder's own problem is said: no second one about its tokenizer
    if cfg.target.tokenizer and not os.path.isdir(cfg.resolve(cfg.target.tokenizer)):
        return                   # likewise
    folder = tokenizer_folder(cfg)
    if not folder:
        problems.add(f"drafter.mask_token_id: no tokenizer to find the mask token in (target.model "
                     f"{cfg.target.model!r} holds none and target.tokenizer is not set): set target.tokenizer to "
                     f"the target's tokenizer folder, or drafter.mask_token_id")
        return
    problems.check(mask_token_id, cfg, model)


def preflight(cfg: Config) -> None:
    """Raise one ConfigError listing every problem found (nothing is created or taken here)."""
    problems = Problems()
    device = _check_device(cfg, problems)
    if device is not None:
        problems.check(resolve_precision, cfg.drafter.precision, device)   # fp8 needs FP8 matmuls here
        if cfg.drafter.attn == "fa4":
            missing = fa4_missing(device)
            problems.add(missing and f"drafter.attn fa4: {missing} (auto takes it where it runs, else flash)")
    check_target_folders(cfg, problems, "the trainer reads the target's config.json, embedding and lm_head there")
    check_capture_layers(cfg, problems)
    _check_mask_token(cfg, problems)
    problems.add(writable_folder_problem("train.out_dir", cfg.resolve(cfg.train.out_dir)))
    if int(os.environ.get("RANK", "0")) == 0:   # rank 0 alone binds the control endpoint and serves metrics
        check_endpoint(problems, "service.trainer_endpoint", cfg.service.trainer_endpoint, cfg.service.allowed_uids)
        problems.add(port_problem("service.trainer_metrics_port", cfg.service.trainer_metrics_port))
    problems.raise_all("trainer")
