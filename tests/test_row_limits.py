"""One row never takes a chat file down: depth, number size, byte size, unreadable Parquet rows, and
the cut that tokenizes only the prefix of a long view (prepare-data, target_server/data.py).
Every input file is generated here."""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from target_server import data, toy_corpus
from target_server.data import MAX_ROW_DEPTH, PreparedDataset, prepare_data
from test_data import DEMO_TOKENIZER, _chat, _prepare_cli, _write_lines

LIMIT = 2 << 20   # max_row_bytes in these tests: the deep and long-number rows fit, HUGE does not
DEEP = f"nested deeper than {MAX_ROW_DEPTH} levels"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def _nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def _answer(text: str) -> dict:
    return _chat(("user", "Say it."), ("assistant", text))


def _padded(row: str, size: int) -> str:
    """The row with trailing JSON whitespace, `size` bytes long: it parses as the row itself."""
    return row + " " * (size - len(row.encode()))


def _arrays(path) -> dict[str, np.ndarray]:
    return {name: np.load(path / f"{name}.npy") for name in ("input_ids", "loss_mask", "offsets", "sample_ids")}


HUGE = json.dumps(_answer("y " * 1_500_000))   # read past in 1 MiB pieces, never whole; many words (one word past data.word_cap is a bad row of its own)


def test_bad_rows_of_every_kind_are_listed_and_the_good_rows_around_them_kept_exactly(tmp_path):
    good = [json.dumps(s) for s in toy_corpus.generate(8, seed=3)]
    bad = [
        ("[" * 100_000 + "]" * 100_000, DEEP),                                   # json's own RecursionError
        (json.dumps({**_answer("x"), "tools": [_nested(MAX_ROW_DEPTH)]}), DEEP),  # under it: measured
        (json.dumps({**_answer("x"), "tools": json.dumps([_nested(MAX_ROW_DEPTH)])}), f"invalid tools: {DEEP}"),
        (json.dumps(_answer("x"))[:-1] + ', "n": ' + "7" * 1_000_000 + "}",
         f"number with more than {sys.get_int_max_str_digits()} digits"),
        (HUGE, f"larger than max_row_bytes: {len(HUGE)} > {LIMIT} bytes"),
        (_padded(good[0], LIMIT + 1), f"larger than max_row_bytes: {LIMIT + 1} > {LIMIT} bytes"),
    ]
    # A row of exactly max_row_bytes is kept, whatever its line ending ("\r\n" is not the row's), and
    # one nested exactly MAX_ROW_DEPTH levels deep.
    good += [_padded(good[1], LIMIT), _padded(good[2], LIMIT) + "\r",
             json.dumps({**_answer("deep enough"), "meta": _nested(MAX_ROW_DEPTH - 1)})]
    lines, good_lines, expected = [], [], []
    for i, row in enumerate(good):
        lines.append(row)
        good_lines.append(len(lines))
        if i < len(bad):
            lines.append(bad[i][0])
            expected.append((len(lines), bad[i][1]))
    lines.append("[" * 101 + "]" * 101)    # the last line, without a newline: one level too deep
    expected.append((len(lines), DEEP))
    src = _write_lines(tmp_path / "mixed.jsonl", lines)
    with open(src, "rb+") as f:
        f.truncate(os.path.getsize(src) - 1)
    report = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "mixed"), max_len=512, max_row_bytes=LIMIT)

    assert report.bad == expected and report.rows == len(lines) and report.kept == len(good)
    written = [json.loads(x) for x in (tmp_path / "mixed" / "bad_rows.jsonl").read_text().splitlines()]
    assert [(w["line"], w["sample_id"], w["reason"]) for w in written] == [(n, n - 1, r) for n, r in expected]
    summary = report.summary()
    assert f"{len(expected)} bad" in summary and "2 x number with more than" not in summary
    assert f"3 x {DEEP} (line 2, 4, {len(lines)})" in summary

    alone = _write_lines(tmp_path / "good.jsonl", good)
    prepare_data(alone, DEMO_TOKENIZER, str(tmp_path / "good"), max_len=512, max_row_bytes=LIMIT)
    mixed, reference = _arrays(tmp_path / "mixed"), _arrays(tmp_path / "good")
    for name in ("input_ids", "loss_mask", "offsets"):
        assert np.array_equal(mixed[name], reference[name]), name
    assert mixed["sample_ids"].tolist() == [n - 1 for n in good_lines]


def test_a_file_of_bad_rows_only_exits_2_naming_each_rows_reason(tmp_path, capsys):
    src = _write_lines(tmp_path / "rows.jsonl", ['{"n": ' + "1" * 1_000_000 + "}", "[" * 100_000,
                                                 HUGE])
    rc, out, err = _prepare_cli(src, str(tmp_path / "p"), capsys, "--max-row-bytes", str(LIMIT))
    assert rc == 2 and out == ""
    assert err.splitlines()[:4] == [f"prepare-data: {src}: no usable rows",
                                    f"  line 1: number with more than {sys.get_int_max_str_digits()} digits",
                                    f"  line 2: {DEEP}",
                                    f"  line 3: larger than max_row_bytes: {len(HUGE)} > {LIMIT} bytes"]
    rc, out, _ = _prepare_cli(src, str(tmp_path / "p"), capsys, "--max-row-bytes", str(2 * LIMIT),  # the flag decides
                              "--max-bad-share", "1")   # 2 of 3 rows bad: allowed
    assert rc == 0 and out.startswith("3 rows: 1 kept")


def test_parquet_rows_oversize_or_unconvertible_and_damaged_row_groups_are_bad_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_answer(f"fine {i}") for i in range(6)]
    rows[1] = _answer("w" * (LIMIT + 1))
    created = pa.array([0, 0, 2**62, 0, 0, 0], pa.timestamp("ms"))   # row 3: past what datetime holds
    table = pa.Table.from_pylist(rows).append_column("created", created)
    pq.write_table(table, tmp_path / "rows.parquet")
    report = prepare_data(str(tmp_path / "rows.parquet"), DEMO_TOKENIZER, str(tmp_path / "p"), max_len=256,
                          max_row_bytes=LIMIT)
    assert [line for line, _ in report.bad] == [2, 3]
    assert report.bad[0][1].startswith("larger than max_row_bytes: ") and report.bad[0][1].endswith(f" > {LIMIT} bytes")
    assert report.bad[1][1].startswith("unreadable Parquet row: OverflowError")
    assert PreparedDataset.open(str(tmp_path / "p")).sample_ids.tolist() == [0, 3, 4, 5]

    # A damaged row group: its rows are bad (which of them the damage holds is unknown), the rest kept.
    pq.write_table(pa.Table.from_pylist([_answer(f"fine {i}") for i in range(6)]), tmp_path / "groups.parquet",
                   row_group_size=2)
    column = pq.ParquetFile(tmp_path / "groups.parquet").metadata.row_group(1).column(1)
    raw = bytearray((tmp_path / "groups.parquet").read_bytes())
    start = column.dictionary_page_offset or column.data_page_offset
    raw[start:start + column.total_compressed_size] = b"\xab" * column.total_compressed_size
    (tmp_path / "damaged.parquet").write_bytes(raw)
    report = prepare_data(str(tmp_path / "damaged.parquet"), DEMO_TOKENIZER, str(tmp_path / "d"), max_len=256)
    assert [line for line, _ in report.bad] == [3, 4]
    assert all(reason.startswith("unreadable Parquet row group 1: ") and "\n" not in reason for _, reason in report.bad)
    assert PreparedDataset.open(str(tmp_path / "d")).sample_ids.tolist() == [0, 1, 4, 5]


# ---------------------------------------------------------------------------------------------
# the cut: a long view is tokenized as a prefix, with exactly the tokens of the whole view


TRICKY = ["don't   stop\n\n  it's 1234567 h\u00e9llo e\u0301t\u00e9 \u4e16\u754c \U0001F642 \t\t end   ",
          "    indented code:\n\tif x:  \n\t\treturn 'y'\r\n\n\n" * 3, "word " * 40, "aaaaaaaaaaaaaaaa" * 8]


class _Spy:
    """The tokenizer, recording the longest text it was asked to tokenize."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, texts, **kwargs):
        self.longest = max(self.longest, *map(len, texts))
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name: str):   # added_tokens_decoder...: the tokenizer's own
        return getattr(self.tokenizer, name)


def _views(tokenizer) -> list:
    renderer = data._Renderer(tokenizer, tokenizer.chat_template, {}, tuple(data._special_tokens(tokenizer)))
    views = []
    for text in TRICKY:
        conversation = data.Conversation([{"role": "user", "content": text[:20]},
                                          {"role": "assistant", "content": text},
                                          {"role": "user", "content": "more"}, {"role": "assistant", "content": text}])
        views += renderer.views(conversation)
    return views


def test_a_cut_view_keeps_exactly_the_ids_and_mask_of_the_whole_view(tokenizer, monkeypatch):
    monkeypatch.setattr(data.chats, "_CHARS_PER_TOKEN", 1)   # cut as short as it goes: at every place it can fall
    cuts = 0
    for view in _views(tokenizer):
        (whole,) = data._encode_views(tokenizer, [view], None)
        assert whole.whole
        for keep in range(1, len(whole.ids) + 2):
            (cut,) = data._encode_views(tokenizer, [view], keep)
            cuts += not cut.whole
            n = len(whole.ids) if cut.whole else keep      # cut all the way back to whole: every token
            assert cut.ids.tolist() == whole.ids[:n].tolist() and cut.mask.tolist() == whole.mask[:n].tolist()
            assert cut.learns == bool(whole.mask.any())
    assert cuts > 200


def _other_tokenizer(pre_tokenizer: str):
    """A BPE tokenizer trained on the views' own text, with the demo's special tokens, an NFC
    normalizer (as Qwen's) and a pre-tokenizer unlike the demo's byte-level regex."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from target_server.tokenizer import SPECIAL_TOKENS

    demo = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = {"metaspace": pre_tokenizers.Metaspace(), "whitespace": pre_tokenizers.Whitespace(),
                             "none": None}[pre_tokenizer]
    texts = [text for text, _ in _views(demo)]
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS))
    other = PreTrainedTokenizerFast(tokenizer_object=backend)
    other.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return other, demo


@pytest.mark.parametrize("pre_tokenizer", ["metaspace", "whitespace", "none"])
def test_the_cut_is_exact_with_other_pre_tokenizers_and_without_one(monkeypatch, pre_tokenizer):
    other, demo = _other_tokenizer(pre_tokenizer)
    monkeypatch.setattr(data.chats, "_CHARS_PER_TOKEN", 1)
    cuts = 0
    for view in _views(demo):
        (whole,) = data._encode_views(other, [view], None)
        for keep in range(1, len(whole.ids) + 2, 2):
            (cut,) = data._encode_views(other, [view], keep)
            cuts += not cut.whole
            n = len(whole.ids) if cut.whole else keep
            assert cut.ids.tolist() == whole.ids[:n].tolist() and cut.mask.tolist() == whole.mask[:n].tolist()
    assert cuts > 10   # without a pre-tokenizer, at the special tokens only: the text between two is one word


def test_a_long_answer_costs_the_tokens_kept_not_its_length(tokenizer):
    text = "The quick brown fox jumps over the lazy dog, 12345 times. " * 20_000     # 1.2M characters
    (view,) = data._Renderer(tokenizer, tokenizer.chat_template, {}, ()).views(data.Conversation(
        [{"role": "user", "content": "Go."}, {"role": "assistant", "content": text}]))
    spy = _Spy(tokenizer)
    (cut,) = data._encode_views(spy, [view], 65)
    assert not cut.whole and len(cut.ids) == 65 and cut.learns
    assert spy.longest <= 65 * data._CHARS_PER_TOKEN * 4
    head = tokenizer(view[0][:2000], add_special_tokens=False)["input_ids"]
    assert cut.ids.tolist() == head[:65]


@pytest.mark.parametrize("overlong", ["truncate", "skip"])
def test_prepare_data_cut_and_uncut_write_the_same_folder(tmp_path, monkeypatch, overlong):
    rows = [json.dumps(s) for s in toy_corpus.generate(20, seed=11)]
    rows += [json.dumps(_answer(text * 4)) for text in TRICKY]
    rows.append(json.dumps(_chat(("user", "word " * 200), ("assistant", "late"))))   # its answer lies past max_len
    src = _write_lines(tmp_path / "rows.jsonl", rows)
    reports = {}
    for name, chars_per_token in (("uncut", 10**9), ("cut", 1)):
        monkeypatch.setattr(data.chats, "_CHARS_PER_TOKEN", chars_per_token)
        reports[name] = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / name), max_len=48, overlong=overlong,
                                     max_bad_share=1.0)   # under skip most rows are too long, on purpose
    uncut, cut = _arrays(tmp_path / "uncut"), _arrays(tmp_path / "cut")
    for name in uncut:
        assert np.array_equal(uncut[name], cut[name]), name
    a, b = reports["uncut"], reports["cut"]
    assert (a.kept, a.truncated, a.documents, a.loss_tokens) == (b.kept, b.truncated, b.documents, b.loss_tokens)
    assert [(n, r.split(":")[0]) for n, r in a.bad] == [(n, r.split(":")[0]) for n, r in b.bad] and a.bad
    if overlong == "skip":   # a cut view is not counted to its end
        changed = [(r, s) for (_, r), (_, s) in zip(a.bad, b.bad) if r != s]
        assert changed and all(re.fullmatch(r"longer than max_len: \d+ > 48 tokens", r) and
                               s == "longer than max_len: more than 48 tokens" for r, s in changed)


def test_what_a_cut_can_change_ends_the_tokens_kept():
    one_char = [(i, i + 1) for i in range(6)]
    assert data._unchanged_by_cut([0, 0, 0, 0, 0, 0], one_char, 6, 1) == 0   # one word: the tokenizer splits none
    assert data._unchanged_by_cut([0, 1, 1, 2, 3, 3], one_char, 6, 1) == 3   # the last two words may change
    assert data._unchanged_by_cut([0, 1, 1, 2, 3, 3], one_char, 6, 3) == 1   # an added token of 3 may start at 4
    assert data._unchanged_by_cut([0, None, 1, 2, 3, 4], one_char, 6, 1) == 1  # a token of no word ends what is known
    assert data._unchanged_by_cut([], [], 6, 1) == 0


def test_the_target_server_preparing_data_at_start_applies_data_max_row_bytes(tmp_path):
    from common.config import load_config

    rows = [json.dumps(s) for s in toy_corpus.generate(3, seed=4)]
    src = _write_lines(tmp_path / "chat.jsonl", [rows[0], "[" * 100_000, rows[1], HUGE, rows[2]])
    prepared = {}
    for limit in (LIMIT, 2 * LIMIT):
        cfg = load_config(None, [f"data.train_path={src}", f"target.tokenizer={DEMO_TOKENIZER}",
                                 f"target.cache_dir={tmp_path / 'cache'}", f"data.max_row_bytes={limit}"])
        prepared[limit] = data.ensure_prepared(cfg)
    small, large = prepared[LIMIT], prepared[2 * LIMIT]
    assert small.path != large.path            # the limit is part of the cache key
    assert small.sample_ids.tolist() == [0, 2, 4] and large.sample_ids.tolist() == [0, 2, 3, 4]
    assert small.meta["report"]["bad"] == [[2, DEEP], [4, f"larger than max_row_bytes: {len(HUGE)} > {LIMIT} bytes"]]


# ----------------------------------------------------------------------------------------------
# One long word: tokenized whole up to the word cap (exactly as uncut), a bad row past it


def _one_word_view(tokenizer, word: str):
    (view,) = data._Renderer(tokenizer, tokenizer.chat_template or _demo_template(), {}, ()).views(
        data.Conversation([{"role": "user", "content": "Go."}, {"role": "assistant", "content": word}]))
    return view


def _demo_template() -> str:   # the trained tokenizers carry no template: the demo's renders the row
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER).chat_template


@pytest.mark.parametrize("kind", ["demo", "metaspace", "whitespace", "none"])
def test_a_single_word_row_under_the_cap_keeps_exactly_the_uncut_tokens_and_over_it_is_a_bad_row(tokenizer, kind):
    tok = tokenizer if kind == "demo" else _other_tokenizer(kind)[0]
    keep, cut_short = 17, 0
    words = ("ab" * 3000, "\u00e9t\u00e9" * 1500, "x" * 5000)      # 4,500-6,000 characters: one word
    for word, tail in [(w, t) for w in words for t in ("", " and more" * 3000)]:
        view = _one_word_view(tok, word + tail)
        (whole,) = data._encode_views(tok, [view], None)
        assert len(whole.ids) > keep            # the cut falls inside the word, and must grow to its end
        spy = _Spy(tok)
        (cut,) = data._encode_views(spy, [view], keep, cap=len(view[0]))
        n = len(whole.ids) if cut.whole else keep     # the word ends the view: proven only at its end
        assert cut.ids.tolist() == whole.ids[:n].tolist() and cut.mask.tolist() == whole.mask[:n].tolist()
        cut_short += not cut.whole
        # A cap below the word's length: a bad row, and the tokenizer never saw much more than the cap.
        cap = len(word) // 4
        spy = _Spy(tok)
        with pytest.raises(data._WordTooLong, match="word too long"):
            data._encode_views(spy, [view], keep, cap=cap)
        assert spy.longest <= max(keep * data._CHARS_PER_TOKEN, len(view[0]) - len(word) + 2 * cap)
        with pytest.raises(data._WordTooLong, match="word too long"):   # split: seen before tokenizing
            data._encode_views(None, [view], None, cap=cap)
    # With words after it, the cut ends past the long word, before the view's end (without a
    # pre-tokenizer the text up to the next added token is one word: the cut is proven only at its end).
    assert cut_short == (0 if kind == "none" else len(words))


def test_the_word_cap_is_the_kept_tokens_times_the_longest_vocabulary_entry(tokenizer):
    longest = max(map(len, tokenizer.get_vocab()))
    assert data.word_cap(tokenizer, 100) == 101 * longest


@pytest.mark.parametrize("overlong", ["truncate", "skip", "split"])
def test_prepare_data_lists_a_row_of_one_huge_word_as_a_bad_row_and_keeps_the_others(tmp_path, overlong):
    cap = data.word_cap(__import__("transformers").AutoTokenizer.from_pretrained(DEMO_TOKENIZER), 48)
    rows = [json.dumps(s) for s in toy_corpus.generate(6, seed=3)]
    rows.insert(2, json.dumps(_answer("a" * (cap + 500))))
    rows.insert(4, json.dumps(_answer("b" * (cap // 2))))     # under the cap: kept (truncate, split) or too long (skip)
    src = _write_lines(tmp_path / "rows.jsonl", rows)
    report = prepare_data(src, DEMO_TOKENIZER, str(tmp_path / "out"), max_len=48, overlong=overlong,
                          max_bad_share=1.0)
    bad = dict(report.bad)
    assert bad[3].startswith("word too long: more than")
    assert report.rows == len(rows) and report.kept + len(report.bad) == len(rows)
    if overlong == "skip":
        assert bad[5].startswith("longer than max_len")
    else:
        assert 5 not in bad
    listed = [json.loads(line) for line in open(tmp_path / "out" / "bad_rows.jsonl")]
    assert {"line": 3, "sample_id": 2, "reason": bad[3]} in listed


@pytest.mark.parametrize("kind", ["demo", "metaspace", "whitespace", "none"])
def test_a_split_view_tokenized_in_pieces_has_exactly_the_whole_views_ids_and_mask(tokenizer, monkeypatch, kind):
    """Under split (every token kept) a view longer than SPLIT_PIECE is tokenized a piece at a time;
    at pieces of 37 and 211 characters every view's ids and mask are those of the whole view, for
    four kinds of pre-tokenizer (without one, or where a piece's first word comes out unlike the
    piece before's, the view is tokenized whole)."""
    other = tokenizer if kind == "demo" else _other_tokenizer(kind)[0]
    views = _views(tokenizer)
    monkeypatch.setattr(data.chats, "SPLIT_PIECE", 10 ** 9)
    wholes = data._encode_views(other, views, None)
    reach = max(len(t.content) for t in other.added_tokens_decoder.values())
    pieced = 0
    for piece in (37, 211):
        monkeypatch.setattr(data.chats, "SPLIT_PIECE", piece)
        for view, whole in zip(views, wholes):
            (got,) = data._encode_views(other, [view], None)
            assert got.ids.tolist() == whole.ids.tolist() and got.mask.tolist() == whole.mask.tolist(), (kind, piece)
            try:
                ids, _ = data.chats._encode_in_pieces(other, view[0], reach, piece)
            except data.chats._PieceMismatch:
                continue
            assert ids.tolist() == whole.ids.tolist()
            pieced += len(view[0]) > piece
    if kind != "none":     # where a pre-tokenizer splits words, the pieces ran (no whole-text fallback)
        assert pieced >= 3, pieced


def test_a_long_split_answer_is_tokenized_a_piece_at_a_time(tokenizer):
    text = "The quick brown fox jumps over the lazy dog, 12345 times. " * 20_000     # 1.2M characters
    (view,) = data._Renderer(tokenizer, tokenizer.chat_template, {}, ()).views(data.Conversation(
        [{"role": "user", "content": "Go."}, {"role": "assistant", "content": text}]))
    spy = _Spy(tokenizer)
    (got,) = data._encode_views(spy, [view], None)
    assert got.whole and spy.longest <= data.chats.SPLIT_PIECE
    assert got.ids.tolist() == tokenizer(view[0], add_special_tokens=False)["input_ids"]
