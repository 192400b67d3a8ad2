"""`dfpipe export`: a checkpoint -> the drafter folder SGLang / vLLM / Transformers / the reference loader read."""
from __future__ import annotations

import sys

from common.config import Config
from common.trust import Untrusted
from drafter_trainer.checkpoint import CheckpointInvalid, TrainerState, checkpoint_root, load_newest
from drafter_trainer.export import ExportError, check_target, export_drafter
from drafter_trainer.model import DFlashConfig, DFlashDraftModel
from target_server.tiny import BUILTIN_PREFIX


def export_checkpoint(cfg: Config, checkpoint: str, out_dir: str, target_dir: str = "") -> str:
    """Export `checkpoint` (default: the newest that verifies) to out_dir after checking it against
    the target. A checkpoint that fails verification is never exported: named, it is an error;
    looking for the newest, each newer one that fails is skipped with a line saying why.

    target_dir: the target model folder (default: the config's target). A folder that does not
    exist or whose hidden size, vocabulary or layer count differ from the drafter's is an error;
    a built-in target (a test model built on demand) is not checked. A checked target's config
    fingerprint is recorded in the export (`dfpipe eval` compares it with the target it is given).
    """
    try:
        path, state = _checkpoint(cfg, checkpoint)
    except Untrusted as e:   # another user controls what would be read: one line, nothing of it loaded
        raise SystemExit(f"dfpipe export: refused: {e}") from None
    model = DFlashDraftModel(DFlashConfig(**state.drafter_config), split_fc=state.split_fc)
    try:
        state.restore_weights(model)
    except ValueError as e:
        raise SystemExit(f"dfpipe export: checkpoint {path}: {e}") from None
    target = target_dir or cfg.resolve(cfg.target.model)
    checked: str | None = None
    if target.startswith(BUILTIN_PREFIX):
        print(f"dfpipe export: target {target} is built in, not checked (pass --target FOLDER to check one)")
    else:
        try:
            check_target(model.config, target)
        except ExportError as e:
            hint = "" if target_dir else " (the config's target; pass --target FOLDER for another)"
            raise SystemExit(f"dfpipe export: {e}{hint}") from None
        checked = target
    # records the checked target and the precision the target ran in for `dfpipe eval`
    export_drafter(model, out_dir, target_dir=checked, target_precision=state.target_precision)
    return out_dir


def _checkpoint(cfg: Config, checkpoint: str) -> tuple[str, TrainerState]:
    """The checkpoint to export, verified and loaded: `checkpoint`, or the newest of the run that verifies."""
    if checkpoint:
        try:
            return checkpoint, TrainerState.load(checkpoint)
        except CheckpointInvalid as e:
            raise SystemExit(f"dfpipe export: {e}; this checkpoint fails verification and is not exported "
                             "(`dfpipe inspect RUN_FOLDER` lists the ones that verify)") from None
    run = cfg.resolve(cfg.train.out_dir)
    found = load_newest(run, lambda e: print(f"dfpipe export: skipping {e.path}: fails verification "
                                             f"({e.check}: {e.detail})", file=sys.stderr))
    if found is None:
        raise SystemExit(f"dfpipe export: no checkpoint under {checkpoint_root(run)} verifies")
    return found
