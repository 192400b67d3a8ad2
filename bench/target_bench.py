"""Packed vs padded target forward on a long-tailed length distribution.

    python bench/target_bench.py --target builtin:tiny-qwen3.5 --device cpu
    python bench/target_bench.py --target /models/Qwen3.5-27B --device cuda --docs 512 --max-len 3072 \
        --token-budget 16384

Document lengths are lognormal (median --median, shape --sigma), clipped to [1, --max-len]. Both modes
run the same truncated target (up to the deepest captured layer) over the same documents in the same
process:

- packed: documents greedily packed into rows of at most --token-budget tokens, TargetRunner.capture
  (document-aware varlen path); computed tokens = real tokens.
- padded: --token-budget // --max-len documents per batch, right-padded to the longest in the batch,
  transformers' own batched forward with an attention mask (the usual baseline); computed tokens =
  batch x longest. Padding every document to --max-len (one static shape) is reported without running.

Prints one markdown table row per mode plus the packed/padded ratio of real tokens per second.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.batch import document_positions  # noqa: E402
from target_server.target import TargetRunner  # noqa: E402
from target_server.tiny import resolve_target  # noqa: E402


def lognormal_lengths(n: int, median: float, sigma: float, max_len: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.normal(math.log(median), sigma, size=n)).round().astype(np.int64)
    return np.clip(lens, 1, max_len).tolist()


def pack_rows(lens: list[int], budget: int) -> list[list[int]]:
    """Greedy in order: start a new row when the next document does not fit."""
    rows: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lens):
        if used + n > budget and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[..., object], batches: list[tuple[torch.Tensor, ...]], device: torch.device) -> float:
    """Seconds of fn over every batch, after one untimed call (kernel autotune / first-call costs)."""
    fn(*batches[0])
    _sync(device)
    start = time.perf_counter()
    for batch in batches:
        fn(*batch)
    _sync(device)
    return time.perf_counter() - start


def run_packed(runner: TargetRunner, docs: list[torch.Tensor], rows: list[list[int]]) -> tuple[int, float]:
    batches = []
    for row in rows:
        lens = torch.tensor([len(docs[i]) for i in row], dtype=torch.int32)
        batches.append((torch.cat([docs[i] for i in row]), document_positions(lens), lens))
    return sum(len(d) for d in docs), _timed(runner.capture, batches, runner.device)


@torch.no_grad()
def run_padded(runner: TargetRunner, docs: list[torch.Tensor], per_batch: int) -> tuple[int, float]:
    batches = []
    computed = 0
    for s in range(0, len(docs), per_batch):
        group = docs[s:s + per_batch]
        width = max(len(d) for d in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        mask = torch.zeros(len(group), width, dtype=torch.int64)
        for r, d in enumerate(group):
            ids[r, :len(d)] = d
            mask[r, :len(d)] = 1
        batches.append((ids.to(runner.device), mask.to(runner.device)))
        computed += len(group) * width
    return computed, _timed(lambda ids, mask: runner.model(input_ids=ids, attention_mask=mask, use_cache=False),
                            batches, runner.device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="builtin:tiny-qwen3.5")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dfpipe-targets"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--docs", type=int, default=192)
    p.add_argument("--median", type=float, default=150.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    a = p.parse_args()
    if a.max_len > a.token_budget:
        p.error("--max-len must not exceed --token-budget")
    if a.threads:
        torch.set_num_threads(a.threads)

    runner = TargetRunner.load(resolve_target(a.target, a.cache_dir), device=a.device, dtype=a.dtype
                               ).fix_linear_shape(a.token_budget)   # as the server runs it
    lens = lognormal_lengths(a.docs, a.median, a.sigma, a.max_len, a.seed)
    g = torch.Generator().manual_seed(a.seed)
    docs = [torch.randint(0, runner.vocab_size, (n,), generator=g) for n in lens]
    real = sum(lens)
    per_batch = max(1, a.token_budget // a.max_len)

    _, t_packed = run_packed(runner, docs, pack_rows(lens, a.token_budget))
    computed_padded, t_padded = run_padded(runner, docs, per_batch)
    static = len(lens) * a.max_len

    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {runner.device} {runner.dtype} "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), linear backend {runner.linear_backend}")
    print(f"# target {a.target}: {len(runner.model.layers)}/{runner.num_layers} layers run, hidden {runner.hidden_size}")
    print(f"# {len(lens)} docs, lognormal median {a.median} sigma {a.sigma}, clipped to {a.max_len}: "
          f"{real} real tokens, mean {real / len(lens):.0f}, max {max(lens)}; budget {a.token_budget}, "
          f"padded batch {per_batch} docs")
    print("| mode | computed / real tokens | real tok/s |")
    print("| --- | --- | --- |")
    print(f"| packed (varlen) | {1.0:.2f} | {real / t_packed:,.0f} |")
    print(f"| padded to longest in batch | {computed_padded / real:.2f} | {real / t_padded:,.0f} |")
    print(f"| padded to max_len (static, not run) | {static / real:.2f} | - |")
    print(f"packed / padded real tok/s: {t_padded / t_packed:.2f}x")


if __name__ == "__main__":
    main()
