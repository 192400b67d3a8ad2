"""Chats: rows in the openai or sharegpt format -> conversations (roles, tool calls, control tokens),
the chat template that renders them into views with the spans the assistant generated, and their
tokenization, cut to the tokens a document keeps (the proven-prefix cut, the long-word cap)."""
from __future__ import annotations

import inspect
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from common.config import DataConfig
from target_server.data.rows import DataError, ROW_FORMATS, _parse_json, _source_rows, detect_format

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "observation": "tool"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # the names transformers reads as reasoning
# A view's text tokenized under truncate/skip is first cut to (max_len + 1) * this many characters,
# and cut again 4x longer while that holds too few tokens (`_encode_views`): most tokens are shorter.
_CHARS_PER_TOKEN = 8


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON value (tool calls, tool schemas)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (dict, list)):
        for v in value.values() if isinstance(value, dict) else value:
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
        if reason := _tool_calls(m["tool_calls"], i):
            return None, reason
        out["tool_calls"] = m["tool_calls"]
        content = "" if content is None else content  # OpenAI: content is null beside tool calls
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)  # OpenAI content parts, text only
    if not isinstance(content, str):
        return None, f"invalid content: message {i} content is {type(content).__name__}, not a string"
    out["content"] = content
    if (reasoning := next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)) is not None:
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
                if hit := control_tokens.search(text):
                    # The template would tokenize it as the real control token and corrupt turn boundaries.
                    return None, f"control token in content: message {i} contains {hit.group(0)!r}"
        if hit := next((h for h in map(control_tokens.search, _strings(tools)) if h), None):
            return None, f"control token in content: tools contain {hit.group(0)!r}"
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        return None, "no assistant turn"
    if messages[0]["role"] == "assistant":
        return None, "assistant turn without a prompt: message 0 is the assistant's"
    return Conversation(messages, tools), ""


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
    if clash := sorted(set(kwargs) & (own - {"kwargs"})):
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
    """Renders conversations with one template and its variables; finds the generated spans (package docstring)."""

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


# Characters a split view is tokenized in at a time (`_encode_in_pieces`): at about 400 bytes a
# character of tokenizer memory, ~100 MB, where a 16 MiB answer tokenized whole took 4.7 GB.
SPLIT_PIECE = 1 << 18


class _PieceMismatch(ValueError):
    """A piece started mid-text tokenized its first word unlike the piece before it."""


def _encode_in_pieces(tokenizer: Any, text: str, reach: int, piece: int) -> tuple[np.ndarray, np.ndarray]:
    """Every token of `text` (ids [n], offsets into it [n, 2]), tokenizing at most `piece` characters at a time.

    Of each piece the tokens `_unchanged_by_cut` proves are the whole text's are kept, and the next
    piece starts where the first unproven one starts: a word (or added token) start, from which a
    pre-tokenizer's scan goes on as over the whole text (its regex looks ahead, never behind). A
    tokenizer for which that does not hold (one that marks a text's first word, as a prefix space
    does) shows it on the word the two pieces share: that raises _PieceMismatch, and the caller
    tokenizes the text whole. A piece in which no word is proven (no pre-tokenizer, or one word
    longer than the piece) raises it too."""
    ids: list[np.ndarray] = []        # per piece, as arrays: 4M tokens as Python ints and tuples took ~600 MB
    offsets: list[np.ndarray] = []
    start, expected = 0, None
    while True:
        end = min(len(text), start + piece)
        enc = tokenizer([text[start:end]], add_special_tokens=False, return_offsets_mapping=True)
        p_ids, p_off = enc["input_ids"][0], enc["offset_mapping"][0]
        if expected is not None and (not p_ids or (p_ids[0], p_off[0][1] + start) != expected):
            raise _PieceMismatch(f"the piece at character {start} begins unlike the piece before it")
        take = len(p_ids) if end == len(text) else _unchanged_by_cut(enc.word_ids(0), p_off, end - start, reach)
        if take == 0 or (end < len(text) and take >= len(p_ids)):
            raise _PieceMismatch(f"no token proven in the piece at character {start}")
        ids.append(np.asarray(p_ids[:take], dtype=np.int64))
        offsets.append(np.asarray(p_off[:take], dtype=np.int64).reshape(-1, 2) + start)
        if end == len(text):
            return np.concatenate(ids), np.concatenate(offsets)
        expected = (p_ids[take], p_off[take][1] + start)      # the shared word's first token, as this piece has it
        start += p_off[take][0]


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
    # under split a long view is tokenized in pieces (`_encode_in_pieces`), the rest in one batch
    pieced = {i for i, (text, _) in enumerate(views) if keep is None and len(text) > SPLIT_PIECE}
    encoded = tokenizer([t if i not in pieced else "" for i, t in enumerate(texts)], add_special_tokens=False,
                        return_offsets_mapping=True)
    out = []
    for i, ((text, spans), cut) in enumerate(zip(views, texts)):
        ids, offsets, size = encoded["input_ids"][i], encoded["offset_mapping"][i], len(cut)
        if i in pieced:
            try:
                ids, offsets = _encode_in_pieces(tokenizer, text, reach, SPLIT_PIECE)
            except _PieceMismatch:
                whole_text = tokenizer([text], add_special_tokens=False, return_offsets_mapping=True)
                ids, offsets = whole_text["input_ids"][0], whole_text["offset_mapping"][0]
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
