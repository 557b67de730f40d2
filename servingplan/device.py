"""Where the model and its KV pool live (config `model.device`: cpu or cuda), and the one wait every
timed call makes before the clock is read.

    model_device(model) -> torch.device
    wait_for(device)     block until the work queued on `device` has run (nothing on the CPU)
"""
from __future__ import annotations

import torch


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def wait_for(device: torch.device) -> None:
    """CUDA queues kernels and returns at once, so a clock read straight after a call would time its
    launch, not its work: wait for the GPU. On the CPU a call returns when its work is done, and
    this does nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
