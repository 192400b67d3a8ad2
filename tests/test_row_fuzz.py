"""Rows of any content: each is kept or listed with its line and reason, and a file mostly bad stops
(issue 47 items 2 and 6; target_server/data.py `_encode_rows`, `PrepareReport.check_bad_share`)."""
from __future__ import annotations

import json
import os
import random

from target_server import toy_corpus
from test_data import _chat, _prepare_cli, _write_lines

SURROGATE = json.dumps(_chat(("user", "a\ud800b"), ("assistant", "ok")))   # valid JSON, no valid UTF-8 text


def _random_text(rng: random.Random) -> str:
    kinds = [
        lambda: "".join(chr(rng.randint(0xD800, 0xDFFF)) for _ in range(rng.randint(1, 3))),   # lone surrogates
        lambda: "".join(chr(rng.randint(0xE000, 0xF8FF)) for _ in range(rng.randint(1, 20))),  # private use
        lambda: "".join(chr(rng.randint(0, 31)) for _ in range(rng.randint(1, 20))),           # control characters
        lambda: rng.choice("xz.") * rng.randint(1000, 50_000),                                # one huge word
        lambda: "".join(chr(rng.randint(32, 0x10FFFF)) for _ in range(rng.randint(1, 40))),   # anything
        lambda: "plain words here",
    ]
    return "".join(rng.choice(kinds)() for _ in range(rng.randint(1, 3)))


def _random_row(rng: random.Random) -> str:
    shape = rng.randrange(4)
    if shape == 0:   # deep structures where content goes
        value: object = _random_text(rng)
        for _ in range(rng.randint(1, 150)):
            value = rng.choice([[value], {"k": value}])
        return json.dumps({"messages": [{"role": "user", "content": value}, {"role": "assistant", "content": "x"}]})
    if shape == 1:   # a content of the wrong kind, or a message of odd keys
        return json.dumps({"messages": [{"role": rng.choice(["user", "assistant", "tool", "?"]),
                                         "content": rng.choice([None, 7, [1], {"a": 1}, _random_text(rng)])},
                                        {"role": "assistant", "content": _random_text(rng)}]})
    return json.dumps(_chat(("user", _random_text(rng)), ("assistant", _random_text(rng))))


def test_every_fuzzed_row_is_kept_or_listed_with_its_line(tmp_path, capsys):
    rng = random.Random(47)
    good = [json.dumps(s) for s in toy_corpus.generate(60, seed=5)]
    fuzzed = [_random_row(rng) for _ in range(40)] + [SURROGATE]
    lines = good + fuzzed
    rng.shuffle(lines)
    src = _write_lines(tmp_path / "fuzz.jsonl", lines)
    rc, out, err = _prepare_cli(src, str(tmp_path / "out"), capsys)
    assert rc == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    bad = [json.loads(line) for line in (tmp_path / "out" / "bad_rows.jsonl").read_text().splitlines()]
    report = meta["report"]
    assert report["rows"] == len(lines) == report["kept"] + len(bad)
    assert all(b["line"] == b["sample_id"] + 1 and b["reason"] for b in bad)
    surrogate = lines.index(SURROGATE) + 1
    assert [b["reason"] for b in bad if b["line"] == surrogate][0].startswith("tokenizer error: TypeError")
    assert "warning" in err and f"{len(bad)} of {len(lines)} rows" in err


def test_a_lone_surrogate_is_a_bad_row_and_the_rows_around_it_are_kept(tmp_path, capsys):
    good = [json.dumps(s) for s in toy_corpus.generate(5, seed=1)]
    src = _write_lines(tmp_path / "s.jsonl", good[:3] + [SURROGATE] + good[3:])
    rc, out, err = _prepare_cli(src, str(tmp_path / "out"), capsys)
    assert rc == 0, err
    (bad,) = [json.loads(line) for line in (tmp_path / "out" / "bad_rows.jsonl").read_text().splitlines()]
    assert bad["line"] == 4 and bad["reason"].startswith("tokenizer error: TypeError")
    assert "1 of 6 rows (16.7%) are bad" in err and len(err.strip().splitlines()) == 1


def test_a_file_mostly_bad_stops_with_status_2_unless_allowed(tmp_path, capsys):
    good = [json.dumps(s) for s in toy_corpus.generate(2, seed=2)]
    src = _write_lines(tmp_path / "m.jsonl", good + [SURROGATE] * 3 + ["not json"] * 2)
    rc, out, err = _prepare_cli(src, str(tmp_path / "out"), capsys)
    assert rc == 2 and "5 of 7 rows (71.4%) are bad, more than data.max_bad_share 0.5" in err
    assert "line 3: tokenizer error" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    rc, out, err = _prepare_cli(src, str(tmp_path / "out"), capsys, "--max-bad-share", "1")
    assert rc == 0 and "5 of 7 rows (71.4%) are bad and skipped" in err


def test_the_target_server_s_own_preparation_keeps_bad_rows_listed_and_stops_on_a_file_mostly_bad(tmp_path, caplog):
    import pytest

    from common.config import ConfigError, load_config
    from target_server import data
    from test_data import DEMO_TOKENIZER

    good = [json.dumps(s) for s in toy_corpus.generate(3, seed=6)]
    src = _write_lines(tmp_path / "chat.jsonl", good + [SURROGATE])

    def config(share: float, cache: str = "cache"):
        return load_config(None, [f"data.train_path={src}", f"target.tokenizer={DEMO_TOKENIZER}",
                                  f"target.cache_dir={tmp_path / cache}", f"data.max_bad_share={share}"])
    prepared = data.ensure_prepared(config(0.5))
    assert prepared.meta["report"]["bad"][0][0] == 4 and prepared.sample_ids.tolist() == [0, 1, 2]
    assert "1 of 4 rows (25.0%) are bad and skipped" in caplog.text
    with pytest.raises(ConfigError, match=r"data.train_path: .* 1 of 4 rows \(25.0%\) are bad, more than "
                                          r"data.max_bad_share 0.1"):
        data.ensure_prepared(config(0.1))     # the cache prepared under 0.5, judged again under 0.1
    with pytest.raises(ConfigError, match=r"data.train_path: .* 1 of 4 rows \(25.0%\) are bad, more than "):
        data.ensure_prepared(config(0.1, "fresh"))   # preparing anew: the same one line, nothing cached
    assert not os.listdir(tmp_path / "fresh" / "data")
