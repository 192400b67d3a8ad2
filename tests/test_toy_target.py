"""make-toy-target: a short run gives a loadable Qwen3.5 folder; data and weights follow the seed.

The real run takes minutes (bench/toy_tau.py, docs/benchmarks.md); here it trains a few steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dfpipe import eval as ev
from dfpipe import toy_target as tt
from target_server import toy_corpus
from target_server.tiny import build_tiny_target

TINY = tt.ToyRecipe(batch_tokens=512, pool_samples=32, heldout_samples=2, heldout_max_new_tokens=6,
                    warmup_steps=2)


def test_short_cli_run_writes_a_loadable_hybrid_qwen35_folder(tmp_path: Any,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path / "toy")
    assert tt.main(argparse.Namespace(out=out, minutes=0.1, seed=0)) == 0
    assert "held-out loss" in capsys.readouterr().out
    report = tt.read_report(out)
    assert report is not None and report["steps"] >= 1 and report["minutes_budget"] == 0.1
    assert math.isfinite(report["final_train_loss"]) and math.isfinite(report["heldout_loss"])
    assert report["heldout_decoded"] >= 1
    config = json.load(open(os.path.join(out, "config.json"), encoding="utf-8"))
    assert config["model_type"] == "qwen3_5_text"
    assert {"linear_attention", "full_attention"} <= set(config["layer_types"])
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == config["vocab_size"] == 512 and tokenizer.mask_token == "<|mask|>"
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Spell cat."}], tokenize=True,
                                           add_generation_prompt=True, return_dict=True)["input_ids"]
    logits = model(input_ids=torch.tensor([prompt])).logits
    assert torch.isfinite(logits).all()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".toy-target-")], "temp folder left behind"


def test_same_seed_and_steps_give_identical_weights(tmp_path: Any) -> None:
    runs = [tt.make_toy_target(str(tmp_path / name), minutes=2, seed=3, steps=2, recipe=TINY) for name in "ab"]
    assert [r.steps for r in runs] == [2, 2]
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    initial = load_file(build_tiny_target(str(tmp_path / "init"), hidden_size=TINY.hidden_size,
                                          num_layers=TINY.num_layers, seed=3) + "/model.safetensors")
    assert not torch.equal(a["lm_head.weight"], initial["lm_head.weight"]), "training changed nothing"


def test_streamed_batches_fit_the_budget_and_weigh_answers_only() -> None:
    tokenizer = tt.load_tokenizer()
    recipe = tt.ToyRecipe(batch_tokens=700, pool_samples=40)

    def first(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        data = iter(tt.StreamedBatches(tokenizer, seed, recipe, pad_id=tokenizer.pad_token_id))
        return [next(data) for _ in range(n)]

    batches = first(0, 12)
    docs = tt.encode_chats(tokenizer, [toy_corpus.sample(0, i) for i in range(4 * recipe.pool_samples)])
    masks = {tuple(ids): mask for ids, mask in docs}       # documents end in "\n", never in the pad id 0
    seen = set()
    for input_ids, weights in batches:
        assert input_ids.numel() <= recipe.batch_tokens
        for row, w in zip(input_ids.tolist(), weights.tolist()):
            n = len(row)
            while row[n - 1] == tokenizer.pad_token_id:
                n -= 1
            assert w[:n] == [float(m) for m in masks[tuple(row[:n])]] and set(w[n:]) <= {0.0}
            seen.add(tuple(row[:n]))
    first_pool = {tuple(ids) for ids, _ in docs[:recipe.pool_samples]}
    assert first_pool <= seen                 # the first pool was used up, nothing dropped
    again = first(0, 12)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(batches, again))
    assert not torch.equal(first(1, 1)[0][0], batches[0][0])


def test_heldout_prompts_are_never_training_samples() -> None:
    train = {json.dumps(toy_corpus.sample(0, i)) for i in range(2000)}
    heldout = tt.heldout_samples(0, 50)
    assert heldout[0] == toy_corpus.sample(0, tt.HELDOUT_START)
    # the corpus repeats easy prompts by chance ("Spell cat."), but held-out indices are disjoint
    assert sum(json.dumps(s) in train for s in heldout) < len(heldout) // 2


def test_demo_heldout_file_is_the_generator_output_and_shares_no_row_with_training(tmp_path: Any) -> None:
    demo = os.path.join(os.path.dirname(__file__), "..", "configs", "demo")
    with open(os.path.join(demo, "chat.jsonl"), encoding="utf-8") as f:
        train = [json.loads(line) for line in f]
    with open(os.path.join(demo, "heldout.jsonl"), encoding="utf-8") as f:
        heldout = [json.loads(line) for line in f]
    keys = {json.dumps(s, sort_keys=True) for s in train}
    assert heldout and not [s for s in heldout if json.dumps(s, sort_keys=True) in keys]
    assert len({json.dumps(s, sort_keys=True) for s in heldout}) == len(heldout)
    assert heldout == toy_corpus.held_out(len(heldout), 0, tt.HELDOUT_START, train)  # reproducible
    out = tmp_path / "h.jsonl"
    toy_corpus.main(["--out", str(out), "--n", "5", "--start", str(tt.HELDOUT_START),
                     "--exclude", os.path.join(demo, "chat.jsonl")])
    assert [json.loads(line) for line in out.read_text().splitlines()] == heldout[:5]


def test_refuses_to_overwrite_a_non_empty_folder(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    assert tt.main(argparse.Namespace(out=str(tmp_path), minutes=0.1, seed=0)) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_an_untrained_drafter_exports_and_decodes_losslessly(tmp_path: Any) -> None:
    """The toy drafter's starting point on a random tiny target: build -> export -> load -> eval.
    (Training it is the services' job: tests/test_tau_ci.py.)"""
    from drafter_trainer.export import export_drafter

    target_dir = build_tiny_target(str(tmp_path / "target"), hidden_size=64, num_layers=8, seed=0,
                                   tokenizer_dir=tt.TOKENIZER_DIR)
    recipe = tt.DrafterRecipe(num_layers=1, block_size=4)
    drafter = tt.untrained_drafter(target_dir, recipe, seed=3)
    assert not drafter.training and drafter.config.block_size == 4 and drafter.lm_head.loaded
    export_drafter(drafter, str(tmp_path / "drafter"))
    target, loaded = ev.load_models(target_dir, str(tmp_path / "drafter"), torch.device("cpu"))
    report = ev.evaluate(target, loaded, ev.Prompts([[1, 277, 202, 75, 2, 202, 1, 271, 202]], [1]), 6, set())
    assert report.lossless and report.generated_tokens == 6


def test_regenerated_answers_are_the_targets_own_greedy_answers(tmp_path: Any) -> None:
    target_dir = build_tiny_target(str(tmp_path / "target"), hidden_size=64, num_layers=4, seed=2,
                                   tokenizer_dir=tt.TOKENIZER_DIR)
    samples = [toy_corpus.sample(0, i) for i in range(3)]
    regenerated = tt.regenerate_answers(target_dir, samples, max_new_tokens=5, batch_size=2)
    tokenizer = tt.load_tokenizer(target_dir)
    target = ev.TargetModel.load(target_dir, torch.device("cpu"))
    for before, after in zip(samples, regenerated):
        turns = ev.chat_prompt_turns(before)
        assert after["messages"][:-1] == turns and after["messages"][-1]["role"] == "assistant"
        prompt = tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
        greedy = ev.greedy_decode(target, prompt, 5, ev.stop_token_ids(tokenizer)).tokens
        assert after["messages"][-1]["content"] == tokenizer.decode(
            [t for t in greedy if t not in ev.stop_token_ids(tokenizer)])


def _fidelity(fp8_fp32: float, fp8_bf16: float, loss_fp8: float) -> tt.GradientFidelity:
    return tt.GradientFidelity(step=7, accuracy=0.9, loss={"fp32": 1.0, "bf16": 1.0, "fp8": loss_fp8},
                               cosine={"fp8/fp32": {"fc.weight": 0.999, "norm.weight": fp8_fp32},
                                       "fp8/bf16": {"fc.weight": fp8_bf16, "norm.weight": 0.999},
                                       "bf16/fp32": {"fc.weight": 1.0, "norm.weight": 1.0}})


def test_fp8_fidelity_passes_only_with_every_parameter_against_both_references_and_the_loss_close() -> None:
    assert _fidelity(0.995, 0.995, 1.004).passed
    assert _fidelity(0.99, 0.99, 0.996).passed                                # the cosine limit itself passes
    worst = _fidelity(0.98, 0.995, 1.0)
    assert not worst.passed and worst.min_cosine == ("norm.weight", 0.98)
    assert not _fidelity(0.995, 0.985, 1.0).passed, "bf16 is a reference too"
    assert not _fidelity(0.995, 0.995, 1.006).passed and not _fidelity(0.995, 0.995, 0.994).passed
    assert "FAIL, least gradient cosine 0.9800 (norm.weight" in str(worst)
