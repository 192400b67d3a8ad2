"""Part `env`: the versions (torch, transformers, triton, fla, zmq, ...), the device and the host's
transport facts (GPU topology, NUMA, huge pages); then the fixtures in the workdir: a
Qwen3.5-27B-shaped target cut to --layers layers with random bf16 weights, and a prepared dataset of
--dataset-docs lognormal documents (fixtures.py). Result: fixtures, reused when the sizes match."""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import shutil
import subprocess
from typing import Any

import numpy as np
import torch

from bench.gpu import fixtures
from bench.gpu.shared import Ctx, SkipPart, target_shape


def part_env(ctx: Ctx) -> str:
    a = ctx.args
    info = versions(ctx.device)
    for k, v in info.items():
        print(f"{k:>24}: {v}")
    ctx.store.update(lambda d: d["meta"].update(versions=info))
    if not ctx.cuda and not a.quick:
        raise SkipPart("no CUDA: fixtures of the 27B shape are built only on a GPU host (or pass --quick)")
    shape = target_shape(a)
    key = {"shape": fixtures.shape_dict(shape), "token_budget": a.token_budget, "max_len": a.max_len,
           "median": a.median, "sigma": a.sigma, "dataset_docs": a.dataset_docs, "seed": a.seed,
           "device_type": ctx.device.type}
    target_dir, data_dir = os.path.join(ctx.workdir, "target"), os.path.join(ctx.workdir, "data")
    try:
        old = fixtures.read_manifest(ctx.workdir)
    except FileNotFoundError:
        old = {}
    if old.get("key") == key and os.path.isfile(os.path.join(target_dir, "config.json")):
        print(f"fixtures in {ctx.workdir} match these sizes: reused")
        return "reused fixtures"
    for path in (target_dir, data_dir):
        shutil.rmtree(path, ignore_errors=True)
    build_s = fixtures.build_target(target_dir, shape, ctx.device, seed=a.seed)
    lengths = fixtures.document_lengths(a.dataset_docs, a.median, a.sigma, a.max_len, a.seed)
    tokens = fixtures.write_dataset(data_dir, lengths, shape.vocab, shape.mask_token_id, a.seed)
    disk = sum(os.path.getsize(os.path.join(target_dir, f)) for f in os.listdir(target_dir))
    fixtures.write_manifest(ctx.workdir, {"key": key, "shape": key["shape"], "target_dir": target_dir,
                                          "data_dir": data_dir, "token_budget": a.token_budget, "max_len": a.max_len})
    figures = {"target_build_s": build_s, "target_gb_on_disk": disk / 1e9, "dataset_docs": len(lengths),
               "dataset_tokens": tokens, "doc_len_mean": float(lengths.mean()),
               "doc_len_p50": float(np.median(lengths)), "doc_len_max": int(lengths.max())}
    ctx.store.figures("env", **figures)
    print(json.dumps(figures, indent=1))
    return "built fixtures"


def versions(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "device": str(device), "cpus": os.cpu_count()}
    for mod in ("transformers", "triton", "fla", "zmq", "msgpack", "numpy", "safetensors"):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "unknown")
        except Exception as e:  # a missing or broken package is a finding, not a crash
            out[mod] = f"missing ({type(e).__name__}: {e})"[:200]
    with contextlib.suppress(ImportError):
        import triton
        autotuning = getattr(getattr(triton, "knobs", None), "autotuning", None)
        out["triton_autotune_cache_knob"] = hasattr(autotuning, "cache")  # TRITON_CACHE_AUTOTUNING is read
    out.update({var: os.environ.get(var, "") for var in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "PYTHONPATH")})
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gb=round(p.total_memory / 1e9, 1),
                   sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    # what bounds the transport: GPU <-> CPU/NUMA affinity, and whether /dev/shm may use huge pages
    for name, cmd in (("gpu_topology", ["nvidia-smi", "topo", "-m"]), ("numa", ["numactl", "--hardware"])):
        try:
            out[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout[-3000:]
        except (OSError, subprocess.SubprocessError) as e:
            out[name] = f"unavailable ({type(e).__name__})"
    for name, path in (("shmem_thp", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
                       ("thp", "/sys/kernel/mm/transparent_hugepage/enabled")):
        try:
            with open(path, encoding="ascii") as f:
                out[name] = f.read().strip()
        except OSError:
            out[name] = "unavailable"
    try:
        with open("/proc/mounts", encoding="ascii") as f:
            out["dev_shm_mount"] = next((line.strip() for line in f if " /dev/shm " in line), "not mounted")
    except OSError:
        out["dev_shm_mount"] = "unavailable"
    return out
