"""Small host-side helpers shared by the kernel wrappers (no Triton code here)."""

from __future__ import annotations

import contextlib
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_launchable(*tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device can run a Triton kernel; returns the device.

    Compiled kernels need CUDA tensors; under the interpreter the tensors may live on the CPU.
    """
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"kernel inputs on different devices: {device} and {t.device}")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"cbatch.kernels got tensors on {device}: the Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before importing triton, for CPU testing)"
        )
    return device


def on_device(device: torch.device):
    """Make `device` current for the launch, so multi-GPU processes launch on the inputs' GPU."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
