"""The attention kernels this torch offers at the drafter's head size (256), at the shapes of
drafter_trainer/block_flash.py's two parts: FlashAttention 2 (the flash path's kernels), cuDNN's
fused attention and the memory-efficient kernel, dense (SDPA backends) and variable-length (the
`_flash_attention_*` / `_cudnn_attention_*` ops block_flash would call), forward and backward in
TFLOP/s (4 * heads * d * visible keys a forward, twice that a backward), and each varlen kernel's
output and gradients against FlashAttention's (relative to the largest value).

Why: at 32K-token documents the drafter's step spends about half its time in attention; whether
another kernel could lift the long-document MFU is a question of these rates.

    python -m bench.gpu.attn_kernels          # CUDA only; one JSON line per shape, $OUT/attn_kernels.json
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 4, 256      # key heads of the 27B drafter; its 24 query heads come folded into rows
# (sequences, query rows, keys): part A (a 64-block segment's folded rows over a long prefix),
# part B (a block's folded rows over its key run), a whole 32K document
DENSE = [(1, 6144, 16384), (8, 6144, 16384), (512, 96, 2048), (1, 32768, 32768)]
VARLEN = [(8, 6144, 16384), (512, 96, 2048), (64, 1536, 16384)]


def seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def dense(seqs: int, rows: int, keys: int, dev: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(seqs, HEADS, n, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
                   for n in (rows, keys, keys, rows))
    for x in (q, k, v):
        x.requires_grad_()
    flop = 4.0 * seqs * HEADS * rows * keys * HEAD_DIM
    row: dict[str, Any] = {"dense": [seqs, rows, keys]}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fwd = seconds(lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach()))
                both = seconds(lambda: F.scaled_dot_product_attention(q, k, v).backward(do))
            row[name] = {"fwd_tflop_s": round(flop / fwd / 1e12, 1), "fwd_bwd_tflop_s": round(3 * flop / both / 1e12, 1)}
        except RuntimeError as e:
            row[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def varlen(seqs: int, rows: int, keys: int, dev: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=dev).manual_seed(0)
    k_lens = torch.randint(keys // 4, keys + 1, (seqs,), generator=g, device=dev).cpu()
    q_lens = torch.full((seqs,), rows)
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32).to(dev)
                  for n in (q_lens, k_lens))
    q, k, v, do = (torch.randn(int(n.sum()), HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
                   for n in (q_lens, k_lens, k_lens, q_lens))
    mq, mk, scale = rows, int(k_lens.max()), HEAD_DIM ** -0.5
    flop = 4.0 * HEADS * HEAD_DIM * float((q_lens * k_lens).sum())
    row: dict[str, Any] = {"varlen": [seqs, rows, keys]}

    def fa_fwd() -> tuple[torch.Tensor, ...]:
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, False, False, scale=scale)
    out, lse, rng, unused, _ = fa_fwd()

    def fa_bwd() -> tuple[torch.Tensor, ...]:
        return torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, cu_q, cu_k, mq, mk, 0.0, False, rng,
                                                         unused, scale=scale)
    ref = (out, *fa_bwd())
    row["flash"] = {"fwd_tflop_s": round(flop / seconds(fa_fwd) / 1e12, 1),
                    "bwd_tflop_s": round(2 * flop / seconds(fa_bwd) / 1e12, 1)}

    def cd_fwd() -> tuple[Any, ...]:
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, mq, mk, True, 0.0, False, False,
                                                        scale=scale)
    try:
        res = cd_fwd()
        c_out, c_lse, seed, offset = res[0], res[1], res[6], res[7]

        def cd_bwd() -> tuple[torch.Tensor, ...]:
            return torch.ops.aten._cudnn_attention_backward(do, q, k, v, c_out, c_lse, seed, offset, None, cu_q, cu_k,
                                                             mq, mk, 0.0, False, scale=scale)
        got = (c_out.view_as(out), *cd_bwd())
        row["cudnn"] = {"fwd_tflop_s": round(flop / seconds(cd_fwd) / 1e12, 1),
                        "bwd_tflop_s": round(2 * flop / seconds(cd_bwd) / 1e12, 1),
                        "rel_err_vs_flash": {n: float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                             for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}}
    except RuntimeError as e:
        row["cudnn"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("attn_kernels needs CUDA")
    dev = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    for measure, shape in [(dense, s) for s in DENSE] + [(varlen, s) for s in VARLEN]:
        rows.append(measure(*shape, dev))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "attn_kernels.json"), "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
