"""The data plan fingerprint: what decides which documents batch seq s holds, named by setting,
hashed the same in every process; on the wire it is validated; checkpoints record it and
`dfpipe inspect` shows it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from common.protocol import PLAN_ID_LEN, Hello, ProtocolError, Welcome, check_plan, decode, plan_id
from common.seqset import SeqSet
from drafter_trainer.checkpoint import TrainerState, inspect, plan_changes
from target_server.packer import Packer, data_plan
from machine_speed import scaled

REPO = Path(__file__).resolve().parents[1]
META = {"source_sha256": "a" * 64, "source_format": "openai", "tokenizer_sha256": "b" * 64,
        "chat_template_sha256": "c" * 64, "chat_template_kwargs": {"enable_thinking": False},
        "max_len": 512, "overlong": "truncate"}
LENGTHS = [int(n) for n in np.random.default_rng(0).integers(20, 500, size=300)]


def _plan(meta: dict[str, Any] = META, lengths: list[int] = LENGTHS, token_budget: int = 512,
          seed: int = 0) -> dict[str, Any]:
    # data_plan reads only the prepared folder's meta.json (dataset.meta) and the packer
    return data_plan(SimpleNamespace(meta=meta), Packer(np.asarray(lengths), token_budget, seed))


@pytest.mark.parametrize("change, setting", [
    ({"meta": {**META, "source_sha256": "d" * 64}}, "data.train_path"),
    ({"meta": {**META, "source_format": "sharegpt"}}, "data.format"),
    ({"meta": {**META, "tokenizer_sha256": "e" * 64}}, "target.tokenizer"),
    ({"meta": {**META, "chat_template_sha256": "f" * 64}}, "data.chat_template"),
    ({"meta": {**META, "chat_template_kwargs": {"enable_thinking": True}}}, "data.chat_template_kwargs"),
    ({"meta": {**META, "max_len": 256}}, "data.max_len"),
    ({"meta": {**META, "overlong": "split"}}, "data.overlong"),
    ({"seed": 1}, "data.seed"),
    ({"token_budget": 1024}, "data.token_budget"),
    ({"lengths": LENGTHS[:-1]}, "packing"),             # another document list: other batches
])
def test_every_component_changes_the_fingerprint_and_is_named(change: dict[str, Any], setting: str) -> None:
    before, after = _plan(), _plan(**change)
    assert after["id"] != before["id"]
    assert before["id"] == plan_id(before) and after["id"] == plan_id(after)
    changed = plan_changes(before, after)
    assert [c.split(":")[0] for c in changed if c.startswith(setting + ":")] == [setting], changed
    if setting != "packing":  # a seed or budget also repacks: packing changes beside it
        assert all(c.split(":")[0] in (setting, "packing") for c in changed), changed
    check_plan(after)


def test_the_same_plan_has_the_same_fingerprint_in_another_process() -> None:
    code = ("import json, sys, numpy as np; from types import SimpleNamespace; "
            "from target_server.packer import Packer, data_plan; "
            "meta, lengths = json.loads(sys.argv[1]); "
            "print(json.dumps(data_plan(SimpleNamespace(meta=meta), Packer(np.asarray(lengths), 512, 0))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([META, LENGTHS])], capture_output=True, text=True,
                         timeout=scaled(120), cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    here = _plan()
    assert json.loads(out.stdout) == here and len(here["id"]) == PLAN_ID_LEN


def test_a_plan_on_the_wire_must_carry_the_fingerprint_of_its_components() -> None:
    plan = _plan()
    welcome = Welcome(rid=1, consumer_epoch=1, rings=[], target={}, epoch_sizes=[3], ready=[], heldout_batches=0,
                      plan=plan)
    assert decode(welcome.encode()).plan == plan
    with pytest.raises(ProtocolError, match="not the fingerprint"):
        Welcome(rid=1, consumer_epoch=1, rings=[], target={}, epoch_sizes=[3], ready=[], heldout_batches=0,
                plan={**plan, "data.seed": 1})   # a component changed under an old id
    for bad in ({}, {"id": plan["id"]}, {**plan, "id": "XYZ"}, {**plan, "data.seed": 1.5}):
        with pytest.raises(ProtocolError):
            check_plan(bad)
    hello = dict(rid=1, job="j", secret="ab" * 16, rank=0, world=1, pid=1, start_time=0, have=SeqSet(), epochs=1,
                 credit=1, heldout=False)
    assert Hello(**hello).plan == "" and Hello(**hello, plan=plan["id"]).plan == plan["id"]
    for bad_id in ("0" * (PLAN_ID_LEN - 1), "G" * PLAN_ID_LEN, 7):
        with pytest.raises(ProtocolError):
            Hello(**hello, plan=bad_id)


def test_a_checkpoint_records_its_plan_and_inspect_shows_it(tmp_path: Path) -> None:
    import torch

    plan = _plan()
    state = TrainerState(step=3, epoch=0, have=SeqSet([0, 1]), trained_samples={0: np.array([4, 7])},
                         sample_seqs={0: np.array([0, 1])}, plan=plan)
    path, _ = state.save(str(tmp_path), keep=2, reason="test", epoch_samples=2)
    assert inspect(path)["plan"] == plan and inspect(path)["verified"] == "ok"
    # from before plans (and manifests): no plan in its meta.json
    old = tmp_path / "old"
    old.mkdir()
    torch.save({"step": 3, "model": {}, "trained_samples": {0: np.array([4, 7])}}, old / "state.pt")
    (old / "meta.json").write_text(json.dumps({"step": 3, "epoch": 0, "have": [[0, 2]]}))
    assert inspect(str(old))["plan"] is None
