"""Which FP8 implementation the drafter uses, chosen by measurement: one drafter MLP (gate, up, down
at the target's widths) over one chunk's block tokens, forward + backward, compiled, fp32 master
weights under bf16 autocast (as the trainer runs it), three ways:

    bf16      nn.Linear (cuBLAS bf16)
    dfpipe    drafter_trainer.fp8.linear: row-wise scaled e4m3 for all three matmuls
    torchao   torchao.float8's Float8Linear, its "rowwise" recipe (the same scaling scheme), where
              torchao imports and converts on this torch

Each is timed over `iters` steps after two warm-up ones (the compile), and its output and input
gradient compared with bf16's (relative error of the whole tensor).
"""
from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, linear: type[nn.Linear]) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _plain(hidden: int, out: int) -> nn.Linear:
    return nn.Linear(hidden, out, bias=False)


def _timed(mlp: nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Seconds per forward + backward, and the output and input gradient of the last one."""
    compiled = torch.compile(mlp, dynamic=False)
    xr = x.detach().requires_grad_()
    for _ in range(2):
        xr.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = compiled(xr)
        y.backward(grad)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        xr.grad = None
        for p in mlp.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = compiled(xr)
        y.backward(grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters, y.detach().float(), xr.grad.detach().float()


def compare(hidden: int, intermediate: int, tokens: int, iters: int = 20) -> dict[str, Any]:
    from drafter_trainer.model import Linear

    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    grad = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16) * 1e-3
    base = MLP(hidden, intermediate, _plain).to(dev)
    for p in base.parameters():
        nn.init.normal_(p, std=0.02)
    flops = 3 * 2.0 * tokens * 3 * hidden * intermediate
    out: dict[str, Any] = {"hidden": hidden, "intermediate": intermediate, "tokens": tokens, "iters": iters}
    s, y_ref, g_ref = _timed(base, x, grad, iters)
    out["bf16"] = {"ms": s * 1e3, "tflops": flops / s / 1e12}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    ours = MLP(hidden, intermediate, Linear).to(dev)
    ours.load_state_dict(base.state_dict())
    for m in ours.modules():
        if isinstance(m, Linear):
            m.precision = "fp8"
    s, y, g = _timed(ours, x, grad, iters)
    out["dfpipe"] = {"ms": s * 1e3, "tflops": flops / s / 1e12, "speedup": out["bf16"]["ms"] / (s * 1e3),
                     "out_rel_err": rel(y, y_ref), "grad_rel_err": rel(g, g_ref)}
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        theirs = copy.deepcopy(base)
        convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name("rowwise"))
        s, y, g = _timed(theirs, x, grad, iters)
        import torchao
        out["torchao"] = {"version": torchao.__version__, "ms": s * 1e3, "tflops": flops / s / 1e12,
                          "speedup": out["bf16"]["ms"] / (s * 1e3), "out_rel_err": rel(y, y_ref),
                          "grad_rel_err": rel(g, g_ref)}
    except Exception as e:     # not installed, or not working with this torch: say which
        out["torchao"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out
