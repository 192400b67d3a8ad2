"""Acceptance length on the toy target: tau vs drafter training steps, with the lossless check at each point.

    python bench/toy_tau.py [--minutes 8] [--steps 300] [--eval-every 50] [--block-size 16]

The full procedure, each stage cached under --cache-dir so a rerun skips what it already has:

  1. toy target     `dfpipe make-toy-target` (a tiny Qwen3.5 trained on the toy corpus, --minutes)
  2. drafter data   the first --train-samples corpus prompts answered by the target itself (greedy):
                    DFlash trains a drafter on its target's responses; written as chat JSONL, the
                    same file `data.train_path` of the two-service pipeline would read
  3. drafter        --mode pipeline (default): trained through the two services, `dfpipe demo`
                    (target_server -> /dev/shm ring -> drafter_trainer) with a checkpoint every
                    --eval-every steps, each checkpoint exported with `dfpipe export`'s code;
                    --mode in-process: `dfpipe.toy_target.train_toy_drafter` (the same capture,
                    anchors, blocks and loss in one process, no ring, no ZeroMQ). Step 0 is an
                    untrained drafter.
  4. evaluation     `dfpipe.eval.evaluate` on --eval-prompts held-out corpus prompts: measured tau,
                    acceptance per block position, and the lossless check (every output must equal
                    plain greedy decoding; the script exits 1 if one does not)

Writes bench/out/toy_tau.json, bench/out/toy_tau.png (tau vs steps) and the final drafter export
under the cache dir, and prints a markdown table for docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

if not torch.cuda.is_available():
    # transformers must take its pure-torch Qwen3.5 path on a CPU-only machine
    for _mod in ("fla", "causal_conv1d"):
        sys.modules.setdefault(_mod, None)  # type: ignore[arg-type]

from dfpipe import eval as ev  # noqa: E402
from dfpipe import toy_target as tt  # noqa: E402
from target_server import toy_corpus  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def toy_target_dir(cache: str, minutes: float, seed: int) -> str:
    path = os.path.join(cache, f"toy-target-s{seed}-m{minutes:g}")
    if tt.read_report(path) is None:
        log(f"making the toy target in {path} ({minutes:g} min budget)")
        tt.make_toy_target(path, minutes=minutes, seed=seed, progress=log)
    report = tt.read_report(path)
    log(f"toy target {path}: {report['steps']} steps, held-out loss {report['heldout_loss']}, token accuracy "
        f"{report['heldout_token_accuracy']}, greedy exact match {report['heldout_exact_match']}")
    return path


def drafter_data(cache: str, target_dir: str, n: int, seed: int) -> tuple[list[dict[str, Any]], str]:
    """The first n training prompts answered by the target (cached as chat JSONL)."""
    with open(os.path.join(target_dir, "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    path = os.path.join(cache, f"drafter-data-{digest}-n{n}-s{seed}.jsonl")
    if not os.path.isfile(path):
        log(f"answering {n} corpus prompts with the target -> {path}")
        samples = tt.regenerate_answers(target_dir, [toy_corpus.sample(seed, i) for i in range(n)])
        toy_corpus.write_jsonl(samples, path)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f], path


def plot(points: list[dict[str, Any]], block_size: int, png: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot (numbers are in the JSON)")
        return False
    steps = [p["step"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(steps, [p["tau"] for p in points], "o-", label="measured tau (held-out decode)")
    ax.plot(steps, [p["implied_tau"] for p in points], "s--", alpha=0.7,
            label="implied by training accuracy (trainer log)")
    ax.axhline(block_size, color="gray", lw=0.8, ls=":", label=f"block size {block_size}")
    ax.set_xlabel("drafter training step")
    ax.set_ylabel("tokens per target forward")
    ax.set_title("DFlash drafter on the toy Qwen3.5 target")
    ax.set_ylim(0, block_size + 0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


PIPELINE_CONFIG = """\
# written by bench/toy_tau.py: the two services on the toy target
ring:
  name: dfpipe-toytau
  slots: 4
data:
  train_path: {data}
  token_budget: {token_budget}
  max_len: 1024
  seed: {seed}
target:
  model: {target}
  cache_dir: {cache}
  devices: [cpu]
  audit_every: 0
drafter:
  num_layers: {layers}
  block_size: {block}
  max_anchors: {anchors}
train:
  out_dir: {run}
  epochs: {epochs}
  lr: {lr}
  warmup_ratio: 0.05
  checkpoint_every: {every}
  keep_checkpoints: 1000
  log_every: 5
  max_steps: {steps}
  seed: {seed}
  tensorboard: false
service:
  target_endpoint: ipc://{sock}/target.sock
  trainer_endpoint: ipc://{sock}/trainer.sock
  heartbeat_s: 0.5
  lease_s: 10.0
  rescan_s: 0.25
"""


def train_through_pipeline(args: argparse.Namespace, target_dir: str, data_path: str,
                           samples: list[dict[str, Any]], recipe: tt.DrafterRecipe
                           ) -> list[tuple[int, str, float, float]]:
    """Run `dfpipe demo` on the toy target; (step, exported drafter, implied tau, loss) per checkpoint.

    implied tau and loss are the trainer's logged values at the nearest logged step."""
    from common.config import load_config
    from dfpipe.demo import run_demo
    from dfpipe.export_cmd import export_checkpoint
    from drafter_trainer.checkpoint import list_checkpoints, read_meta

    import numpy as np
    from target_server.packer import Packer

    # Whole epochs, so the trainer's cosine schedule (a function of planned batches) runs to its end.
    lengths = np.array([len(ids) for ids, _ in tt.encode_chats(tt.load_tokenizer(target_dir), samples)])
    batches_per_epoch = Packer(lengths, recipe.token_budget, args.seed).epoch_size(0)
    epochs = max(1, round(args.steps / batches_per_epoch))
    run = os.path.join(args.cache_dir, f"pipeline-run-a{recipe.max_anchors}")
    config = os.path.join(args.cache_dir, "pipeline.yaml")
    sockets = os.path.join("/tmp", f"dfpipe-toytau-{os.getpid()}")
    with open(config, "w", encoding="utf-8") as f:
        f.write(PIPELINE_CONFIG.format(
            data=data_path, token_budget=recipe.token_budget, seed=args.seed, target=target_dir,
            cache=os.path.join(args.cache_dir, "pipeline-cache"), layers=recipe.num_layers, block=recipe.block_size,
            anchors=recipe.max_anchors, run=run, epochs=epochs, lr=args.lr,
            every=args.eval_every, steps=0, sock=sockets))
    log(f"two-service training: {config}: {epochs} epochs of {batches_per_epoch} batches "
        f"(--steps {args.steps} rounded to whole epochs)")
    try:
        rc = run_demo(config)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    if rc != 0:
        raise SystemExit(f"the pipeline run failed with exit code {rc}; logs under {run}/logs")
    logged: dict[int, tuple[float, float]] = {}
    metrics = os.path.join(run, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    logged[int(rec["step"])] = (float(rec.get("tau", "nan")), float(rec.get("loss", "nan")))
    cfg = load_config(config)
    exports = []
    for ckpt in list_checkpoints(run):
        step = int(read_meta(ckpt)["step"])
        out = os.path.join(args.cache_dir, f"pipeline-exports-a{recipe.max_anchors}", f"step-{step:06d}")
        export_checkpoint(cfg, ckpt, out, target_dir)
        nearest = min(logged, key=lambda k: abs(k - step), default=None)
        exports.append((step, out, *(logged[nearest] if nearest is not None else (float("nan"), float("nan")))))
    return exports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=os.path.join(REPO, ".cache", "dfpipe", "toy-tau"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "out"))
    ap.add_argument("--minutes", type=float, default=8.0, help="toy target training budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-samples", type=int, default=1500, help="prompts the target answers for the drafter")
    ap.add_argument("--steps", type=int, default=400,
                    help="drafter optimizer steps (pipeline mode: rounded to whole epochs)")
    ap.add_argument("--eval-every", type=int, default=80)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mode", choices=["pipeline", "in-process"], default="pipeline")
    ap.add_argument("--anchors", type=int, default=512,
                    help="drafter.max_anchors: anchors per document (512: the published recipe)")
    args = ap.parse_args(argv)
    os.makedirs(args.cache_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()

    target_dir = toy_target_dir(args.cache_dir, args.minutes, args.seed)
    samples, data_path = drafter_data(args.cache_dir, target_dir, args.train_samples, args.seed)
    t_data = time.monotonic()

    tokenizer = tt.load_tokenizer(target_dir)
    stops = ev.stop_token_ids(tokenizer)
    heldout = tt.heldout_samples(args.seed, args.eval_prompts)
    prompts_file = os.path.join(args.out, "toy_tau_prompts.jsonl")
    toy_corpus.write_jsonl(heldout, prompts_file)
    prompts = ev.load_prompts(prompts_file, tokenizer)
    recipe = tt.DrafterRecipe(num_layers=args.drafter_layers, block_size=args.block_size, lr=args.lr,
                              max_anchors=args.anchors)
    references: dict[int, ev.GreedyOutput] = {}
    target: ev.TargetModel | None = None
    points: list[dict[str, Any]] = []
    failures: list[ev.Mismatch] = []

    def evaluate(step: int, implied: float, loss: float, model: Any) -> None:
        nonlocal target
        if target is None:
            target = ev.TargetModel.load(target_dir, model.fc.weight.device, model.config.target_layer_ids)
        t = time.monotonic()
        report = ev.evaluate(target, model, prompts, args.max_new_tokens, stops, references=references)
        failures.extend(report.mismatches)
        points.append({"step": step, "tau": round(report.tau, 3), "implied_tau": round(implied, 3),
                       "loss": round(loss, 4), "lossless": report.lossless,
                       "acceptance_per_position": [round(a, 3) for a in report.acceptance_per_position],
                       "generated_tokens": report.generated_tokens, "target_forwards": report.target_forwards,
                       "eval_seconds": round(time.monotonic() - t, 1)})
        log(f"step {step}: tau {report.tau:.2f} (implied {implied:.2f}), loss {loss:.3f}, "
            f"lossless {report.lossless}, {report.generated_tokens} tokens / {report.target_forwards} forwards")

    def on_step(info: tt.DrafterStep, model: Any) -> None:
        if info.step == 1:
            log(f"drafter step time {info.seconds:.2f} s")
        if info.step % args.eval_every == 0 or info.step == args.steps:
            evaluate(info.step, info.implied_tau, info.loss, model)

    # step 0: the untrained drafter (same initialisation as the trained one)
    untrained = tt.train_toy_drafter(target_dir, samples[:1], steps=0, recipe=recipe, seed=args.seed)
    evaluate(0, 1.0, float("nan"), untrained)
    t_train = time.monotonic()
    if args.mode == "in-process":
        drafter = tt.train_toy_drafter(target_dir, samples, steps=args.steps, recipe=recipe, seed=args.seed,
                                       on_step=on_step)
        from drafter_trainer.export import export_drafter
        export_dir = os.path.join(args.cache_dir, f"drafter-b{args.block_size}-steps{args.steps}")
        export_drafter(drafter, export_dir)
    else:
        export_dir = ""
        from drafter_trainer.export import load_drafter
        for step, export_dir, implied, loss in train_through_pipeline(args, target_dir, data_path, samples, recipe):
            evaluate(step, implied, loss, load_drafter(export_dir, target_dir))
    train_and_eval_s = time.monotonic() - t_train

    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, "
                   f"{'cuda' if torch.cuda.is_available() else 'cpu'}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": "python bench/toy_tau.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args),
        "toy_target": tt.read_report(target_dir),
        "drafter_recipe": asdict(recipe),
        "drafter_samples": len(samples),
        "points": points,
        "export": export_dir,
        "seconds": {"target_and_data": round(t_data - t0, 1), "train_and_eval": round(train_and_eval_s, 1),
                    "total": round(time.monotonic() - t0, 1)},
    }
    result["toy_target"].pop("loss_curve", None)
    with open(os.path.join(args.out, "toy_tau.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    plotted = plot(points, args.block_size, os.path.join(args.out, "toy_tau.png"))
    print("\n| drafter step | measured tau | implied tau (train batch) | DFlash loss | lossless |")
    print("| --- | --- | --- | --- | --- |")
    for p in points:
        print(f"| {p['step']} | {p['tau']:.2f} | {p['implied_tau']:.2f} | {p['loss']:.3f} | "
              f"{'yes' if p['lossless'] else 'NO'} |")
    log(f"wrote {os.path.join(args.out, 'toy_tau.json')}" + (" and toy_tau.png" if plotted else "")
        + f"; total {result['seconds']['total']:.0f} s")
    if failures:
        log(f"LOSSLESS CHECK FAILED {len(failures)} time(s): {failures[:3]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
