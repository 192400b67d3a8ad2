"""Part `p23`: the target's first pass against a repeat per attention variant (--firstpass-batches);
P2, the TargetWorker against the bare forward over the same batches, in turns, with its diagnostics
(--p2-diagnostics); P3, packed against padded (--p3-docs; 0 leaves it out). Result: ratios."""
from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from bench.gpu import fixtures
from bench.gpu.shared import Ctx, P2Rig


def part_p23(ctx: Ctx) -> str:
    from target_server.data import PreparedDataset
    from target_server.packer import Packer

    a = ctx.args
    dev = ctx.device
    manifest = fixtures.read_manifest(ctx.workdir)
    budget, max_len = manifest["token_budget"], manifest["max_len"]
    runner = fixtures.load_runner(manifest, dev, a.allow_torch_linear)
    ctx.store.figures("p23", first_forward_s=runner.warmup(budget), linear_backend=runner.linear_backend)
    failed = []
    try:
        if a.firstpass_batches > 0:
            first_pass_by_attention(ctx, runner, manifest)
    except Exception as e:  # a diagnostic: P2 and P3 still run
        traceback.print_exc()
        ctx.store.figures("p23", first_pass_error=f"{type(e).__name__}: {e}"[:500])
    runner.attention_path = "auto"
    if ctx.cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)   # as TargetRunner.load leaves it

    # P2: the server's worker path vs the bare forward over the same batches, repeated in turns
    numbers: dict[str, Any] = {"batches_timed": a.p2_batches, "token_budget": budget, "audit_every": a.audit_every,
                               "repeats": a.p2_repeats}
    with ctx.recorded("P2", numbers, failed):
        dataset = PreparedDataset.open(manifest["data_dir"])
        packer = Packer(dataset.lengths, budget, a.seed)
        p2 = P2Rig(ctx, runner, dataset, packer, list(range(a.p2_warmup + a.p2_batches)), max_len, a.p2_warmup, "p2")
        numbers["tokens_timed"] = p2.tokens
        numbers.update(p2.turns(a.p2_repeats))
        ratio = sum(numbers["ratio_runs"]) / len(numbers["ratio_runs"])
        # P2 and the target-alone rate (P6d, P7) are recorded before the diagnostics, which a
        # part's timeout may cut short (--p2-diagnostics 0 leaves them out)
        ctx.store.figures("p23", target_alone_tok_s=numbers["worker_tok_s"], bare_forward_tok_s=numbers["bare_tok_s"])
        ctx.store.benchmark("P2", {"worker_over_bare_forward": ratio}, numbers)
        if a.p2_diagnostics:
            bare_tok_s, worker_tok_s, skip = p2.bare_tok_s, p2.worker_run, a.p2_warmup - 1
            # diagnostics, each against the bare rate above: the worker without its per-batch audit; a
            # consumer in this process that polls every millisecond (the harness before the seventh
            # session); and the input copies as they were before it (blocking: every batch first waited
            # for the previous forward to finish), the bare loop then measured the same way
            numbers["worker_without_audit_tok_s"] = worker_tok_s(
                patch=lambda w: setattr(w, "_audit", lambda seq, hidden, arrays: True)).tokens_per_s(skip)
            numbers["worker_consumer_polling_tok_s"] = worker_tok_s(poll_interval_s=0.001).tokens_per_s(skip)
            with blocking_input_copies():
                numbers["bare_blocking_inputs_tok_s"] = bare_tok_s()
                blocked = worker_tok_s()
                numbers["worker_blocking_inputs_tok_s"] = blocked.tokens_per_s(skip)
                numbers["worker_blocking_inputs_stages"] = blocked.stages
                # both as they were: the producer and harness of runs before the seventh session
                numbers["worker_blocking_inputs_consumer_polling_tok_s"] = worker_tok_s(
                    poll_interval_s=0.001).tokens_per_s(skip)
            # the baseline again, after the workers: how much the bare rate itself moves within a run
            numbers["bare_after_tok_s"] = bare_tok_s()
            del p2
            ctx.store.figures("p23", target_alone_tok_s=numbers["worker_tok_s"],
                              bare_forward_tok_s=numbers["bare_tok_s"])
            ctx.store.benchmark("P2", {"worker_over_bare_forward": ratio}, numbers)
        print(json.dumps({k: v for k, v in numbers.items() if "stages" not in k}, indent=1))

    # P3: packed (varlen) vs padded (transformers' batched forward), bench/target_bench's own runs
    # --p3-docs 0: P3 not run (its padded baseline is the slow half of the part; P2 alone is quick)
    if a.p3_docs <= 0:
        ctx.store.benchmark_error("P3", "not run: --p3-docs 0")
    else:
        numbers = {"docs": a.p3_docs, "median": a.median, "sigma": a.sigma, "max_len": max_len, "token_budget": budget}
        with ctx.recorded("P3", numbers, failed):
            from bench.target_bench import lognormal_lengths, pack_rows, run_packed, run_padded

            lens = lognormal_lengths(a.p3_docs, a.median, a.sigma, max_len, a.seed + 1)
            g = torch.Generator().manual_seed(a.seed + 1)
            top = min(runner.vocab_size, manifest["shape"]["mask_token_id"])
            docs = [torch.randint(0, top, (n,), generator=g) for n in lens]
            rows = pack_rows(lens, budget)
            per_batch = max(1, budget // max_len)
            real = sum(lens)
            # each run twice: the first pays for new kernel shapes (padded widths, autotune)
            for _ in range(2):
                _, t_packed = run_packed(runner, docs, rows)
            for _ in range(2):
                computed_padded, t_padded = run_padded(runner, docs, per_batch)
            packed_computed = sum(sum(lens[i] for i in row) for row in rows)
            numbers.update({"real_tokens": real, "packed_rows": len(rows), "packed_fill": real / (len(rows) * budget),
                            "padded_batch_docs": per_batch, "packed_tok_s": real / t_packed,
                            "padded_tok_s": real / t_padded,
                            "packed_computed_over_real": packed_computed / real,
                            "padded_computed_over_real": computed_padded / real,
                            "static_padded_computed_over_real": len(lens) * max_len / real})
            print(json.dumps(numbers, indent=1))
            ctx.store.benchmark("P3", {"packed_over_padded_tok_s": numbers["packed_tok_s"] / numbers["padded_tok_s"],
                                       "packed_computed_over_real": numbers["packed_computed_over_real"]}, numbers)
    if failed:
        raise RuntimeError(f"{', '.join(failed)} failed (see the log)")
    return "measured"


def first_pass_by_attention(ctx: Ctx, runner: Any, manifest: dict[str, Any]) -> None:
    """Why a target's first pass over a batch is slower than a repeat: for each attention variant,
    fresh batches (never seen by this process) timed once, then the same batches again. Variants:
    SDPA per document with cuDNN's attention allowed (torch's default) and without it, and one flash
    varlen call per row (the default on CUDA). Figures `first_pass` in part p23."""
    from target_server.data import PreparedDataset
    from target_server.packer import Packer, build_packed

    a = ctx.args
    variants = [("per_document+cudnn", "per_document", True), ("per_document", "per_document", False)]
    if ctx.cuda:
        variants.append(("varlen", "varlen", False))
    dataset = PreparedDataset.open(manifest["data_dir"])
    packer = Packer(dataset.lengths, manifest["token_budget"], a.seed)
    out: dict[str, Any] = {"batches": a.firstpass_batches}
    for i, (name, path, cudnn) in enumerate(variants):
        # seqs far past those P2 and the services use, and different for every variant
        seqs = range(10_000 + 100 * i, 10_000 + 100 * i + a.firstpass_batches)
        batches = [fixtures.batch_tensors(build_packed(dataset, packer.batch(s))) for s in seqs]
        runner.attention_path = path
        if ctx.cuda:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        rates = [fixtures.capture_tok_s(runner, batches, ctx.device) for _ in range(2)]
        out[name] = {"first_tok_s": rates[0], "repeat_tok_s": rates[1], "first_over_repeat": rates[0] / rates[1],
                     "docs_per_batch": sum(int(b[2].numel()) for b in batches) / len(batches)}
        print(f"first pass, {name}: {rates[0]:,.0f} tok/s first, {rates[1]:,.0f} repeat", flush=True)
        ctx.store.figures("p23", first_pass=out)


@contextlib.contextmanager
def blocking_input_copies() -> Iterator[None]:
    """The target's input copies as they were before the seventh session: one `.to(device)` per
    tensor from pageable memory, each of which waits for the stream (the previous forward)."""
    from target_server import varlen

    def blocking(device: Any, *items: Any) -> list[Any]:
        return [item.with_tensors([t.to(device) for t in item.tensors()]) if isinstance(item, varlen.PackedDocs)
                else item.to(device) for item in items]

    shipped = varlen.to_device
    varlen.to_device = blocking
    try:
        yield
    finally:
        varlen.to_device = shipped
