"""`dfpipe regenerate` against a real OpenAI-compatible server: `transformers serve` running the tiny Qwen3.5.

The server is started once for the module, in a subprocess that blocks FLA / causal-conv1d the way
conftest.py does for this process (so a machine with FLA installed still runs the torch path on CPU).
The tiny model is greedy-decoded (temperature 0), so the expected answer of every turn can be computed
here with the same weights and compared with what the command wrote.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "configs" / "demo" / "tokenizer"
MAX_TOKENS = 6
# `transformers serve` in a child process, with FLA kept out before transformers is imported.
SERVE = ("import sys\n"
         "for mod in ('fla', 'causal_conv1d'):\n"
         "    sys.modules[mod] = None\n"
         "from transformers.cli.transformers import main\n"
         "sys.argv = ['transformers', 'serve', *sys.argv[1:]]\n"
         "sys.exit(main())\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from target_server.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("regen")
    model_dir = build_tiny_target(str(root / "tiny-qwen3.5"), arch="qwen3.5", tokenizer_dir=str(TOKENIZER))
    port = free_port()
    log_path = root / "serve.log"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, model_dir, "--device", "cpu", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve not up after 120 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield {"url": url, "model": model_dir}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def oracle(server: dict[str, str]):
    """The served weights' greedy answer to a conversation, computed in this process: (content, reasoning).

    The generated tokens come from this process's own `generate`; turning them into the message goes
    through the server's own parser (the Qwen3.5 response template: content ends at <|im_end|>, thinking
    goes to reasoning_content), since that is the message format the command stores.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.cli.serving.utils import parse_assistant_message

    tok = AutoTokenizer.from_pretrained(server["model"])
    model = AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32).eval()

    def answer(messages: list[dict]) -> tuple[str, str | None]:
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
        generated = out[0, enc["input_ids"].shape[1]:]
        content, reasoning, _ = parse_assistant_message(
            tok, model, generated, enc["input_ids"], cleaned_content=tok.decode(generated, skip_special_tokens=True))
        return content, reasoning
    return answer


def as_answer(turn: dict) -> tuple[str, str | None]:
    return turn["content"], turn.get("reasoning_content")


def regenerate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfpipe", "regenerate", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


MULTI_TURN = [
    {"id": "sys-two-turns", "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Add 2 + 3."},
        {"role": "assistant", "content": "The answer is five, as 2 + 3 = 5."},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"}]},
    {"conversations": [
        {"from": "human", "value": "Reverse this list: gray, cat, fox."},
        {"from": "gpt", "value": "fox, cat, gray."},
        {"from": "human", "value": "Now sort it."},
        {"from": "gpt", "value": "cat, fox, gray."}]},
    {"messages": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "horse, bird, cherry"},
        {"role": "user", "content": "Repeat 'brown bridge' 5 times."},
        {"role": "assistant", "content": "brown bridge brown bridge"},
        {"role": "user", "content": "Thanks."}]},
]


def test_every_assistant_turn_is_replaced_by_the_servers_answer_to_the_regenerated_conversation(
        server, oracle, tmp_path):
    src, out = tmp_path / "chat.jsonl", tmp_path / "regen.jsonl"
    write_jsonl(src, MULTI_TURN)
    # No --model: the command takes the one model the server lists. transformers serve before 5.24
    # (the release pinned for Python 3.10) answers /v1/models with a 500: then the command must say
    # so and stop, and --model names the model.
    common = ("--input", str(src), "--out", str(out), "--endpoint", server["url"], "--temperature", "0",
              "--max-tokens", str(MAX_TOKENS), "--chat-template-kwargs", '{"enable_thinking": false}',
              "--concurrency", "2")
    listed = httpx2.get(server["url"].rstrip("/") + "/v1/models", timeout=30).status_code == 200
    if not listed:
        r = regenerate(*common)
        assert r.returncode == 2 and "did not list models" in r.stderr and not out.exists(), r.stderr
    r = regenerate(*common, *(() if listed else ("--model", server["model"])))
    assert r.returncode == 0, r.stderr
    assert "regenerated 3 rows, failed 0, invalid input 0" in r.stderr
    rows = {row["input_index"]: row for row in read_jsonl(out)}
    assert sorted(rows) == [0, 1, 2] and len(read_jsonl(out)) == 3
    assert not read_jsonl(Path(f"{out}.failed.jsonl"))
    assert rows[0]["id"] == "sys-two-turns" and "conversations" not in rows[1]

    discriminating = 0
    for i, src_row in enumerate(MULTI_TURN):
        original = src_row.get("messages") or [
            {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
            for t in src_row["conversations"]]
        new = rows[i]["messages"]
        assert [m["role"] for m in new] == [m["role"] for m in original]
        for k, (old_m, new_m) in enumerate(zip(original, new)):
            if old_m["role"] != "assistant":
                assert new_m == old_m  # system / user turns kept as they were
                continue
            # The answer to the conversation so far, with the *regenerated* earlier assistant turns.
            assert as_answer(new_m) == oracle(new[:k]), (i, k)
            assert new_m["content"] != old_m["content"]
            if k > 2:  # a later turn: its answer depends on which earlier answers the prompt holds
                discriminating += oracle(new[:k]) != oracle(original[:k])
    # Without this the test could not tell regenerated from original earlier turns in the prompts.
    assert discriminating >= 1

    meta = json.loads(Path(f"{out}.meta.json").read_text())
    assert meta["chat_template_kwargs"] == {"enable_thinking": False}
    assert meta["model"] == server["model"] and meta["max_tokens"] == MAX_TOKENS


def _demo_rows(n: int) -> list[dict]:
    lines = (ROOT / "configs" / "demo" / "chat.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def test_a_killed_run_resumes_where_it_stopped_and_does_no_row_twice(server, tmp_path):
    n = 30
    src, out = tmp_path / "chat.jsonl", tmp_path / "regen.jsonl"
    write_jsonl(src, _demo_rows(n))
    args = ["--input", str(src), "--out", str(out), "--endpoint", server["url"], "--model", server["model"],
            "--temperature", "0", "--max-tokens", "2", "--concurrency", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "dfpipe", "regenerate", "--no-progress", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_bytes().count(b"\n") < 3) and proc.poll() is None:
            assert time.monotonic() < deadline, "no rows written within 60 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    before = out.read_bytes()
    done_before = before.count(b"\n")
    assert 3 <= done_before < n, "the run finished before the kill: resume was not exercised"
    # A kill in the middle of a write leaves a partial last line; simulate the worst case.
    with open(out, "ab") as f:
        f.write(b'{"input_index": 29, "messages": [{"role": "us')

    r = regenerate(*args)
    assert r.returncode == 0, r.stderr
    assert "dropping a partial last line" in r.stderr
    assert f"regenerated {n - done_before} rows" in r.stderr and f"skipped (done earlier) {done_before}" in r.stderr
    after = out.read_bytes()
    assert after.startswith(before)  # the rows done before the kill are untouched
    indices = [row["input_index"] for row in read_jsonl(out)]
    assert sorted(indices) == list(range(n))  # every row once: none lost, none done twice

    # Resuming with other sampling would mix two kinds of answers in one file: refused.
    r = regenerate(*args[:-4], "--max-tokens", "3", "--concurrency", "1")
    assert r.returncode == 2 and "other settings" in r.stderr and "max_tokens" in r.stderr
    assert out.read_bytes() == after


def test_failing_endpoints_are_retried_counted_written_aside_and_resumable(server, tmp_path):
    src, out = tmp_path / "chat.jsonl", tmp_path / "regen.jsonl"
    write_jsonl(src, _demo_rows(3) + ["not json", {"messages": [{"role": "user", "content": "no answer"}]}])
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    # A closed port: a connection error, retried with backoff, then written aside.
    r = regenerate("--input", str(src), "--out", str(out), "--endpoint", closed, "--model", server["model"],
                   "--max-tokens", "2", "--retries", "2", "--backoff", "0.01")
    assert r.returncode == 1, r.stderr
    assert "regenerated 0 rows, failed 3, invalid input 2" in r.stderr
    assert not read_jsonl(out)
    failed = {f["input_index"]: f for f in read_jsonl(Path(f"{out}.failed.jsonl"))}
    assert sorted(failed) == [0, 1, 2, 3, 4]
    for i in range(3):
        assert failed[i]["stage"] == "request" and failed[i]["attempts"] == 3, failed[i]
        assert "ConnectError" in failed[i]["error"]
    assert failed[3]["stage"] == "input" and "not JSON" in failed[3]["error"]
    assert failed[4]["stage"] == "input" and "no assistant turn" in failed[4]["error"]

    # A rerun skips rows already written aside; --retry-failed tries them again, here on the real server.
    r = regenerate("--input", str(src), "--out", str(out), "--endpoint", server["url"], "--model",
                   server["model"], "--max-tokens", "2")
    assert r.returncode == 1 and "skipped (done earlier) 5" in r.stderr
    r = regenerate("--input", str(src), "--out", str(out), "--endpoint", server["url"], "--model",
                   server["model"], "--max-tokens", "2", "--retry-failed")
    assert r.returncode == 1 and "regenerated 3 rows, failed 0, invalid input 2" in r.stderr  # input stays bad
    assert sorted(row["input_index"] for row in read_jsonl(out)) == [0, 1, 2]
    assert sorted(f["input_index"] for f in read_jsonl(Path(f"{out}.failed.jsonl"))) == [3, 4]

    # A model the server does not serve: HTTP 400, which no retry can fix, so one attempt per row.
    out2 = tmp_path / "wrong-model.jsonl"
    r = regenerate("--input", str(src), "--out", str(out2), "--endpoint", server["url"], "--model",
                   "no-such-model", "--max-tokens", "2", "--retries", "3", "--backoff", "0.01")
    assert r.returncode == 1 and "failed 3, invalid input 2" in r.stderr
    requests = [f for f in read_jsonl(Path(f"{out2}.failed.jsonl")) if f["stage"] == "request"]
    assert len(requests) == 3
    for f in requests:
        assert f["attempts"] == 1 and "HTTP 400" in f["error"] and "no-such-model" in f["error"], f

    # A dead endpoint stops the run after N failures in a row instead of writing off every row;
    # the rows it did not reach are in neither file, so a rerun does them.
    out3 = tmp_path / "outage.jsonl"
    src3 = tmp_path / "six.jsonl"
    write_jsonl(src3, _demo_rows(6))
    r = regenerate("--input", str(src3), "--out", str(out3), "--endpoint", closed, "--model", server["model"],
                   "--max-tokens", "2", "--retries", "0", "--concurrency", "1", "--max-consecutive-failures", "2")
    assert r.returncode == 1 and "stopped early: 2 conversations in a row failed" in r.stderr
    assert len(read_jsonl(Path(f"{out3}.failed.jsonl"))) == 2 and not read_jsonl(out3)
    r = regenerate("--input", str(src3), "--out", str(out3), "--endpoint", server["url"], "--model",
                   server["model"], "--max-tokens", "2", "--retry-failed")
    assert r.returncode == 0, r.stderr
    assert sorted(row["input_index"] for row in read_jsonl(out3)) == list(range(6))


class FlakyProxy:
    """Answers the first requests with the given error statuses, then forwards to the real server:
    an overloaded or restarting server as seen from the client."""

    def __init__(self, upstream: str, statuses: list[int]):
        import http.server
        import threading

        proxy = self
        self.statuses, self.seen = list(statuses), []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = proxy.statuses.pop(0) if proxy.statuses else 0
                proxy.seen.append(status or 200)
                if status:
                    payload, headers = b'{"error": "busy"}', {"Retry-After": "0"}
                else:
                    resp = httpx2.post(upstream + self.path, content=body,
                                       headers={"Content-Type": "application/json"}, timeout=60)
                    status, payload, headers = resp.status_code, resp.content, {}
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_overload_statuses_are_retried_until_answered_and_a_bad_request_is_not(server, oracle, tmp_path):
    src = tmp_path / "chat.jsonl"
    write_jsonl(src, _demo_rows(1))
    common = ["--input", str(src), "--model", server["model"], "--temperature", "0",
              "--max-tokens", str(MAX_TOKENS), "--backoff", "0.01"]

    proxy = FlakyProxy(server["url"], [503, 429, 502])
    try:
        out = tmp_path / "retried.jsonl"
        r = regenerate(*common, "--out", str(out), "--endpoint", proxy.url, "--retries", "3")
        assert r.returncode == 0, r.stderr
        assert proxy.seen == [503, 429, 502, 200]
        (row,) = read_jsonl(out)
        assert as_answer(row["messages"][1]) == oracle(row["messages"][:1])

        # Out of retries: the row is written aside with the last error and the attempts it took.
        proxy.statuses, proxy.seen = [503, 503], []
        out = tmp_path / "gave-up.jsonl"
        r = regenerate(*common, "--out", str(out), "--endpoint", proxy.url, "--retries", "1")
        assert r.returncode == 1 and proxy.seen == [503, 503]
        (failure,) = read_jsonl(Path(f"{out}.failed.jsonl"))
        assert failure["attempts"] == 2 and "HTTP 503" in failure["error"]

        # A 4xx other than 408 / 429 is the request's fault: no second attempt.
        proxy.statuses, proxy.seen = [422], []
        out = tmp_path / "bad-request.jsonl"
        r = regenerate(*common, "--out", str(out), "--endpoint", proxy.url, "--retries", "3")
        assert r.returncode == 1 and proxy.seen == [422]
        (failure,) = read_jsonl(Path(f"{out}.failed.jsonl"))
        assert failure["attempts"] == 1 and "HTTP 422" in failure["error"]
    finally:
        proxy.close()


def test_without_a_terminal_progress_is_a_plain_line_now_and_then_with_the_time_left(monkeypatch, capsys):
    from common import metrics

    clock = iter(float(t) for t in range(0, 1000, 10))      # a row every 10 s
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    lines = metrics.ProgressLines("dfpipe regenerate", "rows", total=100, done=20)   # 20 rows done by an earlier run
    for _ in range(6):
        lines.update(1)
    said = capsys.readouterr().err.splitlines()
    # one line per LOG_LINE_EVERY_S (30 s), at 30 s and at 60 s: 0.1 rows/s over the last window
    assert said == ["dfpipe regenerate: 23/100 rows (23.0%), 12m50s left",
                    "dfpipe regenerate: 26/100 rows (26.0%), 12m20s left"], said
