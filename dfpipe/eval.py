"""dfpipe eval: speculative decoding with a DFlash drafter, its acceptance length, and a lossless check.

One prompt (docs/architecture.md, "Speculative decoding check"). Positions count tokens of the whole
sequence (prompt + output):

    prefill   target(prompt[0..P-1])        -> first token x[P] (greedy), features of 0..P-1 = context
    step      anchor a = last verified token, at position p = len(context)
              drafter(context, [x[p], MASK x (B-1)] at positions p..p+B-1)  -> draft d[1..B-1]
              target([x[0..p], d[1..B-1]])   -> g[k] = target's greedy choice for position p+k, k = 1..B
                                                 (g[k] reads logits at p+k-1: it sees only x[..p] and d[..k-1])
              accept n = longest run with d[k] == g[k]  (0 <= n <= B-1), then the bonus g[n+1]
              output += d[1..n], g[n+1];  context += features of positions p..p+n (all verified)
    stop      at <|im_end|> / eos (kept) or max_new_tokens

Every step costs one target forward and yields n + 1 tokens: tau = mean(n + 1) over the steps,
bonus included (B when every draft is accepted, 1 when none is). Acceptance at block position k
is the share of steps with n >= k. The prefill forward is not a step (plain decoding pays it too).

The target forward recomputes the whole sequence every step instead of keeping a KV cache: a
hybrid target's Gated-DeltaNet state cannot be rolled back past rejected draft tokens without
snapshots, and at toy sizes O(n^2) is cheap. Correctness is what this command checks: the output
must equal plain greedy decoding of the target (also by full recompute), token for token; a
difference is an error naming the prompt, the first differing position and the reference's top-2
logit margin there (a margin near 0 is a floating-point near-tie, anything else is a bug).

Captured layer l is the output of decoder layer l (a forward hook; HF `hidden_states[l + 1]`),
the convention the drafter was trained with (target_server.target).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from dfpipe.cpu_fla import quiet_fla_on_cpu
from target_server import fp8

log = logging.getLogger(__name__)

IM_END = "<|im_end|>"
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


class EvalError(ValueError):
    """Inputs eval cannot use (missing folders, a drafter that does not fit the target, no prompts)."""


# ---- the target -------------------------------------------------------------------------------
class TargetModel:
    """A frozen HF causal LM: logits of every position, and the captured layers when asked.

    `forward(ids)` runs the whole sequence (no cache) and returns (logits [n, V] fp32,
    features [k, n, H] or None); plane i is the output of decoder layer layer_ids[i].
    """

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int] = (), precision: str = "") -> None:
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = [int(i) for i in layer_ids]
        self.device = next(model.parameters()).device
        # how the target runs (target_server.fp8): fp8-block, fp8-block-dequantized-<dtype>, or its dtype
        self.precision = precision or fp8.precision(False, False, model.get_input_embeddings().weight.dtype)
        layers = self._decoder_layers()
        if any(not 0 <= i < len(layers) for i in self.layer_ids):
            raise EvalError(f"captured layers {self.layer_ids} outside the target's {len(layers)} decoder layers")
        self._captured: dict[int, torch.Tensor] = {}
        for plane, layer in enumerate(self.layer_ids):
            layers[layer].register_forward_hook(self._keep(plane))

    def _decoder_layers(self) -> torch.nn.ModuleList:
        base = getattr(self.model, "model", self.model)
        base = getattr(base, "language_model", base)
        if not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
            raise EvalError(f"{type(self.model).__name__}: cannot find its decoder layers")
        return base.layers

    def _keep(self, plane: int) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            self._captured[plane] = (output[0] if isinstance(output, tuple) else output)[0]
        return hook

    @classmethod
    def load(cls, path: str, device: torch.device, layer_ids: Sequence[int] = (),
             dtype: torch.dtype | None = None) -> "TargetModel":
        """from_pretrained onto device; dtype default: fp32 on CPU, the checkpoint's own on CUDA.

        A block-wise FP8 target runs as the target server runs it (target_server.fp8, which says why
        not with transformers' own FP8 support): loaded unquantized, its FP8 weights converted here
        (`load_fp8_weights`): FP8 matmuls where the device has them, dequantized weights elsewhere."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise EvalError(f"target {path!r} is not a model folder (no config.json)")
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                fmt = fp8.read_format(json.load(f))
        except (ValueError, AttributeError) as e:    # not JSON, not an object, a quantization we cannot run
            raise EvalError(f"target {path}: {e}") from None
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else "auto"
        if fmt is None:
            return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device), layer_ids)
        config = AutoConfig.from_pretrained(path)
        for c in (config, config.get_text_config()):
            if hasattr(c, "quantization_config"):
                del c.quantization_config
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()   # its load report would list every weight_scale_inv as unexpected
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).to(device)
        finally:
            hf_logging.set_verbosity(verbosity)
        fp8_matmul = fp8.fp8_matmul_unavailable(device) is None
        load_fp8_weights(model, path, fmt, fp8_matmul)
        return cls(model, layer_ids, fp8.precision(True, fp8_matmul, model.get_input_embeddings().weight.dtype))

    @torch.no_grad()
    def forward(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._captured.clear()
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=input_ids, use_cache=False).logits[0].float()
        if not self.layer_ids:
            return logits, None
        return logits, torch.stack([self._captured[p] for p in range(len(self.layer_ids))])


def load_fp8_weights(model: torch.nn.Module, path: str, fmt: fp8.BlockFp8, fp8_matmul: bool) -> int:
    """Each Linear of `model` whose weight the checkpoint at `path` holds in e4m3, rebuilt from that
    weight and its block scales (`fp8.runnable`): what `from_pretrained` put there (the raw e4m3
    values, unscaled) is replaced. Checkpoint and model names are matched the way the target server
    matches them (target.WEIGHT_PREFIXES), so FP8 tensors of modules the model lacks (MTP, vision)
    are left alone. Returns how many were rebuilt."""
    from safetensors import safe_open

    from target_server.target import WEIGHT_PREFIXES, checkpoint_files

    def local(name: str) -> str:
        return next(name[len(p):] for p in WEIGHT_PREFIXES if name.startswith(p))

    params = {local(n): n for n, _ in model.named_parameters()}
    device = next(model.parameters()).device
    where: dict[str, str] = {}
    e4m3: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                where[name] = file
                if f.get_slice(name).get_dtype() == "F8_E4M3" and local(name) in params:
                    e4m3.append(name)

    def read(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt", device=str(device)) as f:
            return f.get_tensor(name)

    for name in e4m3:
        if name + fp8.SCALE_SUFFIX not in where:
            raise EvalError(f"target {path}: {name} is e4m3 but the checkpoint has no {name}{fp8.SCALE_SUFFIX}")
        module_name = params[local(name)].removesuffix(".weight")
        module = model.get_submodule(module_name)
        if type(module) is not torch.nn.Linear:
            raise EvalError(f"target {path}: {name} is e4m3 but {module_name} is a {type(module).__name__}")
        model.set_submodule(module_name, fp8.runnable(module, read(name), read(name + fp8.SCALE_SUFFIX), fmt.block,
                                                      fp8_matmul))
    return len(e4m3)


def stop_token_ids(tokenizer: Any) -> set[int]:
    """Tokens that end an answer: the chat turn end `<|im_end|>` and eos (whichever exist)."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)}
    return {int(i) for i in ids if i is not None and i != tokenizer.unk_token_id}


def truncate_output(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The first max_new_tokens tokens, cut after the first stop token (which is kept)."""
    tokens = tokens[:max_new_tokens]
    return tokens[:next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))]


@dataclass
class GreedyOutput:
    tokens: list[int]
    margins: list[float]    # top-1 minus top-2 logit at each chosen token (near 0: a numerical coin toss)


def greedy_decode(target: TargetModel, prompt: Sequence[int], max_new_tokens: int, stop_ids: set[int]
                  ) -> GreedyOutput:
    """Plain greedy decoding, one full forward per token: the reference speculative decoding must equal."""
    ids, out, margins = list(prompt), [], []
    for _ in range(max_new_tokens):
        logits, _ = target.forward(ids)
        top = torch.topk(logits[-1], 2)
        token = int(top.indices[0])
        out.append(token)
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(token)
        if token in stop_ids:
            break
    return GreedyOutput(out, margins)


# ---- the drafter ------------------------------------------------------------------------------
def single_block(context_len: int, anchor_token: int, block_size: int, mask_token_id: int,
                 device: torch.device) -> Any:
    """The BlockBatch of one decode step: one block at position context_len over one document.

    Training cuts blocks out of a packed row whose tokens all have context features; at decode
    time the anchor is the newest verified token and has none yet, so the block is described
    directly: it sees every context position (all < anchor position = context_len).
    """
    from drafter_trainer.blocks import IGNORE_INDEX, BlockBatch

    positions = context_len + torch.arange(block_size, device=device)
    block_input_ids = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=device)
    block_input_ids[0, 0] = anchor_token
    return BlockBatch(
        block_input_ids=block_input_ids,
        block_positions=positions[None, :],
        labels=torch.full((1, block_size), IGNORE_INDEX, dtype=torch.long, device=device),
        weights=torch.zeros(1, block_size, device=device),
        anchors=torch.tensor([context_len], device=device),
        anchor_doc=torch.zeros(1, dtype=torch.long, device=device),
        valid=torch.ones(1, dtype=torch.bool, device=device),
        context_doc=torch.zeros(context_len, dtype=torch.long, device=device),
        context_positions=torch.arange(context_len, device=device),
    )


@torch.no_grad()
def draft_block(drafter: Any, context: torch.Tensor, anchor_token: int) -> list[int]:
    """The drafter's B-1 guesses after anchor_token, from the target's features of the context [k, S, H]."""
    cfg = drafter.config
    blocks = single_block(context.shape[1], anchor_token, cfg.block_size, cfg.mask_token_id, context.device)
    hidden = drafter(context, blocks.block_input_ids, blocks)          # [1, B, H]
    return drafter.compute_logits(hidden[0, 1:]).argmax(-1).tolist()


def accept_length(draft: Sequence[int], verified: Sequence[int]) -> int:
    """How many leading draft tokens equal the target's own greedy choices."""
    return next((n for n, (d, v) in enumerate(zip(draft, verified)) if d != v), len(draft))


@dataclass
class SpeculativeOutput:
    tokens: list[int]
    accepted: list[int]     # drafted tokens accepted at each step (0..B-1), before truncation at a stop


def speculative_decode(target: TargetModel, drafter: Any, prompt: Sequence[int], max_new_tokens: int,
                       stop_ids: set[int]) -> SpeculativeOutput:
    """DFlash decoding of one prompt (the loop in the module docstring), B = drafter.config.block_size."""
    if not prompt:
        raise EvalError("empty prompt")
    block_size = drafter.config.block_size
    logits, context = target.forward(prompt)
    out = [int(logits[-1].argmax())]
    accepted: list[int] = []
    while out[-1] not in stop_ids and len(out) < max_new_tokens:
        p = context.shape[1]                                   # the anchor's position
        draft = draft_block(drafter, context, out[-1])
        logits, features = target.forward([*prompt, *out, *draft])
        verified = logits[p:p + block_size].argmax(-1).tolist()  # verified[k-1] = choice for position p+k
        n = accept_length(draft, verified)
        accepted.append(n)
        out += draft[:n] + [verified[n]]
        context = torch.cat([context, features[:, p:p + n + 1]], dim=1)
        if any(t in stop_ids for t in out[-(n + 1):]):
            break
    return SpeculativeOutput(truncate_output(out, max_new_tokens, stop_ids), accepted)


# ---- prompts ----------------------------------------------------------------------------------
@dataclass
class Prompts:
    token_ids: list[list[int]]
    source_lines: list[int]             # 1-based line of each prompt in the file
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (line, reason)
    kind: str = "text"                  # "chat" (JSONL with messages) or "text" (one prompt per line)


def prompt_turns(conversation: Any) -> list[dict[str, Any]] | str:
    """The turns of a conversation before its first assistant turn (the prompt), or why it has none."""
    answer = next((i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"), None)
    prefix = conversation.messages[:answer]
    if not any(m["role"] == "user" for m in prefix):
        return "no user turn before the first assistant turn"
    return prefix


def chat_prompt_turns(row: Any) -> list[dict[str, Any]] | str:
    """The prompt turns of one chat row (OpenAI or ShareGPT, read as prepare-data reads it), or why the
    row is unusable."""
    from target_server.data import ROW_FORMATS, detect_format, parse_row

    fmt = detect_format(row) if isinstance(row, dict) else "openai"
    if fmt is None:
        return f"missing {' or '.join(map(repr, ROW_FORMATS.values()))}"
    conversation, reason = parse_row(row, fmt, None, need_answer=False)
    return reason if conversation is None else prompt_turns(conversation)


def _is_chat_file(path: str) -> bool:
    """Chat rows: a Parquet file, or one whose first non-empty line is a JSON object or array (or
    opens one: a pretty-printed file); else text prompts, one a line ("[INST] ..." included)."""
    from target_server.data import read_lines

    if path.endswith(".parquet"):
        return True
    first = next((text for _, text, _ in read_lines(path) if text is None or text.strip()), None)
    first = first.strip() if first is not None else None     # None: no line, or not UTF-8 (reported per line)
    if first in ("{", "["):
        return True
    try:
        return isinstance(json.loads(first), (dict, list)) if first else False
    except RecursionError:   # JSON nested too deep to parse: a chat row, reported bad by ChatRows
        return True
    except ValueError:
        return False


def load_prompts(path: str, tokenizer: Any, limit: int = 0) -> Prompts:
    """Prompt token ids from a chat file (JSONL or Parquet) or a text file (one prompt per line).

    A chat file's rows are read and checked by prepare-data's own row parser (`ChatRows`: OpenAI
    `messages` or ShareGPT `conversations`, a UTF-8 BOM accepted, control tokens refused), so every
    row prepare-data accepts is a prompt here: the turns before its first assistant turn (a row
    without an answer is a prompt too), with the row's tools. A text line becomes one user turn.
    Both are rendered with the tokenizer's chat template plus the generation prompt (raw text when
    the tokenizer has no template). Unusable rows are skipped, counted and logged, never fatal.
    """
    from target_server.data import ChatRows, control_tokens, read_lines

    if not os.path.isfile(path):
        raise EvalError(f"prompts file not found: {path}")
    kind = "chat" if _is_chat_file(path) else "text"
    has_template = bool(getattr(tokenizer, "chat_template", None))
    result = Prompts([], [], kind=kind)
    rows: Any = (ChatRows(path, control_tokens=control_tokens(tokenizer), need_answer=False) if kind == "chat"
                 else ((line, text, reason) for line, text, reason in read_lines(path) if text is None or text.strip()))
    for line_no, item, reason in rows:
        if limit and len(result.token_ids) >= limit:
            break
        tools = None
        if kind == "chat" and item is not None:
            turns, tools = prompt_turns(item), item.tools
            reason = turns if isinstance(turns, str) else ""
        elif item is not None:
            turns = [{"role": "user", "content": item}]
        if reason:
            result.skipped.append((line_no, reason))
            log.warning("prompts %s line %d skipped: %s", path, line_no, reason)
            continue
        if has_template:
            ids = tokenizer.apply_chat_template(turns, tools=tools, tokenize=True, add_generation_prompt=True,
                                                return_dict=True)["input_ids"]
        else:
            ids = tokenizer("\n".join(m["content"] for m in turns), add_special_tokens=True)["input_ids"]
        result.token_ids.append(list(ids))
        result.source_lines.append(line_no)
    return result


# ---- the evaluation ---------------------------------------------------------------------------
@dataclass
class Mismatch:
    prompt: int                 # index among the evaluated prompts
    line: int                   # line in the prompts file
    position: int               # first differing output position (0 = first generated token)
    speculative: int | None     # token there (None: the output ended earlier)
    greedy: int | None
    greedy_margin: float | None  # reference's top-1 minus top-2 logit at that position


@dataclass
class EvalReport:
    target: str
    drafter: str
    device: str
    block_size: int
    prompts: int
    prompts_skipped: int
    generated_tokens: int               # speculative output tokens, all prompts
    target_forwards: int                # verify steps (prefill excluded)
    tau: float                          # tokens per target forward, bonus included
    acceptance_per_position: list[float]  # [B-1]: share of steps whose draft was accepted through position k
    accepted_histogram: list[int]       # [B]: steps that accepted n = 0..B-1 drafted tokens
    lossless: bool
    mismatches: list[Mismatch]
    speculative_seconds: float
    greedy_seconds: float
    warnings: list[str] = field(default_factory=list)   # pairing doubts (check_pairing), also on stderr
    target_precision: str = ""          # how the target ran here (target_server.fp8): fp8-block, bf16, ...
    trained_precision: str = ""         # how it ran when the drafter was trained (its export's record; "": none)


def summarize(accepted: list[int], block_size: int) -> tuple[float, list[float], list[int]]:
    """(tau, acceptance per block position 1..B-1, histogram of n) from the per-step accepted counts."""
    histogram = [accepted.count(n) for n in range(block_size)]
    steps = len(accepted)
    if steps == 0:
        return 0.0, [0.0] * (block_size - 1), histogram
    tau = sum(n + 1 for n in accepted) / steps
    per_position = [sum(n >= k for n in accepted) / steps for k in range(1, block_size)]
    return tau, per_position, histogram


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts), None if equal."""
    end = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), end)


def evaluate(target: TargetModel, drafter: Any, prompts: Prompts, max_new_tokens: int, stop_ids: set[int],
             target_name: str = "", drafter_name: str = "",
             references: dict[int, GreedyOutput] | None = None) -> EvalReport:
    """Speculative and plain greedy decoding of every prompt; tau, acceptance, the lossless check.

    references: greedy outputs by prompt index, filled in here; pass the same dict when evaluating
    several drafters against one target with the same prompts and settings to decode greedily once.
    """
    references = {} if references is None else references
    block_size = drafter.config.block_size
    accepted: list[int] = []
    mismatches: list[Mismatch] = []
    generated = 0
    spec_s = greedy_s = 0.0
    for i, prompt in enumerate(prompts.token_ids):
        t = time.perf_counter()
        spec = speculative_decode(target, drafter, prompt, max_new_tokens, stop_ids)
        spec_s += time.perf_counter() - t
        if i not in references:
            t = time.perf_counter()
            references[i] = greedy_decode(target, prompt, max_new_tokens, stop_ids)
            greedy_s += time.perf_counter() - t
        reference = references[i]
        accepted += spec.accepted
        generated += len(spec.tokens)
        if (pos := first_difference(spec.tokens, reference.tokens)) is not None:
            mismatch = Mismatch(
                prompt=i, line=prompts.source_lines[i], position=pos,
                speculative=spec.tokens[pos] if pos < len(spec.tokens) else None,
                greedy=reference.tokens[pos] if pos < len(reference.tokens) else None,
                greedy_margin=reference.margins[pos] if pos < len(reference.margins) else None)
            mismatches.append(mismatch)
            log.error("prompt %d (line %d): speculative output differs from greedy at position %d: %s vs %s "
                      "(greedy top-2 margin %s)", i, mismatch.line, pos, mismatch.speculative, mismatch.greedy,
                      mismatch.greedy_margin)
    tau, per_position, histogram = summarize(accepted, block_size)
    return EvalReport(
        target=target_name, drafter=drafter_name, device=str(target.device), block_size=block_size,
        prompts=len(prompts.token_ids), prompts_skipped=len(prompts.skipped), generated_tokens=generated,
        target_forwards=len(accepted), tau=tau, acceptance_per_position=per_position,
        accepted_histogram=histogram, lossless=not mismatches, mismatches=mismatches,
        speculative_seconds=round(spec_s, 3), greedy_seconds=round(greedy_s, 3), target_precision=target.precision)


def render(report: EvalReport) -> str:
    lines = [
        f"dfpipe eval: {report.prompts} prompts ({report.prompts_skipped} skipped), block size {report.block_size}, "
        f"device {report.device}",
        f"  target  {report.target} ({report.target_precision}; the drafter was trained on "
        f"{report.trained_precision or 'a precision its export does not record'})",
        f"  drafter {report.drafter}",
        f"tau {report.tau:.3f} tokens per target forward (bonus included): {report.generated_tokens} tokens, "
        f"{report.target_forwards} verify forwards",
        "acceptance by block position: " + " ".join(
            f"{k}:{a:.2f}" for k, a in enumerate(report.acceptance_per_position, start=1)),
        f"time: speculative {report.speculative_seconds:.1f} s, plain greedy {report.greedy_seconds:.1f} s "
        "(both recompute the full sequence each forward)",
    ]
    lines += [f"WARNING: {w}" for w in report.warnings]
    if report.lossless:
        lines.append("lossless: OK, every output equals plain greedy decoding token for token")
    else:
        lines.append(f"lossless: FAILED on {len(report.mismatches)} of {report.prompts} prompts")
        for m in report.mismatches[:10]:
            lines.append(f"  prompt {m.prompt} (line {m.line}): first difference at output position {m.position}: "
                         f"speculative {m.speculative}, greedy {m.greedy} (greedy top-2 margin {m.greedy_margin})")
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------------------
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"device {name}: CUDA is not available")
    return device


def with_block_size(drafter: Any, block_size: int) -> Any:
    """The same drafter shaped for another block size (block size is a shape, not a weight)."""
    from drafter_trainer.model import DFlashDraftModel

    if block_size == drafter.config.block_size:
        return drafter
    resized = DFlashDraftModel(dataclasses.replace(drafter.config, block_size=block_size),
                               split_fc=drafter.split_fc, attn_impl=drafter.attn_impl)
    resized.load_trainable_state_dict(drafter.trainable_state_dict())
    resized.set_target_head(drafter.embed_tokens.weight, drafter.lm_head.weight)
    return resized.to(drafter.fc.weight.device).eval()


def check_pairing(drafter_dir: str, target_dir: str) -> list[str]:
    """Refuse a drafter that does not fit the target; return warnings about whether it was trained on it.

    Refused (EvalError): a target whose hidden size, vocabulary or layer count differ from the ones
    in the drafter's config.json, or that lacks a layer the drafter reads (target_layer_ids). The
    shapes can fit a target the drafter never saw (two models of one family), so the export's record
    of its target (`dfpipe.target_config_sha256`, written by `dfpipe export`) is compared with this
    target's config.json: a different one, or none recorded, is a warning, since tau then measures
    nothing useful.
    """
    from drafter_trainer.export import (CONFIG_FILE, DFPIPE_KEY, ExportError, check_target, read_target_config,
                                        target_fingerprint)
    from drafter_trainer.model import DFlashConfig

    if not os.path.isdir(drafter_dir):
        raise EvalError(f"drafter folder not found: {drafter_dir}")
    try:
        with open(os.path.join(drafter_dir, CONFIG_FILE), encoding="utf-8") as f:
            exported = json.load(f)
        config = DFlashConfig.from_json_dict(exported)
        check_target(config, target_dir)
        target_config = read_target_config(target_dir)
    except FileNotFoundError:
        raise EvalError(f"drafter {drafter_dir}: no {CONFIG_FILE} (not a dfpipe export)") from None
    except ExportError as e:
        raise EvalError(f"drafter {drafter_dir}: {e}") from None
    except (ValueError, AttributeError) as e:       # not JSON, not an object, fields missing (DrafterConfigError)
        raise EvalError(f"drafter {drafter_dir}: unreadable {CONFIG_FILE} ({e})") from None
    recorded = exported.get(DFPIPE_KEY) if isinstance(exported.get(DFPIPE_KEY), dict) else {}
    fingerprint = recorded.get("target_config_sha256")
    if not fingerprint:
        return [f"the drafter {drafter_dir} records no target it was trained on; its shape fits {target_dir}, "
                f"but tau means something only if that is its target (`dfpipe export --target FOLDER` "
                f"records it)"]
    if fingerprint != target_fingerprint(target_config):
        return [f"the drafter {drafter_dir} was trained on another target ({recorded.get('target', 'unnamed')}, "
                f"whose config.json differs from {target_dir}'s): its shape fits, but tau measures a "
                f"drafter paired with a target it never saw"]
    return []


def check_precision(drafter_dir: str, running: str) -> tuple[str, list[str]]:
    """The target precision the drafter was trained on (its export's `dfpipe.target_precision`; ""
    when it records none), and a warning when the target here runs in another: the drafter then
    predicts features it never saw (an FP8 model's differ from its bf16 model's), and tau measures
    that pairing, not the one it was trained for."""
    from drafter_trainer.export import CONFIG_FILE, DFPIPE_KEY

    try:
        with open(os.path.join(drafter_dir, CONFIG_FILE), encoding="utf-8") as f:
            recorded = json.load(f).get(DFPIPE_KEY)
    except (OSError, ValueError, AttributeError):
        return "", []
    trained = str(recorded.get("target_precision") or "") if isinstance(recorded, dict) else ""
    if not trained or trained == running:
        return trained, []
    return trained, [f"the drafter {drafter_dir} was trained on the target in {trained}, this eval runs it in "
                     f"{running}: tau measures the drafter on features it was not trained on (evaluate on the "
                     f"precision it was trained for, e.g. the FP8 checkpoint on a Hopper GPU for fp8-block)"]


def load_models(target_dir: str, drafter_dir: str, device: torch.device, block_size: int = 0,
                target_dtype: torch.dtype | None = None) -> tuple[TargetModel, Any]:
    """The drafter (with the target's embed_tokens/lm_head; block_size 0: as trained) and the target
    capturing the drafter's target_layer_ids. Call check_pairing first for a clear refusal of a
    drafter that does not fit the target."""
    from drafter_trainer.export import ExportError, load_drafter

    if not os.path.isdir(drafter_dir):
        raise EvalError(f"drafter folder not found: {drafter_dir}")
    try:
        drafter = load_drafter(drafter_dir, target_dir, device=device)
    except (ExportError, ValueError, FileNotFoundError) as e:
        raise EvalError(f"cannot load the drafter {drafter_dir} with target {target_dir}: {e}") from e
    if block_size:
        if block_size < 2:
            raise EvalError(f"block size must be >= 2, got {block_size}")
        drafter = with_block_size(drafter, block_size)
    target = TargetModel.load(target_dir, device, drafter.config.target_layer_ids, dtype=target_dtype)
    hidden = int(target.model.config.hidden_size)
    if hidden != drafter.config.hidden_size:
        raise EvalError(f"drafter hidden size {drafter.config.hidden_size} != target hidden size {hidden}")
    return target, drafter


def main(args: argparse.Namespace) -> int:
    """`dfpipe eval`: args.target, drafter, prompts, block_size (0: the drafter's), max_new_tokens, limit,
    device, json. Exit 0 when lossless, 1 on any mismatch, 2 on unusable inputs (a drafter that does
    not fit the target included)."""
    quiet_fla_on_cpu()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.max_new_tokens < 1:
            raise EvalError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        device = _device(args.device)
        warnings = check_pairing(args.drafter, args.target)
        for warning in warnings:
            print(f"dfpipe eval: WARNING: {warning}", file=sys.stderr)
        target, drafter = load_models(args.target, args.drafter, device, args.block_size)
        trained_precision, precision_warnings = check_precision(args.drafter, target.precision)
        for warning in precision_warnings:
            print(f"dfpipe eval: WARNING: {warning}", file=sys.stderr)
        warnings += precision_warnings
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.target)
        except Exception as e:  # transformers raises many types for a folder without a tokenizer
            raise EvalError(f"cannot load the target's tokenizer from {args.target}: {e}") from e
        prompts = load_prompts(args.prompts, tokenizer, args.limit)
        if not prompts.token_ids:
            from target_server.data import unusable_file_fix
            fix = unusable_file_fix(args.prompts)
            raise EvalError("\n".join([f"no usable prompt in {args.prompts}" + (f": {fix}" if fix else ""),
                                       *(f"  line {line}: {reason}" for line, reason in prompts.skipped[:3])]))
    except EvalError as e:
        print(f"dfpipe eval: {e}", file=sys.stderr)
        return EXIT_USAGE
    report = evaluate(target, drafter, prompts, args.max_new_tokens, stop_token_ids(tokenizer),
                      target_name=args.target, drafter_name=args.drafter)
    report.warnings = warnings
    report.trained_precision = trained_precision
    if args.json:
        print(json.dumps(asdict(report), indent=1))
    else:
        print(render(report))
    if not report.lossless:
        print(f"dfpipe eval: ERROR: speculative decoding is not lossless on {len(report.mismatches)} prompt(s); "
              f"first at prompt {report.mismatches[0].prompt}, output position {report.mismatches[0].position}",
              file=sys.stderr)
        return EXIT_MISMATCH
    return EXIT_OK
