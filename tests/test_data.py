"""Demo tokenizer, toy corpus, prepare-data and the prepared-folder reader."""
from __future__ import annotations

import filecmp
import json
import os
import re

import numpy as np
import pytest

from target_server import toy_corpus
from target_server.data import DataError, PreparedDataset, ensure_prepared, main as prepare_main, prepare_data
from target_server.packer import Packer
from target_server.tokenizer import CHAT_TEMPLATE, IM_END, MASK_TOKEN, SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TOKENIZER = os.path.join(REPO, "configs", "demo", "tokenizer")
DEMO_CHAT = os.path.join(REPO, "configs", "demo", "chat.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def _chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def _write_lines(path, lines: list[str | bytes]) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return str(path)


GOOD = json.dumps(_chat(("user", "Count from 1 to 5."), ("assistant", "1, 2, 3, 4, 5.")))


# ---------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_build_is_byte_identical_and_equals_the_shipped_folder(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_tokenizer(str(a))
    build_tokenizer(str(b))
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) == sorted(os.listdir(DEMO_TOKENIZER))
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors
    _, mismatch, errors = filecmp.cmpfiles(a, DEMO_TOKENIZER, names, shallow=False)
    assert not mismatch and not errors, f"configs/demo/tokenizer is stale: {mismatch}"


def test_tokenizer_round_trips_every_corpus_text_and_any_unicode(tokenizer):
    texts = [m["content"] for s in toy_corpus.generate(400, seed=7) for m in s["messages"]]
    texts += ["héllo wörld — 世界 🙂", "  two  spaces\tand\ttabs\n\n", "x" * 300, "12345678901234567890"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in tokenizer("ü€")["input_ids"]


def test_tokenizer_special_tokens_are_real_single_rows(tokenizer):
    assert len(tokenizer) <= VOCAB_SIZE
    assert tokenizer.mask_token == MASK_TOKEN
    for token in SPECIAL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and 0 <= ids[0] < len(tokenizer)
    assert tokenizer.mask_token_id == tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"


def test_loss_mask_covers_exactly_each_assistant_content_and_its_im_end(tokenizer):
    conversation = _chat(("system", "Be exact."), ("user", "Spell cat."), ("assistant", "C-A-T."),
                         ("user", "Again, with spaces"), ("assistant", "\n C - A - T .  "))["messages"]
    out = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = np.array(out["input_ids"]), np.array(out["assistant_masks"])
    # Split the masked tokens into runs; each run must decode to one assistant turn + <|im_end|>.
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    runs = [tokenizer.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == [m["content"] + IM_END for m in conversation if m["role"] == "assistant"]
    # Everything else (headers, system and user turns, the newline after <|im_end|>) is context.
    assert tokenizer.decode(ids[mask == 0].tolist()).count("Spell cat.") == 1


def test_chat_template_generation_prompt_ends_with_assistant_header(tokenizer):
    text = tokenizer.apply_chat_template(_chat(("user", "hi"))["messages"], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# toy corpus


def test_toy_corpus_is_deterministic_prefix_stable_and_seed_dependent():
    a = toy_corpus.generate(60, seed=3)
    assert a == toy_corpus.generate(60, seed=3)
    assert toy_corpus.generate(20, seed=3) == a[:20]
    assert a != toy_corpus.generate(60, seed=4)


def test_toy_corpus_answers_follow_from_the_prompt():
    checked = 0
    for s in toy_corpus.generate(300, seed=11):
        msgs = s["messages"]
        assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str) for m in msgs)
        user = next(m for m in msgs if m["role"] == "user")["content"]
        answer = next(m for m in msgs if m["role"] == "assistant")["content"]
        if m := re.fullmatch(r"Sort these words alphabetically: (.*)\.", user):
            assert answer == ", ".join(sorted(m.group(1).split(", "))) + "."
        elif m := re.fullmatch(r"Reverse this list: (.*)\.", user):
            assert answer == ", ".join(m.group(1).split(", ")[::-1]) + "."
        elif m := re.fullmatch(r"Count from (\d+) to (\d+)\.", user):
            assert answer == ", ".join(str(x) for x in range(int(m.group(1)), int(m.group(2)) + 1)) + "."
        elif m := re.fullmatch(r"What is ([\d + ]+)\?", user):
            assert answer.endswith(f"The answer is {sum(int(x) for x in m.group(1).split(' + '))}.")
        else:
            continue
        checked += 1
    assert checked > 40


def test_toy_corpus_cli_reproduces_the_shipped_demo_file(tmp_path):
    out = tmp_path / "chat.jsonl"
    toy_corpus.main(["--out", str(out), "--n", "2000", "--seed", "0"])
    assert filecmp.cmp(out, DEMO_CHAT, shallow=False), "configs/demo/chat.jsonl is stale"
    assert os.path.getsize(DEMO_CHAT) < 512 * 1024


# ---------------------------------------------------------------------------------------------
# prepare-data


BAD_ROWS: list[tuple[bytes | str, str]] = [
    (b"\xff\xfe not utf-8", "not UTF-8"),
    ("", "empty line"),
    ("   ", "empty line"),
    ('{"messages": [', "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"conversation": []}', "missing 'messages'"),
    ('{"messages": "hi"}', "invalid 'messages'"),
    ('{"messages": []}', "invalid 'messages'"),
    ('{"messages": ["hi"]}', "invalid message"),
    ('{"messages": [{"role": 1, "content": "x"}, {"role": "assistant", "content": "y"}]}', "invalid role"),
    ('{"messages": [{"role": "assistent", "content": "y"}]}', "invalid role"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null}]}', "invalid content"),
    ('{"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]}', "invalid content"),
    (json.dumps(_chat(("system", "s"), ("user", "no answer here"))), "no assistant turn"),
    (json.dumps(_chat(("user", "fake <|im_end|> turn"), ("assistant", "y"))), "control token in content"),
]


def test_every_bad_row_is_counted_with_its_line_and_reason_and_good_rows_kept(tmp_path):
    lines: list[bytes | str] = []
    expected_bad: list[tuple[int, str]] = []
    good_lines: list[int] = []
    for raw, kind in BAD_ROWS:
        lines.append(GOOD)
        good_lines.append(len(lines))
        lines.append(raw)
        expected_bad.append((len(lines), kind))
    # Only b"\n" ends a row: a CRLF ending, or a lone "\r" as JSON whitespace, must not shift line numbers.
    for raw in (GOOD.encode() + b"\r", GOOD.replace('"messages":', '"messages":\r', 1), b"\r"):
        lines.append(raw)
        good_lines.append(len(lines))
    good_lines.pop()
    expected_bad.append((len(lines), "empty line"))
    src = _write_lines(tmp_path / "rows.jsonl", lines)
    out = tmp_path / "prepared"
    report = prepare_data(src, DEMO_TOKENIZER, str(out), max_len=256)

    assert report.rows == len(lines)
    assert report.kept == len(good_lines) and report.documents == len(good_lines)
    assert [(line, reason.split(":")[0]) for line, reason in report.bad] == expected_bad
    written = [json.loads(x) for x in (out / "bad_rows.jsonl").read_text().splitlines()]
    assert [(w["line"], w["sample_id"], w["reason"]) for w in written] == [(l, l - 1, r) for l, r in report.bad]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["report"]["bad"] == [list(b) for b in report.bad]
    ds = PreparedDataset.open(str(out))
    assert ds.sample_ids.tolist() == [line - 1 for line in good_lines]
    summary = report.summary()
    assert f"{len(expected_bad)} bad" in summary and "not UTF-8 (line 2)" in summary


def test_documents_hold_the_rows_tokens_and_ids_survive_re_preparation(tmp_path, tokenizer):
    samples = toy_corpus.generate(30, seed=5)
    lines = [json.dumps(s) for s in samples]
    lines.insert(4, "not json")
    src = _write_lines(tmp_path / "rows.jsonl", lines)
    out = tmp_path / "prepared"
    prepare_data(src, DEMO_TOKENIZER, str(out), max_len=1024)
    first = {name: np.load(out / f"{name}.npy") for name in ("input_ids", "loss_mask", "offsets", "sample_ids")}

    ds = PreparedDataset.open(str(out))
    assert len(ds) == 30 and ds.lengths.tolist() == np.diff(first["offsets"]).tolist()
    for i in (0, 4, 29):
        ids, mask, sid = ds.sample(i)
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        row = json.loads(lines[sid])
        ref = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert ids.tolist() == ref["input_ids"] and mask.tolist() == ref["assistant_masks"]
    assert ds.sample(4)[2] == 5  # the row after the bad line keeps its own line index

    prepare_data(src, DEMO_TOKENIZER, str(out), max_len=1024)  # replaces the folder in place
    for name, array in first.items():
        assert np.array_equal(np.load(out / f"{name}.npy"), array)


def _long_row(n_numbers: int) -> str:
    numbers = ", ".join(str(i) for i in range(n_numbers))
    return json.dumps(_chat(("user", "Count."), ("assistant", numbers)))


def _late_answer_row() -> str:
    return json.dumps(_chat(("user", "word " * 80), ("assistant", "ok")))


def test_overlong_truncate_keeps_the_first_max_len_tokens_and_counts(tmp_path):
    src = _write_lines(tmp_path / "rows.jsonl", [GOOD, _long_row(60), _late_answer_row()])
    report = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=40, overlong="truncate")
    ds = PreparedDataset.open(str(tmp_path / "p"))
    assert report.truncated == 1 and report.kept == 2
    assert ds.lengths.max() == 40 and ds.sample_ids.tolist() == [0, 1]
    assert report.bad == [(3, report.bad[0][1])] and report.bad[0][1].startswith("no assistant tokens after truncation")


def test_overlong_split_keeps_every_piece_with_the_row_sample_id(tmp_path, tokenizer):
    row = _long_row(60)
    src = _write_lines(tmp_path / "rows.jsonl", [GOOD, row])
    report = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=40, overlong="split")
    ds = PreparedDataset.open(str(tmp_path / "p"))
    assert report.split == 1 and report.kept == 2 and report.pieces_dropped == 0
    pieces = [ds.sample(i) for i in range(len(ds)) if ds.sample(i)[2] == 1]
    assert len(pieces) > 1 and all(len(ids) <= 40 for ids, _, _ in pieces)
    ref = tokenizer.apply_chat_template(json.loads(row)["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert np.concatenate([ids for ids, _, _ in pieces]).tolist() == ref


def test_overlong_split_drops_pieces_without_loss_tokens_and_counts_them(tmp_path):
    src = _write_lines(tmp_path / "rows.jsonl", [_late_answer_row()])
    report = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=40, overlong="split")
    ds = PreparedDataset.open(str(tmp_path / "p"))
    assert report.kept == 1 and report.pieces_dropped >= 1
    assert all(ds.sample(i)[1].any() for i in range(len(ds)))


def test_overlong_skip_reports_the_row_as_bad(tmp_path):
    src = _write_lines(tmp_path / "rows.jsonl", [_long_row(60), GOOD])
    report = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=40, overlong="skip")
    assert report.kept == 1 and report.truncated == report.split == 0
    assert len(report.bad) == 1 and report.bad[0][0] == 1 and report.bad[0][1].startswith("longer than max_len")
    assert PreparedDataset.open(str(tmp_path / "p")).sample_ids.tolist() == [1]


@pytest.mark.parametrize("overlong", ["truncate", "split", "skip"])
def test_a_trace_longer_than_the_budget_gets_the_overlong_choice_and_every_document_packs_whole(tmp_path, overlong):
    # a long answer (a thinking trace, at the demo tokenizer's scale: thousands of tokens) against
    # data.max_len = data.token_budget, the longest a config allows
    budget = 1024
    src = _write_lines(tmp_path / "rows.jsonl", [GOOD, _long_row(1200)])
    report = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=budget, overlong=overlong)
    ds = PreparedDataset.open(str(tmp_path / "p"))
    assert ds.lengths.max() <= budget
    batches = Packer(ds.lengths, budget, seed=0).epoch_batches(0)
    assert sorted(d for b in batches for d in b) == list(range(len(ds)))
    if overlong == "truncate":
        assert report.truncated == 1 and ds.lengths.tolist()[1] == budget
    elif overlong == "split":
        assert report.split == 1 and (ds.sample_ids == 1).sum() >= 3
    else:
        assert report.kept == 1 and ds.sample_ids.tolist() == [0]
        assert [line for line, _ in report.bad] == [2]
        assert re.fullmatch(rf"longer than max_len: \d+ > {budget} tokens", report.bad[0][1])


def test_a_prepared_folder_with_documents_longer_than_the_budget_is_refused_naming_the_fix(tmp_path):
    src = _write_lines(tmp_path / "rows.jsonl", [GOOD, _long_row(1200)])
    prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=8192)     # kept whole
    ds = PreparedDataset.open(str(tmp_path / "p"))
    longest = int(ds.lengths.max())
    assert longest > 3 * 1024
    with pytest.raises(ValueError, match=rf"document 1 has {longest} tokens > token_budget 1024: a document is "
                                         rf"trained whole.*data.max_len <= 1024.*data.token_budget to at least {longest}"):
        Packer(ds.lengths, 1024, seed=0)
    assert Packer(ds.lengths, longest, seed=0).epoch_size(0) == 2     # the budget it asks for packs it


def test_tokenizer_without_a_chat_template_is_a_clear_error(tmp_path):
    """Any template works (tests/test_chat_formats.py); none at all is an error naming the fix."""
    bare = tmp_path / "bare-tokenizer"
    bare.mkdir()
    for name in os.listdir(DEMO_TOKENIZER):
        if name != "chat_template.jinja":
            (bare / name).write_bytes(open(os.path.join(DEMO_TOKENIZER, name), "rb").read())
    src = _write_lines(tmp_path / "rows.jsonl", [GOOD])
    with pytest.raises(DataError, match="no chat template; set a chat_template"):
        prepare_data(src, str(bare), str(tmp_path / "p"), max_len=64)
    assert not (tmp_path / "p").exists()
    prepare_data(src, str(bare), str(tmp_path / "p"), max_len=64, chat_template=CHAT_TEMPLATE)
    assert PreparedDataset.open(str(tmp_path / "p")).meta["chat_template"] == CHAT_TEMPLATE


def test_bad_arguments_are_clear_errors_not_crashes(tmp_path):
    src = _write_lines(tmp_path / "rows.jsonl", [GOOD])
    with pytest.raises(DataError, match="not found"):
        prepare_data(str(tmp_path / "missing.jsonl"), DEMO_TOKENIZER, str(tmp_path / "p"), max_len=64)
    with pytest.raises(DataError, match="overlong"):
        prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=64, overlong="wrap")
    with pytest.raises(DataError, match="tokenizer"):
        prepare_data(src, str(tmp_path / "no-tokenizer"), str(tmp_path / "p"), max_len=64)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not replacing"):
        prepare_data(src, DEMO_TOKENIZER, str(precious), max_len=64)
    assert (precious / "notes.txt").read_text() == "keep me"
    assert prepare_main(["--jsonl", str(tmp_path / "missing.jsonl"), "--tokenizer", DEMO_TOKENIZER,
                         "--out", str(tmp_path / "p")]) == 2


def _prepare_cli(src: str, out: str, capsys: pytest.CaptureFixture[str], *options: str) -> tuple[int, str, str]:
    from dfpipe.cli import main as dfpipe_main
    rc = dfpipe_main(["prepare-data", "--input", src, "--tokenizer", DEMO_TOKENIZER, "--out", out, *options])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


CAFE = [json.dumps(_chat(("user", "Un caf\u00e9 ?"), ("assistant", "Oui, un caf\u00e9.")), ensure_ascii=False)] * 3


def test_a_utf8_bom_at_the_start_of_the_file_is_accepted(tmp_path, capsys):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\n".join(CAFE).encode() + b"\n")
    rc, out, err = _prepare_cli(str(src), str(tmp_path / "p"), capsys)
    assert rc == 0, err
    assert out.startswith("3 rows: 3 kept") and ", 0 bad;" in out
    assert PreparedDataset.open(str(tmp_path / "p")).sample_ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "pretty-printed"])
def test_a_json_array_file_is_told_to_become_jsonl_with_the_command(tmp_path, capsys, indent):
    src = tmp_path / "chat.json"
    src.write_text(json.dumps([json.loads(row) for row in CAFE], indent=indent))
    rc, out, err = _prepare_cli(str(src), str(tmp_path / "p"), capsys)
    first = err.splitlines()[0]
    assert rc == 2 and out == ""
    assert first == (f"prepare-data: {src}: no usable rows: it looks like a JSON array; write one object per line "
                     f"(JSONL), e.g. jq -c '.[]' {src} > {tmp_path / 'chat.lines.jsonl'}")
    assert err.splitlines()[1].startswith("  line 1: not ")           # the first rows' own reasons follow
    assert not (tmp_path / "p").exists()


def test_latin1_text_is_named_with_the_iconv_command_that_converts_it(tmp_path, capsys):
    src = tmp_path / "chat.jsonl"
    src.write_bytes("\n".join(CAFE).encode("latin-1") + b"\n")
    rc, out, err = _prepare_cli(str(src), str(tmp_path / "p"), capsys)
    lines = err.splitlines()
    assert rc == 2 and out == ""
    assert lines[0] == (f"prepare-data: {src}: no usable rows: it is not UTF-8 and looks like Latin-1 (ISO-8859-1) "
                        f"or Windows-1252 text; convert it: iconv -f latin1 -t utf-8 {src} > "
                        f"{tmp_path / 'chat.utf8.jsonl'}")
    byte = CAFE[0].encode("latin-1").index(b"\xe9")
    assert lines[1:4] == [f"  line {i}: not UTF-8: byte {byte} is 0xe9; the line looks like Latin-1 (or "
                          f"Windows-1252) text" for i in (1, 2, 3)]


def test_rows_without_a_file_wide_cause_list_their_own_reasons_first(tmp_path, capsys):
    src = _write_lines(tmp_path / "rows.jsonl", ['{"messages": "hi"}', '{"conversation": []}', "{broken"])
    rc, _, err = _prepare_cli(src, str(tmp_path / "p"), capsys)
    assert rc == 2
    assert err.splitlines()[:4] == [f"prepare-data: {src}: no usable rows",
                                    "  line 1: invalid 'messages': expected a list, got str",
                                    "  line 2: missing 'messages': the file holds openai rows",
                                    "  line 3: not JSON: Expecting property name enclosed in double quotes at column 2"]


# ---------------------------------------------------------------------------------------------
# reading a prepared folder


@pytest.fixture
def prepared(tmp_path):
    src = _write_lines(tmp_path / "rows.jsonl", [json.dumps(s) for s in toy_corpus.generate(12, seed=1)])
    prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=512)
    return tmp_path / "p"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def _retype(path):
    np.save(path, np.load(path).astype(np.int64))


def _reorder_offsets(path):
    offsets = np.load(path)
    offsets[[1, 2]] = offsets[[2, 1]]
    np.save(path, offsets)


def _drop_document(path):
    np.save(path, np.load(path)[:-1])


@pytest.mark.parametrize("damage, target, message", [
    (os.unlink, "input_ids.npy", "missing input_ids.npy"),
    (os.unlink, "meta.json", "no meta.json"),
    (_truncate, "input_ids.npy", "corrupt or truncated"),
    (_retype, "loss_mask.npy", "expected 1-d uint8"),
    (_reorder_offsets, "offsets.npy", "strictly increase"),
    (_drop_document, "sample_ids.npy", "offsets has"),
    (lambda p: p.write_text("{not json"), "meta.json", "unreadable"),
])
def test_opening_a_damaged_folder_names_the_problem(prepared, damage, target, message):
    PreparedDataset.open(str(prepared))  # intact first: the damage is what fails
    damage(prepared / target)
    with pytest.raises(DataError, match=re.escape(message)):
        PreparedDataset.open(str(prepared))


def test_opening_a_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        PreparedDataset.open(str(tmp_path / "nowhere"))


def test_sample_index_out_of_range_raises_index_error(prepared):
    ds = PreparedDataset.open(str(prepared))
    with pytest.raises(IndexError):
        ds.sample(len(ds))
    with pytest.raises(IndexError):
        ds.sample(-1)


def test_ensure_prepared_prepares_a_chat_file_once_then_reuses_it(tmp_path, monkeypatch):
    from common.config import load_config
    import target_server.data as data

    src = _write_lines(tmp_path / "chat.jsonl", [json.dumps(s) for s in toy_corpus.generate(10, seed=2)])
    cfg = load_config(None, [f"data.train_path={src}", f"target.tokenizer={DEMO_TOKENIZER}",
                             f"target.cache_dir={tmp_path / 'cache'}", "data.max_len=512"])
    first = ensure_prepared(cfg)
    assert len(first) == 10 and first.path.startswith(str(tmp_path / "cache"))

    def no_second_preparation(*args, **kwargs):
        raise AssertionError("prepared again")
    monkeypatch.setattr(data.prepare, "prepare_data", no_second_preparation)
    assert ensure_prepared(cfg).path == first.path
    # A prepared folder is opened as it is.
    cfg.data.train_path = first.path
    assert ensure_prepared(cfg).path == first.path


def test_prepare_data_in_a_log_says_how_far_it_is_and_the_time_left(tmp_path, monkeypatch, capsys):
    from common import metrics
    from target_server.data import source_row_count

    rows = [json.dumps(_chat(("user", f"Count to {i}."), ("assistant", f"{i}."))) for i in range(6)]
    src = _write_lines(tmp_path / "c.jsonl", rows)
    assert source_row_count(src) == 6
    (tmp_path / "no_newline.jsonl").write_text("\n".join(rows))   # a last line without its newline counts
    assert source_row_count(str(tmp_path / "no_newline.jsonl")) == 6
    clock = iter(float(t) for t in range(0, 10_000, 20))   # a row every 20 s (a slow tokenizer)
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "p"), max_len=256)   # stderr is no terminal here
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prepare-data:")]
    # a line per 30 s: rows 2, 4 and 6 of 6, the time left at one row per 20 s
    assert said == ["prepare-data: 2/6 rows (33.3%), 1m20s left", "prepare-data: 4/6 rows (66.7%), 40s left",
                    "prepare-data: 6/6 rows (100.0%), 0s left"], said
