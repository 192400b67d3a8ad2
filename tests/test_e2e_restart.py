"""End to end with real processes: restart the trainer (kill -9, mid-checkpoint, graceful, new
hyper-parameters) and the target server; every sample of the epoch lands in the saved model
exactly once and the target is never reloaded by a trainer restart."""
from __future__ import annotations

import glob
import json
import random
import signal
import time
from pathlib import Path

import pytest

from e2e import CACHE, DEMO, Service, assert_exactly_once, ctl, inspect_run, load, serving, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _trained_at_least(endpoint: str, n: int):
    s = ctl(endpoint, "status")
    return s if s and s.get("batches_trained", 0) >= n else None


def _no_ring_files(cfg: dict) -> None:
    assert glob.glob(f"/dev/shm/{cfg['ring']['name']}.*") == []


def _serving_target_and_trainer(config: Path, tmp_path: Path, services: list[Service]) -> tuple[Service, Service]:
    """Start the target server, then a trainer once it serves; return both when 4 batches are trained.
    Both go into `services` as soon as they start (the caller stops them)."""
    cfg = load(config)
    target = Service("target-server", config, tmp_path)
    services.append(target)
    wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
    tr = Service("trainer", config, tmp_path)
    services.append(tr)
    wait_for(lambda: _trained_at_least(cfg["service"]["trainer_endpoint"], 4), 180, "trainer past 4 batches")
    return target, tr


def test_trainer_killed_repeatedly_still_trains_every_sample_exactly_once(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    cfg = load(config)
    ep_target, ep_trainer = cfg["service"]["target_endpoint"], cfg["service"]["trainer_endpoint"]
    target = Service("target-server", config, tmp_path)
    trainers: list[Service] = []
    try:
        first = wait_for(lambda: serving(ep_target), 180, "target serving")
        rng = random.Random(1234)
        goal = 0
        for i in range(6):
            if i == 2:
                # dies inside its first checkpoint: state written, not yet renamed into place
                tr = Service("trainer", config, tmp_path, env={"DFPIPE_FAULT": "checkpoint.before_rename"})
                trainers.append(tr)
                assert tr.wait(180) == -signal.SIGKILL, tr.log()
                continue
            tr = Service("trainer", config, tmp_path)
            trainers.append(tr)
            goal += 3
            wait_for(lambda: _trained_at_least(ep_trainer, goal), 180, f"trainer past {goal} batches")
            time.sleep(rng.uniform(0.0, 0.4))
            assert tr.alive(), f"trainer finished before kill {i}: make the test data larger\n{tr.log()}"
            tr.kill9()
        final = Service("trainer", config, tmp_path)
        trainers.append(final)
        assert final.wait(300) == 0, final.log()
        assert_exactly_once(config)
        status = ctl(ep_target, "status")
        assert status["pid"] == first["pid"] == target.pid
        assert status["model_loads"] == 1
        assert status["sessions"] >= 7
        assert status["batches"]["quarantined"] == 0
    finally:
        for tr in trainers:
            tr.stop()
        target.stop()
    assert target.proc.returncode == 0, target.log()
    _no_ring_files(cfg)


def test_graceful_shutdown_then_restart_with_new_learning_rate_keeps_exactly_once(tmp_path: Path) -> None:
    # A model folder (not a builtin spec): the trainer builds its drafter while it connects.
    from target_server.tiny import resolve_target
    folder = resolve_target("builtin:tiny-qwen3.5", str(CACHE), tokenizer_dir=str(DEMO / "tokenizer"))
    config = write_config(tmp_path, target={"model": folder})
    cfg = load(config)
    ep_target, ep_trainer = cfg["service"]["target_endpoint"], cfg["service"]["trainer_endpoint"]
    services: list[Service] = []
    try:
        target, tr = _serving_target_and_trainer(config, tmp_path, services)
        assert ctl(ep_trainer, "shutdown") == {"accepted": "shutdown"}
        assert tr.wait(60) == 0, tr.log()
        after_stop = inspect_run(config)
        assert after_stop["samples_duplicated"] == 0 and after_stop["samples_trained"] > 0

        tr2 = Service("trainer", config, tmp_path, overrides=["train.lr=0.0005"])
        services.append(tr2)
        wait_for(lambda: _trained_at_least(ep_trainer, after_stop["batches"] + 2), 180, "restarted trainer stepping")
        startup = ctl(ep_trainer, "status")["startup"]
        sequential = ("process_to_setup_s", "resume_and_endpoints_s", "welcome_s", "optimizer_and_outputs_s",
                      "first_batch_wait_s", "first_step_s")   # one after another, to the first step
        assert {*sequential, "build_s", "head_s", "process_to_first_step_s"} <= set(startup), startup
        assert all(startup[k] >= 0 for k in sequential) and startup["first_step_s"] > 0, startup
        # the phases account for the whole start-up, without counting any stretch twice
        assert 0.8 * startup["process_to_first_step_s"] <= sum(startup[k] for k in sequential) \
            <= startup["process_to_first_step_s"] + 0.05, startup
        assert "rebuilding the drafter" not in tr2.log(tail=10_000)
        tr2.signal(signal.SIGTERM)  # SIGTERM: finish the step, checkpoint, exit 0
        assert tr2.wait(60) == 0, tr2.log()

        tr3 = Service("trainer", config, tmp_path, overrides=["train.lr=0.0005"])
        services.append(tr3)
        assert tr3.wait(300) == 0, tr3.log()
        assert_exactly_once(config)
        assert ctl(ep_target, "status")["model_loads"] == 1
    finally:
        for s in services[::-1]:
            s.stop()
    _no_ring_files(cfg)


def test_target_killed_mid_epoch_trainer_waits_and_resumes_with_nothing_lost(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    cfg = load(config)
    ep_target, ep_trainer = cfg["service"]["target_endpoint"], cfg["service"]["trainer_endpoint"]
    services: list[Service] = []
    try:
        target, tr = _serving_target_and_trainer(config, tmp_path, services)
        target.kill9()
        waiting = wait_for(lambda: (s := ctl(ep_trainer, "status")) and s["state"] == "waiting_for_target" and s,
                           60, "trainer to report waiting_for_target")
        assert waiting["pid"] == tr.pid
        target2 = Service("target-server", config, tmp_path)
        services.append(target2)
        assert tr.wait(300) == 0, tr.log() + "\n--- target ---\n" + target2.log()
        assert_exactly_once(config)
        status = ctl(ep_target, "status")
        assert status["pid"] == target2.pid and status["model_loads"] == 1
    finally:
        for s in services[::-1]:
            s.stop()
    _no_ring_files(cfg)


def test_a_second_trainer_on_the_same_out_dir_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    cfg = load(config)
    ep_trainer = cfg["service"]["trainer_endpoint"]
    services: list[Service] = []
    try:
        _, first = _serving_target_and_trainer(config, tmp_path, services)
        assert ctl(ep_trainer, "pause") is not None
        wait_for(lambda: (s := ctl(ep_trainer, "status")) and s["state"] == "paused", 60, "trainer paused")
        # the first trainer's save in progress, as a second trainer would find it
        in_progress = tmp_path / "run" / "checkpoints" / ".tmp-step-00000099-1"
        in_progress.mkdir(parents=True)
        before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
        # another control endpoint: only the out_dir is shared
        second = Service("trainer", config, tmp_path,
                         overrides=[f"service.trainer_endpoint={ep_trainer.removesuffix('.sock')}-2.sock"])
        services.append(second)
        assert second.wait(120) == 5, second.log()
        assert f"is in use by another trainer (pid {first.pid}" in second.log(), second.log()
        assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before, "the refused trainer touched nothing"
        assert in_progress.is_dir() and first.alive()
        assert ctl(ep_trainer, "resume") is not None
        assert first.wait(300) == 0, first.log()
        assert_exactly_once(config)
    finally:
        for s in services[::-1]:
            s.stop()
    _no_ring_files(cfg)


def test_a_really_full_tmpfs_costs_each_save_and_never_the_run(tmp_path: Path, small_tmpfs) -> None:
    # no injected fault: the checkpoints folder is a tmpfs too small for one checkpoint, where
    # torch.save fails with RuntimeError("unexpected pos") (it used to end the trainer with exit 1)
    config = write_config(tmp_path, train={"max_checkpoint_failures": 99})   # 16 batches, a save every 3 steps
    cfg = load(config)
    ckpts = tmp_path / "run" / "checkpoints"
    small_tmpfs(str(ckpts), "16k")
    services: list[Service] = []
    try:
        target = Service("target-server", config, tmp_path)
        services.append(target)
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        full = Service("trainer", config, tmp_path)
        services.append(full)
        assert full.wait(300) == 4, full.log()       # handled: "no final checkpoint", not a crash
        log = full.log(tail=10_000)
        failed = log.count("failed: [Errno 28] writing")
        assert failed == 6, log                       # steps 3, 6, 9, 12, 15 and the final one at 16
        assert "No space left on device" in log and "Traceback" not in log, log
        assert "6 of 99 failures in a row" in log and "at step 16, without a final checkpoint" in log, log
        assert list(ckpts.iterdir()) == [], "every failed save removed"
    finally:
        for s in services[::-1]:
            s.stop()
    _no_ring_files(cfg)


def test_a_full_disk_fails_checkpoints_without_losing_a_sample_and_a_lasting_one_stops_the_trainer(
        tmp_path: Path) -> None:
    config = write_config(tmp_path)    # 16 batches, a checkpoint every 3 steps
    cfg = load(config)
    ep_target = cfg["service"]["target_endpoint"]
    ckpts = tmp_path / "run" / "checkpoints"
    services: list[Service] = []
    try:
        target = Service("target-server", config, tmp_path)
        services.append(target)
        wait_for(lambda: serving(ep_target), 180, "target serving")
        # the disk stays full: three periodic saves fail, the trainer stops with status 4
        # (its final save fails too) and leaves no half-written folder behind
        full = Service("trainer", config, tmp_path, env={"DFPIPE_FAULT": "checkpoint.write:99"})
        services.append(full)
        assert full.wait(300) == 4, full.log()
        log = full.log(tail=10_000)
        assert log.count("failed: [Errno 28] No space left on device") == 4, log
        assert "3 checkpoints in a row failed" in log and "without a final checkpoint" in log, log
        assert list(ckpts.iterdir()) == []
        # room again after two more failed saves: training goes on, and the run ends exactly once
        # with the batches the first trainer trained but never committed delivered again
        again = Service("trainer", config, tmp_path, env={"DFPIPE_FAULT": "checkpoint.write:2"})
        services.append(again)
        assert again.wait(300) == 0, again.log()
        assert again.log(tail=10_000).count("No space left on device") == 2
        assert_exactly_once(config)
        status = ctl(ep_target, "status")
        assert status["model_loads"] == 1 and status["batches"]["quarantined"] == 0
    finally:
        for s in services[::-1]:
            s.stop()
    _no_ring_files(cfg)


def _files(root: Path) -> dict[str, bytes]:
    """Every file under root and its bytes, but the out_dir lock (its content is the holder's pid)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "trainer.lock"}


def _as_before_plans_and_manifests(path: Path) -> dict:
    """Rewrite a checkpoint as dfpipe wrote them before plans and manifests: the sample ids in
    state.pt, no samples.npz, no manifest, no plan in meta.json. Its meta."""
    import numpy as np
    import torch

    state = torch.load(path / "state.pt", weights_only=True)   # what the trainer saves loads weights-only
    with np.load(path / "samples.npz") as z:
        state["trained_samples"] = {int(k[4:]): z[k] for k in z.files if k.startswith("ids_")}
    torch.save(state, path / "state.pt")
    meta = json.loads((path / "meta.json").read_text())
    del meta["plan"], meta["format"]
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "samples.npz").unlink()
    (path / "manifest.json").unlink()
    return meta


def test_a_changed_data_plan_is_refused_naming_it_and_new_plan_starts_a_new_accounting(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    cfg = load(config)
    ep_target, ep_trainer = cfg["service"]["target_endpoint"], cfg["service"]["trainer_endpoint"]
    out_dir = tmp_path / "run"
    services: list[Service] = []
    try:
        target, tr = _serving_target_and_trainer(config, tmp_path, services)
        old_plan = ctl(ep_target, "status")["plan"]
        assert ctl(ep_trainer, "shutdown") == {"accepted": "shutdown"}
        assert tr.wait(60) == 0, tr.log()
        assert inspect_run(config)["plan"] == old_plan
        # a checkpoint from before plans were fingerprinted (and before manifests): resumed with a
        # warning after its consistency check, records both from then on
        meta = _as_before_plans_and_manifests(Path(inspect_run(config)["path"]))
        old = Service("trainer", config, tmp_path, overrides=[f"train.max_steps={meta['step'] + 2}"])
        services.append(old)
        assert old.wait(300) == 0, old.log()
        assert "records no data plan" in old.log(tail=10_000) and "has no manifest" in old.log(tail=10_000)
        stopped = inspect_run(config)
        assert stopped["plan"] == old_plan and stopped["step"] == meta["step"] + 2
        target.stop()
        assert target.proc.returncode == 0, target.log()

        # the target comes back with another seed: the same seqs now hold other documents
        target2 = Service("target-server", config, tmp_path, overrides=["data.seed=1"])
        services.append(target2)
        new_plan = wait_for(lambda: serving(ep_target), 180, "target serving the new plan")["plan"]
        assert new_plan["id"] != old_plan["id"] and new_plan["data.seed"] == 1
        before = _files(out_dir)
        refused = Service("trainer", config, tmp_path)
        services.append(refused)
        assert refused.wait(300) == 6, refused.log()
        log = refused.log(tail=10_000)
        assert "data.seed: 0 -> 1" in log and "train.new_plan=true" in log, log
        assert _files(out_dir) == before, "the refused trainer changed nothing in out_dir"
        assert ctl(ep_target, "status")["refused"] == {"plan_changed": 1}

        # on purpose: the weights are kept, the accounting starts anew for the new plan
        tr3 = Service("trainer", config, tmp_path, overrides=["train.new_plan=true"])
        services.append(tr3)
        assert tr3.wait(300) == 0, tr3.log()
        assert "train.new_plan: leaving data plan" in tr3.log(tail=10_000)
        info = assert_exactly_once(config)
        # the new plan's epoch, every sample once, counted on from the old run's step (one batch a step)
        assert info["plan"] == new_plan and info["step"] == stopped["step"] + info["batches"], (stopped, info)
    finally:
        for s in services[::-1]:
            s.stop()
    _no_ring_files(cfg)
