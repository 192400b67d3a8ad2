"""prepare-data: chat JSONL -> a tokenized, memory-mappable folder; and its reader.

Prepared folder (one per dataset; every array is a plain `.npy`, so `np.load(mmap_mode="r")` opens
it in microseconds and the OS page cache shares it between processes):

    <out_dir>/
      input_ids.npy    int32  [T]    the documents' tokens, back to back
      loss_mask.npy    uint8  [T]    1 on tokens the drafter learns (the chat template's generation span)
      offsets.npy      int64  [N+1]  document i is tokens [offsets[i], offsets[i+1]); offsets[0] = 0
      sample_ids.npy   int64  [N]    0-based line of the source row (a split row repeats its id)
      meta.json                      format/version, source and tokenizer (paths + digests), counts,
                                     max_len, overlong policy, the PrepareReport
      bad_rows.jsonl                 one {"line", "sample_id", "reason"} per rejected row

    input_ids   | doc 0 ........ | doc 1 .... | doc 2 ............ |
    offsets     0                a            b                    T

Source rows are numbered two ways, both written down: `sample_id` is the 0-based line index
(stable across re-preparation, whatever else changes in the file below it); report `line`
numbers are 1-based, as an editor or `sed -n 'Lp'` shows them, so `line == sample_id + 1`.

No row is ever dropped without a trace: every line is either kept (perhaps truncated or split,
both counted) or listed in the report with its line number and the reason.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

import numpy as np

from common.config import Config

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
ROLES = ("system", "user", "assistant", "tool")
# Files that define a tokenizer (hashed into meta.json); a model folder's weights are not among them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_ENCODE_BATCH = 256


class DataError(ValueError):
    """A prepared folder or a prepare-data input that cannot be used; the message says which file and why."""


# ----------------------------------------------------------------------------------------------
# The report


@dataclass
class PrepareReport:
    """What prepare-data did with every source row.

    rows = kept + len(bad). `truncated` and `split` count kept rows (a split row yields several
    documents); `pieces_dropped` counts split pieces without a single loss token (they would cost
    target compute and teach nothing).
    """

    rows: int = 0
    kept: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)  # (1-based line, reason)
    truncated: int = 0
    split: int = 0
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
        if self.pieces_dropped:
            parts.append(f"{self.pieces_dropped} split pieces without loss tokens dropped")
        for kind, lines in sorted(self.reasons().items()):
            shown = ", ".join(map(str, lines[:8])) + (", ..." if len(lines) > 8 else "")
            parts.append(f"  {len(lines)} x {kind} (line {shown})")
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["bad"] = [list(b) for b in self.bad]
        return d


# ----------------------------------------------------------------------------------------------
# Row validation: raw line -> messages, or the reason it is unusable


def _parse_row(raw: bytes, control_tokens: re.Pattern[str] | None) -> tuple[list[dict[str, str]] | None, str]:
    """(messages, "") for a usable row, else (None, reason)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8: byte {e.start}"
    if not text.strip():
        return None, "empty line"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e.msg} at column {e.colno}"
    if not isinstance(row, dict):
        return None, f"not a JSON object: got {type(row).__name__}"
    if "messages" not in row:
        return None, "missing 'messages'"
    messages = row["messages"]
    if not isinstance(messages, list):
        return None, f"invalid 'messages': expected a list, got {type(messages).__name__}"
    if not messages:
        return None, "invalid 'messages': empty list"
    cleaned: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return None, f"invalid message: message {i} is a {type(m).__name__}, not an object"
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            return None, f"invalid role: message {i} role is {type(role).__name__}, not a string"
        if role not in ROLES:
            return None, f"invalid role: message {i} role {role!r} is not one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return None, f"invalid content: message {i} content is {type(content).__name__}, not a string"
        if control_tokens is not None:
            hit = control_tokens.search(content)
            if hit:
                # The template would tokenize it as the real control token and corrupt turn boundaries.
                return None, f"control token in content: message {i} contains {hit.group(0)!r}"
        cleaned.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in cleaned):
        return None, "no assistant turn"
    return cleaned, ""


def _read_lines(f: BinaryIO, digest: Any) -> Iterator[tuple[int, bytes]]:
    """(1-based line, bytes without the line ending). Binary on purpose: only b'\\n' ends a row
    (text mode would also split at a lone '\\r', shifting every later line number)."""
    for number, raw in enumerate(f, start=1):
        digest.update(raw)
        yield number, raw.rstrip(b"\r\n")


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


def _file_sha256(path: str) -> str:
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
            h.update(name.encode() + b"\0" + _file_sha256(path).encode())
    return h.hexdigest()


def _load_tokenizer(tokenizer_dir: str) -> Any:
    if not os.path.isdir(tokenizer_dir):
        raise DataError(f"tokenizer folder not found: {tokenizer_dir}")
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # transformers raises many types for an unusable folder
        raise DataError(f"cannot load a tokenizer from {tokenizer_dir}: {e}") from e


def _resolve_template(tokenizer: Any, chat_template: str | None, tokenizer_dir: str) -> str:
    template = chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    template = template if template is not None else getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise DataError(f"{tokenizer_dir}: tokenizer has no chat template; pass chat_template=")
    if not _GENERATION_TAG.search(template):
        # Without it transformers returns an all-zero assistant mask: every row would be rejected.
        raise DataError(f"the chat template of {tokenizer_dir} has no {{% generation %}} block, so it cannot "
                        "mark assistant tokens; pass chat_template= (e.g. target_server.tokenizer.CHAT_TEMPLATE "
                        "adapted to the target's format)")
    return template


def _control_token_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    specials |= set(getattr(tokenizer, "all_special_tokens", []))
    specials.discard("")
    if not specials:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))


def _encode(tokenizer: Any, template: str, conversations: list[list[dict[str, str]]]
            ) -> list[tuple[np.ndarray, np.ndarray] | str]:
    """Token ids and loss masks for each conversation, or the template's error for that one."""
    def run(batch: list[list[dict[str, str]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = tokenizer.apply_chat_template(batch, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return [(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8))
                for ids, mask in zip(out["input_ids"], out["assistant_masks"])]

    try:
        return list(run(conversations))
    except Exception:
        # One row broke the batch (a template `raise_exception`, say): find it, keep the others.
        results: list[tuple[np.ndarray, np.ndarray] | str] = []
        for conversation in conversations:
            try:
                results.append(run([conversation])[0])
            except Exception as e:
                results.append(f"template error: {type(e).__name__}: {e}")
        return results


def _documents(ids: np.ndarray, mask: np.ndarray, max_len: int, overlong: str, report: PrepareReport
               ) -> list[tuple[np.ndarray, np.ndarray]] | str:
    """The documents one encoded row becomes under the overlong policy, or the reason it becomes none."""
    if len(ids) == 0:
        return "empty: the template produced no tokens"
    if not mask.any():
        return "no assistant tokens"
    if len(ids) <= max_len:
        return [(ids, mask)]
    if overlong == "skip":
        return f"longer than max_len: {len(ids)} > {max_len} tokens"
    if overlong == "truncate":
        if not mask[:max_len].any():
            return f"no assistant tokens after truncation: all of them lie beyond max_len {max_len}"
        report.truncated += 1
        return [(ids[:max_len], mask[:max_len])]
    pieces = [(ids[s:s + max_len], mask[s:s + max_len]) for s in range(0, len(ids), max_len)]
    useful = [p for p in pieces if p[1].any()]
    report.split += 1
    report.pieces_dropped += len(pieces) - len(useful)
    return useful


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


def prepare_data(jsonl_path: str, tokenizer_dir: str, out_dir: str, max_len: int, overlong: str = "truncate",
                 chat_template: str | None = None) -> PrepareReport:
    """Tokenize a chat JSONL file into a prepared folder (layout in the module docstring).

    chat_template: a Jinja template (or a path to one) used instead of the tokenizer's own; it must
    wrap assistant content in {% generation %}. Bad rows are counted and listed, never fatal;
    a missing input, an unusable tokenizer or bad arguments raise DataError.
    """
    if overlong not in OVERLONG_POLICIES:
        raise DataError(f"overlong must be one of {', '.join(OVERLONG_POLICIES)}, got {overlong!r}")
    if max_len < 2:
        raise DataError(f"max_len must be at least 2 tokens, got {max_len}")
    if not os.path.isfile(jsonl_path):
        raise DataError(f"input file not found: {jsonl_path}")
    out_dir = os.path.normpath(out_dir)
    tokenizer = _load_tokenizer(tokenizer_dir)
    template = _resolve_template(tokenizer, chat_template, tokenizer_dir)
    control_tokens = _control_token_pattern(tokenizer)

    tmp = _prepare_out_dir(out_dir)
    report = PrepareReport()
    writers = {name: _ArrayWriter(os.path.join(tmp, f"{name}.npy"), ARRAYS[name]) for name in ("input_ids", "loss_mask")}
    offsets, sample_ids = [0], []
    max_token_id = -1
    source_digest = hashlib.sha256()

    def flush(pending: list[tuple[int, list[dict[str, str]]]]) -> None:
        nonlocal max_token_id
        if not pending:
            return
        encoded = _encode(tokenizer, template, [conversation for _, conversation in pending])
        for (line, _), result in zip(pending, encoded):
            docs = result if isinstance(result, str) else _documents(*result, max_len, overlong, report)
            if isinstance(docs, str):
                report.bad.append((line, docs))
                continue
            report.kept += 1
            for ids, mask in docs:
                writers["input_ids"].append(ids)
                writers["loss_mask"].append(mask)
                offsets.append(offsets[-1] + len(ids))
                sample_ids.append(line - 1)
                report.loss_tokens += int(mask.sum())
                max_token_id = max(max_token_id, int(ids.max()))
        pending.clear()

    try:
        pending: list[tuple[int, list[dict[str, str]]]] = []
        with open(jsonl_path, "rb") as f:
            for line, raw in _read_lines(f, source_digest):
                report.rows += 1
                messages, reason = _parse_row(raw, control_tokens)
                if messages is None:
                    # Rows reach the report in file order: flush what is pending before this one.
                    flush(pending)
                    report.bad.append((line, reason))
                    continue
                pending.append((line, messages))
                if len(pending) >= _ENCODE_BATCH:
                    flush(pending)
            flush(pending)
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
            "source": os.path.abspath(jsonl_path), "source_sha256": source_digest.hexdigest(),
            "tokenizer": os.path.abspath(tokenizer_dir), "tokenizer_sha256": tokenizer_digest(tokenizer_dir),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            "vocab_size": len(tokenizer), "max_token_id": max_token_id,
            "max_len": max_len, "overlong": overlong,
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
        return len(self.sample_ids)

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
    if cfg.target.tokenizer:
        return cfg.resolve(cfg.target.tokenizer)
    model = cfg.resolve(cfg.target.model)
    if not model.startswith("builtin:") and os.path.isfile(os.path.join(model, "tokenizer_config.json")):
        return model
    raise DataError(f"data.{source} is a chat file but no tokenizer is known: set target.tokenizer "
                    f"(target.model {cfg.target.model!r} has no tokenizer folder)")


def ensure_prepared(cfg: Config, source: str = "train_path") -> PreparedDataset:
    """The data set named by `data.<source>` (train_path, or heldout_path for the held-out batches): a
    prepared folder as it is, or a chat .jsonl prepared once into <target.cache_dir>/data/<name>-<key>/,
    key = digest of (file bytes, tokenizer files, max_len, overlong, format version); a later start
    with the same inputs reuses it."""
    path = cfg.resolve(getattr(cfg.data, source))
    if not path:
        raise DataError(f"data.{source} is empty: name a prepared folder or a chat .jsonl file")
    if os.path.isdir(path):
        return PreparedDataset.open(path)
    if not os.path.isfile(path):
        raise DataError(f"data.{source} not found: {path}")
    tokenizer_dir = _tokenizer_for(cfg, source)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, _file_sha256(path), tokenizer_digest(tokenizer_dir),
                                     cfg.data.max_len, cfg.data.overlong]).encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(path))[0]
    out_dir = os.path.join(cfg.resolve(cfg.target.cache_dir), "data", f"{name}-{key}")
    if os.path.isfile(os.path.join(out_dir, "meta.json")):
        try:
            return PreparedDataset.open(out_dir)
        except DataError as e:
            log.warning("prepared cache %s unusable (%s); preparing again", out_dir, e)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    report = prepare_data(path, tokenizer_dir, out_dir, cfg.data.max_len, cfg.data.overlong)
    log.info("prepared %s -> %s\n%s", path, out_dir, report.summary())
    if report.bad:
        log.warning("%d bad rows in %s, listed in %s", len(report.bad), path, os.path.join(out_dir, "bad_rows.jsonl"))
    if report.documents == 0:
        raise DataError(f"{path}: no usable rows\n{report.summary()}")
    return PreparedDataset.open(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tokenize a chat JSONL file into a prepared dataset folder.")
    parser.add_argument("--jsonl", required=True, help="chat JSONL: one {\"messages\": [...]} per line")
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (the target's)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--max-len", type=int, default=3072)
    parser.add_argument("--overlong", choices=OVERLONG_POLICIES, default="truncate")
    parser.add_argument("--chat-template", default=None, help="Jinja template (file) with {% generation %}")
    args = parser.parse_args(argv)
    try:
        report = prepare_data(args.jsonl, args.tokenizer, args.out, args.max_len, args.overlong, args.chat_template)
    except DataError as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    print(f"wrote {args.out} (bad rows listed in {os.path.join(args.out, 'bad_rows.jsonl')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
