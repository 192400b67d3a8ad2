"""make-toy-target: a tiny Qwen3.5 LM trained on the toy corpus, so a drafter has something to learn.

A randomly initialised target is useless for measuring acceptance length: its greedy choices are
noise, and no drafter can predict noise. This trains the built-in tiny Qwen3.5 architecture
(`target_server.tiny`, hybrid 3 Gated-DeltaNet : 1 attention) from scratch on chat samples from
`target_server.toy_corpus`, whose answers follow from their prompts (counting, times tables,
spelling, copying lists, facts of a fixed made-up world). A few CPU minutes teach it the shape of
the answers (not yet always their content, see docs/benchmarks.md): its greedy output is
structured, repetitive text whose next tokens its own hidden states predict, a target worth
drafting for.

    dfpipe make-toy-target --out DIR [--minutes 8] [--seed 0]

    DIR/
      config.json, model.safetensors     Qwen3_5ForCausalLM (fp32), loadable with from_pretrained
      tokenizer.json, tokenizer_config.json, chat_template.jinja    the demo tokenizer (vocab 512)
      toy_target.json                    recipe, steps, final loss, held-out greedy accuracy, timings

Training data is streamed: pool k holds corpus samples [k*P, (k+1)*P), sorted by length and cut
into batches of at most `batch_tokens` padded tokens, so no sample is seen twice and padding stays
small. Held-out samples come from the same generator at
indices >= HELDOUT_START, which training never reaches. Loss covers assistant tokens only (the
chat template's generation span, `<|im_end|>` included): the prompts are random by design.

Determinism: the initial weights and the data order are pure functions of the seed. `--minutes` is
a wall-clock budget: the learning rate decays with the share of it used, and the step count that
fit is recorded in toy_target.json. Pass `steps=` to `make_toy_target` for a schedule that is a
function of the step alone, reproducible across machines (bit-exact only as far as torch's CPU
kernels are; the time budget still caps the run). On a shared CPU, OMP_NUM_THREADS=1 is faster
than oversubscribed threads (torch's intra-op threads spin while another process holds the cores).

The second half of the file trains a drafter for the toy target (`regenerate_answers`: the target's
own answers as training data; `train_drafter_through_services`: both services, as users run them)
for bench/toy_tau.py and the CI's acceptance-length test.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from dfpipe.cpu_fla import quiet_fla_on_cpu
from dfpipe.eval import TargetModel, chat_prompt_turns, first_difference, greedy_decode, stop_token_ids
from target_server import toy_corpus
from target_server.tiny import build_tiny_target

log = logging.getLogger(__name__)

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo",
                             "tokenizer")
REPORT_FILE = "toy_target.json"
# Held-out samples live far beyond any index training reaches (1M samples: ~13 CPU-hours of the default recipe).
HELDOUT_START = 1_000_000


@dataclass
class ToyRecipe:
    """Every knob of the toy target, with the values the default run uses."""
    hidden_size: int = 128
    num_layers: int = 8              # 3 Gated-DeltaNet : 1 full attention, as published Qwen3.5
    # Small batches, high learning rate: on a CPU budget many small steps beat few large ones
    # (held-out answer loss after the same 250K tokens: 0.95 with 512-token batches at 6e-3,
    # 1.04 with 1024 at 3e-3, 1.10 with 2048 at 3e-3).
    batch_tokens: int = 512          # padded tokens per optimizer step
    pool_samples: int = 256          # samples sorted by length together (bucketing window)
    max_len: int = 384               # longer samples are skipped and counted (rare in the corpus)
    prompt_weight: float = 0.0       # loss weight of non-assistant tokens (assistant tokens weigh 1)
    lr: float = 6e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 20
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    heldout_samples: int = 48        # prompts decoded greedily at the end
    heldout_max_new_tokens: int = 160
    eval_fraction: float = 0.12      # of the time budget kept back for the held-out check and saving


@dataclass
class ToyReport:
    """What toy_target.json records about one run."""
    seed: int
    steps: int
    minutes_budget: float
    train_seconds: float
    total_seconds: float
    samples_drawn: int
    tokens_seen: int
    skipped_overlong: int
    final_train_loss: float                  # mean assistant-token CE over the last 10% of steps
    heldout_loss: float                      # teacher-forced assistant-token CE on held-out samples
    heldout_token_accuracy: float            # teacher-forced argmax == label on held-out assistant tokens
    heldout_exact_match: float               # greedy answer == reference answer, whole string
    heldout_prefix_accuracy: float           # mean fraction of answer tokens before the first greedy error
    heldout_decoded: int                     # held-out prompts decoded greedily (as many as the budget allowed)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    recipe: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)


def heldout_samples(seed: int, n: int) -> list[toy_corpus.Sample]:
    """n corpus samples that training with `seed` never sees (same generator, disjoint indices)."""
    return [toy_corpus.sample(seed, HELDOUT_START + i) for i in range(n)]


def auto_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(path: str = TOKENIZER_DIR) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def encode_chats(tokenizer: Any, samples: list[toy_corpus.Sample]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, assistant mask) per sample, rendered with the tokenizer's chat template."""
    out = tokenizer.apply_chat_template([s["messages"] for s in samples], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return [(list(ids), list(mask)) for ids, mask in zip(out["input_ids"], out["assistant_masks"])]


class StreamedBatches:
    """Length-bucketed batches over the endless toy corpus, a pure function of (seed, batch order).

    Pool k holds samples [k*P, (k+1)*P). It is sorted by length and cut greedily into batches whose
    padded size (rows x longest row) stays within `batch_tokens`; the batches of a pool are then
    shuffled with a generator seeded by (seed, k). Each batch is `(input_ids [B, T], weights [B, T])`,
    right-padded with `pad_id` (invisible to a causal model, so no attention mask is needed); the
    loss weight of a token is 1 on assistant tokens, `prompt_weight` on the other real tokens and
    0 on padding.
    """

    def __init__(self, tokenizer: Any, seed: int, recipe: ToyRecipe, pad_id: int) -> None:
        self.tokenizer, self.seed, self.recipe, self.pad_id = tokenizer, seed, recipe, pad_id
        self.samples_drawn = 0
        self.skipped_overlong = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        pool = 0
        while True:
            yield from self._pool_batches(pool)
            pool += 1

    def _pool_batches(self, pool: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        p = self.recipe.pool_samples
        samples = [toy_corpus.sample(self.seed, i) for i in range(pool * p, (pool + 1) * p)]
        docs = []
        for ids, mask in encode_chats(self.tokenizer, samples):
            if len(ids) > self.recipe.max_len:
                self.skipped_overlong += 1
                log.warning("toy target: skipped a %d-token sample (max_len %d)", len(ids), self.recipe.max_len)
                continue
            docs.append((ids, mask))
        docs.sort(key=lambda d: len(d[0]))
        groups: list[list[tuple[list[int], list[int]]]] = [[]]
        for doc in docs:
            # docs ascend in length, so the newcomer is the longest row of its group
            if groups[-1] and (len(groups[-1]) + 1) * len(doc[0]) > self.recipe.batch_tokens:
                groups.append([])
            groups[-1].append(doc)
        random.Random(f"toy-target/{self.seed}/{pool}").shuffle(groups)
        self.samples_drawn += len(docs)
        return [pad_batch(group, self.pad_id, self.recipe.prompt_weight) for group in groups]


def pad_batch(docs: list[tuple[list[int], list[int]]], pad_id: int, prompt_weight: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids [B, T], loss weights [B, T]) of (ids, assistant mask) documents."""
    width = max(len(ids) for ids, _ in docs)
    input_ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    weights = torch.zeros((len(docs), width))
    for row, (ids, mask) in enumerate(docs):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        assistant = torch.tensor(mask, dtype=torch.float32)
        weights[row, :len(ids)] = assistant + (1 - assistant) * prompt_weight
    return input_ids, weights


def lr_at(step: int, progress: float, recipe: ToyRecipe) -> float:
    """Linear warmup over the first steps, then cosine from lr down to min_lr_ratio * lr as progress goes 0 -> 1."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


@dataclass
class LMLoss:
    loss: torch.Tensor          # weighted mean CE (differentiable)
    answer_ce_sum: float        # CE summed over assistant tokens
    answer_tokens: int
    answer_correct: int         # assistant tokens whose argmax is the label


def lm_loss(model: Any, input_ids: torch.Tensor, weights: torch.Tensor) -> LMLoss:
    """Weighted next-token CE (logits[t] predicts token t+1, with token t+1's weight) and answer statistics."""
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    target, w = input_ids[:, 1:], weights[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view_as(w)
    answer = w == 1
    with torch.no_grad():
        stats = (float((ce * answer).sum()), int(answer.sum()), int(((logits.argmax(-1) == target) & answer).sum()))
    return LMLoss((ce * w).sum() / w.sum().clamp_min(1e-9), *stats)


@dataclass
class TrainRun:
    losses: list[float] = field(default_factory=list)          # answer-token CE per step
    curve: list[tuple[int, float]] = field(default_factory=list)
    tokens_seen: int = 0


def train_lm(model: Any, data: StreamedBatches, recipe: ToyRecipe, steps: int | None, deadline: float,
             say: Callable[[str], None]) -> TrainRun:
    """AdamW on the weighted LM loss until `steps` steps or the deadline (time.monotonic()), whichever first."""
    device = next(model.parameters()).device
    model.train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]          # norms, gates: no weight decay
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": recipe.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}], lr=recipe.lr, betas=recipe.betas)
    run = TrainRun()
    start = time.monotonic()
    for step, (input_ids, weights) in enumerate(data):
        now = time.monotonic()
        if (steps is not None and step >= steps) or now >= deadline:
            break
        # With a step count the schedule is a function of the step (reproducible); with only a time
        # budget it follows the share of the budget used, so a machine slowed down by other work
        # still finishes its cosine decay instead of being cut off at a high learning rate.
        progress = step / steps if steps is not None else (now - start) / max(1e-9, deadline - start)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, progress, recipe)
        out = lm_loss(model, input_ids.to(device), weights.to(device))
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        run.losses.append(out.answer_ce_sum / max(1, out.answer_tokens))
        run.tokens_seen += int(input_ids.numel())
        if step % 25 == 0:
            run.curve.append((step, round(run.losses[-1], 4)))
            say(f"toy target: step {step} ({progress:.0%} of the schedule) answer loss {run.losses[-1]:.3f} "
                f"({now - start:.0f} s)")
    model.eval()
    return run



@torch.no_grad()
def evaluate_heldout(model: Any, tokenizer: Any, samples: list[toy_corpus.Sample], max_new_tokens: int,
                     deadline: float | None = None) -> dict[str, float]:
    """Teacher-forced loss/accuracy on the assistant tokens, and greedy answers of the first assistant turn.

    Greedy decoding is the slow part (one full forward per token); it covers samples in order until
    `deadline` (time.monotonic()), at least one, and says how many it decoded.
    """
    device = next(model.parameters()).device
    model.eval()
    input_ids, weights = pad_batch(encode_chats(tokenizer, samples), tokenizer.pad_token_id, 0.0)
    teacher_forced = lm_loss(model, input_ids.to(device), weights.to(device))
    stops = stop_token_ids(tokenizer)
    target = TargetModel(model)
    exact, prefix_fracs = 0, []
    for s in samples:
        if prefix_fracs and deadline is not None and time.monotonic() >= deadline:
            break
        turns = chat_prompt_turns(s)
        prompt = tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
        answer_text = s["messages"][len(turns)]["content"]
        reference = tokenizer(answer_text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        answer = greedy_decode(target, prompt, min(max_new_tokens, len(reference) + 8), stops).tokens
        differs_at = first_difference(answer, reference)
        exact += differs_at is None
        prefix_fracs.append(min(len(reference), len(answer) if differs_at is None else differs_at) / len(reference))
    decoded = len(prefix_fracs)
    tokens = max(1, teacher_forced.answer_tokens)
    return {"loss": teacher_forced.answer_ce_sum / tokens, "token_accuracy": teacher_forced.answer_correct / tokens,
            "exact_match": exact / decoded, "prefix_accuracy": sum(prefix_fracs) / decoded, "decoded": decoded}


def _versions() -> dict[str, str]:
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}"}


def make_toy_target(out_dir: str, minutes: float = 8.0, seed: int = 0, steps: int | None = None,
                    recipe: ToyRecipe | None = None, device: torch.device | None = None,
                    progress: Callable[[str], None] | None = None) -> ToyReport:
    """Train the toy target and write it to out_dir (which must not exist or be empty); return its report.

    minutes bounds the whole run (training stops at the deadline whatever `steps` says); with
    steps=None training runs until the training share of the budget is used.
    """
    recipe = recipe or ToyRecipe()
    say = progress or log.info
    if minutes <= 0:
        raise ValueError(f"minutes must be positive, got {minutes}")
    if recipe.max_len > recipe.batch_tokens:
        raise ValueError(f"max_len ({recipe.max_len}) must fit in one batch (batch_tokens {recipe.batch_tokens})")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} exists and is not an empty folder; choose another --out or remove it")
    t0 = time.monotonic()
    deadline = t0 + minutes * 60 * (1 - recipe.eval_fraction)
    device = device or auto_device()
    tokenizer = load_tokenizer()
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".toy-target-", dir=parent)
    try:
        from transformers import AutoModelForCausalLM

        build_tiny_target(tmp, arch="qwen3.5", vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
                          num_layers=recipe.num_layers, seed=seed, tokenizer_dir=TOKENIZER_DIR)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device)
        data = StreamedBatches(tokenizer, seed, recipe, pad_id=tokenizer.pad_token_id)
        torch.manual_seed(seed)
        run = train_lm(model, data, recipe, steps, deadline, say)
        if not run.losses:
            raise RuntimeError(f"no training step fit in {minutes} minutes")
        train_seconds = time.monotonic() - t0
        tail = run.losses[-max(1, len(run.losses) // 10):]
        # the held-out check may use what is left of the budget, less a moment for saving
        heldout = evaluate_heldout(model, tokenizer, heldout_samples(seed, recipe.heldout_samples),
                                   recipe.heldout_max_new_tokens, deadline=t0 + minutes * 60 * 0.97 - 2)
        model.to("cpu").save_pretrained(tmp, safe_serialization=True)
        report = ToyReport(
            seed=seed, steps=len(run.losses), minutes_budget=minutes, train_seconds=round(train_seconds, 1),
            total_seconds=0.0, samples_drawn=data.samples_drawn, tokens_seen=run.tokens_seen,
            skipped_overlong=data.skipped_overlong, final_train_loss=round(sum(tail) / len(tail), 4),
            heldout_loss=round(heldout["loss"], 4), heldout_token_accuracy=round(heldout["token_accuracy"], 4),
            heldout_exact_match=round(heldout["exact_match"], 4),
            heldout_prefix_accuracy=round(heldout["prefix_accuracy"], 4), heldout_decoded=int(heldout["decoded"]),
            loss_curve=run.curve, recipe=asdict(recipe), versions=_versions())
        report.total_seconds = round(time.monotonic() - t0, 1)
        with open(os.path.join(tmp, REPORT_FILE), "w", encoding="utf-8") as f:
            json.dump(asdict(report), f, indent=1)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(tmp, out_dir)  # a reader never sees a half-written target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def read_report(target_dir: str) -> dict[str, Any] | None:
    """toy_target.json of a folder made by make_toy_target, or None for any other folder."""
    path = os.path.join(target_dir, REPORT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(args: argparse.Namespace) -> int:
    """`dfpipe make-toy-target`: args.out, args.minutes, args.seed."""
    quiet_fla_on_cpu()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        report = make_toy_target(args.out, minutes=args.minutes, seed=args.seed,
                                 steps=getattr(args, "steps", None), progress=print)
    except (FileExistsError, ValueError, RuntimeError) as e:
        print(f"dfpipe make-toy-target: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {report.steps} steps in {report.train_seconds:.0f} s, final train loss "
          f"{report.final_train_loss:.3f}, held-out loss {report.heldout_loss:.3f}, token accuracy "
          f"{report.heldout_token_accuracy:.1%}, greedy exact match {report.heldout_exact_match:.1%} "
          f"(prefix {report.heldout_prefix_accuracy:.1%}) on {report.heldout_decoded} held-out prompts")
    return 0


# ---- a drafter for the toy target (bench/toy_tau.py, the CI's acceptance-length test) ---------


@torch.no_grad()
def regenerate_answers(target_dir: str, samples: list[toy_corpus.Sample], max_new_tokens: int = 192,
                       batch_size: int = 32, device: torch.device | None = None) -> list[toy_corpus.Sample]:
    """The samples with their first assistant turn replaced by the target's own greedy answer.

    DFlash trains the drafter on the target's responses, not the dataset's: the drafter must
    predict what the target will say. Later turns are dropped. Batched `generate` with a cache
    (left padding): fast, and the exact tokens matter less here than in the lossless check.
    """
    from transformers import AutoModelForCausalLM

    device = device or auto_device()
    tokenizer = load_tokenizer(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    stops = sorted(stop_token_ids(tokenizer))
    out: list[toy_corpus.Sample] = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        prefixes = [chat_prompt_turns(s) for s in chunk]       # corpus samples: always a valid prompt
        prompts = [tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=True)
                   ["input_ids"] for p in prefixes]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + list(p) for p in prompts],
                                 device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=stops,
                                   pad_token_id=tokenizer.pad_token_id)[:, width:]
        for prefix, row in zip(prefixes, generated.tolist()):
            end = next((i for i, t in enumerate(row) if t in stops), len(row))
            answer = tokenizer.decode(row[:end], skip_special_tokens=False)
            out.append({"messages": [*prefix, {"role": "assistant", "content": answer}]})
    return out


@dataclass
class DrafterRecipe:
    """The drafter's knobs for a run on the toy target (the recipe of docs/architecture.md, "The DFlash
    drafter", shortened for a CPU)."""
    num_layers: int = 2
    block_size: int = 16
    token_budget: int = 2048
    max_anchors: int = 512              # per document
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_ratio: float = 0.05
    precision: str = "auto"             # drafter.precision: fp8-emulated checks FP8 rounding on a CPU


SERVICES_CONFIG = """\
# written by dfpipe.toy_target.train_drafter_through_services: both services on the toy target
ring:
  name: {ring}
  slots: 4
data:
  train_path: {data}
  token_budget: {token_budget}
  max_len: 1024
  seed: {seed}
target:
  model: {target}
  cache_dir: {run}/cache
  devices: [cpu]
  audit_every: 0
drafter:
  num_layers: {layers}
  block_size: {block}
  max_anchors: {anchors}
  precision: {precision}
train:
  out_dir: {run}/train
  epochs: {epochs}
  lr: {lr}
  warmup_ratio: {warmup_ratio}
  min_lr_ratio: {min_lr_ratio}
  checkpoint_every: {every}
  keep_checkpoints: 1000
  log_every: 5
  seed: {seed}
  tensorboard: false
service:
  target_endpoint: ipc://{sockets}/target.sock
  trainer_endpoint: ipc://{sockets}/trainer.sock
  heartbeat_s: 0.5
  lease_s: 10.0
  rescan_s: 0.25
"""


def train_drafter_through_services(target_dir: str, data_path: str, run_dir: str, recipe: DrafterRecipe,
                                   epochs: int, seed: int = 0, checkpoint_every: int = 0) -> str:
    """Train a drafter for the toy target on the chat file `data_path` through both services, the
    path users run (`dfpipe demo`: target server -> /dev/shm ring -> trainer), `epochs` whole
    epochs (the learning-rate schedule runs to its end). Returns the config it wrote; the run's
    checkpoints are in `<run_dir>/train` (every `checkpoint_every` steps; 0: only the final
    one) and the final drafter in `<run_dir>/train/export`; the compute dtype is the device's
    (fp32 on a CPU). Raises RuntimeError if the run fails.
    """
    from dfpipe.demo import run_demo

    os.makedirs(run_dir, exist_ok=True)
    config = os.path.join(run_dir, "services.yaml")
    sockets = tempfile.mkdtemp(prefix="dfpipe-toy-")      # short: an ipc path has a length limit
    with open(config, "w", encoding="utf-8") as f:
        f.write(SERVICES_CONFIG.format(
            ring=f"dfpipe-toy-{os.getpid()}", data=os.path.abspath(data_path), token_budget=recipe.token_budget,
            seed=seed, target=os.path.abspath(target_dir), run=os.path.abspath(run_dir), layers=recipe.num_layers,
            block=recipe.block_size, anchors=recipe.max_anchors, epochs=epochs, lr=recipe.lr,
            warmup_ratio=recipe.warmup_ratio, min_lr_ratio=recipe.min_lr_ratio,
            every=checkpoint_every or 1_000_000, sockets=sockets, precision=recipe.precision))
    try:
        rc = run_demo(config, fresh=True)   # a whole training, never one continued
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    if rc != 0:
        raise RuntimeError(f"training through the services failed (exit {rc}); logs in {run_dir}/train/logs")
    return config


def planned_steps(target_dir: str, samples: list[toy_corpus.Sample], recipe: DrafterRecipe, epochs: int,
                  seed: int = 0) -> int:
    """The optimizer steps `train_drafter_through_services` runs on `samples`: the target server's
    packer's batches over `epochs` epochs (one step a batch on one rank)."""
    import numpy as np

    from target_server.packer import Packer

    lengths = np.array([len(ids) for ids, _ in encode_chats(load_tokenizer(target_dir), samples)])
    return sum(Packer(lengths, recipe.token_budget, seed).epoch_sizes(epochs))


# Issue 39's FP8 fidelity check. Comparing whole trainings (FP8 against bf16, paired by seed) was
# noise-bound: FP8's rounding sends a small training down another path, and seeds alone move its
# final loss by ~15%. So the check is on one step instead, without training noise: the same weights
# and batch, the loss and every parameter's gradient in fp8-emulated against fp32 and bf16, at the
# start, middle and end of a training that makes the drafter's predictions sharp. Sharpness is what
# exposed the head's backward (dCE/dh = g W): g = softmax - onehot shrinks to a few small entries,
# and the gradient becomes a difference of nearly equal rows of W.
FIDELITY_MIN_COSINE = 0.99          # every parameter's gradient, against fp32's and bf16's
FIDELITY_MAX_LOSS_REL = 0.005       # |fp8 loss / fp32 loss - 1|


def captured_batch(target_dir: str, rows: list[dict[str, Any]], layer_ids: list[int]) -> Any:
    """The chat `rows` packed into one batch with the toy target's captured planes (`layer_ids`),
    as the target server would deliver them (fp32, one document a row)."""
    from common.batch import PackedBatch, document_positions

    target = TargetModel.load(target_dir, torch.device("cpu"), layer_ids)
    planes, ids, mask, lens = [], [], [], []
    with torch.no_grad():
        for doc, doc_mask in encode_chats(load_tokenizer(target_dir), rows):
            planes.append(target.forward(doc)[1].float())
            ids += doc
            mask += doc_mask
            lens.append(len(doc))
    doc_lens = torch.tensor(lens, dtype=torch.int32)
    return PackedBatch(hidden=torch.cat(planes, 1), input_ids=torch.tensor(ids, dtype=torch.int32),
                       loss_mask=torch.tensor(mask, dtype=torch.uint8),
                       position_ids=document_positions(doc_lens).to(torch.int32), doc_lens=doc_lens,
                       sample_ids=torch.arange(len(lens)), doc_ids=torch.arange(len(lens)))


@dataclass(frozen=True)
class GradientFidelity:
    """One step of a drafter in fp8-emulated against the same step in fp32 and in bf16 (autocast):
    the losses, and per trainable parameter the cosine of FP8's gradient to each of theirs (and of
    bf16's to fp32's: where even that is low, the gradient is rounding noise and no check can pass)."""
    step: int                           # training steps before this point
    accuracy: float                     # drafted positions whose argmax is the label (fp32 step)
    loss: dict[str, float]              # per precision: fp32, bf16, fp8
    cosine: dict[str, dict[str, float]]     # "fp8/fp32", "fp8/bf16", "bf16/fp32" -> parameter -> cosine

    @property
    def loss_rel(self) -> float:
        """FP8's loss against fp32's, relative."""
        return self.loss["fp8"] / self.loss["fp32"] - 1

    @property
    def min_cosine(self) -> tuple[str, float]:
        """(parameter, cosine) of the worst parameter of FP8's against either reference."""
        return min(((name, c) for pair in ("fp8/fp32", "fp8/bf16") for name, c in self.cosine[pair].items()),
                   key=lambda nc: nc[1])

    @property
    def passed(self) -> bool:
        return self.min_cosine[1] >= FIDELITY_MIN_COSINE and abs(self.loss_rel) <= FIDELITY_MAX_LOSS_REL

    def __str__(self) -> str:
        name, worst = self.min_cosine
        return (f"step {self.step} (accuracy {self.accuracy:.3f}): {'pass' if self.passed else 'FAIL'}, least "
                f"gradient cosine {worst:.4f} ({name}; limit {FIDELITY_MIN_COSINE}), loss {self.loss_rel:+.3%} "
                f"against fp32 (limit {FIDELITY_MAX_LOSS_REL:.1%}); bf16 against fp32: least cosine "
                f"{min(self.cosine['bf16/fp32'].values()):.4f}")


def gradient_fidelity(drafter: Any, batch: Any, blocks: Any, step: int = 0) -> GradientFidelity:
    """`drafter`'s loss and gradients on `batch` in fp32, bf16 (CPU autocast) and fp8-emulated (fp32
    compute: FP8's rounding alone), its weights untouched; its precision is restored."""
    from drafter_trainer.loss import dflash_loss

    trained = drafter.precision
    runs: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    accuracy = float("nan")
    try:
        for name, precision, autocast in (("fp32", "bf16", False), ("bf16", "bf16", True),
                                          ("fp8", "fp8-emulated", False)):
            drafter.precision = precision
            drafter.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = dflash_loss(drafter, batch, blocks, chunk=1024, backward=True)
            runs[name] = (float(out.loss), {n: p.grad.detach().flatten().double()
                                            for n, p in drafter.named_parameters() if p.grad is not None})
            if name == "fp32":
                accuracy = float(out.correct_per_pos[1:].sum() / out.count_per_pos[1:].sum().clamp_min(1))
    finally:
        drafter.precision = trained
        drafter.zero_grad(set_to_none=True)
    cosine = {f"{a}/{b}": {n: float(F.cosine_similarity(g, runs[b][1][n], dim=0)) for n, g in runs[a][1].items()}
              for a, b in (("fp8", "fp32"), ("fp8", "bf16"), ("bf16", "fp32"))}
    return GradientFidelity(step=step, accuracy=accuracy, loss={k: v[0] for k, v in runs.items()}, cosine=cosine)


def fixed_blocks(batch: Any, recipe: DrafterRecipe, mask_token_id: int, seed: int = 0) -> Any:
    """The blocks of `batch` at recipe.max_anchors anchors a document, drawn once from `seed`."""
    from common.config import default_gamma
    from drafter_trainer.blocks import build_blocks, sample_anchors

    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, recipe.max_anchors, torch.Generator().manual_seed(seed))
    return build_blocks(batch, anchors, recipe.block_size, mask_token_id, default_gamma(recipe.block_size))


FIDELITY_ACCURACIES = (0.5, 0.85)   # the middle and the end: half sharp, and sharp


def fp8_fidelity_along_training(target_dir: str, rows: list[dict[str, Any]], recipe: DrafterRecipe,
                                max_steps: int, seed: int = 0) -> list[GradientFidelity]:
    """Train a drafter for the toy target on the one batch of `rows` (fp32, AdamW at recipe.lr,
    recipe.max_anchors anchors a document, fixed) and check FP8's gradient fidelity
    (`gradient_fidelity`) at the start and right after the first step whose training accuracy
    (of the weights it updates) reaches each of FIDELITY_ACCURACIES (so a point's own accuracy may
    be a little lower): sharp predictions, the regime where FP8 once lost gradient. The end is
    sharp, not memorised: there the gradient of the batch vanishes into rounding noise (even bf16's
    cosine to fp32 falls below 0.5 at accuracy 0.998). Raises RuntimeError when `max_steps` do not
    reach the last accuracy."""
    from drafter_trainer.loss import dflash_loss

    drafter = untrained_drafter(target_dir, recipe, seed).train()
    drafter.precision = "bf16"                    # fp32 on the CPU: the training itself is not under test
    batch = captured_batch(target_dir, rows, drafter.config.target_layer_ids)
    blocks = fixed_blocks(batch, recipe, drafter.config.mask_token_id, seed)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=recipe.lr)
    points = [gradient_fidelity(drafter, batch, blocks, 0)]
    log.info("FP8 gradient fidelity at %s", points[-1])
    goals = list(FIDELITY_ACCURACIES)
    for step in range(max_steps):
        optimizer.zero_grad(set_to_none=True)
        out = dflash_loss(drafter, batch, blocks, chunk=1024, backward=True)
        optimizer.step()
        # the accuracy of the weights before this step: checked after the update would be the next one's
        accuracy = float(out.correct_per_pos[1:].sum() / out.count_per_pos[1:].sum().clamp_min(1))
        if accuracy >= goals[0]:
            while goals and accuracy >= goals[0]:
                goals.pop(0)
            points.append(gradient_fidelity(drafter, batch, blocks, step + 1))
            log.info("FP8 gradient fidelity at %s", points[-1])
            if not goals:
                return points
    raise RuntimeError(f"{max_steps} steps did not train the drafter to accuracy {FIDELITY_ACCURACIES[-1]} "
                       f"on its {len(rows)} rows")


def untrained_drafter(target_dir: str, recipe: DrafterRecipe, seed: int = 0) -> Any:
    """A drafter for the toy target as training starts from: initialised, the target's head in place."""
    from common.config import DrafterConfig
    from drafter_trainer.model import DFlashConfig, DFlashDraftModel

    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        target_config = json.load(f)
    config = DFlashConfig.from_target(target_config, DrafterConfig(num_layers=recipe.num_layers,
                                                                   block_size=recipe.block_size),
                                      None, int(load_tokenizer(target_dir).mask_token_id))
    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    model.load_target_head(target_dir, dtype=torch.float32)
    return model.eval()
