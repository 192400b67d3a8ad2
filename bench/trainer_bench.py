"""One DFlash drafter training step (forward + chunked loss + backward + clip + AdamW) at a chosen size.

    python bench/trainer_bench.py                                   # CPU demo size: T=2048, N=128, B=16, H=128
    python bench/trainer_bench.py --device cuda --hidden 5120 --heads 32 --kv-heads 8 --head-dim 128 \
        --intermediate 17408 --vocab 248320 --tokens 16384 --docs 8 --anchors 512 --attn flex
    python bench/trainer_bench.py --sweep-anchors 64,128,256        # loss-head memory vs N (chunked logits)

The batch is synthetic (random hidden states, D documents of random lengths, the first 20% of each
document outside the loss mask); the ring feed is not involved. Each variant (split-FC off / on,
by default) runs in its own process on the same batch, after --warmup untimed steps (which pay
for the torch.compile of --compile on, the default on CUDA).

Reported per variant: median step time, context tokens/s and block rows/s, peak tensor memory above
what was held before (CUDA: max_memory_allocated; CPU: the profiler's memory timeline) of one whole
step and of the context projection alone (fc + hidden_norm, forward and backward: where split-FC
saves the [T, k*H] concatenation), and FLOPs per step counted explicitly:

    fc            2*T*(k*H)*H            x2 (forward + weight grad; the captured planes need no grad)
    ctx k/v proj  2*T*H*2*kv_dim per layer, x3 (forward + input grad + weight grad)
    block proj    2*R*H*(q_dim + 2*kv_dim) + 2*R*q_dim*H per layer, x3
    mlp           2*R*3*H*I per layer, x3
    attention     2*2*R*q_dim*keys per layer (QK^T and PV), x3; keys = the *visible* keys of each
                  query (model FLOPs) and, separately, the keys the chosen kernel computes
                  (split: its segment's context range + B, sdpa: T+R, flex and fa4: the block mask's 128x64 tiles)
    lm_head       2*R_loss*H*V, x2 (forward + input grad; frozen, rows with zero weight skipped)

R = N*B block rows, R_loss = rows with a positive loss weight. MFU = model FLOPs / step time /
--peak-tflops (printed when a peak is given; default 989 for CUDA bf16, H100/H200 dense).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.batch import PackedBatch, check_batch, document_positions  # noqa: E402
from drafter_trainer.block_mask import KV_TILE, Q_TILE, block_mask_of_blocks  # noqa: E402
from drafter_trainer.blocks import AttentionLayout, anchor_seed, build_blocks, sample_anchors  # noqa: E402
from common.config import TrainConfig  # noqa: E402
from drafter_trainer.optim import build_adamw  # noqa: E402
from drafter_trainer.step import Ranks, StepSettings, train_step  # noqa: E402
from drafter_trainer.model import DFlashConfig, DFlashDraftModel  # noqa: E402


def add_shape_args(p: argparse.ArgumentParser, **defaults: int) -> None:
    """The drafter shape's flags (--hidden, --layers, --heads, --kv-heads, --head-dim, --intermediate,
    --vocab, as given), then --capture-layers 5."""
    for name, default in {**defaults, "capture_layers": 5}.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def drafter_config(args: argparse.Namespace, block_size: int, **extra: object) -> DFlashConfig:
    """The drafter of add_shape_args' flags, capturing layers 1, 3, 5, ... of a target one layer deeper."""
    return DFlashConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        vocab_size=args.vocab, rms_norm_eps=1e-6, rope_theta=1e6, block_size=block_size,
        target_layer_ids=list(range(1, 2 * args.capture_layers, 2)), mask_token_id=args.vocab - 1,
        num_target_layers=2 * args.capture_layers + 1, **extra)


def synthetic_batch(tokens: int, docs: int, k: int, hidden: int, vocab: int, seed: int,
                    device: torch.device, dtype: torch.dtype) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=g)[: docs - 1].add(1).sort().values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    lens = (bounds[1:] - bounds[:-1]).to(torch.int32)
    positions = document_positions(lens)
    lengths = torch.repeat_interleave(lens.to(torch.int64), lens.to(torch.int64))
    loss_mask = (positions >= (lengths // 5)).to(torch.uint8)
    batch = PackedBatch(
        hidden=torch.randn(k, tokens, hidden, generator=g).to(dtype),
        input_ids=torch.randint(0, vocab - 1, (tokens,), generator=g, dtype=torch.int32),
        loss_mask=loss_mask, position_ids=positions.to(torch.int32), doc_lens=lens,
        sample_ids=torch.arange(docs, dtype=torch.int64), doc_ids=torch.arange(docs, dtype=torch.int64))
    check_batch(batch)
    return batch.to(device)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_bytes(fn: Callable[[], None], device: torch.device) -> tuple[int, str]:
    """Peak tensor memory of fn() above what was allocated before it, and how it was measured.

    CUDA: the caching allocator's max_memory_allocated. CPU: the profiler's memory timeline
    (every tensor allocation and free, replayed in order; exact for tensors, unlike RSS, which
    glibc's retained heap blurs); VmHWM after clear_refs as a rough fallback.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, "cuda max_memory_allocated"
    try:
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:
            fn()
        _times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device)
        totals = [sum(row) for row in sizes]
        return max(totals) - totals[0], "profiler memory timeline (tensors)"
    except (ImportError, AttributeError, RuntimeError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                  # resets VmHWM (peak RSS) to the current RSS
        base = _rss_bytes("VmRSS")
        fn()
        return _rss_bytes("VmHWM") - base, "VmHWM after clear_refs (RSS, approximate)"


def visible_keys(blocks, window: int | None) -> int:
    """The keys the mask rule (`blocks.AttentionLayout.visible`) lets the block queries of one layer
    see, summed over the queries, counted without a mask: at long contexts a dense one is rows x
    (context + rows) per chunk. A query at offset i of a block whose anchor is at position p of its
    document sees that document's context positions [max(0, p + i - window + 1), p) and its own
    block's B keys (j <= i and i - j < window in a sliding-window layer); a padding block only its
    own block."""
    b = blocks.block_size
    offsets = torch.arange(b, device=blocks.block_positions.device)
    anchor = torch.where(blocks.valid, blocks.block_positions[:, 0], 0)[:, None]        # [N, 1]
    if window is None:
        return int(anchor.sum()) * b + blocks.num_blocks * b * b
    first = (anchor + offsets[None, :] - window + 1).clamp_min(0)
    context = (anchor - first).clamp_min(0)
    return int(context.sum()) + blocks.num_blocks * int(torch.minimum(offsets + 1, torch.tensor(window)).sum())


def step_flops(cfg: DFlashConfig, batch: PackedBatch, blocks, attn_impl: str,
               blocks_per_chunk: int = 0) -> dict[str, float]:
    """FLOPs of one training step by component (see the module docstring). The visible keys are
    counted per layer (`visible_keys`); the keys a kernel computes chunk by chunk as the step runs
    it (each chunk's queries over its context slice and blocks): flash's key runs are the visible
    keys, the other paths' are counted on each chunk's layout."""
    from drafter_trainer.loss import auto_blocks_per_chunk

    t, k, h = batch.num_tokens, cfg.num_context_layers, cfg.hidden_size
    r, b = blocks.num_blocks * blocks.block_size, blocks.block_size
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    r_loss = int((blocks.weights > 0).sum())
    n = cfg.num_hidden_layers
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    windows = [cfg.layer_window(i) for i in range(n)]
    visible_by_layer = [visible_keys(blocks, w) for w in windows]
    # under flash a sliding-window layer runs flex (compiled, as the GPU benchmarks run)
    impls = ["flex" if attn_impl == "flash" and w is not None else attn_impl for w in windows]
    computed = sum(v for v, impl in zip(visible_by_layer, impls) if impl == "flash")
    counted = [i for i, impl in enumerate(impls) if impl != "flash"]
    for part, _first, _end in (blocks.chunks(blocks_per_chunk or auto_blocks_per_chunk(b)) if counted else []):
        layout = AttentionLayout.from_blocks(part)
        rows = part.num_blocks * b
        for i in counted:
            if impls[i] == "split":
                computed += sum((q1 - q0) * (k1 - k0 + b) for q0, q1, k0, k1 in layout.window_segments(windows[i]))
            elif impls[i] in ("flex", "fa4"):
                # every listed tile of the block mask (folded rows: g rows a query token)
                mask = block_mask_of_blocks(part, groups, windows[i])
                tiles = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
                computed += tiles * Q_TILE * KV_TILE // groups
            else:
                computed += rows * layout.num_keys
    out = {
        "fc": 2 * 2.0 * t * k * h * h,
        "ctx_kv": 3 * 2.0 * t * h * 2 * kv_dim * n,
        "block_proj": 3 * 2.0 * r * h * (2 * q_dim + 2 * kv_dim) * n,
        "mlp": 3 * 2.0 * r * 3 * h * cfg.intermediate_size * n,
        "attn_visible": 3 * 4.0 * q_dim * sum(visible_by_layer),
        "lm_head": 2 * 2.0 * r_loss * h * cfg.vocab_size,
    }
    out["model_total"] = sum(out.values())
    out["attn_computed"] = 3 * 4.0 * q_dim * computed
    out["executed_total"] = out["model_total"] - out["attn_visible"] + out["attn_computed"]
    return out


def run_variant(args: argparse.Namespace, cfg: DFlashConfig, batch: PackedBatch, blocks, split_fc: bool,
                device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    model = DFlashDraftModel(cfg, split_fc=split_fc, attn_impl=args.attn).to(device)
    model.compile_for(device, args.compile)         # as the trainer's build_drafter does
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=head_dtype) * 0.02,
                          torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=head_dtype) * 0.02)
    model.checkpoint_layers = args.checkpoint_layers
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_adamw(params, TrainConfig(), device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    settings = StepSettings(loss_chunk=args.chunk, blocks_per_chunk=args.blocks_per_chunk,
                            compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    ranks = Ranks(str(device))

    def step() -> None:   # the trainer's own step
        train_step(model, opt, batch, blocks, 6e-4, settings, ranks)

    def fc_only() -> None:
        with autocast:
            context = model.project_context(batch.hidden)
        context.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    # Memory after timing: a profiled step leaves the process slower for the rest of its life.
    step_peak, method = peak_bytes(step, device)
    fc_only()
    fc_peak, _ = peak_bytes(fc_only, device)
    return {"time": statistics.median(times), "peak": step_peak, "fc_peak": fc_peak, "method": method}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    add_shape_args(p, hidden=128, layers=5, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=8192)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--anchors", type=int, default=128)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--sliding-window", type=int, default=0, help="0: all layers full attention")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--attn", default="auto", choices=["auto", "split", "sdpa", "flex", "flash", "fa4"])
    p.add_argument("--split-fc", default="both", choices=["both", "on", "off"])
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="drafter.compile: torch.compile layers, norms and loss; auto: on for CUDA")
    p.add_argument("--checkpoint-layers", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--sweep-anchors", default="", help="comma list of anchors per document: peak memory vs N at a fixed chunk")
    p.add_argument("--blocks-per-chunk", type=int, default=0, help="drafter.blocks_per_chunk (0: auto)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.attn == "auto":
        args.attn = "sdpa" if device.type == "cuda" else "split"
    if args.attn == "flex" and device.type != "cuda":
        p.error("--attn flex needs CUDA (flex_attention has no CPU backward)")
    peak_tflops = args.peak_tflops or (989.0 if device.type == "cuda" else None)
    layer_types = (["sliding_attention"] * (args.layers - 1) + ["full_attention"] if args.sliding_window
                   else ["full_attention"] * args.layers)
    cfg = drafter_config(args, args.block, layer_types=layer_types, sliding_window=args.sliding_window or None)
    if not args.child:
        # One process per (N, variant): each starts from an empty allocator, so no variant's peak
        # memory depends on what an earlier one left cached or fragmented.
        print(f"# {datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()} "
              f"torch {torch.__version__} device {device}"
              + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
                 else f" threads {torch.get_num_threads()}"))
        print(f"# H={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads}x{args.head_dim} "
              f"I={args.intermediate} V={args.vocab} k={args.capture_layers} T={args.tokens} D={args.docs} "
              f"B={args.block} chunk={args.chunk} blocks/chunk={args.blocks_per_chunk or 'auto'} attn={args.attn} window={args.sliding_window or '-'} "
              f"compile={args.compile}")
        print("| N | fc | step s | ctx tok/s | block rows/s | step peak MiB | fc fwd+bwd peak MiB "
              "| logits if materialised MiB | model GFLOP | executed GFLOP | model TFLOP/s | MFU |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        anchor_counts = [int(x) for x in args.sweep_anchors.split(",") if x] or [args.anchors]
        variants = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[args.split_fc]
        footer = ""
        for n in anchor_counts:
            for variant in variants:
                child = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                         "--anchors", str(n), "--split-fc", variant, "--sweep-anchors", "", "--child"]
                out = subprocess.run(child, check=True, capture_output=True, text=True).stdout.splitlines()
                print(*[line for line in out if line.startswith("|")], sep="\n", flush=True)
                footer = next((line for line in out if line.startswith("# peak")), footer)
        print(footer)
        return

    hidden_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = synthetic_batch(args.tokens, args.docs, args.capture_layers, args.hidden, args.vocab, 0, device,
                            hidden_dtype)
    gen = torch.Generator().manual_seed(anchor_seed(0, 0, args.anchors))
    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, args.anchors, gen)
    blocks = build_blocks(batch, anchors, args.block, cfg.mask_token_id, 7.0)
    flops = step_flops(cfg, batch, blocks, args.attn, args.blocks_per_chunk)
    rows = blocks.num_blocks * blocks.block_size
    logits_mib = int((blocks.weights > 0).sum()) * args.vocab * 4 / 2**20
    split_fc = args.split_fc == "on"
    r = run_variant(args, cfg, batch, blocks, split_fc, device)
    tflops = flops["model_total"] / r["time"] / 1e12
    mfu = f"{100 * tflops / peak_tflops:.1f}%" if peak_tflops else "-"
    print(f"| {blocks.num_blocks} | {'split' if split_fc else 'concat'} | {r['time']:.3f} "
          f"| {args.tokens / r['time']:.0f} | {rows / r['time']:.0f} | {r['peak'] / 2**20:.1f} "
          f"| {r['fc_peak'] / 2**20:.1f} "
          f"| {logits_mib:.1f} | {flops['model_total'] / 1e9:.2f} | {flops['executed_total'] / 1e9:.2f} "
          f"| {tflops:.4f} | {mfu} |")
    print(f"# peak memory: {r['method']}; FLOPs by component: "
          + ", ".join(f"{k}={v / 1e9:.2f}G" for k, v in flops.items()))

if __name__ == "__main__":
    main()
