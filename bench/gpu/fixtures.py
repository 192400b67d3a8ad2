"""What the GPU benchmarks run on: a 27B-shaped target cut to a few layers, a synthetic prepared
dataset with long-tailed document lengths, and a timer that is right on both CPU and GPU.

Work folder (default /tmp/dfpipe-gpu-bench), built once by the `env` part and reused by the others:

    manifest.json        the shape, capture ids, token budget and paths below (parts read it; a
                         changed shape rebuilds)
    target/              Qwen3_5TextConfig of the real Qwen3.5-27B widths (gpu_bench.py's FULL), random
                         weights, bf16 safetensors, only `layers` decoder layers (3 GDN : 1 attention)
    data/                a dfpipe prepared folder (input_ids, loss_mask, offsets, sample_ids .npy):
                         lognormal lengths clipped to [2, max_len], first 20% of each document
                         outside the loss mask, token ids never the mask token
    triton/              TRITON_CACHE_DIR shared by every part but the cold start of P4
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.target_bench import lognormal_lengths
from common.batch import TOKEN_TENSORS, PackedBatch

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TargetShape:
    """A Qwen3.5 text decoder shape; `layers` decoder layers, captured at `capture_ids`."""

    hidden: int
    layers: int
    capture_ids: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    vocab: int
    mask_token_id: int

    def config(self) -> Any:
        """Qwen3_5TextConfig: every 4th layer full attention, partial RoPE 0.25 split t/h/w like the
        published config ([11, 11, 10] for head_dim 256)."""
        from transformers import Qwen3_5TextConfig

        half_rotary = int(self.head_dim * 0.25) // 2
        base, extra = divmod(half_rotary, 3)
        section = [base + (1 if i < extra else 0) for i in range(3)]
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": section, "mrope_interleaved": True}
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.layers)]
        return Qwen3_5TextConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, max_position_embeddings=262144, tie_word_embeddings=False,
            rms_norm_eps=1e-6, layer_types=layer_types, rope_parameters=rope, linear_conv_kernel_dim=4,
            linear_key_head_dim=self.linear_k_dim, linear_value_head_dim=self.linear_v_dim,
            linear_num_key_heads=self.linear_k_heads, linear_num_value_heads=self.linear_v_heads)


def build_target(out_dir: str, shape: TargetShape, device: torch.device, seed: int = 0) -> float:
    """Write a randomly initialised `shape` causal LM (with lm_head) to `out_dir`; seconds taken.

    Initialised on `device` in bf16 on CUDA (a 27B-wide layer stack initialised on the CPU in fp32
    would take minutes); fp32 on CPU, like the built-in tiny targets.
    """
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.makedirs(out_dir, exist_ok=True)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(shape.config(), dtype=dtype)
    model.save_pretrained(out_dir)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def document_lengths(n: int, median: float, sigma: float, max_len: int, seed: int) -> np.ndarray:
    """Long-tailed lengths (lognormal, bench/target_bench's draw), at least 2 tokens (one anchor pair)."""
    return np.clip(np.asarray(lognormal_lengths(n, median, sigma, max_len, seed), dtype=np.int64), 2, max_len)


def write_dataset(out_dir: str, lengths: np.ndarray, vocab: int, mask_token_id: int, seed: int) -> int:
    """A prepared dataset folder (the `target_server.data` format) of random tokens; total tokens."""
    rng = np.random.default_rng(seed)
    os.makedirs(out_dir, exist_ok=True)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    total = int(offsets[-1])
    # ids below the mask token: the drafter's block input uses it, and a random document holding it
    # would only blur the accuracy figures
    ids = rng.integers(0, min(vocab, mask_token_id), size=total, dtype=np.int64).astype(np.int32)
    starts = np.repeat(offsets[:-1], lengths)
    pos = np.arange(total, dtype=np.int64) - starts
    loss_mask = (pos >= np.repeat(lengths // 5, lengths)).astype(np.uint8)
    for name, arr in (("input_ids", ids), ("loss_mask", loss_mask), ("offsets", offsets),
                      ("sample_ids", np.arange(len(lengths), dtype=np.int64))):
        np.save(os.path.join(out_dir, f"{name}.npy"), arr)
    meta = {"format": "dfpipe-prepared", "version": 1, "num_documents": int(len(lengths)), "num_tokens": total,
            "max_len": int(lengths.max()), "overlong": "truncate", "source": "bench/gpu synthetic lognormal"}
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return total


def read_manifest(workdir: str) -> dict[str, Any]:
    path = os.path.join(workdir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: run the env part first (gpu_bench.py env)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_manifest(workdir: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(workdir, MANIFEST)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def shape_of(manifest: dict[str, Any]) -> TargetShape:
    d = dict(manifest["shape"])
    d["capture_ids"] = tuple(d["capture_ids"])
    return TargetShape(**d)


def shape_dict(shape: TargetShape) -> dict[str, Any]:
    d = dataclasses.asdict(shape)
    d["capture_ids"] = list(shape.capture_ids)
    return d


class LinearBackendError(RuntimeError):
    """On CUDA the target fell back to the torch Gated DeltaNet path: FLA is not importable."""


def load_runner(manifest: dict[str, Any], device: torch.device, allow_torch_linear: bool = False):
    """The frozen target as the server loads it; on CUDA its GDN layers must run FLA's kernels."""
    from target_server.target import TargetRunner

    runner = TargetRunner.load(manifest["target_dir"], device=str(device), dtype="auto",
                               layer_ids=list(manifest["shape"]["capture_ids"])
                               ).fix_linear_shape(manifest["token_budget"])   # as the server does
    if device.type == "cuda" and runner.linear_backend != "fla" and not allow_torch_linear:
        raise LinearBackendError("the target runs the torch Gated DeltaNet path on CUDA: flash-linear-attention "
                                 "is not importable (install the .whl/ wheels, or pass --allow-torch-linear)")
    return runner


def batch_tensors(arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, doc_lens) of a packed batch, as TargetRunner.capture takes them."""
    return (torch.from_numpy(arrays["input_ids"]), torch.from_numpy(arrays["position_ids"]),
            torch.from_numpy(arrays["doc_lens"]))


def packed_batch(arrays: dict[str, np.ndarray], hidden: torch.Tensor, seq: int, device: torch.device) -> PackedBatch:
    """A trainer-side batch: the dataset's tokens of batch `seq` with the given captured planes."""
    tokens = {k: torch.from_numpy(np.ascontiguousarray(arrays[k])) for k in TOKEN_TENSORS}
    return PackedBatch(hidden=hidden, **tokens, seq=seq, epoch=0).to(device)


class RegionTimer:
    """Seconds of device work between start() and stop().

    CUDA: events on the current stream, so nothing inside the region waits for the host;
    `seconds()` synchronises on the end event only. CPU: perf_counter.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> "RegionTimer":
        self._t0 = time.perf_counter()
        if self.cuda:
            self._start.record()
        return self

    def stop(self) -> "RegionTimer":
        if self.cuda:
            self._end.record()
        self._t1 = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._t1 - self._t0


def capture_tok_s(runner: Any, batches: list[tuple[torch.Tensor, ...]], device: torch.device, warmup: int = 0) -> float:
    """Real tokens/s of `runner.capture` over `batches`, the first `warmup` of them untimed."""
    for b in batches[:warmup]:
        runner.capture(*b)
    timer = RegionTimer(device).start()
    for b in batches[warmup:]:
        runner.capture(*b)
    return sum(int(b[0].numel()) for b in batches[warmup:]) / timer.stop().seconds()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device, n: int, iters: int = 10, warmup: int = 3) -> float:
    """bf16 (CUDA) / fp32 (CPU) n x n x n matmul rate on random data, the MFU denominator."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(warmup):
        a @ b
    timer = RegionTimer(device).start()
    for _ in range(iters):
        a @ b
    seconds = timer.stop().seconds()
    return 2.0 * n ** 3 * iters / seconds / 1e12


def profile_kernels(fn: Any, device: torch.device, top: int = 15) -> dict[str, Any]:
    """One call of `fn` under the torch profiler: device time by kernel (top `top`) and by kind, so a
    missed goal comes with where the time went."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    # device-side events only: the ops' own rows (aten::mm, Optimizer.step) repeat their kernels' time
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows) or 1.0
    kinds: dict[str, float] = {}
    for name, ms, _ in rows:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {"device_ms": total,
            "by_kind_ms": dict(sorted(((k, round(v, 3)) for k, v in kinds.items()), key=lambda kv: -kv[1])),
            "top": [{"kernel": name[:120], "ms": round(ms, 3), "share": round(ms / total, 4), "calls": n}
                    for name, ms, n in rows[:top]]}


def kernel_kind(name: str) -> str:
    """A coarse class of a CUDA kernel by its name: where the step's time goes."""
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "attention", "flex", "efficient_attention")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "cublas")):
        return "matmul"
    if any(s in n for s in ("memcpy", "memset")):
        return "copy"
    if any(s in n for s in ("reduce", "softmax", "norm", "sum")):
        return "reduction/softmax"
    if "triton" in n:
        return "triton (compiled)"
    return "elementwise/other"


def layer_and_rest_bytes(target_dir: str) -> tuple[int, int, int]:
    """(bytes of the decoder layers' tensors, bytes of the rest, number of layers) of a saved
    target, from its safetensors headers: what loading it reads, and how that grows with depth."""
    import re
    import struct

    layer_bytes = rest = 0
    layers: set[int] = set()
    for name in os.listdir(target_dir):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(target_dir, name), "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            found = re.search(r"\.layers\.(\d+)\.", key)
            if found:
                layers.add(int(found.group(1)))
                layer_bytes += end - start
            else:
                rest += end - start
    return layer_bytes, rest, len(layers)
