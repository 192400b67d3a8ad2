"""What one pathological row costs `dfpipe prepare-data`: peak RSS, wall and CPU time from `/usr/bin/time -v`.

    python bench/row_cost_bench.py                          # this checkout, every shape
    python bench/row_cost_bench.py --repo /tmp/wt47base     # another checkout's prepare-data, same files
    python bench/row_cost_bench.py --shapes single-15m,split-15m

Each shape is a chat file of one ordinary row and one large one (an answer of `text`), prepared with the
demo tokenizer (configs/demo/tokenizer) and the data section's defaults (max_len 3072) unless noted:

    single-15m     an answer of one character repeated 15 MiB (one pre-tokenizer word), truncate
    single-16m     the same, 16 MiB - 1 KiB (the row just under the default max_row_bytes 16 MiB), truncate
    split-15m      single-15m under --overlong split
    split-words-15m  an answer of 15 MiB of ordinary words under --overlong split (every token kept)
    words-200m     a 200 MB answer of ordinary words, --max-row-bytes 256 MiB, truncate

--max-bad-share 1: the large row may be a bad row; the run must still exit 0. Prints one JSON object
(one entry per shape: exit status, peak RSS MB, wall s, user+sys CPU s, and the summary's bad-row line).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

# shape -> (answer text maker, extra prepare-data arguments)
SHAPES: dict[str, tuple[Any, list[str]]] = {
    "single-15m": (lambda: "a" * (15 * MIB), []),
    "single-16m": (lambda: "a" * (16 * MIB - 1024), []),
    "split-15m": (lambda: "a" * (15 * MIB), ["--overlong", "split"]),
    "split-words-15m": (lambda: ("The quick brown fox jumps over the lazy dog, 12345 times. " * 300_000)[:15 * MIB],
                        ["--overlong", "split"]),
    "words-200m": (lambda: ("The quick brown fox jumps over the lazy dog, 12345 times. " * 3_500_000)[:200_000_000],
                   ["--max-row-bytes", str(256 * MIB)]),
}


def _row(answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": answer}]})


def write_source(path: str, answer: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(_row("Hello there, how are you?") + "\n")
        f.write(_row(answer) + "\n")


def _time_v(stderr: str) -> dict[str, float]:
    """Peak RSS (MB), wall (s) and CPU (s) from GNU time -v's report."""
    def field(name: str) -> str:
        m = re.search(rf"^\s*{re.escape(name)}: (.+)$", stderr, re.M)
        return m.group(1).strip() if m else "0"

    clock = [float(p) for p in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")]
    wall = sum(v * 60 ** i for i, v in enumerate(reversed(clock)))
    return {"peak_rss_mb": round(int(field("Maximum resident set size (kbytes)")) / 1024, 1),
            "wall_s": round(wall, 2),
            "cpu_s": round(float(field("User time (seconds)")) + float(field("System time (seconds)")), 2)}


def run_shape(repo: str, name: str, work: str) -> dict[str, Any]:
    make, extra = SHAPES[name]
    src = os.path.join(work, f"{name}.jsonl")
    write_source(src, make())
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "dfpipe", "prepare-data", "--input", src,
           "--tokenizer", os.path.join(REPO, "configs", "demo", "tokenizer"), "--out", os.path.join(work, name),
           "--max-bad-share", "1", *extra]
    env = {**os.environ, "PYTHONPATH": repo, "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    os.remove(src)
    bad = next((line.strip() for line in done.stdout.splitlines() if " x " in line and "(line" in line), "")
    return {"rc": done.returncode, **_time_v(done.stderr), "bad": bad,
            **({"stderr_tail": done.stderr[-600:]} if done.returncode else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=REPO, help="checkout whose prepare-data runs (default: this one)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="row-cost-") as work:
        for name in args.shapes.split(","):
            results[name] = run_shape(os.path.abspath(args.repo), name, work)
            print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    print(json.dumps({"repo": os.path.abspath(args.repo), "shapes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
