"""`dfpipe export`: a checkpoint -> the drafter folder SGLang / vLLM / the reference loader read."""
from __future__ import annotations

from common.config import Config
from drafter_trainer.checkpoint import latest_checkpoint, load_checkpoint
from drafter_trainer.export import export_drafter
from drafter_trainer.model import DFlashConfig, DFlashDraftModel


def export_checkpoint(cfg: Config, checkpoint: str, out_dir: str, target_dir: str = "") -> str:
    path = checkpoint or latest_checkpoint(cfg.resolve(cfg.train.out_dir))
    if not path:
        raise SystemExit(f"dfpipe export: no checkpoint under {cfg.resolve(cfg.train.out_dir)}")
    state, _meta = load_checkpoint(path)
    model = DFlashDraftModel(DFlashConfig(**state["drafter_config"]), split_fc=state.get("split_fc", False))
    result = model.load_state_dict(state["model"], strict=False)
    if result.unexpected_keys:
        raise SystemExit(f"dfpipe export: checkpoint {path} has unknown weights {result.unexpected_keys[:4]}")
    export_drafter(model, out_dir)
    return out_dir
