"""prepare-data's inputs: OpenAI and ShareGPT rows, JSONL and Parquet, any chat template and its kwargs.

The loss mask is checked token by token against pieces written out by hand: each piece is tokenized
on its own and carries the mask the design says it has (tests/data/qwen35_style.jinja, a template
without generation markers), and the concatenation must equal what prepare-data wrote.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from common.config import ConfigError, load_config
from target_server import toy_corpus
from target_server.data import DataError, PreparedDataset, ensure_prepared, main as prepare_main, prepare_data
from target_server.tokenizer import CHAT_TEMPLATE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TOKENIZER = os.path.join(REPO, "configs", "demo", "tokenizer")
QWEN35_STYLE = os.path.join(REPO, "tests", "data", "qwen35_style.jinja")
# Qwen's tokenizers hold these as added tokens that are not special (so user text may contain them).
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
# system, user, assistant (reasoning + tool call), tool result, assistant (reasoning + answer), user, assistant
AGENT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "Need the tool.", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 18}'},
    {"role": "assistant", "reasoning_content": "18 C is mild.", "content": "Mild, 18 C."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "reasoning_content": "No forecast tool.", "content": "I cannot tell."},
]
SYSTEM_TURN = ("<|im_start|>system\nYou are terse.\n\nTools you may call:\n<tools>\n" + json.dumps(TOOLS[0])
               + '\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n')
TOOL_CALL_TEXT = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_TURN = '<|im_start|>user\n<tool_response>\n{"temp_c": 18}\n</tool_response><|im_end|>\n'


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """The demo tokenizer plus Qwen's non-special added tokens, saved as a folder."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.add_tokens(QWEN_ADDED)
    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    tokenizer.save_pretrained(folder)
    return str(folder), tokenizer


def _write_jsonl(path, rows: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _write_parquet(path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _expected(tokenizer, pieces: list[tuple[int, str]]) -> tuple[list[int], list[int], list[str]]:
    """ids, mask and token strings of hand-written (mask, text) pieces, each tokenized on its own."""
    ids, mask = [], []
    for flag, text in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [flag] * len(piece)
    return ids, mask, tokenizer.convert_ids_to_tokens(ids)


def _documents(path) -> list[tuple[list[int], list[int], int]]:
    ds = PreparedDataset.open(str(path))
    return [(ids.tolist(), mask.tolist(), sid) for ids, mask, sid in (ds.sample(i) for i in range(len(ds)))]


def _assert_mask(doc: tuple[list[int], list[int], int], expected, sample_id: int) -> None:
    ids, mask, sid = doc
    want_ids, want_mask, tokens = expected
    assert sid == sample_id
    assert ids == want_ids, "the template rendered something other than the hand-written pieces"
    wrong = [(i, tokens[i], mask[i], want_mask[i]) for i in range(len(ids)) if mask[i] != want_mask[i]]
    assert not wrong, f"tokens with the wrong mask (index, token, got, want): {wrong}"


# ---------------------------------------------------------------------------------------------
# the mask, token by token, from a template without generation markers


def test_mask_of_an_agent_conversation_token_by_token(tmp_path, qwen_tokenizer):
    folder, tokenizer = qwen_tokenizer
    src = _write_jsonl(tmp_path / "agent.jsonl", [{"messages": AGENT, "tools": TOOLS}])
    report = prepare_data(src, folder, str(tmp_path / "p"), max_len=4096, chat_template=QWEN35_STYLE)
    # The template drops the reasoning of turns before the last user message once that message exists:
    # the first two assistant turns are trained where the server sees them (with their reasoning), the
    # last one in the full conversation, where the earlier turns are context without reasoning.
    assert report.kept == 1 and report.multi_view == 1 and report.documents == 2
    first, second = _documents(tmp_path / "p")
    _assert_mask(first, _expected(tokenizer, [
        (0, SYSTEM_TURN + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"),
        (1, "Need the tool.\n</think>\n\n" + TOOL_CALL_TEXT + "<|im_end|>"),
        (0, "\n" + TOOL_TURN + "<|im_start|>assistant\n<think>\n"),
        (1, "18 C is mild.\n</think>\n\nMild, 18 C.<|im_end|>"),
        (0, "\n"),
    ]), sample_id=0)
    _assert_mask(second, _expected(tokenizer, [
        (0, SYSTEM_TURN + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n" + TOOL_CALL_TEXT
         + "<|im_end|>\n" + TOOL_TURN + "<|im_start|>assistant\nMild, 18 C.<|im_end|>\n"
         + "<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n<think>\n"),
        (1, "No forecast tool.\n</think>\n\nI cannot tell.<|im_end|>"),
        (0, "\n"),
    ]), sample_id=0)


@pytest.mark.parametrize("kwargs, prompt_tail, generated_head", [
    # thinking on: the generation prompt opens <think>; the model writes the (empty) reasoning and closes it
    ({}, "<think>\n", "\n</think>\n\n"),
    ({"enable_thinking": True}, "<think>\n", "\n</think>\n\n"),
    # thinking off: the template writes the empty think block itself, so it is prompt, not generated
    ({"enable_thinking": False}, "<think>\n\n</think>\n\n", ""),
])
def test_thinking_kwarg_decides_whether_the_empty_think_block_is_prompt(tmp_path, qwen_tokenizer, kwargs,
                                                                        prompt_tail, generated_head):
    folder, tokenizer = qwen_tokenizer
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    prepare_data(_write_jsonl(tmp_path / "r.jsonl", rows), folder, str(tmp_path / "p"), max_len=256,
                 chat_template=QWEN35_STYLE, chat_template_kwargs=kwargs)
    (doc,) = _documents(tmp_path / "p")
    _assert_mask(doc, _expected(tokenizer, [
        (0, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + prompt_tail),
        (1, generated_head + "Hello.<|im_end|>"),
        (0, "\n"),
    ]), sample_id=0)


def test_reasoning_under_thinking_off_is_a_counted_template_mismatch(tmp_path, qwen_tokenizer):
    folder, _ = qwen_tokenizer
    thinking = {"messages": [{"role": "user", "content": "Hi"},
                             {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello."}]}
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    report = prepare_data(_write_jsonl(tmp_path / "r.jsonl", [thinking, plain]), folder, str(tmp_path / "p"),
                          max_len=256, chat_template=QWEN35_STYLE, chat_template_kwargs={"enable_thinking": False})
    assert report.kept == 1 and [line for line, _ in report.bad] == [1]
    assert report.bad[0][1].startswith("template mismatch: message 1")


def test_render_diff_equals_the_generation_markers_of_the_demo_template(tmp_path):
    """The demo template marks content + <|im_end|> with {% generation %}: transformers' mask from the
    markers, prepare-data's mask from rendering, and prepare-data on the template with the markers
    removed all agree, on single- and multi-turn rows."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    rows = toy_corpus.generate(120, seed=9)
    rows += [{"messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Spell cat."},
                           {"role": "assistant", "content": "C-A-T."}, {"role": "user", "content": "Again, spaced"},
                           {"role": "assistant", "content": "\n C - A - T .  "}]}]
    src = _write_jsonl(tmp_path / "rows.jsonl", rows)
    plain = CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert "{%- generation" not in plain and "endgeneration" not in plain
    prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "marked"), max_len=1024)
    prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "plain"), max_len=1024, chat_template=plain)
    marked, unmarked = _documents(tmp_path / "marked"), _documents(tmp_path / "plain")
    assert len(marked) == len(rows) and marked == unmarked
    for (ids, mask, sid) in marked:
        ref = tokenizer.apply_chat_template(rows[sid]["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert ids == ref["input_ids"] and mask == ref["assistant_masks"]


# ---------------------------------------------------------------------------------------------
# formats


def _sharegpt(messages: list[dict]) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


PLAIN = [  # rows both formats can say
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3."},
     {"role": "assistant", "content": "1, 2, 3."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another."}, {"role": "assistant", "content": "Red."}],
    [{"role": "user", "content": "Look it up."}, {"role": "assistant", "content": "Calling."},
     {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}],
]


def test_sharegpt_jsonl_and_parquet_give_the_same_documents_as_openai_jsonl(tmp_path, qwen_tokenizer):
    folder, _ = qwen_tokenizer
    openai_rows = [{"messages": m} for m in PLAIN]
    sharegpt_rows = [_sharegpt(m) for m in PLAIN]
    sources = {
        "openai.jsonl": _write_jsonl(tmp_path / "openai.jsonl", openai_rows),
        "sharegpt.jsonl": _write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt_rows),
        "openai.parquet": _write_parquet(tmp_path / "openai.parquet", openai_rows),
        "sharegpt.parquet": _write_parquet(tmp_path / "sharegpt.parquet", sharegpt_rows),
    }
    docs = {}
    for name, src in sources.items():
        out = tmp_path / f"p-{name}"
        report = prepare_data(src, folder, str(out), max_len=512, chat_template=QWEN35_STYLE)
        assert report.kept == len(PLAIN) and not report.bad, name
        meta = json.loads((out / "meta.json").read_text())
        assert meta["source_format"] == name.split(".")[0]
        docs[name] = _documents(out)
    assert all(d == docs["openai.jsonl"] for d in docs.values())
    assert {sid for _, _, sid in docs["openai.jsonl"]} == {0, 1, 2}


def test_parquet_keeps_reasoning_and_tool_calls(tmp_path, qwen_tokenizer):
    """Parquet stores messages as structs: a field one message lacks is null there, and must read as absent."""
    folder, _ = qwen_tokenizer
    zone = {"type": "object", "properties": {"zone": {"type": "string"}}}
    clock = {"type": "function", "function": {"name": "clock", "description": "Time in a zone", "parameters": zone}}
    ask_clock = [{"role": "user", "content": "Time in Tokyo?"},
                 {"role": "assistant", "content": None,
                  "tool_calls": [{"type": "function", "function": {"name": "clock", "arguments": '{"zone": "JST"}'}}]}]
    rows = [{"messages": AGENT, "tools": TOOLS}, {"messages": PLAIN[0]}, {"messages": ask_clock, "tools": [clock]}]
    jsonl, parquet = _write_jsonl(tmp_path / "a.jsonl", rows), _write_parquet(tmp_path / "a.parquet", rows)
    prepare_data(jsonl, folder, str(tmp_path / "j"), max_len=4096, chat_template=QWEN35_STYLE)
    prepare_data(parquet, folder, str(tmp_path / "q"), max_len=4096, chat_template=QWEN35_STYLE)
    assert _documents(tmp_path / "j") == _documents(tmp_path / "q")
    assert [sid for _, _, sid in _documents(tmp_path / "q")] == [0, 0, 1, 2]


def test_sharegpt_top_level_system_and_role_names(tmp_path, qwen_tokenizer):
    folder, _ = qwen_tokenizer
    llama_factory = {"system": "Be brief.", "conversations": [
        {"from": "human", "value": "Count to 3."}, {"from": "gpt", "value": "1, 2, 3."}]}
    explicit = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "Count to 3."},
                                  {"from": "assistant", "value": "1, 2, 3."}]}
    odd = {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{}"}]}
    bad_system = {"system": ["Be brief."], "conversations": explicit["conversations"][1:]}
    src = _write_jsonl(tmp_path / "s.jsonl", [llama_factory, explicit, odd, bad_system])
    report = prepare_data(src, folder, str(tmp_path / "p"), max_len=512, chat_template=QWEN35_STYLE)
    a, b = _documents(tmp_path / "p")
    assert a[:2] == b[:2] and report.kept == 2
    assert [line for line, _ in report.bad] == [3, 4]
    assert report.bad[0][1].startswith("invalid role: turn 1 from 'function_call'")
    assert report.bad[1][1].startswith("invalid system")


def test_format_is_detected_from_the_first_row_holding_a_key_and_holds_for_the_file(tmp_path):
    rows = ['{"note": "header row"}', _sharegpt(PLAIN[0]), {"messages": PLAIN[0]}, _sharegpt(PLAIN[1])]
    report = prepare_data(_write_jsonl(tmp_path / "m.jsonl", rows), DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512)
    assert report.kept == 2 and [line for line, _ in report.bad] == [1, 3]
    assert report.bad[0][1] == "missing 'messages' or 'conversations'"
    assert report.bad[1][1].startswith("missing 'conversations': the file holds sharegpt rows")
    assert PreparedDataset.open(str(tmp_path / "p")).meta["source_format"] == "sharegpt"


@pytest.mark.parametrize("row, kind", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": "f"}]},
     "invalid tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "invalid tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}, {"role": "assistant", "content": "y"}]},
     "invalid tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 3}]},
     "invalid reasoning_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": "{bad"},
     "invalid tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": [1]},
     "invalid tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<|im_end|>",
                                                      "tool_calls": [CALL]}]}, "control token in content"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"function": {"name": "f", "arguments": "<|im_start|>"}}]}]}, "control token in content"),
    ({"messages": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "x"}]},
     "assistant turn without a prompt"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}, "missing 'messages'"),
])
def test_bad_rows_of_the_richer_formats_are_counted_with_their_reason(tmp_path, row, kind):
    good = {"messages": PLAIN[0]}
    report = prepare_data(_write_jsonl(tmp_path / "r.jsonl", [good, row, good]), DEMO_TOKENIZER,
                          str(tmp_path / "p"), max_len=512)
    assert report.kept == 2 and [(line, reason.split(":")[0]) for line, reason in report.bad] == [(2, kind)]


def test_openai_text_content_parts_read_as_their_text(tmp_path):
    count = [{"type": "text", "text": "Count "}, {"type": "text", "text": "to 3."}]
    parts = {"messages": [{"role": "user", "content": count},
                          {"role": "assistant", "content": [{"type": "text", "text": "1, 2, 3."}]}]}
    text = {"messages": [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2, 3."}]}
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    report = prepare_data(_write_jsonl(tmp_path / "r.jsonl", [parts, text, image]), DEMO_TOKENIZER,
                          str(tmp_path / "p"), max_len=512)
    a, b = _documents(tmp_path / "p")
    assert a[:2] == b[:2] and [(line, r.split(":")[0]) for line, r in report.bad] == [(3, "invalid content")]


def test_tool_calls_with_dict_arguments_and_a_null_content_render(tmp_path, qwen_tokenizer):
    folder, tokenizer = qwen_tokenizer
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [call]}]}
    prepare_data(_write_jsonl(tmp_path / "r.jsonl", [row]), folder, str(tmp_path / "p"), max_len=512,
                 chat_template=QWEN35_STYLE)
    (doc,) = _documents(tmp_path / "p")
    _assert_mask(doc, _expected(tokenizer, [
        (0, "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n"),
        (1, "\n</think>\n\n" + TOOL_CALL_TEXT + "<|im_end|>"),
        (0, "\n"),
    ]), sample_id=0)


# ---------------------------------------------------------------------------------------------
# zero usable rows


def test_a_file_without_one_usable_row_is_an_error_naming_the_formats(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "share.jsonl", [_sharegpt(PLAIN[0])] * 20)
    with pytest.raises(DataError) as caught:
        prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512, row_format="openai")
    message = str(caught.value)
    assert "no usable rows" in message and "20 x missing 'messages'" in message
    assert '"messages"' in message and '"conversations"' in message and "openai" in message and "sharegpt" in message
    assert not (tmp_path / "p").exists() and not list(tmp_path.glob("p.tmp-*"))
    # The command line exits non-zero with the same message; auto-detection reads the file as it is.
    assert prepare_main(["--input", src, "--tokenizer", DEMO_TOKENIZER, "--out", str(tmp_path / "p"),
                         "--format", "openai"]) == 2
    assert "no usable rows" in capsys.readouterr().err
    assert prepare_main(["--input", src, "--tokenizer", DEMO_TOKENIZER, "--out", str(tmp_path / "p")]) == 0
    assert len(PreparedDataset.open(str(tmp_path / "p"))) == 20


@pytest.mark.parametrize("lines", [["not json", "[1]", ""], ['{"text": "plain LM row"}'] * 3])
def test_files_of_no_known_format_are_errors(tmp_path, lines):
    src = _write_jsonl(tmp_path / "x.jsonl", lines)
    with pytest.raises(DataError, match="no usable rows"):
        prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512)


def test_a_parquet_file_without_a_conversation_column_is_an_error(tmp_path):
    src = _write_parquet(tmp_path / "t.parquet", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(DataError, match=r"2 x missing 'messages' or 'conversations'"):
        prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        prepare_data(str(tmp_path / "broken.parquet"), DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512)


# ---------------------------------------------------------------------------------------------
# templates, kwargs, config and meta


def test_template_arguments_are_checked(tmp_path):
    src = _write_jsonl(tmp_path / "r.jsonl", [{"messages": PLAIN[0]}])
    with pytest.raises(DataError, match="chat template file not found"):
        prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512, chat_template=str(tmp_path / "none.jinja"))
    for bad in ({1: True}, ["enable_thinking"], {"when": object()}):
        with pytest.raises(DataError, match="chat_template_kwargs"):
            prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512, chat_template_kwargs=bad)
    for clash in ("add_generation_prompt", "tools", "messages", "tokenize"):
        with pytest.raises(DataError, match=f"{clash} set by prepare-data itself"):
            prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512, chat_template_kwargs={clash: 1})
    with pytest.raises(DataError, match="format must be"):
        prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512, row_format="alpaca")
    assert prepare_main(["--input", src, "--tokenizer", DEMO_TOKENIZER, "--out", str(tmp_path / "p"),
                         "--chat-template-kwargs", "{not json"]) == 2
    assert not (tmp_path / "p").exists()


def test_config_validates_the_data_template_keys(tmp_path):
    cfg = load_config(None, ["data.chat_template_kwargs.enable_thinking=false", "data.format=sharegpt"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False} and cfg.data.format == "sharegpt"
    assert load_config(None, ["data.chat_template_kwargs={a: [1, {b: x}]}"]).data.chat_template_kwargs == \
        {"a": [1, {"b": "x"}]}
    assert load_config(None, ["data.chat_template_kwargs="]).data.chat_template_kwargs == {}
    for override, message in [("data.chat_template_kwargs=true", "expected a mapping"),
                              ("data.chat_template_kwargs=[enable_thinking]", "expected a mapping"),
                              ("data.chat_template_kwargs={1: true}", "keys must be strings"),
                              ("data.chat_template_kwargs={day: 2024-01-01}", "chat_template_kwargs.day"),
                              ("data.chat_template=[a]", "data.chat_template: expected str"),
                              ("data.format=alpaca", "data.format")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  chat_template: t.jinja\n  chat_template_kwargs:\n    enable_thinking: false\n")
    cfg = load_config(str(path))
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.hash("data") != load_config(None).hash("data")


def test_ensure_prepared_uses_and_records_the_config_template_and_kwargs(tmp_path, qwen_tokenizer):
    folder, tokenizer = qwen_tokenizer
    (tmp_path / "tpl").mkdir()
    template = tmp_path / "tpl" / "qwen.jinja"
    template.write_text(open(QWEN35_STYLE, encoding="utf-8").read())
    _write_jsonl(tmp_path / "chat.jsonl", [_sharegpt(m) for m in PLAIN])
    config = tmp_path / "run.yaml"  # relative paths resolve against the config file
    config.write_text(f"data:\n  train_path: chat.jsonl\n  max_len: 512\n  token_budget: 1024\n"
                      f"  chat_template: tpl/qwen.jinja\n  chat_template_kwargs:\n    enable_thinking: false\n"
                      f"target:\n  tokenizer: {folder}\n  cache_dir: cache\n")
    first = ensure_prepared(load_config(str(config)))
    assert first.meta["chat_template"] == template.read_text()
    assert first.meta["chat_template_kwargs"] == {"enable_thinking": False}
    assert first.meta["source_format"] == "sharegpt"
    # The empty think block of thinking-off prompts is context: each document's loss starts after it.
    ids, mask, _ = first.sample(0)
    think_close = ids.tolist().index(tokenizer.convert_tokens_to_ids("</think>"))
    assert not mask[:think_close + 1].any()

    again = ensure_prepared(load_config(str(config)))
    assert again.path == first.path  # same inputs: the cache is reused
    thinking = ensure_prepared(load_config(str(config), ["data.chat_template_kwargs.enable_thinking=true"]))
    assert thinking.path != first.path and thinking.meta["chat_template_kwargs"] == {"enable_thinking": True}
    # Same text, but with thinking on the model closes the (empty) think block itself: more loss tokens.
    assert thinking.num_tokens == first.num_tokens
    assert thinking.meta["num_loss_tokens"] > first.meta["num_loss_tokens"]
    template.write_text(template.read_text().replace("Tools you may call", "Tools"))
    edited = ensure_prepared(load_config(str(config)))
    assert edited.path not in (first.path, thinking.path) and edited.meta["chat_template"] == template.read_text()
    inline = ensure_prepared(load_config(str(config), [f"data.chat_template={json.dumps(CHAT_TEMPLATE)}"]))
    assert inline.meta["chat_template"] == CHAT_TEMPLATE
    assert inline.meta["chat_template_kwargs"] == {"enable_thinking": False}


def test_ensure_prepared_raises_on_a_file_without_usable_rows(tmp_path):
    src = _write_jsonl(tmp_path / "chat.jsonl", ['{"text": "x"}'] * 3)
    cfg = load_config(None, [f"data.train_path={src}", f"target.tokenizer={DEMO_TOKENIZER}",
                             f"target.cache_dir={tmp_path / 'cache'}", "data.max_len=512"])
    with pytest.raises(DataError, match="no usable rows"):
        ensure_prepared(cfg)


def test_prepare_data_cli_takes_its_defaults_from_a_config(tmp_path, capsys):
    from dfpipe.cli import main as dfpipe_main
    src = _write_jsonl(tmp_path / "chat.jsonl", [_sharegpt(m) for m in PLAIN])
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  max_len: 16\n  token_budget: 64\n  overlong: skip\n"
                      f"target:\n  tokenizer: {DEMO_TOKENIZER}\n")
    # max_len 16 with skip: every row is longer, so nothing is usable
    assert dfpipe_main(["prepare-data", "--input", src, "--out", str(tmp_path / "p"), "-c", str(config)]) == 2
    assert "longer than max_len" in capsys.readouterr().err
    assert dfpipe_main(["prepare-data", "--input", src, "--out", str(tmp_path / "p"), "-c", str(config),
                        "--max-len", "512"]) == 0
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["max_len"] == 512 and meta["overlong"] == "skip" and meta["tokenizer"] == DEMO_TOKENIZER
    assert dfpipe_main(["prepare-data", "--input", src, "--out", str(tmp_path / "q")]) == 2
    assert "no tokenizer" in capsys.readouterr().err
