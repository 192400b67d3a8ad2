"""`dfpipe regenerate`: replace every assistant turn of a chat dataset with the target's own answer.

A drafter learns to predict what the target *will* say when serving. Human- or other-model-written
responses teach it a distribution the target never produces, and a template or thinking-mode mismatch
between training data and serving costs acceptance. So each conversation is walked turn by turn: for
every assistant turn, the conversation so far (system / user / tool turns and the *regenerated* earlier
assistant turns) goes to an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang,
`transformers serve`), and the answer (content, `reasoning_content`, tool calls) takes the turn's place.
Tool turns are kept as they are: they answer the original turn's calls, which a regenerated turn may
not repeat word for word.

Files (one JSON object per line):
    <out>               {"input_index": i, "messages": [...], ...other keys of input row i}
    <out>.failed.jsonl  {"input_index": i, "stage": "input" | "request", "error": "...", "attempts": n}
    <out>.meta.json     what shaped the responses (input digest, model, sampling, template kwargs)

A finished run puts every non-blank input line in exactly one of the two JSONL files. Each row is
written with one append + flush, so a killed run leaves at most a partial last line; a rerun drops that
line, skips the indices already present in either file and does the rest: no row is done twice. Rows
are written in completion order (`input_index` names the input row). `--retry-failed` clears the
failed file first so its rows are tried again.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from common.metrics import ProgressLines

if TYPE_CHECKING:
    import httpx2
# httpx2 is imported where requests are made, not here: `dfpipe` builds every subcommand's parser
# from this module, and the services (trainer, target server) must not need an HTTP client.

INDEX_KEY = "input_index"
BACKOFF_CAP_S = 60.0


def retryable(status: int) -> bool:
    """Worth another attempt: the server (or a proxy) is overloaded, restarting or timed out. Any other
    4xx means the request itself is wrong (unknown model, context too long): retrying cannot help."""
    return status >= 500 or status in (408, 429)


class RegenerateError(Exception):
    """A problem that stops the whole run (bad arguments, an output written with other settings)."""


# ---------------------------------------------------------------------------------------------
# Input rows -> OpenAI messages.
# MINIMAL NORMALISER, local to this command: OpenAI `messages` and ShareGPT `conversations` only.
# Replace with the shared reader of target_server/data/ (chats.py) once prepare-data offers one.
# ---------------------------------------------------------------------------------------------

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system", "tool": "tool",
                  "function": "tool", "observation": "tool", "function_response": "tool"}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def normalise_row(row: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, the row's other keys) for one parsed input row; ValueError says why a row is unusable."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    rest = {k: v for k, v in row.items() if k not in ("messages", "conversations", INDEX_KEY)}
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list):
            raise ValueError("'messages' is not a list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ValueError(f"messages[{i}]: expected an object with a role in {sorted(ROLES)}")
        messages = [dict(m) for m in messages]
    elif "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise ValueError("'conversations' is not a list")
        messages = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("value"), str):
                raise ValueError(f"conversations[{i}]: expected an object with a string 'value'")
            role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower())
            if role is None:
                raise ValueError(f"conversations[{i}]: unknown 'from' {t.get('from')!r}; "
                                 f"known: {sorted(SHAREGPT_ROLES)}")
            messages.append({"role": role, "content": t["value"]})
    else:
        raise ValueError("neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn to regenerate")
    return messages, rest


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------

@dataclass
class Settings:
    """Everything that shapes a request. `content_key()` is what must not change across a resume."""
    endpoint: str
    model: str
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str = ""
    timeout_s: float = 600.0
    retries: int = 5
    backoff_s: float = 1.0

    def content_key(self) -> dict[str, Any]:
        keys = ("model", "temperature", "top_p", "max_tokens", "seed", "chat_template_kwargs", "extra_body")
        return {k: v for k, v in asdict(self).items() if k in keys}


class RequestFailed(Exception):
    def __init__(self, message: str, attempts: int):
        super().__init__(message)
        self.attempts = attempts


def base_url(endpoint: str) -> str:
    """The OpenAI base URL: `http://host:8000` and `http://host:8000/v1` both mean the latter."""
    import httpx2

    url = httpx2.URL(endpoint)
    if not url.scheme or not url.host:
        raise RegenerateError(f"--endpoint {endpoint!r} is not an http(s) URL, e.g. http://localhost:8000/v1")
    path = url.path.rstrip("/")
    return str(url.copy_with(path=path or "/v1")).rstrip("/")


def request_body(s: Settings, messages: list[dict[str, Any]], tools: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": s.model, "messages": messages}
    for key in ("temperature", "top_p", "max_tokens", "seed"):
        if (value := getattr(s, key)) is not None:  # unset: the server's default (vLLM: generation_config.json)
            body[key] = value
    if s.chat_template_kwargs:
        # vLLM, SGLang and `transformers serve` all read this request field and pass it to the template.
        body["chat_template_kwargs"] = s.chat_template_kwargs
    if tools:
        body["tools"] = tools
    body.update(s.extra_body)
    return body


def _error_text(resp: httpx2.Response) -> str:
    """`HTTP <status>: <the server's message>` (FastAPI says `detail`, vLLM and SGLang say `error`)."""
    try:
        detail = resp.json()
    except ValueError:
        detail = resp.text
    if isinstance(detail, dict):
        detail = detail.get("detail") or detail.get("error") or detail
    return f"HTTP {resp.status_code}: {str(detail)[:500]}"


def _retry_delay(s: Settings, attempt: int, resp: httpx2.Response | None) -> float:
    """Exponential backoff with full jitter; a server's Retry-After (seconds) wins when it asks for longer."""
    delay = random.uniform(0, min(BACKOFF_CAP_S, s.backoff_s * 2 ** attempt))
    if resp is not None:
        with contextlib.suppress(ValueError):
            delay = max(delay, min(BACKOFF_CAP_S, float(resp.headers.get("retry-after", ""))))
    return delay


async def chat(client: httpx2.AsyncClient, s: Settings, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the assistant message, finish_reason) for one request, retried on connection errors and `retryable`
    statuses with exponential backoff."""
    import httpx2

    attempts = 0
    while True:
        attempts += 1
        resp = None
        try:
            resp = await client.post("/chat/completions", json=body)
            if resp.status_code == 200:
                break
            error = _error_text(resp)
            if not retryable(resp.status_code):
                raise RequestFailed(error, attempts)
        except httpx2.TransportError as e:  # refused, reset, timed out: the server may come back
            error = f"{type(e).__name__}: {e}"
        except httpx2.HTTPError as e:  # a redirect loop, an undecodable body: not transient
            raise RequestFailed(f"{type(e).__name__}: {e}", attempts) from None
        if attempts > s.retries:
            raise RequestFailed(f"{error} (gave up after {attempts} attempts)", attempts)
        await asyncio.sleep(_retry_delay(s, attempts - 1, resp))
    try:
        choice = resp.json()["choices"][0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise RequestFailed(f"malformed response ({type(e).__name__}: {e}): {resp.text[:300]}", attempts) from None
    return message, str(choice.get("finish_reason") or "")


def regenerated_turn(message: dict[str, Any]) -> dict[str, Any]:
    """The stored assistant turn: content plus the reasoning and tool calls when the server returns them."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    # SGLang and `transformers serve` say `reasoning_content`; vLLM >= 0.11 says `reasoning`.
    # Stored as `reasoning_content`, the name Qwen3-style chat templates read.
    if reasoning := message.get("reasoning_content") or message.get("reasoning"):
        turn["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return turn


async def regenerate_conversation(client: httpx2.AsyncClient, s: Settings, messages: list[dict[str, Any]],
                                  tools: Any = None) -> tuple[list[dict[str, Any]], int]:
    """(the conversation with every assistant turn replaced, how many answers hit max_tokens)."""
    out: list[dict[str, Any]] = []
    truncated = 0
    for m in messages:
        if m["role"] != "assistant":
            out.append(m)
            continue
        answer, finish_reason = await chat(client, s, request_body(s, list(out), tools))
        truncated += finish_reason == "length"
        out.append(regenerated_turn(answer))
    return out, truncated


# ---------------------------------------------------------------------------------------------
# Output files and resume
# ---------------------------------------------------------------------------------------------

def failed_path(out: str) -> str:
    return out + ".failed.jsonl"


def meta_path(out: str) -> str:
    return out + ".meta.json"


def done_indices(path: str) -> set[int]:
    """Input indices already written to `path`, after cutting a partial last line left by a killed run."""
    done: set[int] = set()
    if not os.path.exists(path):
        return done
    good_end = 0  # byte offset just past the last complete line
    with open(path, "rb") as f:  # streamed: the output of a large run does not fit in memory
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # the last line, cut short by a kill in the middle of its write
            try:
                done.add(int(json.loads(line)[INDEX_KEY]))
            except (ValueError, KeyError, TypeError):
                raise RegenerateError(f"{path}:{n} is not a row this command wrote; move the file away "
                                      f"or pick another --out") from None
            good_end += len(line)
    if (size := os.path.getsize(path)) > good_end:
        print(f"dfpipe regenerate: {path}: dropping a partial last line ({size - good_end} bytes) "
              f"left by an interrupted run", file=sys.stderr)
        os.truncate(path, good_end)
    return done


def check_meta(out: str, meta: dict[str, Any]) -> None:
    """Write `<out>.meta.json`, or, when resuming, refuse settings that would mix two kinds of responses."""
    path = meta_path(out)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        # The input's path is provenance only: a moved file with the same digest is the same input.
        diff = {k: (old.get(k), meta.get(k)) for k in sorted(set(old) | set(meta))
                if k != "input" and old.get(k) != meta.get(k)}
        if diff:
            raise RegenerateError(f"{out} was started with other settings (earlier, now): {diff}; "
                                  f"resume with the same input and settings, or pick another --out")
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def input_rows(path: str) -> Iterator[tuple[int, str]]:
    """(index, line) per non-blank line; the index is the row number among non-blank lines."""
    with open(path, encoding="utf-8") as f:
        yield from enumerate(line for line in f if line.strip())


class AppendLog:
    """One JSON row per write, appended and flushed at once: a kill leaves at most a partial last line."""

    def __init__(self, path: str):
        self.f = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


@dataclass
class Summary:
    done: int = 0            # regenerated and written by this run
    failed: int = 0          # requests that failed for good (written aside)
    invalid: int = 0         # unusable input rows (written aside)
    skipped: int = 0         # already in the output or failed file from an earlier run
    truncated_turns: int = 0  # answers cut at max_tokens
    stopped: str = ""        # why the run stopped early, if it did

    def line(self) -> str:
        text = (f"regenerated {self.done} rows, failed {self.failed}, invalid input {self.invalid}, "
                f"skipped (done earlier) {self.skipped}; {self.truncated_turns} answers hit max_tokens")
        return text + (f"\nstopped early: {self.stopped}" if self.stopped else "")


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

async def _regenerate_row(client: httpx2.AsyncClient, s: Settings, index: int, line: str
                          ) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None, int]:
    """(index, output row or None, failure record or None, truncated answers)."""
    try:
        row = json.loads(line)
    except ValueError as e:
        return index, None, {INDEX_KEY: index, "stage": "input", "error": f"not JSON: {e}", "attempts": 0}, 0
    try:
        messages, rest = normalise_row(row)
    except ValueError as e:
        return index, None, {INDEX_KEY: index, "stage": "input", "error": str(e), "attempts": 0}, 0
    try:
        new, truncated = await regenerate_conversation(client, s, messages, rest.get("tools"))
    except RequestFailed as e:
        return index, None, {INDEX_KEY: index, "stage": "request", "error": str(e), "attempts": e.attempts}, 0
    return index, {INDEX_KEY: index, **rest, "messages": new}, None, truncated


async def resolve_model(client: httpx2.AsyncClient) -> str:
    """The one model the server lists, for when --model is left out."""
    import httpx2

    try:
        resp = await client.get("/models")
        resp.raise_for_status()
        ids = [m["id"] for m in resp.json()["data"]]
    except (httpx2.HTTPError, ValueError, KeyError, TypeError) as e:
        raise RegenerateError(f"--model not given and {client.base_url}/models did not list models "
                              f"({type(e).__name__}: {e})") from None
    if len(ids) != 1:
        raise RegenerateError(f"--model not given and the server lists {len(ids)} models {ids}; name one")
    return ids[0]


async def run(input_path: str, out: str, s: Settings, concurrency: int = 8, retry_failed: bool = False,
              max_consecutive_failures: int = 32, progress: bool | None = None) -> Summary:
    if concurrency < 1:
        raise RegenerateError("--concurrency must be at least 1")
    if not os.path.isfile(input_path):
        raise RegenerateError(f"input {input_path!r} is not a file")
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    import httpx2

    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=base_url(s.endpoint), headers=headers, limits=limits,
                                  timeout=httpx2.Timeout(s.timeout_s, connect=min(30.0, s.timeout_s))) as client:
        if not s.model:
            s.model = await resolve_model(client)
        from target_server.data import file_sha256
        check_meta(out, {"input": os.path.abspath(input_path), "input_sha256": file_sha256(input_path),
                         **s.content_key()})
        if retry_failed and os.path.exists(failed_path(out)):
            os.remove(failed_path(out))  # its rows are in neither file now, so this run does them again
        skip = done_indices(out) | done_indices(failed_path(out))
        total = sum(1 for _ in input_rows(input_path))
        return await _run_rows(client, s, input_path, out, skip, total, concurrency,
                               max_consecutive_failures, progress)


async def _run_rows(client: httpx2.AsyncClient, s: Settings, input_path: str, out: str, skip: set[int],
                    total: int, concurrency: int, max_consecutive_failures: int,
                    progress: bool | None) -> Summary:
    from tqdm import tqdm

    summary = Summary(skipped=len(skip & set(range(total))))
    outputs, failures = AppendLog(out), AppendLog(failed_path(out))
    # disable=None: a bar on a terminal, nothing in a log file.
    bar = tqdm(total=total, initial=summary.skipped, unit="row", desc="regenerate", dynamic_ncols=True,
               disable=None if progress is None else not progress)
    # no bar (a log file, a pipe) and not told to be quiet: a plain line now and then, with the time left
    lines = ProgressLines("dfpipe regenerate", "rows", total, summary.skipped) if bar.disable and progress is None else None
    pending: set[asyncio.Task] = set()
    consecutive_failures = 0
    rows = (r for r in input_rows(input_path) if r[0] not in skip)
    try:
        while True:
            # Keep `concurrency` conversations in flight; read the input lazily so memory stays flat.
            while len(pending) < concurrency and not summary.stopped and (nxt := next(rows, None)) is not None:
                pending.add(asyncio.ensure_future(_regenerate_row(client, s, *nxt)))
            if not pending:
                break
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                index, row, failure, truncated = task.result()
                if row is not None:
                    outputs.write(row)
                    summary.done += 1
                    summary.truncated_turns += truncated
                    consecutive_failures = 0
                else:
                    failures.write(failure)
                    if failure["stage"] == "input":
                        summary.invalid += 1
                    else:
                        summary.failed += 1
                        consecutive_failures += 1
                        # A dead endpoint would otherwise turn the whole dataset into failure records;
                        # stopping leaves the rest undone, and a rerun picks them up.
                        if max_consecutive_failures and consecutive_failures >= max_consecutive_failures \
                                and not summary.stopped:
                            summary.stopped = (f"{consecutive_failures} conversations in a row failed, last: "
                                               f"{failure['error']}; fix the endpoint and rerun to resume")
                bar.update(1)
                if lines is not None:
                    lines.update(1)
    finally:
        for task in pending:
            task.cancel()
        bar.close()
        outputs.close()
        failures.close()
    return summary


def parse_json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError as e:
        raise RegenerateError(f"{option}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise RegenerateError(f"{option}: expected a JSON object, got {type(value).__name__}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="chat JSONL: OpenAI {\"messages\": [...]} or ShareGPT "
                                                  "{\"conversations\": [{\"from\", \"value\"}]} rows")
    p.add_argument("--out", required=True, help="output JSONL (OpenAI messages); reruns resume it")
    p.add_argument("--endpoint", default="http://localhost:8000/v1",
                   help="OpenAI-compatible base URL of the server running the target (default: %(default)s)")
    p.add_argument("--model", default="", help="model name to request (default: the one the server lists)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="bearer token, if the server wants one (default: $OPENAI_API_KEY)")
    p.add_argument("--temperature", type=float, default=None, help="default: the server's")
    p.add_argument("--top-p", type=float, default=None, help="default: the server's")
    p.add_argument("--max-tokens", type=int, default=None, help="per answer (default: the server's)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat-template-kwargs", default="",
                   help="JSON object for the chat template, e.g. '{\"enable_thinking\": false}': use what "
                        "the target will serve with")
    p.add_argument("--extra-body", default="",
                   help="JSON object merged into each request, e.g. '{\"top_k\": 20}' for vLLM/SGLang")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight (default: %(default)s)")
    p.add_argument("--retries", type=int, default=5,
                   help="extra attempts per request on connection errors, 5xx and 429 (default: %(default)s)")
    p.add_argument("--backoff", type=float, default=1.0,
                   help="base seconds of the exponential backoff between attempts (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    p.add_argument("--max-consecutive-failures", type=int, default=32,
                   help="stop after this many conversations fail in a row, 0: never (default: %(default)s)")
    p.add_argument("--retry-failed", action="store_true",
                   help="try the rows of <out>.failed.jsonl again instead of skipping them")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: a bar on a terminal; otherwise a line with the time left every 30 s)")


def main(args: argparse.Namespace) -> int:
    """Exit 0 when every input row is in the output, 1 when some are failed, invalid or left undone."""
    try:
        settings = Settings(
            endpoint=args.endpoint, model=args.model, temperature=args.temperature, top_p=args.top_p,
            max_tokens=args.max_tokens, seed=args.seed,
            chat_template_kwargs=parse_json_object(args.chat_template_kwargs, "--chat-template-kwargs"),
            extra_body=parse_json_object(args.extra_body, "--extra-body"),
            api_key=args.api_key, timeout_s=args.timeout, retries=max(0, args.retries), backoff_s=args.backoff)
        summary = asyncio.run(run(args.input, args.out, settings, concurrency=args.concurrency,
                                  retry_failed=args.retry_failed,
                                  max_consecutive_failures=args.max_consecutive_failures,
                                  progress=args.progress))
    except RegenerateError as e:
        print(f"dfpipe regenerate: {e}", file=sys.stderr)
        return 2
    print(f"dfpipe regenerate: {summary.line()}", file=sys.stderr)
    left_out = summary.failed + summary.invalid
    if os.path.exists(failed_path(args.out)):
        left_out = len(done_indices(failed_path(args.out)))  # this run's and earlier runs' failures
    if left_out or summary.stopped:
        print(f"dfpipe regenerate: {left_out} rows are in {failed_path(args.out)}, not in {args.out}"
              + ("; rerun to do the rest" if summary.stopped else "; rerun with --retry-failed to try them again"),
              file=sys.stderr)
        return 1
    print(f"dfpipe regenerate: wrote {args.out}", file=sys.stderr)
    return 0
