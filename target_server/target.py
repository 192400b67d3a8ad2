"""The frozen target: load only what capture needs, run a packed forward, hand back the captured layers.

One packed row of T tokens from D documents goes in; k planes of hidden states come out:

    input_ids [T] ─ embed ─► layer 0 ─► layer 1 ─► ... ─► layer max(layer_ids)   (stop: no later
                                │          │                     │                  layer, no final
                                ▼          ▼                     ▼                  norm, no lm_head)
    out [k, T, H]            plane i holds the output of decoder layer layer_ids[i]

Layer id l is the output of decoder layer l, i.e. Hugging Face `hidden_states[l + 1]`
(`hidden_states[0]` is the embedding output, `hidden_states[-1]` the final-normed state: neither
is ever captured). The drafter is trained and served with the same convention.

Loading builds the text decoder on the meta device truncated to max(layer_ids) + 1 layers, then
reads only those tensors from the safetensors files straight onto the device: deeper layers,
lm_head, vision tower and MTP head are never materialised. A block-wise FP8 checkpoint (e4m3
weights with 128 x 128 scales, as published) loads too: its Linear layers run FP8 matmuls on
Hopper, and are dequantized at load elsewhere (target_server.fp8); `precision` says which.

The layer loop is written out here rather than calling HF's model.forward: transformers 5.17-5.24
differ in the kwargs their forwards accept, and the token mixers must be the document-aware ones
from `varlen` (HF's Gated DeltaNet leaks across documents in a packed row). Norms, MLPs and the
attention projections are HF's own modules.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

import torch

from common.batch import BatchError, document_positions
from common.preflight import capture_layer_ids
from target_server import fp8, varlen

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Where the text decoder's tensors live in the checkpoints we load, most specific first:
# Qwen3.5 VL checkpoints ("model.language_model."), causal-LM checkpoints ("model."), bare models ("").
WEIGHT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
GDN_ATTRS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" is bf16 on CUDA and fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected auto | " + " | ".join(DTYPES))
    return DTYPES[dtype]


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _load_weights(model: torch.nn.Module, path: str, device: torch.device, dtype: torch.dtype,
                  fp8_format: fp8.BlockFp8 | None, fp8_matmul: bool) -> int:
    """Fill a meta-device model with the checkpoint tensors it names, read straight onto `device`.

    An e4m3 weight (a block-wise FP8 checkpoint) comes with its `weight_scale_inv`: with
    `fp8_matmul` its Linear becomes a `fp8.BlockFp8Linear` holding both, else it is dequantized to
    `dtype` here (`fp8.runnable`). Returns how many weights were FP8 in the checkpoint.
    """
    from safetensors import safe_open

    wanted = set(model.state_dict().keys())
    scales = {n + fp8.SCALE_SUFFIX for n in wanted if n.endswith(".weight")} if fp8_format else set()
    raw: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                local = next((name[len(p):] for p in WEIGHT_PREFIXES
                              if name.startswith(p) and (name[len(p):] in wanted or name[len(p):] in scales)), None)
                if local is not None and local not in raw:
                    raw[local] = f.get_tensor(name)
    if missing := sorted(wanted - set(raw)):
        raise RuntimeError(f"{path}: checkpoint lacks {len(missing)} tensor(s) the target needs, "
                           f"e.g. {missing[:4]}")
    state: dict[str, torch.Tensor] = {}
    quantized = 0
    for local in sorted(wanted):
        t = raw[local]
        if t.dtype != fp8.FP8_DTYPE:
            state[local] = t.to(dtype)
            continue
        scale = raw.get(local + fp8.SCALE_SUFFIX)
        if fp8_format is None:
            raise fp8.Fp8FormatError(f"{path}: {local} is float8_e4m3fn but config.json has no quantization_config")
        if scale is None:
            raise fp8.Fp8FormatError(f"{path}: {local} is float8_e4m3fn but the checkpoint has no "
                                     f"{local}{fp8.SCALE_SUFFIX}")
        module_name = local[: -len(".weight")]
        module = model.get_submodule(module_name)
        if type(module) is not torch.nn.Linear:
            raise fp8.Fp8FormatError(f"{path}: {local} is float8_e4m3fn, but {module_name} is a "
                                     f"{type(module).__name__}, not a Linear")
        model.set_submodule(module_name, fp8.runnable(module, t, scale, fp8_format.block, fp8_matmul))
        quantized += 1
    # the FP8 Linears hold their weights already: the rest is loaded by name (load() checks that
    # nothing is left on the meta device)
    model.load_state_dict(state, strict=quantized == 0, assign=True)
    return quantized


def _check_layers(layers: torch.nn.ModuleList, model_type: str) -> list[bool]:
    """Which kept layers are Gated DeltaNet; refuse layer kinds the packed path cannot keep apart."""
    is_linear = []
    for i, layer in enumerate(layers):
        for attr in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, attr):
                raise NotImplementedError(f"{model_type}: decoder layer {i} has no {attr}; unsupported target")
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            if absent := [a for a in GDN_ATTRS if not hasattr(gdn, a)]:
                raise NotImplementedError(f"{model_type}: layer {i} linear attention lacks {absent}; "
                                          f"only Qwen3.5-style Gated DeltaNet is supported")
        elif not hasattr(layer, "self_attn"):
            raise NotImplementedError(f"{model_type}: layer {i} has neither self_attn nor linear_attn")
        is_linear.append(gdn is not None)
    return is_linear


class TargetRunner:
    """Frozen target: packed forward that returns the captured layer outputs."""

    def __init__(self, model: torch.nn.Module, model_path: str, config: dict[str, Any], num_layers: int,
                 layer_ids: list[int], device: torch.device, dtype: torch.dtype, linear_backend: str,
                 precision: str = "") -> None:
        self.model = model
        self.model_path = model_path
        self.config = config
        self.num_layers = num_layers
        self.layer_ids = list(layer_ids)
        self.device = device
        self.dtype = dtype
        self.linear_backend = linear_backend
        # how the weights run (target_server.fp8): fp8-block, fp8-block-dequantized-<dtype>, or the dtype
        self.precision = precision or fp8.precision(False, False, dtype)
        text = model.config
        self.hidden_size = int(text.hidden_size)
        self.vocab_size = int(text.vocab_size)
        self._is_linear = _check_layers(model.layers, text.model_type)
        self._plane_of = {layer: i for i, layer in enumerate(self.layer_ids)}
        # Gated DeltaNet kernels run on at least this many tokens (a padding document fills the
        # rest; varlen.PackedDocs.padded): one tuned kernel shape for every packed row. 0: off.
        self.fixed_tokens = 0
        # "auto": one flash varlen call per attention layer on CUDA, SDPA per document elsewhere
        # (varlen.packed_attention); the benchmarks set the others to compare.
        self.attention_path = "auto"
        # FLA's chunk table built on the host with each batch (varlen.PackedDocs.with_fla_chunks)
        self._fla_chunk_table = linear_backend == "fla" and varlen.fla_takes_chunk_table()

    @classmethod
    def load(cls, path: str, device: str = "cpu", dtype: str = "auto", layer_ids: list[int] | None = None,
             num_capture_layers: int = 5, linear_backend: str = "auto",
             fp8_matmul: bool | None = None) -> "TargetRunner":
        """Load the decoder up to the deepest captured layer, frozen, onto `device`.

        layer_ids default to common.config.default_layer_ids(L, num_capture_layers); they must be
        strictly increasing and inside [0, L). linear_backend: auto | torch | fla (see varlen).
        A block-wise FP8 checkpoint (target_server.fp8) runs its FP8 matmuls where cuBLAS's
        block-scaled FP8 GEMM runs (Hopper, bf16; measured 1.45x bf16's matmuls at the 27B shapes,
        docs/benchmarks.md) and is dequantized at load elsewhere: the FP8 model's weights in `dtype`
        matmuls. fp8_matmul=True asks for FP8 matmuls wherever they can run (Triton's GEMM where
        cuBLAS's cannot; raises where none can), False always dequantizes.
        """
        from transformers import AutoConfig, AutoModel

        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config_dict = json.load(f)
        fp8_format = fp8.read_format(config_dict)
        text_cfg = AutoConfig.from_pretrained(path).get_text_config()
        num_layers = int(text_cfg.num_hidden_layers)
        ids = capture_layer_ids(num_layers, list(layer_ids or []), num_capture_layers)
        keep = ids[-1] + 1
        layer_types = list(getattr(text_cfg, "layer_types", None) or [])[:keep]
        if "sliding_attention" in layer_types and getattr(text_cfg, "use_sliding_window", True):
            raise NotImplementedError("sliding-window attention layers are not supported by the packed forward")
        d = text_cfg.to_dict()
        d.update(num_hidden_layers=keep, use_cache=False)
        d.pop("quantization_config", None)   # quantized weights are ours to load (_load_weights)
        if layer_types:
            d["layer_types"] = layer_types
        trunc_cfg = type(text_cfg).from_dict(d)

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch_dtype = resolve_dtype(dtype, dev)
        backend = varlen.resolve_backend(linear_backend, dev)
        if dev.type == "cuda":
            # One SDPA call per document, each a new sequence length: cuDNN's attention builds an
            # execution plan for every new shape (reported at ~0.4 s per shape with torch 2.11),
            # flash attention does not. Process-wide; the target server runs nothing else.
            torch.backends.cuda.enable_cudnn_sdp(False)
        unavailable = fp8.fp8_matmul_unavailable(dev)
        if fp8_format is not None and fp8_matmul and unavailable:
            raise RuntimeError(f"FP8 matmuls cannot run on {dev}: {unavailable}")
        if fp8_matmul is None:
            fp8_matmul = torch_dtype == torch.bfloat16 and fp8.cublas_block_gemm_unavailable(dev) is None
        use_fp8 = fp8_format is not None and bool(fp8_matmul)
        impl = varlen.register_packed_attention()
        with torch.device("meta"):
            model = AutoModel.from_config(trunc_cfg, attn_implementation=impl, dtype=torch_dtype)
        quantized = _load_weights(model, path, dev, torch_dtype, fp8_format, use_fp8)
        precision = fp8.precision(fp8_format is not None, use_fp8, torch_dtype)
        if fp8_format is not None and not use_fp8:
            log.info("target %s: block-wise FP8 checkpoint, %d weights dequantized to %s at load (%s): the FP8 "
                     "model's weights, activations not quantized", path, quantized, torch_dtype,
                     unavailable or "cuBLAS has no block-scaled FP8 GEMM here")
        # Non-persistent buffers (RoPE inverse frequencies) are not in the checkpoint: rebuild on device.
        with torch.device(dev):
            model.rotary_emb = type(model.rotary_emb)(config=model.config)
        if still_meta := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
            raise RuntimeError(f"{path}: tensors left uninitialised after loading: {still_meta[:4]}")
        model.eval().requires_grad_(False)
        runner = cls(model, path, config_dict, num_layers, ids, dev, torch_dtype, backend, precision)
        log.info("target %s: %d of %d layers kept, capture %s, %s (%s) on %s, linear backend %s",
                 path, keep, num_layers, ids, precision, torch_dtype, dev, backend)
        return runner

    def fix_linear_shape(self, num_tokens: int) -> "TargetRunner":
        """Run the FLA kernels on `num_tokens` tokens per row (the token budget): no re-tuning per
        row length. The torch path loops over documents and gains nothing, so it is left alone."""
        if self.linear_backend == "fla":
            self.fixed_tokens = num_tokens
        return self

    def _check_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      doc_lens: torch.Tensor) -> None:
        """Refuse a batch that would crash the forward (on CUDA: a device assert) or mix documents."""
        for name, x in (("input_ids", input_ids), ("position_ids", position_ids), ("doc_lens", doc_lens)):
            if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
                raise BatchError(f"{name}: expected a 1-d integer tensor, got {x.dtype} {tuple(x.shape)}")
        t = input_ids.shape[0]
        if t == 0 or position_ids.shape[0] != t:
            raise BatchError(f"input_ids has {t} tokens, position_ids {position_ids.shape[0]}")
        lens = doc_lens.cpu().to(torch.int64)
        if lens.numel() == 0 or bool((lens <= 0).any()) or int(lens.sum()) != t:
            raise BatchError(f"doc_lens {lens.tolist()[:8]} must be positive and sum to {t}")
        ids = input_ids.cpu()
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise BatchError(f"input_ids outside [0, {self.vocab_size}): min {lo}, max {hi}")
        if not torch.equal(position_ids.cpu().to(torch.int64), document_positions(lens)):
            raise BatchError("position_ids do not restart at 0 in every document")

    def _new_out(self, num_tokens: int) -> torch.Tensor:
        return torch.empty(len(self.layer_ids), num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)

    def _check_out(self, out: torch.Tensor, num_tokens: int) -> None:
        want = (len(self.layer_ids), num_tokens, self.hidden_size)
        if tuple(out.shape) != want or out.dtype != self.dtype:
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)}, expected {self.dtype} {want}")

    def _decoder_layer(self, i: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       docs: varlen.PackedDocs, linear_docs: varlen.PackedDocs) -> torch.Tensor:
        """HF's pre-norm residual block with the document-aware token mixer in the middle."""
        layer = self.model.layers[i]
        mixed = layer.input_layernorm(hidden)
        if self._is_linear[i]:
            mixed = varlen.gated_deltanet_forward(layer.linear_attn, mixed, linear_docs, backend=self.linear_backend)
        else:
            mixed, _ = layer.self_attn(hidden_states=mixed, position_embeddings=rope, attention_mask=None,
                                       **{varlen.DOCS_KWARG: docs, varlen.ATTENTION_PATH_KWARG: self.attention_path})
        hidden = hidden + mixed
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_lens: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed forward over one row; returns hidden [k, T, H] (self.dtype), plane i = layer layer_ids[i].

        input_ids/position_ids [T] (position ids restart at 0 per document), doc_lens [D] summing to T.
        `out` (e.g. a slot view or a device staging buffer) receives the planes when given; if it
        lives on another device the copies are queued non-blocking on the current stream, so record
        an event after this returns before reading it. Raises BatchError on inconsistent input.
        """
        self._check_inputs(input_ids, position_ids, doc_lens)
        t = input_ids.shape[0]
        if out is None:
            out = self._new_out(t)
        else:
            self._check_out(out, t)
        non_blocking = out.device != self.device
        # Triton (FLA) launches on the *current* device: make it ours when one process drives several GPUs.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            host_docs = varlen.PackedDocs.from_doc_lens(doc_lens)
            linear_docs = host_docs.padded(self.fixed_tokens)
            if self._fla_chunk_table:
                linear_docs = linear_docs.with_fla_chunks()
            # one copy that does not wait for the previous batch's forward: the host keeps launching
            ids, pos, docs, linear_docs = varlen.to_device(self.device, input_ids.to(torch.int64),
                                                           position_ids.to(torch.int64), host_docs, linear_docs)
            ids, pos = ids.unsqueeze(0), pos.unsqueeze(0)
            hidden = self.model.embed_tokens(ids)
            # Qwen3.5's multimodal RoPE takes (3, batch, T) position rows; transformers 5.24 broadcasts a
            # (batch, T) tensor itself but 5.17 (the GPU host) indexes three dimensions.
            rope_pos = pos[None].expand(3, -1, -1) if hasattr(self.model.rotary_emb, "mrope_section") else pos
            rope = self.model.rotary_emb(hidden, rope_pos)
            for i in range(self.layer_ids[-1] + 1):
                hidden = self._decoder_layer(i, hidden, rope, docs, linear_docs)
                if (plane := self._plane_of.get(i)) is not None:
                    out[plane].copy_(hidden[0], non_blocking=non_blocking)
        return out

    @torch.no_grad()
    def capture_unpacked(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One document through transformers' own forward (the audit's reference); [k, T, H]."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise BatchError(f"capture_unpacked takes one non-empty document [T], got {tuple(input_ids.shape)}")
        t = input_ids.shape[0]
        self._check_inputs(input_ids, torch.arange(t), torch.tensor([t]))
        out = self._new_out(t)

        def keep(plane: int) -> Any:
            def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
                out[plane].copy_((output[0] if isinstance(output, tuple) else output)[0])
            return hook

        handles = [self.model.layers[layer].register_forward_hook(keep(p)) for p, layer in enumerate(self.layer_ids)]
        try:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                self.model(input_ids=input_ids.to(self.device, torch.int64).unsqueeze(0), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return out

    def warmup(self, num_tokens: int, num_docs: int = 4) -> float:
        """One capture of a synthetic batch of `num_tokens` tokens (kernel autotune happens here); seconds."""
        if num_tokens < num_docs or num_docs < 1:
            raise ValueError(f"warmup: need num_tokens >= num_docs >= 1, got {num_tokens}, {num_docs}")
        lens = torch.full((num_docs,), num_tokens // num_docs, dtype=torch.int32)
        lens[-1] += num_tokens - int(lens.sum())
        ids = torch.arange(num_tokens, dtype=torch.int64) % self.vocab_size
        start = time.perf_counter()
        self.capture(ids, document_positions(lens), lens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start
