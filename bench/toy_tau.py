"""Acceptance length on the toy target: tau vs drafter training steps, with the lossless check at each point.

    python bench/toy_tau.py [--minutes 8] [--steps 300] [--eval-every 50] [--block-size 16]

The full procedure, each stage cached under --cache-dir so a rerun skips what it already has:

  1. toy target     `dfpipe make-toy-target` (a tiny Qwen3.5 trained on the toy corpus, --minutes)
  2. drafter data   the first --train-samples corpus prompts answered by the target itself (greedy):
                    DFlash trains a drafter on its target's responses; written as chat JSONL, the
                    same file `data.train_path` of the two-service pipeline would read
  3. drafter        trained through the two services, `dfpipe demo`'s path (target_server ->
                    /dev/shm ring -> drafter_trainer) with up to --anchors anchors per document and
                    a checkpoint every --eval-every steps, each checkpoint exported with `dfpipe
                    export`'s code. Step 0 is an untrained drafter.
  4. evaluation     `dfpipe.eval.evaluate` on --eval-prompts held-out corpus prompts: measured tau,
                    acceptance per block position, and the lossless check (every output must equal
                    plain greedy decoding; the script exits 1 if one does not)

Writes bench/out/toy_tau.json, bench/out/toy_tau.png (tau vs steps) and the final drafter export
under the cache dir, and prints a markdown table for docs/benchmarks.md.

With --fidelity it checks FP8 instead of stage 3-4's curve (`dfpipe.toy_target.fp8_fidelity_along_training`):
a drafter trained in-process on the first --fidelity-rows rows of stage 2's data until its
predictions are sharp, and at the start, middle and end one step's gradient in fp8-emulated against
fp32 and bf16 on the same weights and batch; prints the per-parameter cosines and the loss
difference, writes bench/out/fp8_fidelity.json, exits 1 if a point misses the gate.
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


def toy_target_dir(cache: str, minutes: float, seed: int, steps: int | None = None,
                   recipe: tt.ToyRecipe | None = None) -> str:
    """The toy target of (minutes, seed, steps), made once per cache. `recipe` may shorten its own
    held-out check (which runs after the weights are final), so the cache key leaves it out."""
    path = os.path.join(cache, f"toy-target-s{seed}-m{minutes:g}" + (f"-n{steps}" if steps else ""))
    if tt.read_report(path) is None:
        log(f"making the toy target in {path} ({minutes:g} min budget" + (f", {steps} steps)" if steps else ")"))
        tt.make_toy_target(path, minutes=minutes, seed=seed, steps=steps, recipe=recipe, progress=log)
    report = tt.read_report(path)
    log(f"toy target {path}: {report['steps']} steps, held-out loss {report['heldout_loss']}, token accuracy "
        f"{report['heldout_token_accuracy']}, greedy exact match {report['heldout_exact_match']}")
    return path


def answered_data(cache: str, target_dir: str, name: str, prompts: list[toy_corpus.Sample],
                  max_new_tokens: int = 192) -> tuple[list[dict[str, Any]], str]:
    """`prompts` answered by the target (greedy), cached as chat JSONL named after the target and `name`."""
    with open(os.path.join(target_dir, "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    path = os.path.join(cache, f"{name}-{digest}-t{max_new_tokens}.jsonl")
    if not os.path.isfile(path):
        log(f"answering {len(prompts)} corpus prompts with the target -> {path}")
        toy_corpus.write_jsonl(tt.regenerate_answers(target_dir, prompts, max_new_tokens=max_new_tokens), path)
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


def train_through_services(args: argparse.Namespace, target_dir: str, data_path: str,
                           samples: list[dict[str, Any]], recipe: tt.DrafterRecipe
                           ) -> list[tuple[int, str, float, float]]:
    """Both services on the toy target (`tt.train_drafter_through_services`), a checkpoint every
    --eval-every steps, each exported; (step, export, implied tau, loss) per checkpoint, the
    implied tau and loss being the trainer's logged values at the nearest logged step."""
    from common.config import load_config
    from dfpipe.demo import read_metrics
    from dfpipe.export_cmd import export_checkpoint
    from drafter_trainer.checkpoint import list_checkpoints, read_meta

    # whole epochs of about --steps steps, so the trainer's cosine schedule (a function of planned batches) ends
    batches_per_epoch = tt.planned_steps(target_dir, samples, recipe, 1, args.seed)
    epochs = max(1, round(args.steps / batches_per_epoch))
    run = os.path.join(args.cache_dir, f"services-run-a{recipe.max_anchors}")
    shutil.rmtree(run, ignore_errors=True)
    log(f"two-service training in {run}: {epochs} epochs of {batches_per_epoch} batches "
        f"(--steps {args.steps} rounded to whole epochs)")
    config = tt.train_drafter_through_services(target_dir, data_path, run, recipe, epochs, seed=args.seed,
                                               checkpoint_every=args.eval_every)
    logged = {int(r["step"]): (float(r.get("tau", "nan")), float(r["loss"]))
              for r in read_metrics(os.path.join(run, "train", "metrics.jsonl")) if "loss" in r}
    cfg = load_config(config)
    exports = []
    for ckpt in list_checkpoints(os.path.join(run, "train")):
        step = int(read_meta(ckpt)["step"])
        out = os.path.join(run, "exports", f"step-{step:06d}")
        export_checkpoint(cfg, ckpt, out, target_dir)
        nearest = min(logged, key=lambda k: abs(k - step), default=None)
        exports.append((step, out, *(logged[nearest] if nearest is not None else (float("nan"), float("nan")))))
    return exports


def fp8_fidelity(args: argparse.Namespace, command: str, target_dir: str, samples: list[dict[str, Any]]) -> int:
    """Issue 39's FP8 check, --fidelity (the module docstring says what it measures); 1 if a point misses the gate."""
    t0 = time.monotonic()
    recipe = tt.DrafterRecipe(num_layers=args.drafter_layers, block_size=args.block_size, lr=args.lr,
                              max_anchors=args.anchors)
    points = tt.fp8_fidelity_along_training(target_dir, samples[:args.fidelity_rows], recipe, args.steps, args.seed)
    print("\n| parameter | " + " | ".join(f"step {p.step} (acc {p.accuracy:.2f}): fp8/fp32, fp8/bf16, bf16/fp32"
                                          for p in points) + " |")
    print("| --- |" + " --- |" * len(points))
    for name in points[0].cosine["fp8/fp32"]:
        cells = [", ".join(f"{p.cosine[pair][name]:.4f}" for pair in ("fp8/fp32", "fp8/bf16", "bf16/fp32"))
                 for p in points]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| loss fp8 / fp32 - 1 | " + " | ".join(f"{p.loss_rel:+.3%}" for p in points) + " |")
    for p in points:
        log(str(p))
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
              "command": command, "args": vars(args), "drafter_recipe": asdict(recipe),
              "gate": {"min_cosine": tt.FIDELITY_MIN_COSINE, "max_loss_rel": tt.FIDELITY_MAX_LOSS_REL},
              "points": [{**asdict(p), "passed": p.passed, "loss_rel": p.loss_rel} for p in points],
              "seconds": round(time.monotonic() - t0, 1)}
    with open(os.path.join(args.out, "fp8_fidelity.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0 if all(p.passed for p in points) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=os.path.join(REPO, ".cache", "dfpipe", "toy-tau"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "out"))
    ap.add_argument("--minutes", type=float, default=8.0, help="toy target training budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-samples", type=int, default=1500, help="prompts the target answers for the drafter")
    ap.add_argument("--steps", type=int, default=400,
                    help="drafter optimizer steps (rounded to whole epochs)")
    ap.add_argument("--eval-every", type=int, default=80)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--anchors", type=int, default=512,
                    help="drafter.max_anchors: anchors per document (512: the published recipe)")
    ap.add_argument("--target-steps", type=int, default=None,
                    help="toy target steps: a schedule of the step alone, reproducible (default: the time budget's)")
    ap.add_argument("--fidelity", action="store_true",
                    help="instead of the tau curve: FP8's gradient fidelity along a training to sharp predictions "
                         "(--steps: the most steps it may take) -> bench/out/fp8_fidelity.json")
    ap.add_argument("--fidelity-rows", type=int, default=32, help="rows of the one batch the fidelity check trains on")
    args = ap.parse_args(argv)
    os.makedirs(args.cache_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()

    target_dir = toy_target_dir(args.cache_dir, args.minutes, args.seed, args.target_steps)
    samples, data_path = answered_data(args.cache_dir, target_dir, f"drafter-data-n{args.train_samples}-s{args.seed}",
                                       [toy_corpus.sample(args.seed, i) for i in range(args.train_samples)])
    command = "python bench/toy_tau.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.fidelity:
        return fp8_fidelity(args, command, target_dir, samples)
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

    # step 0: the untrained drafter (the trainer's initialisation)
    evaluate(0, 1.0, float("nan"), tt.untrained_drafter(target_dir, recipe, seed=args.seed))
    t_train = time.monotonic()
    from drafter_trainer.export import load_drafter
    export_dir = ""
    for step, export_dir, implied, loss in train_through_services(args, target_dir, data_path, samples, recipe):
        evaluate(step, implied, loss, load_drafter(export_dir, target_dir))
    train_and_eval_s = time.monotonic() - t_train

    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, "
                   f"{'cuda' if torch.cuda.is_available() else 'cpu'}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": command,
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
