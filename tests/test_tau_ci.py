"""A drafter trained through both services on a (briefly) trained toy target accepts clearly more
than an untrained one, and speculative decoding stays lossless: the CI-sized version of
bench/toy_tau.py, through the path users run (target server -> ring -> trainer -> export)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

import dfpipe.eval as ev
from common.config import DrafterConfig
import dfpipe.toy_target as tt
from drafter_trainer.export import export_drafter
from target_server import toy_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_drafter_trained_through_the_services_beats_an_untrained_one_and_stays_lossless(tmp_path) -> None:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    target_dir = str(tmp_path / "toy-target")
    tt.make_toy_target(target_dir, minutes=5.0, seed=0, steps=120, device=cpu)
    train = tt.regenerate_answers(target_dir, [toy_corpus.sample(1, i) for i in range(96)],
                                  max_new_tokens=96, device=cpu)
    data = tmp_path / "train.jsonl"
    toy_corpus.write_jsonl(train, str(data))
    # held-out rows the trainer evaluates on (fixed anchors): the loss the FP8 gate compares
    heldout = tt.regenerate_answers(target_dir, [toy_corpus.sample(1, 96 + i) for i in range(16)],
                                    max_new_tokens=96, device=cpu)
    heldout_data = tmp_path / "heldout-train.jsonl"
    toy_corpus.write_jsonl(heldout, str(heldout_data))
    recipe = tt.DrafterRecipe(num_layers=1, block_size=8, token_budget=2048, lr=3e-3)
    run = tmp_path / "run"
    tt.train_drafter_through_services(target_dir, str(data), str(run), recipe, epochs=24,   # ~120 steps
                                      heldout_path=str(heldout_data))
    trained = str(run / "train" / "export")
    assert os.path.isfile(os.path.join(trained, "model.safetensors"))
    export_drafter(tt.untrained_drafter(target_dir, recipe), str(tmp_path / "untrained"))
    # the FP8 quality gate (drafter.precision fp8, emulated on the CPU): the same seed, data and
    # batches through both services
    run8 = tmp_path / "run-fp8"
    tt.train_drafter_through_services(target_dir, str(data), str(run8), replace(recipe, precision="fp8-emulated"),
                                      epochs=24, heldout_path=str(heldout_data))
    trained8 = str(run8 / "train" / "export")

    prompts_file = tmp_path / "heldout.jsonl"
    toy_corpus.write_jsonl(tt.heldout_samples(7, 6), str(prompts_file))
    tokenizer = tt.load_tokenizer(target_dir)
    prompts = ev.load_prompts(str(prompts_file), tokenizer)
    assert len(prompts.token_ids) == 6
    stop = ev.stop_token_ids(tokenizer)
    taus = {}
    refs: dict = {}
    for name, path in (("untrained", str(tmp_path / "untrained")), ("trained", trained), ("fp8", trained8)):
        target, drafter = ev.load_models(target_dir, path, cpu)
        report = ev.evaluate(target, drafter, prompts, 48, stop, references=refs)
        assert report.lossless, report.mismatches
        taus[name] = report.tau
    losses = {name: final_eval_loss(str(r / "train" / "metrics.jsonl")) for name, r in (("trained", run), ("fp8", run8))}
    print(f"tau untrained {taus['untrained']:.3f} trained {taus['trained']:.3f} fp8 {taus['fp8']:.3f}; "
          f"final held-out loss {losses['trained']:.4f} fp8 {losses['fp8']:.4f}")
    assert taus["untrained"] < 1.3, taus
    assert taus["trained"] >= taus["untrained"] + 1.0, taus   # measured: 1.00 -> 4.20
    # FP8 trains (the drafter accepts clearly more than an untrained one, and stays lossless) ...
    assert taus["fp8"] >= taus["untrained"] + 1.0, taus
    # ... and the quality gate decides whether it may be the default: its final held-out loss within
    # 1% of full precision's and its tau no worse than 0.1 below. Measured on this toy: loss 2.2%
    # above, tau 0.06 above (docs/benchmarks.md), so bf16 stays the default.
    gate = abs(losses["fp8"] - losses["trained"]) <= 0.01 * losses["trained"] and taus["fp8"] >= taus["trained"] - 0.1
    print(f"FP8 quality gate: {'pass' if gate else 'miss'} (loss {losses['fp8'] / losses['trained'] - 1:+.2%}, "
          f"tau {taus['fp8'] - taus['trained']:+.3f})")
    assert gate or DrafterConfig().precision == "bf16", (losses, taus)


def final_eval_loss(metrics_path: str) -> float:
    """The last held-out loss the trainer recorded: the same held-out batches and anchors in every
    run (a training step's loss depends on which batch the ring delivered at that step)."""
    with open(metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    assert evals, f"no held-out eval in {metrics_path}"
    return float(evals[-1]["eval_loss"])
