"""prepare-data: chat rows (JSONL or Parquet) -> a tokenized, memory-mappable folder; and its reader.

Input: one conversation per JSONL line or Parquet row, in one of two formats, detected per file
(the first row holding either key decides) or named (`format=`):

    openai    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...],
               "tools": [...]?}   "content" a string (or a list of {"type": "text", "text"} parts);
                                  an assistant message may carry "reasoning_content" (or "reasoning")
                                  and "tool_calls" (then "content" may be null); a tool message
                                  "tool_call_id" / "name". The template renders them all.
    sharegpt  {"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": "..."}, ...],
               "system": "..."?, "tools": [...]?}   (also user/assistant/observation as `from`)

What the drafter learns (loss mask 1) comes from rendering the conversation with the chat template
itself, so any template works, with or without `{% generation %}` markers. For assistant message k:

    prompt_k = render(messages[:k], add_generation_prompt=True)   what the server renders before turn k
    turn_k   = render(messages[:k+1])                             must begin with prompt_k
    generated text of turn k = turn_k[len(prompt_k):], less the whitespace after its final special token

so the template's assistant header (`<|im_start|>assistant\\n`, and an empty `<think>\\n\\n</think>\\n\\n`
where the generation prompt holds it, as with enable_thinking=false) is context, while the reasoning
block, the content, the tool calls and the end-of-turn token (`<|im_end|>`: the drafter learns
where a turn stops) are generated; the newline the template writes after `<|im_end|>` is context.
A token is 1 when its characters overlap generated text (as transformers' `{% generation %}` mask).
The document is turn_K of the last assistant message (later messages hold nothing to learn).
Some templates re-render history once later turns exist (Qwen3's drop the reasoning of turns
before the last user message): a turn is trained where its own context and text are what the
server sees, so such a row becomes several documents (views), each the rendering up to the last
turn it is trained on; `PrepareReport.multi_view` counts those rows.

Prepared folder (one per dataset; every array is a plain `.npy`, so `np.load(mmap_mode="r")` opens
it in microseconds and the OS page cache shares it between processes):

    <out_dir>/
      input_ids.npy    int32  [T]    the documents' tokens, back to back
      loss_mask.npy    uint8  [T]    1 on tokens the drafter learns (the assistant's generated tokens, above)
      offsets.npy      int64  [N+1]  document i is tokens [offsets[i], offsets[i+1]); offsets[0] = 0
      sample_ids.npy   int64  [N]    0-based row of the source (a split or multi-view row repeats its id)
      meta.json                      format/version, source (path, digest, row format), tokenizer (path,
                                     digest), chat template (text, digest, kwargs), counts, max_len,
                                     overlong policy, the PrepareReport
      bad_rows.jsonl                 one {"line", "sample_id", "reason"} per rejected row

    input_ids   | doc 0 ........ | doc 1 .... | doc 2 ............ |
    offsets     0                a            b                    T

Source rows are numbered two ways, both written down: `sample_id` is the 0-based line (Parquet:
row) index (stable across re-preparation, whatever else changes in the file below it); report
`line` numbers are 1-based, as an editor or `sed -n 'Lp'` shows them, so `line == sample_id + 1`.

No row is ever dropped without a trace: every row is either kept (perhaps truncated or split,
both counted) or listed in the report with its line number and the reason (a row larger than
max_row_bytes, never parsed; nested deeper than MAX_ROW_DEPTH; a number past Python's int-string
limit; a Parquet row or row group pyarrow cannot read; a word longer than `word_cap`, whose
tokenization alone would cost gigabytes), and the file goes on; a source without a
single usable row is an error that first says what is wrong with the file, when its first bytes
show it (a JSON array, Latin-1 or UTF-16 text, gzip), and the command that fixes it, then the first
rows' own reasons. A UTF-8 byte-order mark at the start of a file is accepted. `dfpipe eval` reads
its chat prompts through the same reader and parser (`ChatRows`).
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from common.config import Config, ConfigError, DataConfig, load_config
from common.metrics import ProgressLines
from common.preflight import tokenizer_folder

log = logging.getLogger(__name__)

FORMAT = "dfpipe-prepared"
FORMAT_VERSION = 1
ARRAYS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "offsets": np.dtype(np.int64),
    "sample_ids": np.dtype(np.int64),
}
OVERLONG_POLICIES = ("truncate", "split", "skip")
ROW_FORMATS = {"openai": "messages", "sharegpt": "conversations"}  # format -> the row key holding the turns
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "observation": "tool"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # the names transformers reads as reasoning
EXPECTED_FORMATS = (
    "one conversation per JSONL line or Parquet row, in one of:\n"
    '  openai:   {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}\n'
    '  sharegpt: {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}'
)
# Files that define a tokenizer (hashed into meta.json); a model folder's weights are not among them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
_ENCODE_BATCH = 256
# Deeper rows are bad rows. Chat rows and their tool schemas nest a few tens of levels at most; the
# parsers and templates that walk a row recurse once per level, against Python's recursion limit (1000).
MAX_ROW_DEPTH = 100
# A view's text tokenized under truncate/skip is first cut to (max_len + 1) * this many characters,
# and cut again 4x longer while that holds too few tokens (`_encode_views`): most tokens are shorter.
_CHARS_PER_TOKEN = 8


class DataError(ValueError):
    """A prepared folder or a prepare-data input that cannot be used; the message says which file and why."""


class TooManyBadRows(DataError):
    """More of a source's rows are bad than data.max_bad_share allows: a file mostly bad is the wrong
    file or a broken export, and training on its few good rows would hide that."""


# ----------------------------------------------------------------------------------------------
# The report


@dataclass
class PrepareReport:
    """What prepare-data did with every source row.

    rows = kept + len(bad). `truncated` and `split` count kept rows (a split row yields several
    documents); `multi_view` counts kept rows the template rendered as several views (module
    docstring); `pieces_dropped` counts documents (split pieces, truncated views) without a single
    loss token (they would cost target compute and teach nothing).
    """

    rows: int = 0
    kept: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)  # (1-based line, reason)
    truncated: int = 0
    split: int = 0
    multi_view: int = 0
    pieces_dropped: int = 0
    documents: int = 0
    tokens: int = 0
    loss_tokens: int = 0

    def reasons(self) -> dict[str, list[int]]:
        """Kind of reason (text before the first ':') -> lines, in file order."""
        kinds: dict[str, list[int]] = {}
        for line, reason in self.bad:
            kinds.setdefault(reason.split(":", 1)[0], []).append(line)
        return kinds

    def summary(self) -> str:
        parts = [f"{self.rows} rows: {self.kept} kept ({self.truncated} truncated, {self.split} split), "
                 f"{len(self.bad)} bad; {self.documents} documents, {self.tokens} tokens, "
                 f"{self.loss_tokens} loss tokens"]
        if self.multi_view:
            parts.append(f"{self.multi_view} rows prepared as several views (the template re-renders earlier turns)")
        if self.pieces_dropped:
            parts.append(f"{self.pieces_dropped} documents without loss tokens dropped (split pieces, truncated views)")
        for kind, lines in sorted(self.reasons().items()):
            shown = ", ".join(map(str, lines[:8])) + (", ..." if len(lines) > 8 else "")
            parts.append(f"  {len(lines)} x {kind} (line {shown})")
        return "\n".join(parts)

    def bad_share(self) -> float:
        return len(self.bad) / self.rows if self.rows else 0.0

    def first_reasons(self, count: int = 3) -> str:
        return "; ".join(f"line {line}: {reason}" for line, reason in self.bad[:count])

    def check_bad_share(self, source: str, max_bad_share: float) -> str | None:
        """TooManyBadRows when the share of bad rows exceeds `max_bad_share`; else the one warning
        line to show when some rows are bad (None: none is)."""
        if not self.bad:
            return None
        share = f"{len(self.bad)} of {self.rows} rows ({self.bad_share():.1%})"
        if self.bad_share() > max_bad_share:
            raise TooManyBadRows(
                f"{source}: {share} are bad, more than data.max_bad_share {max_bad_share:g} allows "
                f"(first: {self.first_reasons()}). Fix the file, or allow it with data.max_bad_share: 1 "
                f"(prepare-data --max-bad-share 1) to train on the {self.kept} good rows")
        return f"{source}: {share} are bad and skipped (data.max_bad_share {max_bad_share:g}); first: " \
               f"{self.first_reasons(1)}"

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["bad"] = [list(b) for b in self.bad]
        return d


# ----------------------------------------------------------------------------------------------
# Reading rows: JSONL lines or Parquet rows -> objects, or the reason one is unusable


UTF8_BOM = b"\xef\xbb\xbf"   # what Windows editors write at the start of a "UTF-8" file
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
GZIP_MAGIC = b"\x1f\x8b"


def _looks_like(raw: bytes) -> str:
    """The encoding bytes that are not UTF-8 most likely are: UTF-16 (a BOM or NUL bytes), else Latin-1
    (any byte string decodes as Latin-1; Windows-1252 differs only in printable 0x80-0x9f)."""
    return "UTF-16" if raw.startswith(UTF16_BOMS) or b"\x00" in raw else "Latin-1 (or Windows-1252)"


def _oversize(size: int, limit: int) -> str:
    return f"larger than max_row_bytes: {size} > {limit} bytes"


def read_lines(path: str, max_bytes: int = DataConfig.max_row_bytes) -> Iterator[tuple[int, str | None, str]]:
    """(1-based line, text, "") or (line, None, reason) for each line of a UTF-8 text file; a UTF-8
    BOM at the start of the file is dropped. Binary on purpose: only b'\\n' ends a line (text mode
    would also split at a lone '\\r', shifting every later line number). A line over `max_bytes` is
    never held whole: it is read in 1 MiB pieces, counted and reported."""
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(max_bytes + 2):     # + 2: room for a line of max_bytes and its "\r\n"
            number += 1
            size = len(raw)
            if len(raw) == max_bytes + 2 and not raw.endswith(b"\n"):  # unfinished: count the rest of the line
                while not raw.endswith(b"\n") and (raw := f.readline(1 << 20)):
                    size += len(raw)
            size -= len(raw) - len(raw.rstrip(b"\r\n"))   # the line ending is not the row's
            if size > max_bytes:
                yield number, None, _oversize(size, max_bytes)
                continue
            raw = raw.rstrip(b"\r\n")
            if number == 1:
                raw = raw.removeprefix(UTF8_BOM)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, None, (f"not UTF-8: byte {e.start} is 0x{raw[e.start]:02x}; the line looks like "
                                     f"{_looks_like(raw)} text")
                continue
            yield number, text, ""


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests lists and objects more than `limit` levels (the value itself is
    level 1). Iterative: the walk itself must not recurse."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))
    return False


def _too_deep() -> str:
    return f"nested deeper than {MAX_ROW_DEPTH} levels"


def _parse_json(text: str) -> tuple[Any, str]:
    """(value, "") for JSON text, else (None, reason): not JSON, nested deeper than MAX_ROW_DEPTH (the
    C parser raises RecursionError near 1000 levels; shallower ones are measured), or a number
    with more digits than Python converts (sys.get_int_max_str_digits: ValueError)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e.msg} at column {e.colno}"
    except RecursionError:
        return None, _too_deep()
    except ValueError:  # json.loads' one other ValueError: int() of a number past Python's int-string limit
        return None, f"number with more than {sys.get_int_max_str_digits()} digits"
    return (None, _too_deep()) if _deeper_than(value, MAX_ROW_DEPTH) else (value, "")


def _jsonl_rows(path: str, max_bytes: int) -> Iterator[tuple[int, Any, str]]:
    """(1-based line, object, "") or (line, None, reason)."""
    for number, text, reason in read_lines(path, max_bytes):
        if text is None:
            yield number, None, reason
        elif not text.strip():
            yield number, None, "empty line"
        else:
            yield number, *_parse_json(text)


def _parquet_rows(path: str, max_bytes: int) -> Iterator[tuple[int, Any, str]]:
    """(1-based row, row as a dict, "") or (row, None, reason), read a record batch at a time (bounded
    memory). A row group pyarrow cannot decode (a damaged page) makes each of its rows not yet read
    a bad row: which of them the damage holds is unknown; the file goes on with the next group."""
    import pyarrow as pa
    import pyarrow.parquet as pq  # only where a Parquet file is read

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError... for an unreadable file
        raise DataError(f"{path}: not a readable Parquet file: {e}") from e
    number = 0
    for group in range(parquet.num_row_groups):
        end = number + parquet.metadata.row_group(group).num_rows
        try:
            for batch in parquet.iter_batches(batch_size=1024, row_groups=[group]):
                for row, reason in _batch_rows(batch, max_bytes):
                    number += 1
                    yield number, row, reason
        except (pa.ArrowException, OSError) as e:
            reason = f"unreadable Parquet row group {group}: {type(e).__name__}: {_one_line(e)}"
            while number < end:
                number += 1
                yield number, None, reason


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())   # pyarrow's messages span lines; a reason is one


def _batch_rows(batch: Any, max_bytes: int) -> Iterator[tuple[Any, str]]:
    """(row, "") or (None, reason) for each row of a pyarrow RecordBatch. A row's size is the bytes
    of its Arrow buffers (a slice's nbytes counts only its own), checked before it becomes Python
    objects; a row pyarrow cannot convert (a timestamp past year 9999...) is a bad row of its own."""
    sizes = [batch.slice(i, 1).nbytes for i in range(batch.num_rows)]
    try:
        rows = batch.to_pylist() if max(sizes, default=0) <= max_bytes else None
    except Exception:  # pyarrow and datetime raise several types: find the row, one at a time below
        rows = None
    for i, size in enumerate(sizes):
        if size > max_bytes:
            yield None, _oversize(size, max_bytes)
            continue
        try:
            row = rows[i] if rows is not None else batch.slice(i, 1).to_pylist()[0]
        except Exception as e:
            yield None, f"unreadable Parquet row: {type(e).__name__}: {_one_line(e)}"
            continue
        yield (None, _too_deep()) if _deeper_than(row, MAX_ROW_DEPTH) else (_drop_nulls(row), "")


def _drop_nulls(value: Any) -> Any:
    """Parquet stores a list of objects as structs with the union of their fields, so a field one
    object lacks reads as null: drop null fields (a tool schema must render as it was written)."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _source_rows(path: str, max_bytes: int) -> Iterator[tuple[int, Any, str]]:
    return _parquet_rows(path, max_bytes) if path.endswith(".parquet") else _jsonl_rows(path, max_bytes)


def source_row_count(path: str) -> int:
    """How many rows (Parquet) or lines (JSONL) `path` holds: the total of prepare-data's progress.
    Lines are counted in 1 MiB reads (about a second per GB, against minutes of tokenizing)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:   # unreadable: the reading itself says why
            return 0
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")   # a last line without its newline


def detect_format(row: dict[str, Any]) -> str | None:
    """The format whose key the row holds (a null value does not count)."""
    return next((fmt for fmt, key in ROW_FORMATS.items() if row.get(key) is not None), None)


def _fixed_name(path: str, tag: str) -> str:
    return f"{os.path.splitext(path)[0]}.{tag}.jsonl"


def unusable_file_fix(path: str) -> str:
    """What is wrong with a chat file none of whose rows is usable, and the command that fixes it,
    judged from its first bytes ("" when nothing stands out: the rows' own reasons say it)."""
    if path.endswith(".parquet"):
        return ""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if head.startswith(GZIP_MAGIC):
        return f"it is gzip-compressed; decompress it first: gunzip -c {path} > {_fixed_name(path, 'plain')}"
    if head.startswith(UTF16_BOMS) or b"\x00" in head:
        return (f"it is UTF-16 text, not UTF-8; convert it: "
                f"iconv -f utf-16 -t utf-8 {path} > {_fixed_name(path, 'utf8')}")
    head = head.removeprefix(UTF8_BOM)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:        # not just a character cut at the end of the head
            return (f"it is not UTF-8 and looks like Latin-1 (ISO-8859-1) or Windows-1252 text; convert it: "
                    f"iconv -f latin1 -t utf-8 {path} > {_fixed_name(path, 'utf8')}")
        text = head[:e.start].decode("utf-8")
    if text.lstrip().startswith("["):
        return (f"it looks like a JSON array; write one object per line (JSONL), e.g. "
                f"jq -c '.[]' {path} > {_fixed_name(path, 'lines')}")
    return ""


def no_usable_rows(path: str, report: "PrepareReport", shown: int = 3) -> str:
    """The error for a source without one usable row: what is wrong and its fix first, then the first
    rows' own reasons, the formats expected and the report."""
    fix = unusable_file_fix(path)
    lines = [f"{path}: no usable rows" + (f": {fix}" if fix else "")]
    lines += [f"  line {line}: {reason}" for line, reason in report.bad[:shown]]
    lines += [f"Expected {EXPECTED_FORMATS}", report.summary()]
    return "\n".join(lines)


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON value (tool calls, tool schemas)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _tool_calls(calls: Any, i: int) -> str:
    """"" when `calls` is a list of tool calls ({"function": {"name", "arguments"}} or {"name", "arguments"})."""
    if not isinstance(calls, list):
        return f"invalid tool_calls: message {i} tool_calls is a {type(calls).__name__}, not a list"
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"invalid tool_calls: message {i} call {j} has no function name"
    return ""


def _openai_message(m: Any, i: int) -> tuple[dict[str, Any] | None, str]:
    """One OpenAI message -> the fields a chat template reads (a null field counts as absent)."""
    if not isinstance(m, dict):
        return None, f"invalid message: message {i} is a {type(m).__name__}, not an object"
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        return None, f"invalid role: message {i} role is {type(role).__name__}, not a string"
    if role not in ROLES:
        return None, f"invalid role: message {i} role {role!r} is not one of {', '.join(ROLES)}"
    out: dict[str, Any] = {"role": role}
    if m.get("tool_calls") is not None:
        if role != "assistant":
            return None, f"invalid tool_calls: message {i} is a {role} message"
        reason = _tool_calls(m["tool_calls"], i)
        if reason:
            return None, reason
        out["tool_calls"] = m["tool_calls"]
        content = "" if content is None else content  # OpenAI: content is null beside tool calls
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)  # OpenAI content parts, text only
    if not isinstance(content, str):
        return None, f"invalid content: message {i} content is {type(content).__name__}, not a string"
    out["content"] = content
    reasoning = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            return None, f"invalid reasoning_content: message {i} reasoning is {type(reasoning).__name__}"
        out["reasoning_content"] = reasoning
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out, ""


def _sharegpt_message(m: Any, i: int) -> tuple[dict[str, Any] | None, str]:
    if not isinstance(m, dict):
        return None, f"invalid message: turn {i} is a {type(m).__name__}, not an object"
    speaker, value = m.get("from"), m.get("value")
    if speaker not in SHAREGPT_ROLES:
        return None, f"invalid role: turn {i} from {speaker!r} is not one of {', '.join(SHAREGPT_ROLES)}"
    if not isinstance(value, str):
        return None, f"invalid content: turn {i} value is {type(value).__name__}, not a string"
    return {"role": SHAREGPT_ROLES[speaker], "content": value}, ""


@dataclass
class Conversation:
    """A usable row: messages with the fields a chat template reads, and the row's tool schemas."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def _not_an_object(row: Any) -> str:
    hint = " (a JSON array: write one object per line, JSONL)" if isinstance(row, list) else ""
    return f"not a JSON object: got {type(row).__name__}{hint}"


def parse_row(row: Any, fmt: str, control_tokens: re.Pattern[str] | None,
              need_answer: bool = True) -> tuple[Conversation | None, str]:
    """(conversation, "") for a usable row of format `fmt`, else (None, reason). need_answer False
    (a prompt, for eval) accepts a row without an assistant turn."""
    key = ROW_FORMATS[fmt]
    if not isinstance(row, dict):
        return None, _not_an_object(row)
    if row.get(key) is None:
        return None, f"missing {key!r}: the file holds {fmt} rows"
    turns = row[key]
    if not isinstance(turns, list):
        return None, f"invalid {key!r}: expected a list, got {type(turns).__name__}"
    if not turns:
        return None, f"invalid {key!r}: empty list"
    convert = _openai_message if fmt == "openai" else _sharegpt_message
    messages: list[dict[str, Any]] = []
    system = row.get("system") if fmt == "sharegpt" else None
    if system is not None and not isinstance(system, str):
        return None, f"invalid system: expected a string, got {type(system).__name__}"
    if system:  # ShareGPT files (LLaMA-Factory) may keep the system prompt beside the turns
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        message, reason = convert(turn, i)
        if message is None:
            return None, reason
        messages.append(message)
    tools = row.get("tools")
    if isinstance(tools, str):  # some files (LLaMA-Factory's ShareGPT) keep the tool schemas as a JSON string
        tools, reason = _parse_json(tools) if tools.strip() else (None, "")
        if reason:
            return None, f"invalid tools: {reason}"
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return None, "invalid tools: expected a list of JSON schemas"
    if control_tokens is not None:
        for i, message in enumerate(messages):
            for text in _strings({k: v for k, v in message.items() if k != "role"}):
                hit = control_tokens.search(text)
                if hit:
                    # The template would tokenize it as the real control token and corrupt turn boundaries.
                    return None, f"control token in content: message {i} contains {hit.group(0)!r}"
        hit = next((h for h in map(control_tokens.search, _strings(tools)) if h), None)
        if hit:
            return None, f"control token in content: tools contain {hit.group(0)!r}"
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        return None, "no assistant turn"
    if messages[0]["role"] == "assistant":
        return None, "assistant turn without a prompt: message 0 is the assistant's"
    return Conversation(messages, tools), ""


# ----------------------------------------------------------------------------------------------
# Writing


class _ArrayWriter:
    """Appends 1-d chunks to a raw file, then wraps it as a .npy (bounded memory for any dataset size)."""

    def __init__(self, path: str, dtype: np.dtype) -> None:
        self.path, self.dtype, self.count = path, dtype, 0
        self._raw = open(path + ".raw", "wb")

    def append(self, values: np.ndarray) -> None:
        self._raw.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.count += len(values)

    def finish(self) -> None:
        self._raw.close()
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.count,)}
        with open(self.path, "wb") as out, open(self.path + ".raw", "rb") as raw:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out, 16 << 20)
        os.unlink(self.path + ".raw")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_digest(tokenizer_dir: str) -> str:
    """sha256 over the tokenizer-defining files of a folder (names and bytes)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = os.path.join(tokenizer_dir, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0" + file_sha256(path).encode())
    return h.hexdigest()


def _load_tokenizer(tokenizer_dir: str) -> Any:
    if not os.path.isdir(tokenizer_dir):
        raise DataError(f"tokenizer folder not found: {tokenizer_dir}")
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # transformers raises many types for an unusable folder
        raise DataError(f"cannot load a tokenizer from {tokenizer_dir}: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        # The loss mask maps rendered characters to tokens: only a fast (tokenizer.json) tokenizer has offsets.
        raise DataError(f"{tokenizer_dir}: a fast tokenizer (tokenizer.json) is needed for character offsets")
    return tokenizer


def _is_inline(chat_template: str) -> bool:
    return "{{" in chat_template or "{%" in chat_template


def read_chat_template(chat_template: str | None) -> str | None:
    """The template text a `chat_template` setting names: None for "" (the tokenizer's own); the
    text itself when it is inline Jinja (it holds '{{' or '{%'); else it is a file path: its text."""
    if not chat_template:
        return None
    if _is_inline(chat_template):
        return chat_template
    if not os.path.isfile(chat_template):
        raise DataError(f"chat template file not found: {chat_template} (inline Jinja must hold '{{{{' or '{{%')")
    with open(chat_template, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise DataError(f"chat template file is empty: {chat_template}")
    return text


def _resolve_template(tokenizer: Any, chat_template: str | None, tokenizer_dir: str) -> str:
    try:  # the tokenizer's own may be several named templates: get_chat_template picks the default
        return tokenizer.get_chat_template(read_chat_template(chat_template))
    except ValueError as e:
        raise DataError(f"{tokenizer_dir}: tokenizer has no chat template; set a chat_template ({e})") from e


def _check_template_kwargs(kwargs: Any, tokenizer: Any) -> dict[str, Any]:
    """Template variables: a JSON mapping of str keys that do not clash with what prepare-data passes."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise DataError(f"chat_template_kwargs must be a mapping with string keys, got {kwargs!r}")
    try:
        json.dumps(kwargs)  # recorded in meta.json and hashed into the cache key
    except (TypeError, ValueError) as e:
        raise DataError(f"chat_template_kwargs must hold JSON values: {e}") from e
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
    clash = sorted(set(kwargs) & (own - {"kwargs"}))
    if clash:
        raise DataError(f"chat_template_kwargs: {', '.join(clash)} set by prepare-data itself, not a template variable")
    return dict(kwargs)


def _special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens, longest first (so a regex alternation prefers the longest)."""
    specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    specials |= set(getattr(tokenizer, "all_special_tokens", []))
    specials.discard("")
    return sorted(specials, key=len, reverse=True)


def _control_token_pattern(specials: list[str]) -> re.Pattern[str] | None:
    return re.compile("|".join(re.escape(t) for t in specials)) if specials else None


def control_tokens(tokenizer: Any) -> re.Pattern[str] | None:
    """The tokenizer's special tokens as one pattern: text holding one is refused (`parse_row`)."""
    return _control_token_pattern(_special_tokens(tokenizer))


class ChatRows:
    """A chat file's rows as conversations, in file order: `(line, conversation, "")` or
    `(line, None, reason)`. The one row reader and parser of prepare-data and eval. `format` is the
    row format, named or (auto) decided by the first row holding 'messages' or 'conversations'."""

    def __init__(self, path: str, row_format: str = "auto", control_tokens: re.Pattern[str] | None = None,
                 need_answer: bool = True, max_row_bytes: int = DataConfig.max_row_bytes) -> None:
        self.path, self.control_tokens, self.need_answer = path, control_tokens, need_answer
        self.format = None if row_format == "auto" else row_format
        self.max_row_bytes = max_row_bytes

    def __iter__(self) -> Iterator[tuple[int, Conversation | None, str]]:
        for line, row, reason in _source_rows(self.path, self.max_row_bytes):
            if reason:
                yield line, None, reason
                continue
            if self.format is None and isinstance(row, dict):
                self.format = detect_format(row)
            if self.format is None:
                yield line, None, (_not_an_object(row) if not isinstance(row, dict) else
                                   f"missing {' or '.join(map(repr, ROW_FORMATS.values()))}")
                continue
            conversation, reason = parse_row(row, self.format, self.control_tokens, self.need_answer)
            yield line, conversation, reason


# A view: a rendered text and the character spans of it the assistant generated.
View = tuple[str, list[tuple[int, int]]]


@dataclass
class _Renderer:
    """Renders conversations with one template and its variables; finds the generated spans (module docstring)."""

    tokenizer: Any
    template: str
    kwargs: dict[str, Any]
    end_tokens: tuple[str, ...]  # special tokens: a generated span ends at its last one

    def render(self, conversation: Conversation, upto: int, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            conversation.messages[:upto], tools=conversation.tools, chat_template=self.template,
            add_generation_prompt=generation_prompt, tokenize=False, **self.kwargs)

    def views(self, conversation: Conversation) -> list[View] | str:
        """The views a conversation is trained as, or the reason it cannot be."""
        views: list[View] = []
        text, spans = "", []
        for k, message in enumerate(conversation.messages):
            if message["role"] != "assistant":
                continue
            try:
                prompt = self.render(conversation, k, generation_prompt=True)
                turn = self.render(conversation, k + 1, generation_prompt=False)
            except Exception as e:  # a template's raise_exception, a missing field...: this row only
                return f"template error: {type(e).__name__}: {e}"
            if not turn.startswith(prompt):
                return (f"template mismatch: message {k} does not render as a continuation of the generation "
                        "prompt before it (reasoning_content with thinking off?)")
            if spans and not turn.startswith(text):
                views.append((text, spans))  # the template re-rendered earlier turns: a new view starts
                spans = []
            text = turn
            spans.append((len(prompt), self._generated_end(turn, len(prompt))))
        views.append((text, spans))
        return views

    def _generated_end(self, turn: str, start: int) -> int:
        """Where the generated text ends: after the final special token (the end-of-turn) when only
        whitespace the template writes between turns follows it; else the end of the turn."""
        body = turn[start:].rstrip()
        return start + len(body) if self.end_tokens and body.endswith(self.end_tokens) else len(turn)


@dataclass
class _Encoded:
    """One view's tokens and loss mask: all of them, or (`whole` False) the first ones of a view
    longer than the document keeps, cut before it was tokenized whole (`_encode_views`)."""

    ids: np.ndarray     # int64
    mask: np.ndarray    # uint8: 1 on tokens whose characters overlap a generated span
    whole: bool
    learns: bool        # some token of the whole view is 1 (beyond a cut: a generated span reaches past it)


def _unchanged_by_cut(words: list[int | None], offsets: list[tuple[int, int]], size: int, reach: int) -> int:
    """How many leading tokens of a text cut after `size` characters are those of the uncut text.

    A tokenizer matches its added tokens (`<|im_end|>`, `<think>`...; `reach`: the longest one's
    length) first, splits the rest into words with its pre-tokenizer (a regex such as Qwen's) and
    tokenizes each word alone. So a cut can change the words within `reach` characters of it (an
    added token the cut falls into starts there), and the word before those, where a regex looks a
    character ahead (`\\s+(?!\\S)`); tokens of earlier words stay. A tokenizer without a
    pre-tokenizer keeps the tokens before the added token nearest the cut (the text between two is
    one word). tests/test_row_limits.py checks every cut against the whole text, for four kinds."""
    first = next((i for i, (_, end) in enumerate(offsets) if end > size - reach), len(offsets) - 1)
    if first < 0 or words[first] is None:
        return 0
    near = words[first]
    return next((i for i, word in enumerate(words) if word is None or word >= near - 1), len(words))


class _WordTooLong(ValueError):
    """A view holds a pre-tokenizer word longer than the word cap: its message is the row's bad-row reason."""


def word_cap(tokenizer: Any, max_len: int) -> int:
    """The longest pre-tokenizer word a row may hold: (max_len + 1) x the longest vocabulary entry.

    A tokenizer runs BPE on each word whole, in memory and time in proportion to the word (about
    400 bytes a character: a 15 MiB word took 6.4 GB and 46 s), and whether a prefix of one word
    tokenizes as the start of the whole word cannot be proven (a merge at its end can move every
    boundary before it), so such a word is never cut. A token covers at most the longest entry's
    characters, so a word past the cap holds more tokens than a document keeps (NFC can compose a
    few characters into one, so nearly always): a row holding one is a bad row ("word too long"),
    read before its cost is paid."""
    vocab = tokenizer.get_vocab()
    return (max_len + 1) * max(map(len, vocab), default=1)


def _long_word(text: str, cap: int) -> int | None:
    """Where a run of more than `cap` characters without whitespace, or of whitespace only, starts
    (None: there is none). Pre-tokenizers that split at whitespace (byte-level regexes, Metaspace,
    Whitespace) make no word longer than such a run and one character; without a pre-tokenizer the
    text between two added tokens is one word, which this does not see."""
    found = re.search(r"\S{%d,}|\s{%d,}" % (cap + 1, cap + 1), text)
    return found.start() if found else None


def _word_too_long(cap: int, start: int) -> _WordTooLong:
    return _WordTooLong(f"word too long: more than {cap} characters at character {start} the tokenizer cannot "
                        f"split (one pre-tokenizer word; longer than (max_len + 1) x the longest vocabulary "
                        f"entry); tokenizing it whole would cost about 400 bytes a character")


def _last_word_start(words: list[int | None], offsets: list[tuple[int, int]], size: int) -> int:
    """Where the last word of a cut text starts (`size`: the text ends in an added token, no word)."""
    last = words[-1] if words else None
    if last is None:
        return size
    i = len(words) - 1
    while i > 0 and words[i - 1] == last:
        i -= 1
    return offsets[i][0]


def _encode_views(tokenizer: Any, views: list[View], keep: int | None, cap: int | None = None) -> list[_Encoded]:
    """Token ids of each view's text (as apply_chat_template tokenizes it), and its mask.

    keep None: every token (overlong split). Else only the first `keep` are needed: a longer text is
    tokenized as a prefix of keep * _CHARS_PER_TOKEN characters, 4x longer while fewer than `keep`
    of its tokens are certain to be the uncut text's (`_unchanged_by_cut`), so a 200 MB answer costs
    the tokens kept, not 50M tokens; the ids and mask kept are exactly those of the whole text.

    cap (`word_cap`; None: no cap) bounds one word's cost: under split a view holding a longer run
    (`_long_word`) raises _WordTooLong before it is tokenized; under a cut, the cut never grows
    more than `cap` characters past the start of the word it falls in, and raises when that word
    is still unproven there (the whole text holds a word longer than `cap`)."""
    if not views:
        return []
    bound = None if keep is None else keep * _CHARS_PER_TOKEN
    reach = max((len(t.content) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()), default=1)
    if keep is None and cap is not None:
        for text, _ in views:
            if (start := _long_word(text, cap)) is not None:
                raise _word_too_long(cap, start)
    texts = [text if bound is None or len(text) <= bound else text[:bound] for text, _ in views]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for i, ((text, spans), cut) in enumerate(zip(views, texts)):
        ids, offsets, size = encoded["input_ids"][i], encoded["offset_mapping"][i], len(cut)
        words = encoded.word_ids(i) if size < len(text) else []     # only a cut text asks which words changed
        while size < len(text) and _unchanged_by_cut(words, offsets, size, reach) < keep:
            grown = min(len(text), size * 4)
            if cap is not None:
                # The cut's last word may differ from the whole text's by an added token the cut fell
                # into (reach) and a lookahead's character: past that, the whole text's word is longer than cap.
                limit = _last_word_start(words, offsets, size) + cap + reach + 2
                if size >= limit:
                    raise _word_too_long(cap, _last_word_start(words, offsets, size))
                grown = min(grown, limit)
            size = grown
            again = tokenizer([text[:size]], add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets, words = again["input_ids"][0], again["offset_mapping"][0], again.word_ids(0)
        whole = size >= len(text)
        if not whole:
            ids, offsets = ids[:keep], offsets[:keep]
        chars = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            mask |= (chars[:, 0] < b) & (chars[:, 1] > a)
        # Past a cut, a generated span reaching beyond the last kept token's end holds tokens learnt.
        learns = bool(mask.any()) or (not whole and any(b > max(a, int(chars[-1, 1])) for a, b in spans))
        out.append(_Encoded(np.asarray(ids, dtype=np.int64), mask.astype(np.uint8), whole, learns))
    return out


def _encode_rows(tokenizer: Any, pending: list[tuple[int, list[View] | str]], keep: int | None,
                 cap: int | None = None) -> list[tuple[int, list[View] | str, list[_Encoded] | str]]:
    """(line, views, their encodings or the reason the row has none) of rendered rows, tokenized in
    one batch. When the batch raises, each row is tokenized alone: the exception a row's own text
    raises in the tokenizer (a lone surrogate: `TypeError: TextEncodeInput must be ...`, a codec
    error) makes that row a bad row, its line and the exception its reason; the others are kept.
    So does a word longer than `cap` (`_encode_views`), with its own reason."""
    views_to_encode = [v for _, views in pending if not isinstance(views, str) for v in views]
    try:
        encoded = iter(_encode_views(tokenizer, views_to_encode, keep, cap))
        return [(line, views, views if isinstance(views, str) else [next(encoded) for _ in views])
                for line, views in pending]
    except Exception:   # noqa: BLE001: one row's content; which one is found below
        if len(pending) == 1 and not isinstance(pending[0][1], str):
            line, views = pending[0]
            try:
                return [(line, views, _encode_views(tokenizer, views, keep, cap))]
            except _WordTooLong as e:
                return [(line, views, str(e))]
            except Exception as e:   # this row's own text: a bad row, not the file's end
                return [(line, views, f"tokenizer error: {type(e).__name__}: {str(e)[:200]}")]
        return [row for one in pending for row in _encode_rows(tokenizer, [one], keep, cap)]


def _documents(views: list[_Encoded], max_len: int, overlong: str, report: PrepareReport
               ) -> list[tuple[np.ndarray, np.ndarray]] | str:
    """The documents one row's encoded views become under the overlong policy, or the reason it becomes none."""
    if all(len(v.ids) == 0 for v in views):
        return "empty: the template produced no tokens"
    if not any(v.learns for v in views):
        return "no assistant tokens"
    longest = max(len(v.ids) for v in views)
    if overlong == "skip" and longest > max_len:
        if all(v.whole for v in views):
            return f"longer than max_len: {longest} > {max_len} tokens"
        return f"longer than max_len: more than {max_len} tokens"  # a cut view is not counted further
    docs: list[tuple[np.ndarray, np.ndarray]] = []
    dropped = 0
    for v in views:
        ids, mask = v.ids, v.mask
        if len(ids) <= max_len:
            pieces = [(ids, mask)]
        elif overlong == "truncate":
            pieces = [(ids[:max_len], mask[:max_len])]
        else:
            pieces = [(ids[s:s + max_len], mask[s:s + max_len]) for s in range(0, len(ids), max_len)]
        useful = [p for p in pieces if p[1].any()]
        dropped += len(pieces) - len(useful)
        docs += useful
    if not docs:
        return f"no assistant tokens after truncation: all of them lie beyond max_len {max_len}"
    report.pieces_dropped += dropped
    if longest > max_len:
        report.truncated += overlong == "truncate"
        report.split += overlong == "split"
    return docs


def _prepare_out_dir(out_dir: str) -> str:
    """A fresh sibling temp folder; refuses to replace a non-empty folder that is not a prepared dataset."""
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise DataError(f"output path exists and is not a folder: {out_dir}")
        if os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "meta.json")):
            raise DataError(f"output folder {out_dir} is not empty and is not a prepared dataset; not replacing it")
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _publish(tmp: str, out_dir: str) -> None:
    """Swap the finished folder into place; a reader never sees a half-written dataset."""
    old = f"{out_dir}.old-{os.getpid()}"
    if os.path.exists(out_dir):
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def prepare_data(source_path: str, tokenizer_dir: str, out_dir: str, max_len: int, overlong: str = "truncate",
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 row_format: str = "auto", max_row_bytes: int = DataConfig.max_row_bytes,
                 max_bad_share: float = DataConfig.max_bad_share) -> PrepareReport:
    """Tokenize a chat JSONL or Parquet file into a prepared folder (input formats and layout in the
    module docstring).

    chat_template: a Jinja template, or a path to one, used instead of the tokenizer's own;
    chat_template_kwargs: variables it reads (e.g. {"enable_thinking": False}); row_format: auto
    (detected from the first row holding 'messages' or 'conversations') | openai | sharegpt;
    max_row_bytes: a larger row (JSONL line, Parquet row) is a bad row, never parsed.
    Bad rows are counted and listed, fatal only above max_bad_share of the rows (TooManyBadRows,
    nothing written); a missing input, an unusable tokenizer or
    template, bad arguments or a source without one usable row raise DataError.
    """
    if overlong not in OVERLONG_POLICIES:
        raise DataError(f"overlong must be one of {', '.join(OVERLONG_POLICIES)}, got {overlong!r}")
    if max_len < 2:
        raise DataError(f"max_len must be at least 2 tokens, got {max_len}")
    if row_format != "auto" and row_format not in ROW_FORMATS:
        raise DataError(f"format must be auto or one of {', '.join(ROW_FORMATS)}, got {row_format!r}")
    if max_row_bytes < 1:
        raise DataError(f"max_row_bytes must be at least 1, got {max_row_bytes}")
    if not 0 <= max_bad_share <= 1:
        raise DataError(f"max_bad_share must be a share of the rows, 0 to 1, got {max_bad_share}")
    if not os.path.isfile(source_path):
        raise DataError(f"input file not found: {source_path}")
    out_dir = os.path.normpath(out_dir)
    tokenizer = _load_tokenizer(tokenizer_dir)
    template = _resolve_template(tokenizer, chat_template, tokenizer_dir)
    kwargs = _check_template_kwargs(chat_template_kwargs or {}, tokenizer)
    specials = _special_tokens(tokenizer)
    renderer = _Renderer(tokenizer, template, kwargs, tuple(specials))
    source_sha256 = file_sha256(source_path)
    rows = ChatRows(source_path, row_format, _control_token_pattern(specials), max_row_bytes=max_row_bytes)
    # Tokens a view needs: split keeps them all; truncate and skip max_len, and one more to tell a longer view.
    keep = None if overlong == "split" else max_len + 1
    cap = word_cap(tokenizer, max_len)

    tmp = _prepare_out_dir(out_dir)
    report = PrepareReport()
    writers = {name: _ArrayWriter(os.path.join(tmp, f"{name}.npy"), ARRAYS[name]) for name in ("input_ids", "loss_mask")}
    offsets, sample_ids = [0], []
    max_token_id = -1

    def flush(pending: list[tuple[int, list[View] | str]]) -> None:
        nonlocal max_token_id
        for line, views, encoded in _encode_rows(tokenizer, pending, keep, cap):
            docs = encoded if isinstance(encoded, str) else _documents(encoded, max_len, overlong, report)
            if isinstance(docs, str):
                report.bad.append((line, docs))
                continue
            report.kept += 1
            report.multi_view += len(views) > 1
            for ids, mask in docs:
                writers["input_ids"].append(ids)
                writers["loss_mask"].append(mask)
                offsets.append(offsets[-1] + len(ids))
                sample_ids.append(line - 1)
                report.loss_tokens += int(mask.sum())
                max_token_id = max(max_token_id, int(ids.max()))
        pending.clear()

    total = source_row_count(source_path)
    # a bar on a terminal; in a log file (a target server preparing at start) a line every 30 s
    bar = tqdm(total=total, unit="row", desc="prepare-data", dynamic_ncols=True, disable=None)
    lines = ProgressLines("prepare-data", "rows", total) if bar.disable else None
    reached = 0   # the last row (line) number read
    try:
        pending: list[tuple[int, list[View] | str]] = []   # rendered rows waiting to be tokenized together
        pending_chars = 0
        for line, conversation, reason in rows:
            report.rows += 1
            if line > reached:
                bar.update(line - reached)
                if lines is not None:
                    lines.update(line - reached)
                reached = line
            if conversation is None:
                # Rows reach the report in file order: flush what is pending before this one.
                flush(pending)
                pending_chars = 0
                report.bad.append((line, reason))
                continue
            views = renderer.views(conversation)
            pending.append((line, views))
            pending_chars += 0 if isinstance(views, str) else sum(len(text) for text, _ in views)
            if len(pending) >= _ENCODE_BATCH or pending_chars > max_row_bytes:  # a batch of long rows is smaller
                flush(pending)
                pending_chars = 0
        flush(pending)
        if report.kept == 0:
            raise DataError(no_usable_rows(source_path, report))
        report.check_bad_share(source_path, max_bad_share)
        for w in writers.values():
            w.finish()
        np.save(os.path.join(tmp, "offsets.npy"), np.asarray(offsets, dtype=ARRAYS["offsets"]))
        np.save(os.path.join(tmp, "sample_ids.npy"), np.asarray(sample_ids, dtype=ARRAYS["sample_ids"]))
        report.documents, report.tokens = len(sample_ids), offsets[-1]
        with open(os.path.join(tmp, "bad_rows.jsonl"), "w", encoding="utf-8") as f:
            for line, reason in report.bad:
                f.write(json.dumps({"line": line, "sample_id": line - 1, "reason": reason}) + "\n")
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "source": os.path.abspath(source_path), "source_sha256": source_sha256, "source_format": rows.format,
            "tokenizer": os.path.abspath(tokenizer_dir), "tokenizer_sha256": tokenizer_digest(tokenizer_dir),
            "chat_template": template, "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            "chat_template_kwargs": kwargs,
            "vocab_size": len(tokenizer), "max_token_id": max_token_id,
            "max_len": max_len, "overlong": overlong, "max_row_bytes": max_row_bytes,
            "num_documents": report.documents, "num_tokens": report.tokens, "num_loss_tokens": report.loss_tokens,
            "arrays": {name: dt.str for name, dt in ARRAYS.items()},
            "report": report.to_dict(),
        }
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return report


# ----------------------------------------------------------------------------------------------
# Reading


class PreparedDataset:
    """A prepared folder, memory-mapped: opening costs O(N) integer work, no token is read."""

    def __init__(self, path: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.path = path
        self.meta = meta
        self.input_ids = arrays["input_ids"]
        self.loss_mask = arrays["loss_mask"]
        self.offsets = arrays["offsets"]
        self.sample_ids = arrays["sample_ids"]
        self.lengths: np.ndarray = np.diff(self.offsets)  # int64 [N]

    @classmethod
    def open(cls, path: str) -> "PreparedDataset":
        meta_path = os.path.join(path, "meta.json")
        if not os.path.isdir(path):
            raise DataError(f"prepared dataset not found: {path}")
        if not os.path.isfile(meta_path):
            raise DataError(f"{path}: no meta.json, not a prepared dataset (run prepare-data)")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"{meta_path}: unreadable: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DataError(f"{meta_path}: not a {FORMAT} folder")
        if meta.get("version") != FORMAT_VERSION:
            raise DataError(f"{meta_path}: format version {meta.get('version')}, this code reads {FORMAT_VERSION}; "
                            "prepare the data again")
        arrays = {name: cls._load_array(path, name, dtype) for name, dtype in ARRAYS.items()}
        cls._check(path, meta, arrays)
        return cls(path, meta, arrays)

    @staticmethod
    def _load_array(path: str, name: str, dtype: np.dtype) -> np.ndarray:
        file = os.path.join(path, f"{name}.npy")
        if not os.path.isfile(file):
            raise DataError(f"{path}: missing {name}.npy")
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{file}: corrupt or truncated: {e}") from e
        if array.dtype != dtype or array.ndim != 1:
            raise DataError(f"{file}: expected 1-d {dtype}, got {array.ndim}-d {array.dtype}")
        return array

    @staticmethod
    def _check(path: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        offsets, n = arrays["offsets"], len(arrays["sample_ids"])
        if len(offsets) != n + 1:
            raise DataError(f"{path}: offsets has {len(offsets)} entries for {n} documents (expected {n + 1})")
        total = int(offsets[-1])
        if int(offsets[0]) != 0 or (n and not bool((np.diff(offsets) > 0).all())):
            raise DataError(f"{path}: offsets must start at 0 and strictly increase (every document non-empty)")
        for name in ("input_ids", "loss_mask"):
            if len(arrays[name]) != total:
                raise DataError(f"{path}: {name} has {len(arrays[name])} tokens, offsets say {total}")
        if meta.get("num_documents") != n or meta.get("num_tokens") != total:
            raise DataError(f"{path}: meta.json counts ({meta.get('num_documents')} documents, "
                            f"{meta.get('num_tokens')} tokens) disagree with the arrays ({n}, {total})")

    def __len__(self) -> int:
        """Documents (a row the template renders as several, or split, counts once per document)."""
        return len(self.sample_ids)

    @property
    def num_samples(self) -> int:
        """Source rows the documents come from (distinct sample ids)."""
        return len(np.unique(self.sample_ids))

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(input_ids int32, loss_mask uint8, sample_id) of document i: read-only views of the mapping."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range [0, {len(self)})")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b], int(self.sample_ids[i])


def _tokenizer_for(cfg: Config, source: str = "train_path") -> str:
    """The tokenizer a chat file is prepared with: target.tokenizer, else the (local) target model folder."""
    found = tokenizer_folder(cfg)
    if found:
        return found
    raise DataError(f"data.{source} is a chat file but no tokenizer is known: set target.tokenizer "
                    f"(target.model {cfg.target.model!r} has no tokenizer folder)")


def template_setting(cfg: Config) -> str:
    """data.chat_template with a file path taken relative to the config file (inline Jinja as it is)."""
    t = cfg.data.chat_template
    return t if not t or _is_inline(t) else cfg.resolve(t)


def ensure_prepared(cfg: Config, source: str = "train_path") -> PreparedDataset:
    """The data set named by `data.<source>` (train_path, or heldout_path for the held-out batches): a
    prepared folder as it is, or a chat .jsonl / .parquet prepared once into
    <target.cache_dir>/data/<name>-<key>/, key = digest of (file bytes, tokenizer files, max_len,
    overlong, max_row_bytes, row format, chat template text and kwargs, format version); a later start with the
    same inputs reuses it, a changed template or kwarg prepares again."""
    path = cfg.resolve(getattr(cfg.data, source))
    if not path:
        raise DataError(f"data.{source} is empty: name a prepared folder or a chat .jsonl / .parquet file")
    if os.path.isdir(path):
        return PreparedDataset.open(path)
    if not os.path.isfile(path):
        raise DataError(f"data.{source} not found: {path}")
    d = cfg.data
    tokenizer_dir = _tokenizer_for(cfg, source)
    template = template_setting(cfg)
    try:
        template_text = read_chat_template(template) or ""  # "": the tokenizer's own, hashed with its files
    except DataError as e:   # a setting that names no file: a restart meets the same (exit status 2)
        raise ConfigError(f"data.chat_template: {e}") from None
    inputs = [FORMAT_VERSION, file_sha256(path), tokenizer_digest(tokenizer_dir), d.max_len, d.overlong, d.format,
              hashlib.sha256(template_text.encode()).hexdigest(), d.chat_template_kwargs, d.max_row_bytes]
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(path))[0]
    out_dir = os.path.join(cfg.resolve(cfg.target.cache_dir), "data", f"{name}-{key}")
    try:   # too many bad rows is the file's, not this host's: a restart meets the same rows (exit status 2)
        return _prepared_cache(cfg, path, tokenizer_dir, template, out_dir)
    except TooManyBadRows as e:
        raise ConfigError(f"data.{source}: {e}") from None


def _prepared_cache(cfg: Config, path: str, tokenizer_dir: str, template: str, out_dir: str) -> PreparedDataset:
    """The prepared folder `out_dir` of chat file `path`: as cached, else prepared now (ensure_prepared)."""
    d = cfg.data
    if os.path.isfile(os.path.join(out_dir, "meta.json")):
        try:
            cached = PreparedDataset.open(out_dir)
        except DataError as e:
            log.warning("prepared cache %s unusable (%s); preparing again", out_dir, e)
        else:   # prepared under another data.max_bad_share (not in the key: it changes no token)
            r = cached.meta.get("report") or {}
            earlier = PrepareReport(rows=r.get("rows", 0), kept=r.get("kept", 0),
                                    bad=[(int(b[0]), str(b[1])) for b in r.get("bad", [])])
            earlier.check_bad_share(path, d.max_bad_share)
            return cached
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    report = prepare_data(path, tokenizer_dir, out_dir, d.max_len, d.overlong, template, d.chat_template_kwargs,
                          d.format, d.max_row_bytes, d.max_bad_share)
    log.info("prepared %s -> %s\n%s", path, out_dir, report.summary())
    if warning := report.check_bad_share(path, d.max_bad_share):
        log.warning("%s; all listed in %s", warning, os.path.join(out_dir, "bad_rows.jsonl"))
    return PreparedDataset.open(out_dir)


# ----------------------------------------------------------------------------------------------
# Command line (`dfpipe prepare-data`, or `python -m target_server.data`)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """prepare-data's options; unset ones come from the config's data section (and target.tokenizer)."""
    parser.add_argument("--input", "--jsonl", dest="input", required=True,
                        help="chat file: .jsonl (one conversation a line) or .parquet (one a row)")
    parser.add_argument("--tokenizer", default="",
                        help="tokenizer folder, the target's (default: the config's target.tokenizer or target.model)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--format", choices=("auto", *ROW_FORMATS), default=None,
                        help="row format: openai (messages), sharegpt (conversations); default data.format, auto: "
                             "detected per file")
    parser.add_argument("--max-len", type=int, default=None, help="longest document in tokens (default data.max_len)")
    parser.add_argument("--overlong", choices=OVERLONG_POLICIES, default=None, help="default data.overlong")
    parser.add_argument("--max-row-bytes", type=int, default=None,
                        help="a larger row (JSONL line, Parquet row) is a bad row, never parsed "
                             "(default data.max_row_bytes)")
    parser.add_argument("--max-bad-share", type=float, default=None, metavar="SHARE",
                        help="stop (exit status 2) when more than this share of the rows is bad; 1 allows any "
                             "(default data.max_bad_share)")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template, a file or inline text; any template works, generation markers "
                             "are not needed (default data.chat_template, else the tokenizer's own)")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                        help='template variables as a JSON object, e.g. \'{"enable_thinking": false}\' '
                             "(default data.chat_template_kwargs)")


def run(args: argparse.Namespace, cfg: Config) -> int:
    """Prepare args.input into args.out; 0, or 2 with the reason on stderr."""
    d = cfg.data
    max_bad_share = d.max_bad_share if args.max_bad_share is None else args.max_bad_share
    try:
        kwargs = d.chat_template_kwargs
        if args.chat_template_kwargs is not None:
            try:
                kwargs = json.loads(args.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise DataError(f"--chat-template-kwargs is not JSON: {e}") from e
        tokenizer_dir = args.tokenizer
        if not tokenizer_dir:
            try:
                tokenizer_dir = _tokenizer_for(cfg)
            except DataError:
                raise DataError("no tokenizer: pass --tokenizer, or a config (-c) whose target.tokenizer or "
                                "target.model folder holds one") from None
        report = prepare_data(args.input, tokenizer_dir, args.out,
                              d.max_len if args.max_len is None else args.max_len, args.overlong or d.overlong,
                              template_setting(cfg) if args.chat_template is None else args.chat_template,
                              kwargs, args.format or d.format,
                              d.max_row_bytes if args.max_row_bytes is None else args.max_row_bytes,
                              max_bad_share)
    except DataError as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    if warning := report.check_bad_share(args.input, max_bad_share):
        print(f"prepare-data: warning: {warning}", file=sys.stderr)
    print(f"wrote {args.out} (bad rows listed in {os.path.join(args.out, 'bad_rows.jsonl')})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tokenize a chat file (JSONL or Parquet) into a prepared folder.")
    add_arguments(parser)
    parser.add_argument("-c", "--config", default="", help="YAML config whose data section gives the defaults")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config or None, args.set)
    except ConfigError as e:
        print(f"prepare-data: config error: {e}", file=sys.stderr)
        return 2
    return run(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
