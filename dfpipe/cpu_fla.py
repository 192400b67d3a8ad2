"""Keeps FLA and causal-conv1d out on a machine without CUDA, before transformers is imported."""
from __future__ import annotations

import sys


def quiet_fla_on_cpu() -> None:
    """On a machine without CUDA, keep FLA/causal-conv1d out so transformers runs its torch path."""
    try:
        import torch
        if not torch.cuda.is_available():
            for mod in ("fla", "causal_conv1d"):
                sys.modules.setdefault(mod, None)  # type: ignore[arg-type]
    except ImportError:
        pass
