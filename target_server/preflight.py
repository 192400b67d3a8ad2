"""The target server's preflight: every problem the config and this host show, before the server
takes a ring, binds its endpoint, prepares data or loads the target (common/preflight.py)."""
from __future__ import annotations

import os

from common.config import Config, check_devices
from common.preflight import (Problems, check_capture_layers, check_endpoint, check_target_folders, local_model,
                              model_folder_problem, port_problem, tokenizer_folder, writable_folder_problem)


def _check_data(cfg: Config, problems: Problems, source: str) -> bool:
    """data.<source>: a prepared folder, or a chat file (prepared with the target's tokenizer into
    target.cache_dir). True when it is a chat file to prepare."""
    key = f"data.{source}"
    path = cfg.resolve(getattr(cfg.data, source))
    if not path:
        problems.add(f"{key} is empty: name a prepared folder or a chat .jsonl / .parquet file")
        return False
    if os.path.isdir(path):
        return False
    if not os.path.isfile(path):
        problems.add(f"{key}: no such file or folder {path}; set it to a prepared folder (dfpipe prepare-data) or "
                     f"a chat .jsonl / .parquet file")
        return False
    model = local_model(cfg)
    # a missing model folder is its own problem (reported once): its tokenizer is then no second one
    if not tokenizer_folder(cfg) and not (model and model_folder_problem(model)):
        problems.add(f"{key} is a chat file but no tokenizer is known: set target.tokenizer (target.model "
                     f"{cfg.target.model!r} has no tokenizer files), or prepare the data (dfpipe prepare-data)")
    return True


def preflight(cfg: Config) -> None:
    """Raise one ConfigError listing every problem found (nothing is created or taken here)."""
    t, problems = cfg.target, Problems()
    problems.check(check_devices, "target.devices", t.devices)
    check_target_folders(cfg, problems, "the target server loads the target from it")
    check_capture_layers(cfg, problems)
    prepares = _check_data(cfg, problems, "train_path")
    if cfg.data.heldout_path:
        prepares = _check_data(cfg, problems, "heldout_path") or prepares
    if prepares or not local_model(cfg):   # prepared data and built-in targets land in target.cache_dir
        problems.add(writable_folder_problem("target.cache_dir", cfg.resolve(t.cache_dir)))
    if t.triton_cache_dir:
        problems.add(writable_folder_problem("target.triton_cache_dir", cfg.resolve(t.triton_cache_dir)))
    shm = cfg.ring.shm_dir
    problems.add(writable_folder_problem("ring.shm_dir", shm) if os.path.isdir(shm) else
                 f"ring.shm_dir: no such folder {shm}; set it to a shared-memory folder (/dev/shm)")
    check_endpoint(problems, "service.target_endpoint", cfg.service.target_endpoint, cfg.service.allowed_uids)
    problems.add(port_problem("service.target_metrics_port", cfg.service.target_metrics_port))
    problems.raise_all("target server")
