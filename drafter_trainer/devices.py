"""The trainer's helper threads and the current CUDA device."""
from __future__ import annotations

import torch


def use_device(device: torch.device | str) -> None:
    """Make `device` this thread's current CUDA device. The current device is per thread: a new
    thread starts on cuda:0, and anything there that uses "the current device" (a bare
    synchronize, Triton's benchmarking) would open a context of this process on GPU 0, which in
    a placement belongs to the target server. A bare "cuda" names the current device already."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
