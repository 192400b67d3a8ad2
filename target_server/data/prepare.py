"""Preparing: a chat file -> a prepared folder, written aside and swapped into place (`prepare_data`);
and the data set a config names, prepared once into the target's cache (`ensure_prepared`)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from common.config import Config, ConfigError, DataConfig
from common.metrics import ProgressLines
from common.preflight import tokenizer_folder
from target_server.data.chats import (ChatRows, View, _check_template_kwargs, _control_token_pattern, _encode_rows,
                                      _Encoded, _is_inline, _load_tokenizer, _Renderer, _resolve_template,
                                      _special_tokens, read_chat_template, word_cap)
from target_server.data.prepared import ARRAYS, FORMAT, FORMAT_VERSION, PreparedDataset
from target_server.data.rows import (ROW_FORMATS, DataError, PrepareReport, TooManyBadRows, no_usable_rows,
                                     source_row_count)

log = logging.getLogger(__name__)

OVERLONG_POLICIES = ("truncate", "split", "skip")
# Files that define a tokenizer (hashed into meta.json); a model folder's weights are not among them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
_ENCODE_BATCH = 256


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
        starts = range(0, len(v.ids), max_len) if overlong == "split" and len(v.ids) > max_len else (0,)
        pieces = [(v.ids[s:s + max_len], v.mask[s:s + max_len]) for s in starts]
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


def _check_arguments(source_path: str, max_len: int, overlong: str, row_format: str, max_row_bytes: int,
                     max_bad_share: float) -> None:
    """DataError for a setting prepare-data cannot work with, or a missing input."""
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


class _Progress:
    """Rows read: a bar on a terminal; in a log file (a target server preparing at start) a line every 30 s."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, unit="row", desc="prepare-data", dynamic_ncols=True, disable=None)
        self.lines = ProgressLines("prepare-data", "rows", total) if self.bar.disable else None
        self.reached = 0   # the last row (line) number read

    def reach(self, line: int) -> None:
        if line > self.reached:
            self.bar.update(line - self.reached)
            if self.lines is not None:
                self.lines.update(line - self.reached)
            self.reached = line


def _rendered_batches(rows: ChatRows, renderer: _Renderer, report: PrepareReport, progress: _Progress,
                      max_row_bytes: int) -> Iterator[list[tuple[int, list[View] | str]]]:
    """The rows rendered, in batches to tokenize together (a batch of long rows is smaller). Rows reach
    the report in file order: a bad row ends the batch before it, and is listed once that is taken."""
    pending: list[tuple[int, list[View] | str]] = []
    pending_chars = 0
    for line, conversation, reason in rows:
        report.rows += 1
        progress.reach(line)
        if conversation is None:
            yield pending
            pending, pending_chars = [], 0
            report.bad.append((line, reason))
            continue
        views = renderer.views(conversation)
        pending.append((line, views))
        pending_chars += 0 if isinstance(views, str) else sum(len(text) for text, _ in views)
        if len(pending) >= _ENCODE_BATCH or pending_chars > max_row_bytes:
            yield pending
            pending, pending_chars = [], 0
    yield pending


class _Folder:
    """The prepared folder being written in `tmp`: each row's documents in row order, then the arrays' ends."""

    def __init__(self, tmp: str, report: PrepareReport) -> None:
        self.tmp, self.report = tmp, report
        self.writers = {name: _ArrayWriter(os.path.join(tmp, f"{name}.npy"), ARRAYS[name])
                        for name in ("input_ids", "loss_mask")}
        self.offsets, self.sample_ids = [0], []
        self.max_token_id = -1

    def add(self, encoded: list[tuple[int, list[View] | str, list[_Encoded] | str]], max_len: int,
            overlong: str) -> None:
        """Tokenized rows: each row's documents under the overlong policy, or the row listed as bad."""
        report = self.report
        for line, views, encoding in encoded:
            docs = encoding if isinstance(encoding, str) else _documents(encoding, max_len, overlong, report)
            if isinstance(docs, str):
                report.bad.append((line, docs))
                continue
            report.kept += 1
            report.multi_view += len(views) > 1
            for ids, mask in docs:
                self.writers["input_ids"].append(ids)
                self.writers["loss_mask"].append(mask)
                self.offsets.append(self.offsets[-1] + len(ids))
                self.sample_ids.append(line - 1)
                report.loss_tokens += int(mask.sum())
                self.max_token_id = max(self.max_token_id, int(ids.max()))

    def finish(self) -> None:
        """The arrays completed and the bad rows listed (meta.json is the caller's)."""
        for w in self.writers.values():
            w.finish()
        np.save(os.path.join(self.tmp, "offsets.npy"), np.asarray(self.offsets, dtype=ARRAYS["offsets"]))
        np.save(os.path.join(self.tmp, "sample_ids.npy"), np.asarray(self.sample_ids, dtype=ARRAYS["sample_ids"]))
        self.report.documents, self.report.tokens = len(self.sample_ids), self.offsets[-1]
        with open(os.path.join(self.tmp, "bad_rows.jsonl"), "w", encoding="utf-8") as f:
            for line, reason in self.report.bad:
                f.write(json.dumps({"line": line, "sample_id": line - 1, "reason": reason}) + "\n")


def prepare_data(source_path: str, tokenizer_dir: str, out_dir: str, max_len: int, overlong: str = "truncate",
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 row_format: str = "auto", max_row_bytes: int = DataConfig.max_row_bytes,
                 max_bad_share: float = DataConfig.max_bad_share) -> PrepareReport:
    """Tokenize a chat JSONL or Parquet file into a prepared folder (formats, layout: package docstring).

    chat_template: a Jinja template, or a path to one, instead of the tokenizer's own;
    chat_template_kwargs: variables it reads (e.g. {"enable_thinking": False}); row_format: auto
    (the first row holding 'messages' or 'conversations' decides) | openai | sharegpt;
    max_row_bytes: a larger row (JSONL line, Parquet row) is a bad row, never parsed. Bad rows are
    counted and listed, fatal only above max_bad_share of the rows (TooManyBadRows, nothing
    written); a missing input, an unusable tokenizer or template, bad arguments or a source without
    one usable row raise DataError.
    """
    _check_arguments(source_path, max_len, overlong, row_format, max_row_bytes, max_bad_share)
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
    folder = _Folder(tmp, report)
    progress = _Progress(source_row_count(source_path))
    try:
        for batch in _rendered_batches(rows, renderer, report, progress, max_row_bytes):
            folder.add(_encode_rows(tokenizer, batch, keep, cap), max_len, overlong)
        if report.kept == 0:
            raise DataError(no_usable_rows(source_path, report))
        report.check_bad_share(source_path, max_bad_share)
        folder.finish()
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "source": os.path.abspath(source_path), "source_sha256": source_sha256, "source_format": rows.format,
            "tokenizer": os.path.abspath(tokenizer_dir), "tokenizer_sha256": tokenizer_digest(tokenizer_dir),
            "chat_template": template, "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            "chat_template_kwargs": kwargs,
            "vocab_size": len(tokenizer), "max_token_id": folder.max_token_id,
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
        progress.bar.close()
    return report


def _tokenizer_for(cfg: Config, source: str = "train_path") -> str:
    """The tokenizer a chat file is prepared with: target.tokenizer, else the (local) target model folder."""
    if found := tokenizer_folder(cfg):
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
    <target.cache_dir>/data/<name>-<key>/, key = digest of every input that can change what it holds
    (`inputs`): a later start with the same inputs reuses it, a changed template or kwarg prepares again."""
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
