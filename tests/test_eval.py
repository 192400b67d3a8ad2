"""dfpipe eval: speculative decoding equals greedy decoding, and its acceptance accounting is exact.

The target is a tiny random Qwen3.5 (hybrid Gated-DeltaNet + attention) built from a config; the
API tests run it in float64 so that no top-2 logit near-tie can make two mathematically equal
forwards disagree. Oracle drafters (monkeypatched `draft_block`) that know the target's greedy
continuation prove the tau / per-position bookkeeping; a corrupted acceptance rule proves that
the lossless check catches a wrong token and names where it is.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

import pytest
import torch

from common.config import DrafterConfig
from dfpipe import eval as ev
from drafter_trainer.blocks import build_blocks
from drafter_trainer.export import export_drafter
from drafter_trainer.model import DFlashConfig, DFlashDraftModel
from common.batch import PackedBatch
from target_server.tiny import build_tiny_target
from test_drafter_model import drafter_terms
from tolerances import assert_close

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo",
                             "tokenizer")
LAYER_IDS = [1, 2, 3]
MASK_ID = 3
BLOCK = 4
NEW_TOKENS = 13     # not a multiple of BLOCK: the last step is truncated


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("target"))
    return build_tiny_target(path, hidden_size=64, num_layers=4, seed=1, tokenizer_dir=TOKENIZER_DIR)


@pytest.fixture(scope="module")
def target(target_dir: str) -> ev.TargetModel:
    return ev.TargetModel.load(target_dir, torch.device("cpu"), LAYER_IDS, dtype=torch.float64)


def make_drafter(target_dir: str, block_size: int = BLOCK, seed: int = 0) -> DFlashDraftModel:
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        target_config = json.load(f)
    config = DFlashConfig.from_target(target_config, DrafterConfig(num_layers=1, block_size=block_size),
                                      LAYER_IDS, MASK_ID)
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(config)
    drafter.load_target_head(target_dir)
    return drafter.eval()


@pytest.fixture(scope="module")
def drafter(target_dir: str) -> DFlashDraftModel:
    return make_drafter(target_dir)


PROMPTS = [[1, 277, 202, 75, 76, 2, 202, 1, 271, 202], [1, 277, 202, 300, 301, 302, 303, 2, 202, 1, 271, 202]]


def oracle(monkeypatch: pytest.MonkeyPatch, target: ev.TargetModel, prompt: list[int], right: int,
           check_anchor: bool = True) -> list[int]:
    """Make draft_block propose the target's own greedy continuation for the first `right` block
    positions and a wrong token after; return that continuation."""
    reference = ev.greedy_decode(target, prompt, NEW_TOKENS + 2 * BLOCK, set()).tokens

    def draft(drafter: Any, context: torch.Tensor, anchor_token: int) -> list[int]:
        j = context.shape[1] - len(prompt)             # output index of the anchor
        assert not check_anchor or reference[j] == anchor_token, "the anchor must be the last verified token"
        true = reference[j + 1:j + drafter.config.block_size]
        return [t if k < right else (t + 1) % 512 for k, t in enumerate(true)]

    monkeypatch.setattr(ev, "draft_block", draft)
    return reference


def test_untrained_drafter_is_lossless_with_tau_near_one(target: ev.TargetModel, drafter: DFlashDraftModel) -> None:
    report = ev.evaluate(target, drafter, ev.Prompts(PROMPTS, [1, 2]), NEW_TOKENS, set())
    assert report.lossless, report.mismatches
    assert report.generated_tokens == 2 * NEW_TOKENS
    assert 1.0 <= report.tau < 1.3          # a random drafter almost never guesses a 512-way token
    # every verify forward yields n + 1 tokens; together they cover the outputs after the prefill token
    yielded = sum((n + 1) * count for n, count in enumerate(report.accepted_histogram))
    assert 2 * (NEW_TOKENS - 1) <= yielded < 2 * (NEW_TOKENS - 1 + BLOCK)


def test_oracle_drafter_reaches_tau_equal_to_block_size(monkeypatch: pytest.MonkeyPatch, target: ev.TargetModel,
                                                         drafter: DFlashDraftModel) -> None:
    prompt = PROMPTS[0]
    reference = oracle(monkeypatch, target, prompt, right=BLOCK)
    spec = ev.speculative_decode(target, drafter, prompt, NEW_TOKENS, set())
    assert spec.tokens == reference[:NEW_TOKENS]
    # prefill gives token 0; each verify forward then yields the B-1 drafts plus the bonus token
    assert spec.accepted == [BLOCK - 1] * -(-(NEW_TOKENS - 1) // BLOCK)
    tau, per_position, histogram = ev.summarize(spec.accepted, BLOCK)
    assert tau == BLOCK and per_position == [1.0] * (BLOCK - 1) and histogram[-1] == len(spec.accepted)


@pytest.mark.parametrize("right", [0, 1, 2])
def test_partly_right_drafter_accepts_exactly_its_right_prefix(monkeypatch: pytest.MonkeyPatch, right: int,
                                                                target: ev.TargetModel,
                                                                drafter: DFlashDraftModel) -> None:
    prompt = PROMPTS[1]
    reference = oracle(monkeypatch, target, prompt, right=right)
    report = ev.evaluate(target, drafter, ev.Prompts([prompt], [1]), NEW_TOKENS, set())
    assert report.lossless, report.mismatches
    assert report.tau == right + 1
    assert report.acceptance_per_position == [1.0] * right + [0.0] * (BLOCK - 1 - right)
    assert report.generated_tokens == len(reference[:NEW_TOKENS])


def test_corrupted_acceptance_is_reported_at_the_first_wrong_token(monkeypatch: pytest.MonkeyPatch,
                                                                    target: ev.TargetModel,
                                                                    drafter: DFlashDraftModel) -> None:
    oracle(monkeypatch, target, PROMPTS[0], right=1, check_anchor=False)   # draft position 2 is always wrong
    real = ev.accept_length
    monkeypatch.setattr(ev, "accept_length", lambda draft, verified: min(len(draft), real(draft, verified) + 1))
    report = ev.evaluate(target, drafter, ev.Prompts([PROMPTS[0]], [7]), NEW_TOKENS, set())
    assert not report.lossless
    (m,) = report.mismatches
    # output 0 comes from prefill, 1 is the right draft, 2 the wrongly accepted one
    assert (m.prompt, m.line, m.position) == (0, 7, 2)
    assert m.speculative != m.greedy and m.greedy_margin is not None and m.greedy_margin > 0


def test_output_stops_at_a_stop_token_exactly_like_greedy(target: ev.TargetModel, drafter: DFlashDraftModel,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    reference = oracle(monkeypatch, target, PROMPTS[0], right=BLOCK)
    stop = reference[5]
    first = reference.index(stop)
    spec = ev.speculative_decode(target, drafter, PROMPTS[0], NEW_TOKENS, {stop})
    assert spec.tokens == reference[:first + 1]
    assert ev.greedy_decode(target, PROMPTS[0], NEW_TOKENS, {stop}).tokens == spec.tokens


def test_decode_block_sees_what_a_training_block_sees(target: ev.TargetModel, drafter: DFlashDraftModel) -> None:
    """single_block at decode == build_blocks over a packed row whose anchor features exist but are invisible."""
    ids = PROMPTS[1]
    _, features = target.forward(ids)
    anchor = len(ids) - 3
    trained_view = PackedBatch(hidden=features.float(), input_ids=torch.tensor(ids, dtype=torch.int32),
                               loss_mask=torch.ones(len(ids), dtype=torch.uint8),
                               position_ids=torch.arange(len(ids), dtype=torch.int32),
                               doc_lens=torch.tensor([len(ids)], dtype=torch.int32),
                               sample_ids=torch.zeros(1, dtype=torch.int64), doc_ids=torch.zeros(1, dtype=torch.int64))
    blocks = build_blocks(trained_view, torch.tensor([anchor]), BLOCK, MASK_ID, gamma=4.0)
    with torch.no_grad():
        training = drafter(trained_view.hidden, blocks.block_input_ids, blocks)[0, 1:]
        training_tokens = drafter.compute_logits(training).argmax(-1).tolist()
        decode = ev.single_block(anchor, ids[anchor], BLOCK, MASK_ID, torch.device("cpu"))
        decoded = drafter(features[:, :anchor].float(), decode.block_input_ids, decode)[0, 1:]
    assert_close(decoded, training, n=drafter_terms(drafter.config, len(ids)))
    assert ev.draft_block(drafter, features[:, :anchor].float(), ids[anchor]) == training_tokens


def test_prompts_file_chat_rows_use_turns_before_the_first_answer_and_count_bad_rows(tmp_path: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat."},
                      {"role": "assistant", "content": "C-A-T."}, {"role": "user", "content": "Again."}]},
        {"messages": [{"role": "assistant", "content": "no question"}]},
        {"messages": "not a list"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    prompts = ev.load_prompts(str(path), tok)
    assert prompts.kind == "chat" and prompts.source_lines == [1]
    assert [line for line, _ in prompts.skipped] == [2, 3, 4]
    expected = tok.apply_chat_template(rows[0]["messages"][:2], tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
    assert prompts.token_ids == [list(expected)]
    text = tmp_path / "p.txt"
    text.write_text("Spell cat.\n\nCount from 1 to 3.\n")
    plain = ev.load_prompts(str(text), tok, limit=1)
    assert plain.kind == "text" and plain.source_lines == [1] and tok.decode(plain.token_ids[0]).endswith(
        "<|im_start|>user\nSpell cat.<|im_end|>\n<|im_start|>assistant\n")


def test_a_first_row_nested_too_deep_is_a_bad_chat_row_not_a_crash(tmp_path: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    good = {"messages": [{"role": "user", "content": "Spell cat."}, {"role": "assistant", "content": "C-A-T."}]}
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n" + json.dumps(good) + "\n")
    prompts = ev.load_prompts(str(path), tok)
    assert prompts.kind == "chat" and prompts.source_lines == [2]
    assert [line for line, _ in prompts.skipped] == [1]


def test_every_row_prepare_data_accepts_is_a_prompt_and_the_rows_it_refuses_are_skipped(tmp_path: Any) -> None:
    from transformers import AutoTokenizer

    from target_server.data import prepare_data

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    openai = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Spell "}, {"type": "text", "text": "cat."}]},
                      {"role": "assistant", "content": "C-A-T."}]},
        {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w", "arguments": "{}"}}]},
                      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 2."},
                      {"role": "assistant", "reasoning_content": "Easy.", "content": "1, 2."}]},
        {"messages": [{"role": "user", "content": "fake <|im_end|> turn"}, {"role": "assistant", "content": "y"}]},
    ]
    sharegpt = [{"conversations": [{"from": "human", "value": "Spell dog."}, {"from": "gpt", "value": "D-O-G."}],
                 "system": "Be brief."}]
    for name, rows in (("openai", openai), ("sharegpt", sharegpt)):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode() + b"\n")   # BOM
        report = prepare_data(str(path), TOKENIZER_DIR, str(tmp_path / f"prepared-{name}"), max_len=512)
        prompts = ev.load_prompts(str(path), tok)
        kept = [line for line in range(1, len(rows) + 1) if line not in {bad for bad, _ in report.bad}]
        assert prompts.kind == "chat" and prompts.source_lines == kept and len(kept) == report.kept
        assert [line for line, _ in prompts.skipped] == [line for line, _ in report.bad]
    assert report.kept == 1 and [line for line, _ in ev.load_prompts(str(tmp_path / "openai.jsonl"), tok).skipped] == [4]
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell dog."}],
                                   tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert prompts.token_ids == [list(want)]
    first = ev.load_prompts(str(tmp_path / "openai.jsonl"), tok, limit=1)
    assert tok.decode(first.token_ids[0]).endswith("<|im_start|>user\nSpell cat.<|im_end|>\n<|im_start|>assistant\n")


def _cli_args(tmp_path: Any, target_dir: str, drafter_dir: str, **kw: Any) -> argparse.Namespace:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Count from 3 to 9.\nSpell the word fox.\n")
    base = dict(target=target_dir, drafter=drafter_dir, prompts=str(prompts), block_size=0, max_new_tokens=9,
                limit=0, device="auto", json=True)
    return argparse.Namespace(**{**base, **kw})


def test_cli_exports_load_and_exit_codes_follow_the_lossless_check(tmp_path: Any, target_dir: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    drafter_dir = str(tmp_path / "drafter")
    export_drafter(make_drafter(target_dir, block_size=8), drafter_dir)
    assert ev.main(_cli_args(tmp_path, target_dir, drafter_dir, block_size=BLOCK)) == ev.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["lossless"] and report["block_size"] == BLOCK and report["prompts"] == 2
    assert len(report["acceptance_per_position"]) == BLOCK - 1

    monkeypatch.setattr(ev, "accept_length", lambda draft, verified: len(draft))   # accept everything
    assert ev.main(_cli_args(tmp_path, target_dir, drafter_dir, json=False)) == ev.EXIT_MISMATCH
    captured = capsys.readouterr()
    assert "lossless: FAILED" in captured.out and "output position 1" in captured.err

    assert ev.main(_cli_args(tmp_path, target_dir, str(tmp_path / "missing"))) == ev.EXIT_USAGE
    assert "drafter folder not found" in capsys.readouterr().err


def test_cli_without_a_usable_prompt_says_what_is_wrong_with_the_file_and_the_fix(
        tmp_path: Any, target_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    drafter_dir = str(tmp_path / "drafter")
    export_drafter(make_drafter(target_dir), drafter_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(json.dumps({"messages": [{"role": "user", "content": "caf\u00e9"}]},
                                   ensure_ascii=False).encode("latin-1") + b"\n")
    assert ev.main(_cli_args(tmp_path, target_dir, drafter_dir, prompts=str(prompts))) == ev.EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert err[-2] == (f"dfpipe eval: no usable prompt in {prompts}: it is not UTF-8 and looks like Latin-1 "
                       f"(ISO-8859-1) or Windows-1252 text; convert it: iconv -f latin1 -t utf-8 {prompts} > "
                       f"{tmp_path / 'prompts.utf8.jsonl'}")
    assert err[-1].startswith("  line 1: not UTF-8: byte ")


def _config_only_target(path: Any, target_dir: str, **changes: Any) -> str:
    """A folder holding target_dir's config.json with `changes` applied (a key set to None is removed):
    what check_pairing reads, so a refusal must come before any weight is loaded."""
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(path)


@pytest.mark.parametrize("key, value", [("hidden_size", 128), ("vocab_size", 1024), ("num_hidden_layers", 6)])
def test_cli_refuses_a_drafter_shaped_for_another_target(tmp_path: Any, target_dir: str, key: str, value: int,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    drafter_dir = str(tmp_path / "drafter")
    export_drafter(make_drafter(target_dir), drafter_dir, target_dir=target_dir)
    other = _config_only_target(tmp_path / "other", target_dir, **{key: value})
    assert ev.main(_cli_args(tmp_path, other, drafter_dir)) == ev.EXIT_USAGE
    err = capsys.readouterr().err
    assert "is not the target this drafter was trained for" in err and f"{key} {value}" in err


def test_cli_refuses_a_drafter_reading_layers_the_target_lacks(tmp_path: Any, target_dir: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A config without num_target_layers (a hand-written or foreign export) is checked on its layer ids."""
    drafter_dir = tmp_path / "drafter"
    export_drafter(make_drafter(target_dir), str(drafter_dir), target_dir=target_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    del config["num_target_layers"]
    (drafter_dir / "config.json").write_text(json.dumps(config))
    shallow = _config_only_target(tmp_path / "shallow", target_dir, num_hidden_layers=max(LAYER_IDS),
                                  layer_types=None)
    assert ev.main(_cli_args(tmp_path, shallow, str(drafter_dir))) == ev.EXIT_USAGE
    assert f"reads layers {LAYER_IDS}" in capsys.readouterr().err
    assert ev.check_pairing(str(drafter_dir), target_dir) == []       # its own target still fits


def test_cli_warns_when_the_export_does_not_say_which_target_it_was_trained_on(
        tmp_path: Any, target_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    unknown, own, foreign = (str(tmp_path / name) for name in ("unknown", "own", "foreign"))
    export_drafter(make_drafter(target_dir), unknown)
    export_drafter(make_drafter(target_dir), own, target_dir=target_dir)
    # same shape, another model: the export records a target whose config.json differs
    sibling = _config_only_target(tmp_path / "sibling", target_dir, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 10_000.0})
    export_drafter(make_drafter(target_dir), foreign, target_dir=sibling)

    assert ev.main(_cli_args(tmp_path, target_dir, unknown, max_new_tokens=2)) == ev.EXIT_OK
    captured = capsys.readouterr()
    assert "WARNING" in captured.err and "records no target" in captured.err
    assert len(json.loads(captured.out)["warnings"]) == 1

    assert ev.main(_cli_args(tmp_path, target_dir, foreign, max_new_tokens=2)) == ev.EXIT_OK
    captured = capsys.readouterr()
    assert "trained on another target" in captured.err and sibling in captured.err

    assert ev.main(_cli_args(tmp_path, target_dir, own, max_new_tokens=2)) == ev.EXIT_OK
    captured = capsys.readouterr()
    assert "WARNING" not in captured.err and json.loads(captured.out)["warnings"] == []


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"architectures": ["DFlashDraftModel"]}'])
def test_cli_refuses_a_drafter_config_it_cannot_read(tmp_path: Any, target_dir: str, text: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(text)
    assert ev.main(_cli_args(tmp_path, target_dir, str(tmp_path / "drafter"))) == ev.EXIT_USAGE
    assert "unreadable config.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fp8_target_dir(target_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """target_dir as a block-wise FP8 checkpoint (`dfpipe quantize-fp8`): 64 wide, so every block is partial."""
    from dfpipe.quantize_fp8 import quantize_checkpoint

    return quantize_checkpoint(target_dir, str(tmp_path_factory.mktemp("fp8") / "target"))["out"]


def test_an_fp8_target_runs_its_dequantized_weights_on_the_cpu(fp8_target_dir: str, tmp_path: Any) -> None:
    """eval converts the FP8 weights itself (transformers' reader assumes whole 128 x 128 blocks)."""
    from test_fp8_target import _dequantized_reference

    fp8_target = ev.TargetModel.load(fp8_target_dir, torch.device("cpu"), LAYER_IDS, dtype=torch.float64)
    reference = ev.TargetModel.load(_dequantized_reference(fp8_target_dir, str(tmp_path / "ref")),
                                    torch.device("cpu"), LAYER_IDS, dtype=torch.float64)
    assert fp8_target.precision == "fp8-block-dequantized-fp64" and reference.precision == "fp64"
    logits, features = fp8_target.forward(PROMPTS[1])
    expected_logits, expected_features = reference.forward(PROMPTS[1])
    assert torch.equal(logits, expected_logits) and torch.equal(features, expected_features)


def test_cli_says_which_precision_the_target_ran_in_and_warns_when_the_drafter_trained_on_another(
        tmp_path: Any, target_dir: str, fp8_target_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    on_fp8, on_this, on_bf16 = (str(tmp_path / name) for name in ("on-fp8", "on-this", "on-bf16"))
    export_drafter(make_drafter(target_dir), on_fp8, target_dir=fp8_target_dir, target_precision="fp8-block")
    export_drafter(make_drafter(target_dir), on_this, target_dir=fp8_target_dir,
                   target_precision="fp8-block-dequantized-fp32")
    export_drafter(make_drafter(target_dir), on_bf16, target_dir=target_dir, target_precision="bf16")

    assert ev.main(_cli_args(tmp_path, fp8_target_dir, on_fp8, max_new_tokens=2)) == ev.EXIT_OK
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert (report["target_precision"], report["trained_precision"]) == ("fp8-block-dequantized-fp32", "fp8-block")
    assert len(report["warnings"]) == 1 and "was trained on the target in fp8-block" in captured.err

    assert ev.main(_cli_args(tmp_path, fp8_target_dir, on_this, max_new_tokens=2, json=False)) == ev.EXIT_OK
    captured = capsys.readouterr()
    assert "WARNING" not in captured.err
    assert "(fp8-block-dequantized-fp32; the drafter was trained on fp8-block-dequantized-fp32)" in captured.out

    # trained on the unquantized model: the same model (no "another target"), another precision
    assert ev.main(_cli_args(tmp_path, fp8_target_dir, on_bf16, max_new_tokens=2)) == ev.EXIT_OK
    captured = capsys.readouterr()
    warnings = json.loads(captured.out)["warnings"]
    assert len(warnings) == 1 and "trained on the target in bf16, this eval runs it in fp8-block" in warnings[0]
