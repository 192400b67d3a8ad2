"""Reading rows: JSONL lines or Parquet rows -> objects, or the reason one is unusable, within the
row limits (max_row_bytes, MAX_ROW_DEPTH); and the account of every row (`PrepareReport`)."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

from common.config import DataConfig

ROW_FORMATS = {"openai": "messages", "sharegpt": "conversations"}  # format -> the row key holding the turns
EXPECTED_FORMATS = (
    "one conversation per JSONL line or Parquet row, in one of:\n"
    '  openai:   {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}\n'
    '  sharegpt: {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}'
)
# Deeper rows are bad rows. Chat rows and their tool schemas nest a few tens of levels at most; the
# parsers and templates that walk a row recurse once per level, against Python's recursion limit (1000).
MAX_ROW_DEPTH = 100


class DataError(ValueError):
    """A prepared folder or a prepare-data input that cannot be used; the message says which file and why."""


class TooManyBadRows(DataError):
    """More of a source's rows are bad than data.max_bad_share allows: a file mostly bad is the wrong
    file or a broken export, and training on its few good rows would hide that."""


@dataclass
class PrepareReport:
    """What prepare-data did with every source row.

    rows = kept + len(bad). `truncated` and `split` count kept rows (a split row yields several
    documents); `multi_view` counts kept rows the template rendered as several views (package
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
        return {**self.__dict__, "bad": [list(b) for b in self.bad]}


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
    """(value, "") for JSON text, else (None, reason): not JSON, nested deeper than MAX_ROW_DEPTH, or a
    number with more digits than Python converts."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e.msg} at column {e.colno}"
    except RecursionError:   # the C parser's, near 1000 levels; shallower depths are measured below
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
