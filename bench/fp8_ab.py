"""FP8 decided by a converged A/B on the CPU (issue 46, item 2): does training in fp8 cost the drafter
anything where training ends?

    python bench/fp8_ab.py [--seeds 4] [--max-steps 1000] [--eval-every 50] [--quick]

One step's gradient cannot decide FP8 (its cosine to fp32's drifts as predictions sharpen, and how
far depends on the CPU's kernels, issue 46); the published FP8 recipes validate by training both
precisions to the end and comparing the final loss. So, on the toy target (`dfpipe.toy_target`):

  1. toy target and data   a briefly trained toy target (as tests/test_tau_ci.py's fixture), its own
                           greedy answers to --train-rows corpus prompts (training) and to
                           --heldout-rows held-out prompts (never trained on), captured once into
                           packed batches of --batch-rows documents
  2. paired trainings      per seed, a drafter in "bf16" and a copy of it in "fp8-emulated" trained
                           in lockstep: the same initialisation, the same batches in the same order,
                           the same anchors, the trainer's AdamW and warmup-cosine schedule over
                           --max-steps. Every --eval-every steps both are scored on the held-out
                           batches (as served, fixed anchors: loss and tau implied by the accuracy per
                           block position). A pair stops once both arms have plateaued (held-out
                           loss moving < 0.2% over the last fifth of the steps) or at --max-steps.
  3. the protocol's noise  bf16 against bf16 across seeds (another initialisation, order, anchors):
                           how far apart two trainings land by chance, to read the A/B against
  4. the verdict           95% t-intervals over the seeds of the paired differences, fp8 against
                           bf16: held-out loss (relative) within +-1% and tau within +-0.1, every run
                           plateaued. Beside it, as a measurement, FP8's one-step gradient fidelity
                           (`dfpipe.toy_target.gradient_fidelity`) on the fp8 arm's weights at the
                           start, middle and end of each training.

On a CPU "bf16" runs the matmuls in the compute dtype, fp32, so the A/B sets FP8's rounding against
no rounding at all (fp8-emulated: the same e4m3 values and scales as the GPU's fp8, products in fp32).
Writes bench/out/fp8_ab.json, prints markdown tables; exits 0 when the A/B passes, 1 when it does not
(or a run did not plateau: then it has not decided).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.toy_tau import answered_data, log, toy_target_dir  # noqa: E402  (fla/causal_conv1d kept out on a CPU)
from dfpipe import toy_target as tt  # noqa: E402
from target_server import toy_corpus  # noqa: E402

PLATEAU_TOLERANCE = 0.002       # held-out loss may move this much (relative) over the window...
PLATEAU_WINDOW = 0.2            # ...the last fifth of the steps run
LOSS_REL_BOUND = 0.01           # pass: the 95% bounds of fp8/bf16 - 1 of the held-out loss within +-1%
TAU_BOUND = 0.1                 # and of tau(fp8) - tau(bf16) within +-0.1
ARMS = ("bf16", "fp8-emulated")

# Two-sided 95% quantiles of Student's t (0.975 one-sided) for 1..30 degrees of freedom: the
# standard table, so that the bench needs no scipy.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


# ---- statistics (tests/test_fp8_ab.py checks these on synthetic numbers) ------------------------
def t975(df: int) -> float:
    """Student's t quantile for a two-sided 95% interval with `df` degrees of freedom: the table up
    to 30, beyond it the Cornish-Fisher expansion around the normal quantile (error < 1e-3)."""
    if df < 1:
        raise ValueError(f"a t-interval needs at least 1 degree of freedom (2 pairs), got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


@dataclass(frozen=True)
class Interval:
    """A 95% t-interval of the mean of paired differences."""
    mean: float
    low: float
    high: float
    n: int

    def within(self, bound: float) -> bool:
        """Both bounds inside [-bound, +bound]."""
        return -bound <= self.low and self.high <= bound

    def margin(self, bound: float) -> float:
        """How far inside the bound the interval's farther end lies (negative: by how much it misses)."""
        return bound - max(abs(self.low), abs(self.high))


def paired_t_interval(differences: Sequence[float]) -> Interval:
    """The 95% t-interval of the mean of `differences` (one per paired seed): mean +- t * sd / sqrt(n)."""
    n = len(differences)
    mean = statistics.fmean(differences)
    half = t975(n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def plateau_change(curve: Sequence[tuple[int, float]], window: float = PLATEAU_WINDOW) -> float | None:
    """Relative movement of the held-out loss over the last `window` of the steps run: (max - min) /
    last over the evals from the last one at or before step (1 - window) * final step through the
    final one (so the window covers the whole last fifth, not just the evals inside it). None while
    no eval lies at or before the window's start, or the window holds one eval."""
    if len(curve) < 2:
        return None
    final_step = curve[-1][0]
    start = max((i for i, (step, _) in enumerate(curve) if step <= (1 - window) * final_step), default=None)
    if start is None or start == len(curve) - 1:
        return None
    losses = [loss for _, loss in curve[start:]]
    return (max(losses) - min(losses)) / abs(losses[-1])


def plateaued(curve: Sequence[tuple[int, float]], tolerance: float = PLATEAU_TOLERANCE,
              window: float = PLATEAU_WINDOW) -> bool:
    """Whether the held-out loss moved less than `tolerance` (relative) over the last `window` of the steps."""
    change = plateau_change(curve, window)
    return change is not None and change < tolerance


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str


def decide(loss_rel: Interval, tau_diff: Interval, all_plateaued: bool, loss_bound: float = LOSS_REL_BOUND,
           tau_bound: float = TAU_BOUND) -> Verdict:
    """Pass when both 95% intervals lie within their bounds and every run reached its plateau: an
    unconverged A/B compares trainings that have not ended, which is not the question."""
    misses = []
    if not loss_rel.within(loss_bound):
        misses.append(f"held-out loss [{loss_rel.low:+.3%}, {loss_rel.high:+.3%}] outside +-{loss_bound:.0%} "
                      f"by {-loss_rel.margin(loss_bound):.3%}")
    if not tau_diff.within(tau_bound):
        misses.append(f"tau [{tau_diff.low:+.3f}, {tau_diff.high:+.3f}] outside +-{tau_bound} "
                      f"by {-tau_diff.margin(tau_bound):.3f}")
    if not all_plateaued:
        misses.append("a run did not plateau (raise --max-steps)")
    if misses:
        return Verdict(False, "; ".join(misses))
    return Verdict(True, f"held-out loss within +-{loss_bound:.0%} with {loss_rel.margin(loss_bound):.3%} to spare, "
                         f"tau within +-{tau_bound} with {tau_diff.margin(tau_bound):.3f} to spare")


# ---- data --------------------------------------------------------------------------------------
def captured_batches(target_dir: str, rows: list[dict[str, Any]], batch_rows: int, layer_ids: list[int]) -> list[Any]:
    """`rows` captured by the toy target (`tt.captured_batch`), `batch_rows` documents a packed batch."""
    return [tt.captured_batch(target_dir, rows[i:i + batch_rows], layer_ids) for i in range(0, len(rows), batch_rows)]


def blocks_for(batch: Any, recipe: tt.DrafterRecipe, mask_token_id: int, anchor_seed: int) -> Any:
    """The trainer's blocks of `batch`: up to recipe.max_anchors anchors a document drawn with `anchor_seed`."""
    from common.config import default_gamma
    from drafter_trainer.blocks import build_blocks, sample_anchors

    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, recipe.max_anchors,
                             torch.Generator().manual_seed(anchor_seed))
    return build_blocks(batch, anchors, recipe.block_size, mask_token_id, default_gamma(recipe.block_size))


# ---- training ----------------------------------------------------------------------------------
@dataclass
class Arm:
    """One training of a pair: its drafter, optimizer and held-out curve."""
    precision: str
    drafter: Any
    optimizer: torch.optim.Optimizer
    curve: list[tuple[int, float]] = field(default_factory=list)       # (step, held-out loss)
    taus: list[tuple[int, float]] = field(default_factory=list)        # (step, held-out implied tau)

    @property
    def plateaued(self) -> bool:
        return plateaued(self.curve)


@torch.no_grad()
def heldout_score(drafter: Any, heldout: list[tuple[Any, Any]]) -> tuple[float, float]:
    """(loss, implied tau) on the held-out (batch, blocks), pooled as the trainer's eval pools them:
    the drafter as served (no FP8 in its matmuls), eval mode."""
    from drafter_trainer.loss import dflash_loss, implied_acceptance_length

    was_training = drafter.training
    drafter.eval()
    correct = count = 0
    ce_sum = weight_sum = 0.0
    try:
        with drafter.as_served():
            for batch, blocks in heldout:
                out = dflash_loss(drafter, batch, blocks, chunk=1024)
                correct = correct + out.correct_per_pos.double()
                count = count + out.count_per_pos.double()
                ce_sum += float(out.ce_sum)
                weight_sum += float(out.weight_sum)
    finally:
        drafter.train(was_training)
    return ce_sum / weight_sum, implied_acceptance_length((correct / count.clamp_min(1))[1:])


def fidelity_summary(point: Any) -> dict[str, Any]:
    """The few numbers of a `tt.GradientFidelity` the report keeps (the per-parameter cosines stay out)."""
    name, worst = point.min_cosine
    return {"step": point.step, "accuracy": round(point.accuracy, 4), "min_cosine": round(worst, 5),
            "min_cosine_parameter": name, "bf16_fp32_min_cosine": round(min(point.cosine["bf16/fp32"].values()), 5),
            "loss_rel": point.loss_rel, "passed_ci_gate": point.passed}


def train_pair(seed: int, target_dir: str, recipe: tt.DrafterRecipe, train: list[Any], heldout: list[tuple[Any, Any]],
               probe: tuple[Any, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The A/B of one seed: bf16 and fp8-emulated from one initialisation, stepped in lockstep on the
    same (batch, blocks); both scored every --eval-every steps; FP8's gradient fidelity on the fp8
    arm's weights at each score (the probe batch: training batch 0, fixed anchors)."""
    from common.config import Config, TrainConfig
    from drafter_trainer.blocks import anchor_seed
    from drafter_trainer.loss import dflash_loss
    from drafter_trainer.optim import build_adamw, set_lr
    from drafter_trainer.train import lr_at

    t0 = time.monotonic()
    # the trainer's optimizer and schedule, at the toy recipe's learning rate
    cfg = Config(train=TrainConfig(lr=recipe.lr, warmup_ratio=recipe.warmup_ratio, min_lr_ratio=recipe.min_lr_ratio))
    start = tt.untrained_drafter(target_dir, recipe, seed).train()
    arms = []
    for precision in ARMS:
        drafter = copy.deepcopy(start)
        drafter.precision = precision
        params = [p for p in drafter.parameters() if p.requires_grad]
        arms.append(Arm(precision, drafter, build_adamw(params, cfg.train, torch.device("cpu"))))
    fp8 = arms[1]
    fidelity = [tt.gradient_fidelity(fp8.drafter, *probe, step=0)]
    order: list[int] = []
    step = 0
    while True:
        if step % args.eval_every == 0 or step == args.max_steps:
            for arm in arms:
                loss, tau = heldout_score(arm.drafter, heldout)
                arm.curve.append((step, loss))
                arm.taus.append((step, tau))
            if step:
                fidelity.append(tt.gradient_fidelity(fp8.drafter, *probe, step=step))
            log(f"seed {seed} step {step}: " + ", ".join(
                f"{a.precision} loss {a.curve[-1][1]:.4f} tau {a.taus[-1][1]:.3f}"
                + (f" (moved {plateau_change(a.curve):.2%})" if plateau_change(a.curve) is not None else "")
                for a in arms) + f", fp8 least gradient cosine {fidelity[-1].min_cosine[1]:.4f}")
            if step == args.max_steps or (step >= args.min_steps and all(a.plateaued for a in arms)):
                break
        if not order:
            # each epoch a new order of the training batches, a function of (seed, epoch)
            order = list(range(len(train)))
            random.Random(f"fp8-ab/{seed}/{step // len(train)}").shuffle(order)
        index = order.pop(0)
        batch = train[index]
        blocks = blocks_for(batch, recipe, start.config.mask_token_id, anchor_seed(seed, step // len(train), index))
        lr = lr_at(step / args.max_steps, cfg)
        for arm in arms:
            arm.optimizer.zero_grad(set_to_none=True)
            dflash_loss(arm.drafter, batch, blocks, chunk=1024, backward=True)
            torch.nn.utils.clip_grad_norm_(arm.drafter.parameters(), cfg.train.grad_clip)
            set_lr(arm.optimizer, lr)
            arm.optimizer.step()
        step += 1
    # fidelity at the start, the middle (the score nearest half the steps run) and the end
    middle = min(fidelity, key=lambda p: abs(p.step - step / 2))
    return {"seed": seed, "steps": step, "seconds": round(time.monotonic() - t0, 1),
            "arms": {a.precision: {"heldout_loss": a.curve[-1][1], "tau": a.taus[-1][1], "plateaued": a.plateaued,
                                   "plateau_change": plateau_change(a.curve), "curve": a.curve, "taus": a.taus}
                     for a in arms},
            "fidelity": {"start": fidelity_summary(fidelity[0]), "middle": fidelity_summary(middle),
                         "end": fidelity_summary(fidelity[-1])},
            "fidelity_curve": [fidelity_summary(p) for p in fidelity]}


# ---- report ------------------------------------------------------------------------------------
def seed_noise(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """bf16 against bf16 across seeds: every two seeds' final held-out loss (relative) and tau apart."""
    bf16 = [(p["arms"]["bf16"]["heldout_loss"], p["arms"]["bf16"]["tau"]) for p in pairs]
    loss_rel = [b[0] / a[0] - 1 for i, a in enumerate(bf16) for b in bf16[i + 1:]]
    tau_diff = [b[1] - a[1] for i, a in enumerate(bf16) for b in bf16[i + 1:]]
    return {"pairs_of_seeds": len(loss_rel),
            "loss_rel_abs_mean": statistics.fmean(abs(d) for d in loss_rel), "loss_rel_abs_max": max(map(abs, loss_rel)),
            "loss_sd_rel": statistics.stdev(b[0] for b in bf16) / statistics.fmean(b[0] for b in bf16),
            "tau_abs_mean": statistics.fmean(abs(d) for d in tau_diff), "tau_abs_max": max(map(abs, tau_diff)),
            "tau_sd": statistics.stdev(b[1] for b in bf16)}


def plateau_cell(arm: dict[str, Any]) -> str:
    """yes/NO and how far the held-out loss moved over the last fifth of the steps."""
    change = arm["plateau_change"]
    return ("yes" if arm["plateaued"] else "NO") + (f" ({change:.2%})" if change is not None else "")


def print_tables(pairs: list[dict[str, Any]], noise: dict[str, Any], loss_rel: Interval, tau_diff: Interval,
                 verdict: Verdict) -> None:
    print(f"\nbf16 against bf16 across seeds ({noise['pairs_of_seeds']} pairs of seeds): held-out loss apart by "
          f"{noise['loss_rel_abs_mean']:.2%} on average (at most {noise['loss_rel_abs_max']:.2%}; sd "
          f"{noise['loss_sd_rel']:.2%} of the mean), tau by {noise['tau_abs_mean']:.3f} (at most "
          f"{noise['tau_abs_max']:.3f}; sd {noise['tau_sd']:.3f})")
    print("\n| seed | steps | plateaued bf16 / fp8 | held-out loss bf16 | fp8 | fp8/bf16 - 1 | tau bf16 | fp8 | "
          "fp8 - bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in pairs:
        b, f = p["arms"]["bf16"], p["arms"]["fp8-emulated"]
        print(f"| {p['seed']} | {p['steps']} | {plateau_cell(b)} / {plateau_cell(f)} "
              f"| {b['heldout_loss']:.4f} | {f['heldout_loss']:.4f} | {f['heldout_loss'] / b['heldout_loss'] - 1:+.3%} "
              f"| {b['tau']:.3f} | {f['tau']:.3f} | {f['tau'] - b['tau']:+.3f} |")
    print(f"| mean, 95% t-interval | | | | | {loss_rel.mean:+.3%} [{loss_rel.low:+.3%}, {loss_rel.high:+.3%}] | | | "
          f"{tau_diff.mean:+.3f} [{tau_diff.low:+.3f}, {tau_diff.high:+.3f}] |")
    print(f"| bound | | | | | +-{LOSS_REL_BOUND:.0%} | | | +-{TAU_BOUND} |")
    print("\nFP8's one-step gradient fidelity on the fp8 arm's weights (least per-parameter cosine to fp32's or "
          "bf16's; the CI gate was >= 0.99), a measurement:\n")
    print("| seed | start (acc) | middle (acc) | end (acc) | bf16/fp32 least, all points |")
    print("| --- | --- | --- | --- | --- |")
    for p in pairs:
        cells = [f"{p['fidelity'][k]['min_cosine']:.4f} ({p['fidelity'][k]['accuracy']:.2f}, step "
                 f"{p['fidelity'][k]['step']}, {p['fidelity'][k]['min_cosine_parameter']})" for k in ("start", "middle", "end")]
        print(f"| {p['seed']} | " + " | ".join(cells)
              + f" | {min(x['bf16_fp32_min_cosine'] for x in p['fidelity_curve']):.4f} |")
    print(f"\nverdict: {'PASS' if verdict.passed else 'FAIL'}: {verdict.reason}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=os.path.join(REPO, ".cache", "dfpipe", "fp8-ab"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "out"))
    ap.add_argument("--seeds", type=int, default=4, help="paired seeds 0..N-1 (at least 2 for an interval; 4 to decide)")
    ap.add_argument("--max-steps", type=int, default=1000, help="cap of each training; the cosine schedule spans it")
    ap.add_argument("--min-steps", type=int, default=300, help="no plateau stop before this step")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between held-out scores (and fidelity points)")
    ap.add_argument("--train-rows", type=int, default=768, help="corpus prompts the target answers for training")
    ap.add_argument("--heldout-rows", type=int, default=32, help="held-out prompts the target answers for scoring")
    ap.add_argument("--batch-rows", type=int, default=8, help="documents a training batch")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="longest answer the target writes")
    ap.add_argument("--layers", type=int, default=1, help="drafter layers")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=32, help="anchors a document (drafter.max_anchors)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--target-minutes", type=float, default=5.0, help="toy target budget (as the CI fixture)")
    ap.add_argument("--target-steps", type=int, default=120, help="toy target steps (as the CI fixture)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared CPU runs it fastest)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke: 2 seeds, 30 steps, small data; its numbers decide nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.max_steps, args.min_steps, args.eval_every = 2, 30, 10, 10
        args.train_rows, args.heldout_rows, args.batch_rows = 32, 8, 8
    if args.seeds < 2:
        ap.error("--seeds must be at least 2 (a t-interval needs two pairs)")
    torch.set_num_threads(args.threads)
    os.makedirs(args.cache_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()

    target_dir = toy_target_dir(args.cache_dir, args.target_minutes, 0, args.target_steps,
                                tt.ToyRecipe(heldout_samples=1, heldout_max_new_tokens=16))
    train_rows, _ = answered_data(args.cache_dir, target_dir, f"train-n{args.train_rows}",
                                  [toy_corpus.sample(1, i) for i in range(args.train_rows)], args.max_new_tokens)
    heldout_rows, _ = answered_data(args.cache_dir, target_dir, f"heldout-n{args.heldout_rows}",
                                    tt.heldout_samples(1, args.heldout_rows), args.max_new_tokens)
    recipe = tt.DrafterRecipe(num_layers=args.layers, block_size=args.block_size, max_anchors=args.anchors,
                              lr=args.lr)
    config = tt.untrained_drafter(target_dir, recipe).config
    train = captured_batches(target_dir, train_rows, args.batch_rows, config.target_layer_ids)
    from drafter_trainer.blocks import heldout_anchor_seed
    heldout = [(b, blocks_for(b, recipe, config.mask_token_id, heldout_anchor_seed(0, i)))
               for i, b in enumerate(captured_batches(target_dir, heldout_rows, args.batch_rows, config.target_layer_ids))]
    # the fidelity probe: one training batch at anchors of its own that no seed's training draws
    probe = (train[0], blocks_for(train[0], recipe, config.mask_token_id, heldout_anchor_seed(1, 0)))
    t_data = time.monotonic()
    log(f"data: {len(train)} training batches ({sum(int(b.doc_lens.sum()) for b in train)} tokens), "
        f"{len(heldout)} held-out batches ({sum(int(b.doc_lens.sum()) for b, _ in heldout)} tokens, "
        f"{sum(int((bl.weights.sum(-1) > 0).sum()) for _, bl in heldout)} blocks) in {t_data - t0:.0f} s")

    pairs = [train_pair(seed, target_dir, recipe, train, heldout, probe, args) for seed in range(args.seeds)]
    noise = seed_noise(pairs)
    loss_rel = paired_t_interval([p["arms"]["fp8-emulated"]["heldout_loss"] / p["arms"]["bf16"]["heldout_loss"] - 1
                                  for p in pairs])
    tau_diff = paired_t_interval([p["arms"]["fp8-emulated"]["tau"] - p["arms"]["bf16"]["tau"] for p in pairs])
    verdict = decide(loss_rel, tau_diff, all(a["plateaued"] for p in pairs for a in p["arms"].values()))
    print_tables(pairs, noise, loss_rel, tau_diff, verdict)

    command = "python bench/fp8_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cpus, "
                         f"torch threads {torch.get_num_threads()}, cpu, fp8-emulated",
              "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "command": command.strip(), "args": vars(args), "drafter_recipe": asdict(recipe),
              "toy_target": {k: v for k, v in (tt.read_report(target_dir) or {}).items() if k != "loss_curve"},
              "bounds": {"loss_rel": LOSS_REL_BOUND, "tau": TAU_BOUND, "plateau_tolerance": PLATEAU_TOLERANCE,
                         "plateau_window": PLATEAU_WINDOW},
              "noise_bf16_vs_bf16": noise, "loss_rel": asdict(loss_rel), "tau_diff": asdict(tau_diff),
              "passed": verdict.passed, "verdict": verdict.reason, "pairs": pairs,
              "seconds": {"target_and_data": round(t_data - t0, 1), "total": round(time.monotonic() - t0, 1)}}
    path = os.path.join(args.out, "fp8_ab.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}; total {result['seconds']['total']:.0f} s")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
