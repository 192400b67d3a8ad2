"""Built-in tiny targets: real Qwen3.5 / Qwen3 architectures at toy size, built offline from a config.

They exist so that every code path of the target server (hybrid Gated-DeltaNet + attention layers, the
short convolution, RoPE, layer capture) runs on a laptop CPU and in CI without downloading a model.
Weights are random, drawn with a fixed seed, so the same arguments give the same tensors.

    resolve_target("builtin:tiny-qwen3.5", cache_dir)   ->  <cache_dir>/tiny-qwen3.5-<digest>/
        config.json                 Qwen3_5TextConfig (model_type "qwen3_5_text"), 3 linear : 1 full
        model.safetensors           model.embed_tokens / model.layers.N.* / model.norm / lm_head (untied)
        tokenizer files             copied from `tokenizer_dir` when one is given

The folder name carries a digest of everything that shapes the weights, so a changed recipe never
reuses a stale build. Concurrent builders (two workers starting at once) each build in a private temp
folder and `rename` it into place; the loser discards its copy and uses the winner's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import torch

from common.preflight import BUILTIN_PREFIX, model_folder_problem

# Bumped whenever the recipe below changes what a given set of arguments produces.
RECIPE_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "added_tokens.json")
ARCHS = ("qwen3.5", "qwen3")


def _tiny_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int) -> Any:
    """A small config of the real architecture: same layer kinds, heads and norms, toy widths."""
    head_dim = 32
    if hidden_size % head_dim or hidden_size < 2 * head_dim:
        raise ValueError(f"hidden_size must be a multiple of {head_dim} and at least {2 * head_dim}, got {hidden_size}")
    heads = hidden_size // head_dim
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  head_dim=head_dim, max_position_embeddings=8192, tie_word_embeddings=False)
    if arch == "qwen3.5":
        from transformers import Qwen3_5TextConfig

        # Published Qwen3.5 pattern: every 4th layer is full attention, the rest Gated DeltaNet.
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
        # partial rotary 0.25 of head_dim 32 = 8 rotary dims = 4 frequencies, split t/h/w as 2/1/1.
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        return Qwen3_5TextConfig(**common, layer_types=layer_types, rope_parameters=rope,
                                 linear_conv_kernel_dim=4, linear_key_head_dim=head_dim,
                                 linear_value_head_dim=head_dim, linear_num_key_heads=max(1, heads // 2),
                                 linear_num_value_heads=heads)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHS}")


def _tokenizer_files(tokenizer_dir: str, vocab_size: int) -> list[str]:
    """The tokenizer files to ship with the model, after checking every token id has an embedding row."""
    found = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, name))]
    if "tokenizer.json" not in found:
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer.json to copy into the tiny target")
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"tokenizer in {tokenizer_dir} has {size} tokens but the tiny target's "
                         f"vocab_size is {vocab_size}")
    return [os.path.join(tokenizer_dir, name) for name in found]


def build_tiny_target(out_dir: str, arch: str = "qwen3.5", vocab_size: int = 512, hidden_size: int = 128,
                      num_layers: int = 8, seed: int = 0, tokenizer_dir: str | None = None) -> str:
    """Write a randomly initialised tiny `arch` model (HF folder, safetensors) to `out_dir`; return `out_dir`.

    Deterministic for a given torch/transformers install: the weights come from HF's own initialisation
    run under a fixed seed. lm_head is untied from the embedding, like the production targets.
    """
    from transformers import AutoModelForCausalLM

    config = _tiny_config(arch, vocab_size, hidden_size, num_layers)
    tokenizer_files = _tokenizer_files(tokenizer_dir, vocab_size) if tokenizer_dir else []
    os.makedirs(out_dir, exist_ok=True)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    for path in tokenizer_files:
        shutil.copyfile(path, os.path.join(out_dir, os.path.basename(path)))
    return out_dir


def _tokenizer_digest(tokenizer_dir: str | None) -> str:
    if not tokenizer_dir:
        return ""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = os.path.join(tokenizer_dir, name)
        if os.path.isfile(path):
            h.update(name.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def resolve_target(spec: str, cache_dir: str, tokenizer_dir: str | None = None, **build_kwargs: Any) -> str:
    """A loadable model folder for `spec`: a local HF folder as is, or `builtin:tiny-<arch>` built once.

    `builtin:tiny-qwen3.5` and `builtin:tiny-qwen3` are built under `cache_dir` on first use and reused
    afterwards; `build_kwargs` (vocab_size, hidden_size, num_layers, seed) override the defaults.
    """
    if not spec.startswith(BUILTIN_PREFIX):
        if problem := model_folder_problem(spec):
            raise FileNotFoundError(f"target {problem} (a target is a model folder, or builtin:tiny-qwen3.5 / "
                                    f"builtin:tiny-qwen3)")
        return spec
    name = spec[len(BUILTIN_PREFIX):]
    arch = name.removeprefix("tiny-")
    if not name.startswith("tiny-") or arch not in ARCHS:
        raise ValueError(f"unknown builtin target {spec!r}; known: " + ", ".join(f"builtin:tiny-{a}" for a in ARCHS))
    if unknown := set(build_kwargs) - {"vocab_size", "hidden_size", "num_layers", "seed"}:
        raise TypeError(f"resolve_target: unexpected build argument(s) {sorted(unknown)}")
    recipe = {"recipe": RECIPE_VERSION, "arch": arch, **build_kwargs,
              "tokenizer": _tokenizer_digest(tokenizer_dir)}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    final = os.path.join(cache_dir, f"{name}-{digest}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir)
    try:
        build_tiny_target(tmp, arch=arch, tokenizer_dir=tokenizer_dir, **build_kwargs)
        try:
            os.rename(tmp, final)  # atomic: readers see no folder or a complete one
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
            # Another process won the race with an identical build; keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
