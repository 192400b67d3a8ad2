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

With --gate it runs the FP8 quality gate instead of stage 3-4's curve: for each of --gate-seeds seeds
two trainings through both services (bf16, and fp8-emulated with the same seed and batches), each
drafter's final held-out loss (the trainer's eval of --gate-heldout rows) and tau, the gate over
the pairs (`dfpipe.toy_target.Fp8Gate`: mean differences with one-sided 95% bounds), bf16's
spread across seeds, and FP8's cost per part in one step without training noise ->
bench/out/fp8_gate.json. Each training is cached under --cache-dir: a rerun with more seeds
trains only the new ones.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, replace
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


def toy_target_dir(cache: str, minutes: float, seed: int, steps: int | None = None) -> str:
    path = os.path.join(cache, f"toy-target-s{seed}-m{minutes:g}" + (f"-n{steps}" if steps else ""))
    if tt.read_report(path) is None:
        log(f"making the toy target in {path} ({minutes:g} min budget" + (f", {steps} steps)" if steps else ")"))
        tt.make_toy_target(path, minutes=minutes, seed=seed, steps=steps, progress=log)
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


def whole_epochs(steps: int, target_dir: str, samples: list[dict[str, Any]], recipe: tt.DrafterRecipe,
                 seed: int) -> tuple[int, int]:
    """(epochs, batches of epoch 0) for about `steps` steps: whole epochs, so the trainer's cosine
    schedule (a function of planned batches) runs to its end."""
    batches_per_epoch = tt.planned_steps(target_dir, samples, recipe, 1, seed)
    return max(1, round(steps / batches_per_epoch)), batches_per_epoch


def train_through_services(args: argparse.Namespace, target_dir: str, data_path: str,
                           samples: list[dict[str, Any]], recipe: tt.DrafterRecipe
                           ) -> list[tuple[int, str, float, float]]:
    """Both services on the toy target (`tt.train_drafter_through_services`), a checkpoint every
    --eval-every steps, each exported; (step, export, implied tau, loss) per checkpoint, the
    implied tau and loss being the trainer's logged values at the nearest logged step."""
    from common.config import load_config
    from dfpipe.export_cmd import export_checkpoint
    from drafter_trainer.checkpoint import list_checkpoints, read_meta

    epochs, batches_per_epoch = whole_epochs(args.steps, target_dir, samples, recipe, args.seed)
    run = os.path.join(args.cache_dir, f"services-run-a{recipe.max_anchors}")
    shutil.rmtree(run, ignore_errors=True)
    log(f"two-service training in {run}: {epochs} epochs of {batches_per_epoch} batches "
        f"(--steps {args.steps} rounded to whole epochs)")
    config = tt.train_drafter_through_services(target_dir, data_path, run, recipe, epochs, seed=args.seed,
                                               checkpoint_every=args.eval_every)
    logged: dict[int, tuple[float, float]] = {}
    metrics = os.path.join(run, "train", "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    if "loss" in rec:
                        logged[int(rec["step"])] = (float(rec.get("tau", "nan")), float(rec["loss"]))
    cfg = load_config(config)
    exports = []
    for ckpt in list_checkpoints(os.path.join(run, "train")):
        step = int(read_meta(ckpt)["step"])
        out = os.path.join(run, "exports", f"step-{step:06d}")
        export_checkpoint(cfg, ckpt, out, target_dir)
        nearest = min(logged, key=lambda k: abs(k - step), default=None)
        exports.append((step, out, *(logged[nearest] if nearest is not None else (float("nan"), float("nan")))))
    return exports


def gate_run(target_dir: str, data_path: str, heldout_path: str, prompts_file: str, run: str,
             recipe: tt.DrafterRecipe, epochs: int, steps: int, seed: int, eval_batches: int, compute_dtype: str,
             max_new_tokens: int) -> dict[str, Any]:
    """One of the gate's trainings through both services, its final held-out loss and its tau
    (decoded, lossless check), cached as `<run>/gate.json`: a rerun skips the runs already done.
    Runs in its own process (--gate-jobs): it starts its own services."""
    from drafter_trainer.export import load_drafter

    done = os.path.join(run, "gate.json")
    if os.path.isfile(done):
        with open(done, encoding="utf-8") as f:
            return json.load(f)
    shutil.rmtree(run, ignore_errors=True)
    t = time.monotonic()
    tt.train_drafter_through_services(target_dir, data_path, run, recipe, epochs, seed=seed,
                                      heldout_path=heldout_path, eval_every=steps, eval_batches=eval_batches,
                                      compute_dtype=compute_dtype)
    train_s = time.monotonic() - t
    tokenizer = tt.load_tokenizer(target_dir)
    drafter = load_drafter(os.path.join(run, "train", "export"), target_dir)
    target = ev.TargetModel.load(target_dir, drafter.fc.weight.device, drafter.config.target_layer_ids)
    report = ev.evaluate(target, drafter, ev.load_prompts(prompts_file, tokenizer), max_new_tokens,
                         ev.stop_token_ids(tokenizer))
    result = {"precision": recipe.precision, "seed": seed, "heldout_loss": round(tt.final_heldout_loss(run), 5),
              "tau": round(report.tau, 3), "lossless": report.lossless, "train_seconds": round(train_s, 1)}
    with open(done, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return result


def fp8_gate(args: argparse.Namespace, command: str, target_dir: str, samples: list[dict[str, Any]],
             data_path: str) -> int:
    """Issue 32's FP8 quality gate through both services (`tt.Fp8Gate`): for each of --gate-seeds
    seeds, bf16 (the compute dtype) and fp8-emulated with that seed, data and batches; each run's
    final held-out loss (the trainer's eval of all --gate-heldout rows, fixed anchors) and tau; the
    gate over the pairs, and the seed noise (the bf16 runs' spread). --gate-jobs trainings at a time."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.monotonic()
    heldout_prompts = tt.heldout_samples(args.seed, args.eval_prompts + args.gate_heldout)
    heldout, heldout_path = answered_data(args.cache_dir, target_dir, f"gate-heldout-n{args.gate_heldout}-s{args.seed}",
                                          heldout_prompts[args.eval_prompts:])
    prompts_file = os.path.join(args.out, "toy_tau_prompts.jsonl")
    toy_corpus.write_jsonl(heldout_prompts[:args.eval_prompts], prompts_file)
    recipe = tt.DrafterRecipe(num_layers=args.drafter_layers, block_size=args.block_size, lr=args.lr,
                              max_anchors=args.anchors)
    epochs, _ = whole_epochs(args.steps, target_dir, samples, recipe, args.seed)
    steps = tt.planned_steps(target_dir, samples, recipe, epochs, args.seed)
    heldout_batches = tt.planned_steps(target_dir, heldout, recipe, 1, args.seed)    # all of them
    # The runs' folders are named after everything that shapes them: a rerun with other sizes
    # never takes an older run's result.
    shape = hashlib.sha256(json.dumps([os.path.basename(target_dir), os.path.basename(data_path),
                                       os.path.basename(heldout_path), asdict(recipe), epochs, args.compute_dtype,
                                       args.eval_prompts, args.max_new_tokens]).encode()).hexdigest()[:10]
    seeds = list(range(args.seed, args.seed + args.gate_seeds))
    names = [(f"{precision}-s{seed}", precision, seed) for seed in seeds for precision in ("bf16", "fp8-emulated")]
    log(f"FP8 gate: {len(seeds)} paired seeds, {steps} steps a run ({epochs} epochs), {args.gate_jobs} at a time, "
        f"runs under {args.cache_dir}/gate-{shape}-*")
    runs: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(args.gate_jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(gate_run, target_dir, data_path, heldout_path, prompts_file,
                                     os.path.join(args.cache_dir, f"gate-{shape}-{name}"),
                                     replace(recipe, precision=precision), epochs, steps, seed, heldout_batches,
                                     args.compute_dtype, args.max_new_tokens)
                   for name, precision, seed in names}
        try:
            for name, future in futures.items():
                runs[name] = future.result()
                log(f"{name}: {runs[name]}")
        except BaseException:
            for future in futures.values():   # one failed: the rest would fail alike
                future.cancel()
            raise
    pairs = [(runs[f"bf16-s{s}"]["heldout_loss"], runs[f"fp8-emulated-s{s}"]["heldout_loss"],
              runs[f"bf16-s{s}"]["tau"], runs[f"fp8-emulated-s{s}"]["tau"]) for s in seeds]
    gate = tt.fp8_gate(pairs)
    bf16_losses = [p[0] for p in pairs]
    seed_noise = (statistics.stdev(bf16_losses) / statistics.fmean(bf16_losses)
                  if len(bf16_losses) > 1 else float("nan"))
    in_step = fp8_in_step(target_dir, os.path.join(args.cache_dir, f"gate-{shape}-bf16-s{args.seed}", "train", "export"),
                          heldout, args.seed)
    (loss, loss_lo, loss_hi), (tau, tau_lo, tau_hi) = gate.loss, gate.tau
    result = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "command": command,
              "args": vars(args), "toy_target": tt.read_report(target_dir), "drafter_recipe": asdict(recipe),
              "epochs": epochs, "steps": steps, "runs": runs,
              "seed_noise": round(seed_noise, 5),   # bf16's final loss across seeds: its relative sd
              "in_step": in_step,
              "gate": {"verdict": gate.verdict, "pairs": len(pairs), "confidence": tt.GATE_CONFIDENCE,
                       "loss_rel": [round(x, 5) for x in gate.loss_rel],
                       "loss_rel_mean_bounds": [round(x, 5) for x in (loss, loss_lo, loss_hi)],
                       "tau_diff": [round(x, 3) for x in gate.tau_diff],
                       "tau_diff_mean_bounds": [round(x, 4) for x in (tau, tau_lo, tau_hi)]},
              "seconds": round(time.monotonic() - t0, 1)}
    result["toy_target"].pop("loss_curve", None)
    with open(os.path.join(args.out, "fp8_gate.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    log(f"FP8 quality gate: {gate}; bf16's seed noise (relative sd of its final loss) {seed_noise:.2%}")
    return 0 if all(r["lossless"] for r in runs.values()) else 1


def fp8_in_step(target_dir: str, export_dir: str, rows: list[dict[str, Any]], seed: int) -> dict[str, dict[str, float]]:
    """Where FP8 costs, without a training's noise: one loss and backward of a trained drafter on
    the target's captured planes of `rows`, each variant against full precision (the compute
    dtype): its loss's relative difference and its gradient's error (norm of the difference over
    all weights over the reference's norm). Variants: bf16 autocast (the scale of a harmless
    rounding), FP8 everywhere, and FP8 in one part only (fc, attention projections, MLP, the head's
    logits, the head's input gradient), the rest exact."""
    from types import SimpleNamespace

    from common.batch import PackedBatch, document_positions
    from common.config import default_gamma
    from drafter_trainer import fp8
    from drafter_trainer.blocks import build_blocks, sample_anchors
    from drafter_trainer.export import load_drafter
    from drafter_trainer.loss import dflash_loss
    from drafter_trainer.model import Linear

    drafter = load_drafter(export_dir, target_dir).train()
    target = ev.TargetModel.load(target_dir, drafter.fc.weight.device, drafter.config.target_layer_ids)
    planes, ids, mask, lens = [], [], [], []
    with torch.no_grad():
        for doc, doc_mask in tt.encode_chats(tt.load_tokenizer(target_dir), rows):
            planes.append(target.forward(doc)[1].float())
            ids += doc
            mask += doc_mask
            lens.append(len(doc))
    doc_lens = torch.tensor(lens, dtype=torch.int32)
    batch = PackedBatch(hidden=torch.cat(planes, 1), input_ids=torch.tensor(ids, dtype=torch.int32),
                        loss_mask=torch.tensor(mask, dtype=torch.uint8),
                        position_ids=document_positions(doc_lens).to(torch.int32), doc_lens=doc_lens,
                        sample_ids=torch.arange(len(lens)), doc_ids=torch.arange(len(lens)))
    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, 512, torch.Generator().manual_seed(seed))
    blocks = build_blocks(batch, anchors, drafter.config.block_size, drafter.config.mask_token_id,
                          default_gamma(drafter.config.block_size))
    weight = drafter.lm_head.weight
    exact, quantized = fp8.HeadMatmuls(weight, "bf16"), fp8.HeadMatmuls(weight, "fp8-emulated")
    linears = {name: m for name, m in drafter.named_modules() if isinstance(m, Linear)}
    parts = {"fc": lambda n: n == "fc", "attention": lambda n: ".self_attn." in n, "mlp": lambda n: ".mlp." in n}

    def step(fp8_linears: Any, logits_fp8: bool, grad_fp8: bool, autocast: bool = False) -> tuple[float, torch.Tensor]:
        for name, module in linears.items():
            module.precision = "fp8-emulated" if fp8_linears(name) else "bf16"
        head = SimpleNamespace(logits=(quantized if logits_fp8 else exact).logits, fp8=True, emulate=True,
                               grad_input=(quantized if grad_fp8 else exact).grad_input)
        drafter.head_matmuls = lambda: head
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = dflash_loss(drafter, batch, blocks, chunk=1024, backward=True)
        return float(out.loss), torch.cat([p.grad.flatten().float() for p in drafter.parameters() if p.grad is not None])

    def none(_name: str) -> bool:
        return False

    ref_loss, ref_grad = step(none, False, False)
    variants = {"bf16 autocast": (none, False, False, True), "fp8 everywhere": (lambda n: True, True, True, False),
                **{f"fp8 {part} only": (match, False, False, False) for part, match in parts.items()},
                "fp8 head logits only": (none, True, False, False), "fp8 head gradient only": (none, False, True, False)}
    result = {}
    for name, args in variants.items():
        loss, grad = step(*args)
        result[name] = {"loss_rel": round(loss / ref_loss - 1, 5),
                        "grad_rel_err": round(float((grad - ref_grad).norm() / ref_grad.norm()), 4)}
        log(f"in-step {name}: loss {result[name]['loss_rel']:+.3%}, gradient error {result[name]['grad_rel_err']:.4f}")
    return result


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
    ap.add_argument("--gate", action="store_true",
                    help="instead of the tau curve: the FP8 quality gate (fp8-emulated against bf16, paired "
                         "by seed) -> bench/out/fp8_gate.json")
    ap.add_argument("--gate-seeds", type=int, default=2, help="paired seeds the gate trains (two runs each)")
    ap.add_argument("--gate-jobs", type=int, default=1, help="gate trainings at a time (each starts both services)")
    ap.add_argument("--gate-heldout", type=int, default=64, help="held-out rows the gate's loss is measured on")
    ap.add_argument("--compute-dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="the target's dtype and the trainer's compute dtype (auto: fp32 on a CPU)")
    args = ap.parse_args(argv)
    os.makedirs(args.cache_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()

    target_dir = toy_target_dir(args.cache_dir, args.minutes, args.seed, args.target_steps)
    samples, data_path = answered_data(args.cache_dir, target_dir, f"drafter-data-n{args.train_samples}-s{args.seed}",
                                       [toy_corpus.sample(args.seed, i) for i in range(args.train_samples)])
    command = "python bench/toy_tau.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.gate:
        return fp8_gate(args, command, target_dir, samples, data_path)
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
