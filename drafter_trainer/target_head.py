"""The target's frozen token embedding and output head, read by tensor name from its checkpoint.

The drafter embeds its block tokens with the target's `embed_tokens` and scores its outputs with
the target's `lm_head`; both stay frozen and are never exported (a serving engine takes them from
the target it already holds). Only these two tensors are read: for a 27B target the rest of the
checkpoint is tens of GB the trainer must not touch.

Where the two tensors live depends on the architecture:

    text-only causal LM (Qwen3, Qwen3.5 text)   model.embed_tokens.weight                lm_head.weight
    multimodal wrapper (Qwen3.5 / 3.6 VL)        model.language_model.embed_tokens.weight lm_head.weight
    older VL layout                              language_model.model.embed_tokens.weight language_model.lm_head.weight

A checkpoint without an lm_head tensor and `tie_word_embeddings: true` uses the embedding as its
head (small Qwen3.5 models do); without the flag a missing head is an error, never a guess.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from .devices import use_device

EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
LM_HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
)


class TargetHeadError(ValueError):
    """The target folder does not hold a usable embedding / lm_head pair."""


@dataclass
class TargetHead:
    """embed_tokens [V, H] and lm_head [V, H]; `tied` when lm_head is embed_tokens itself."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    tied: bool


class FrozenTargetWeight(nn.Module):
    """A frozen [V, H] target matrix held by the drafter; empty ([0, H]) until loaded. A module (not
    a bare tensor) so the state-dict names read `embed_tokens.weight` and `lm_head.weight`, and a
    parameter with requires_grad=False (not a buffer) so DDP neither reduces nor re-broadcasts it."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, hidden_size), requires_grad=False)

    @property
    def loaded(self) -> bool:
        return self.weight.shape[0] > 0


def _target_config(target_dir: str) -> dict:
    path = os.path.join(target_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise TargetHeadError(f"{target_dir}: no config.json (not a Hugging Face model folder)") from None


def text_config(target_config: dict) -> dict:
    """The language-model part of a target config (multimodal configs nest it under text_config)."""
    return target_config.get("text_config") or target_config


def _tensor_files(target_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the shard index or the single file's header."""
    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise TargetHeadError(f"{index}: no weight_map")
        return {name: os.path.join(target_dir, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(target_dir) if f.endswith(".safetensors"))
    if not files:
        raise TargetHeadError(f"{target_dir}: no .safetensors files")
    names: dict[str, str] = {}
    for file in files:
        path = os.path.join(target_dir, file)
        names.update({name: path for name in _header(path)[1] if name != "__metadata__"})
    return names


# bytes per read: a span of a tensor is read in chunks into pinned buffers, each copied to the
# device while the next is read. READERS threads read spans side by side: one thread reading the
# page cache into pageable memory (safetensors' get_tensor + .to) moved ~2 GB/s on the H200 host,
# 5 GB of a 27B target's embedding and head in 2.5 s of every restart.
READ_CHUNK = 32 << 20
READERS = 4
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


@dataclass
class _Span:
    path: str
    file_offset: int
    dest: torch.Tensor      # flat uint8 view of the destination tensor's bytes
    nbytes: int


def _header(path: str) -> tuple[int, dict]:
    """(offset of the data section, the JSON header) of a safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(size))
        except (ValueError, MemoryError, OverflowError):
            header = None
    if not isinstance(header, dict):
        raise TargetHeadError(f"{path}: not a safetensors file (its header does not parse)")
    return 8 + size, header


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise TargetHeadError(f"{path}: ends inside a tensor (truncated checkpoint?)")
        done += n


class _Reader(threading.local):
    """One reading thread's pinned staging buffers and copy stream."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.events: list[torch.cuda.Event | None] = []
        self.stream: torch.cuda.Stream | None = None


def _read_span(span: _Span, device: torch.device, reader: _Reader) -> None:
    fd = os.open(span.path, os.O_RDONLY)
    try:
        if device.type != "cuda":   # straight into the tensor's memory
            _pread_into(fd, memoryview(span.dest.numpy()), span.file_offset, span.path)
            return
        use_device(device)
        if reader.stream is None:
            reader.stream = torch.cuda.Stream(device)
            reader.buffers = [torch.empty(READ_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            reader.events = [None, None]
        for i, at in enumerate(range(0, span.nbytes, READ_CHUNK)):
            n = min(READ_CHUNK, span.nbytes - at)
            b = i % 2
            if reader.events[b] is not None:   # its previous copy must be through before it is refilled
                reader.events[b].synchronize()
            _pread_into(fd, memoryview(reader.buffers[b].numpy())[:n], span.file_offset + at, span.path)
            with torch.cuda.stream(reader.stream):
                span.dest[at:at + n].copy_(reader.buffers[b][:n], non_blocking=True)
                reader.events[b] = torch.cuda.Event()
                reader.events[b].record(reader.stream)
        reader.stream.synchronize()
    finally:
        os.close(fd)


def read_tensors(wanted: list[tuple[str, str]], device: str | torch.device) -> list[torch.Tensor]:
    """The tensors `(file, name)` of safetensors checkpoints on `device`, read in parallel spans."""
    device = torch.device(device)
    headers: dict[str, tuple[int, dict]] = {}
    out: list[torch.Tensor] = []
    spans: list[_Span] = []
    for path, name in wanted:
        if path not in headers:
            headers[path] = _header(path)
        data_at, header = headers[path]
        info = header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise TargetHeadError(f"{path}: tensor {name} is missing or of a dtype the drafter cannot use "
                                  f"({info.get('dtype') if isinstance(info, dict) else None})")
        begin, end = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]], device=device)
        flat = t.view(-1).view(torch.uint8)
        if flat.numel() != end - begin:
            raise TargetHeadError(f"{path}: tensor {name} holds {end - begin} bytes, its shape needs {flat.numel()}")
        out.append(t)
        per = max(READ_CHUNK, -(-flat.numel() // READERS // READ_CHUNK) * READ_CHUNK)
        spans += [_Span(path, data_at + begin + at, flat[at:at + per], min(per, flat.numel() - at))
                  for at in range(0, flat.numel(), per)]
    reader = _Reader()
    with ThreadPoolExecutor(READERS, thread_name_prefix="target-head-read") as pool:
        for f in [pool.submit(_read_span, span, device, reader) for span in spans]:
            f.result()
    return out


def read_target_head(target_dir: str, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> TargetHead:
    """Load only embed_tokens and lm_head from a target checkpoint folder (sharded or not); dtype None
    keeps the checkpoint's (bf16 for published targets: half fp32's memory, and the drafter computes
    in bf16 on GPU anyway)."""
    cfg = _target_config(target_dir)
    text = text_config(cfg)
    names = _tensor_files(target_dir)
    embed_name = next((n for n in EMBED_NAMES if n in names), None)
    if embed_name is None:
        raise TargetHeadError(f"{target_dir}: no embedding tensor among {EMBED_NAMES}")
    head_name = next((n for n in LM_HEAD_NAMES if n in names), None)
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if head_name is not None:
        embed, head = read_tensors([(names[embed_name], embed_name), (names[head_name], head_name)], device)
        tied = False
    elif tie:
        embed, = read_tensors([(names[embed_name], embed_name)], device)
        head, tied = embed, True
    else:
        raise TargetHeadError(
            f"{target_dir}: no lm_head tensor among {LM_HEAD_NAMES} and tie_word_embeddings is not set")
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    for name, t in (("embed_tokens", embed), ("lm_head", head)):
        if t.dim() != 2 or (vocab is not None and t.shape[0] != vocab) or (hidden is not None and t.shape[1] != hidden):
            raise TargetHeadError(
                f"{target_dir}: {name} has shape {tuple(t.shape)}, config says [{vocab}, {hidden}]")
    if dtype is not None:
        embed = embed.to(dtype)
        head = embed if tied else head.to(dtype)
    return TargetHead(embed_tokens=embed, lm_head=head, tied=tied)
