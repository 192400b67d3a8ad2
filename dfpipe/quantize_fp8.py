"""dfpipe quantize-fp8: a model folder -> the block-wise FP8 checkpoint its makers would publish.

    dfpipe quantize-fp8 --model IN --out OUT        IN: a Hugging Face model folder, or
                                                    builtin:tiny-qwen3.5 / builtin:tiny-qwen3

OUT is IN with every Linear weight of the decoder layers in e4m3 plus its `weight_scale_inv` (one
fp32 scale per 128 x 128 block, a partial block at an edge with its own), config.json's
`quantization_config` saying so (`target_server.fp8`), and every other tensor and file as it was:
embeddings, lm_head, norms, the short conv and the small Gated DeltaNet projections stay in the
source dtype, as in the published Qwen3 / Qwen3.5 FP8 checkpoints. So tests and GPU benchmarks
get an FP8 target without a hub download; a published FP8 checkpoint needs no conversion.

Shard by shard (one shard's tensors in memory at a time), into a temporary folder renamed into
place: OUT is absent or complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from target_server import fp8

INDEX = "model.safetensors.index.json"


class QuantizeError(ValueError):
    """A source this command cannot quantize, or an OUT it must not overwrite."""


def quantize_checkpoint(src: str, out: str) -> dict[str, Any]:
    """Write the block-wise FP8 checkpoint of the model folder `src` to `out`; what was quantized."""
    from safetensors.torch import load_file, save_file

    from target_server.target import checkpoint_files

    try:
        with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise QuantizeError(f"{src}: no readable config.json ({e})") from None
    if "quantization_config" in config or "quantization_config" in (config.get("text_config") or {}):
        raise QuantizeError(f"{src} is already quantized (config.json has a quantization_config)")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise QuantizeError(f"{out} exists and is not an empty folder: choose another --out")
    try:
        files = checkpoint_files(src)
    except FileNotFoundError as e:
        raise QuantizeError(str(e)) from None
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-", dir=parent)
    quantized: list[str] = []
    kept: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for file in files:
            tensors = load_file(file)
            shard: dict[str, Any] = {}
            for name, t in tensors.items():
                if fp8.should_quantize(name, t):
                    shard[name], shard[name + fp8.SCALE_SUFFIX] = fp8.quantize_weight(t)
                    quantized.append(name)
                else:
                    shard[name] = t.contiguous()
                    if name.endswith(".weight"):
                        kept.append(name[: -len(".weight")])
            del tensors
            save_file(shard, os.path.join(tmp, os.path.basename(file)), metadata={"format": "pt"})
            weight_map.update({name: os.path.basename(file) for name in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
            del shard
        if not quantized:
            raise QuantizeError(f"{src}: no Linear weight of a decoder layer found to quantize")
        if os.path.isfile(os.path.join(src, INDEX)):
            with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                          indent=2)
        config["quantization_config"] = fp8.quantization_config(fp8.BLOCK, sorted(kept))
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        written = {os.path.basename(p) for p in files} | {INDEX, "config.json"}
        for name in sorted(os.listdir(src)):   # tokenizer, chat template, generation config, ...
            path = os.path.join(src, name)
            if name not in written and os.path.isfile(path) and not name.endswith(".safetensors"):
                shutil.copyfile(path, os.path.join(tmp, name))
        for name in os.listdir(tmp):   # readable by a serving process of another user, like the source
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        if os.path.isdir(out):
            os.rmdir(out)   # empty (checked above): a folder cannot be renamed over one
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "quantized": len(quantized), "kept": len(kept), "block": list(fp8.BLOCK), "bytes": total}


def main(args: argparse.Namespace) -> int:
    """`dfpipe quantize-fp8`: args.model (folder or builtin:tiny-*), args.out. Exit 2 on unusable input."""
    from target_server.tiny import ARCHS, BUILTIN_PREFIX, build_tiny_target

    try:
        if args.model.startswith(BUILTIN_PREFIX):
            arch = args.model[len(BUILTIN_PREFIX):].removeprefix("tiny-")
            if arch not in ARCHS:
                raise QuantizeError(f"unknown builtin target {args.model!r}; known: "
                                    + ", ".join(f"{BUILTIN_PREFIX}tiny-{a}" for a in ARCHS))
            with tempfile.TemporaryDirectory() as built:
                report = quantize_checkpoint(build_tiny_target(built, arch=arch), args.out)
        else:
            report = quantize_checkpoint(args.model, args.out)
    except QuantizeError as e:
        print(f"dfpipe quantize-fp8: {e}", file=sys.stderr)
        return 2
    bn, bk = report["block"]
    print(f"dfpipe quantize-fp8: {report['quantized']} weights in e4m3 with {bn}x{bk} block scales, "
          f"{report['kept']} kept as they were; {report['bytes'] / 1e6:.1f} MB in {report['out']}")
    return 0
