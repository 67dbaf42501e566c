"""Small host-side helpers shared by the kernel wrappers (no Triton code here)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from cbatch.fp8_kv import FP8_KV_DTYPE


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter_scalars() -> None:
    """Under TRITON_INTERPRET with triton 3.6 (the GPU image's): its interpreter holds scalar kernel arguments as
    1-element arrays and turns them into loop bounds with int(array), an error from NumPy 2.4 on; triton 3.9
    squeezes first. This makes 3.6 do the same (a no-op change on 3.9). Only the interpreter is touched."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_scalars", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor


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



def check_kv_cache_dtype(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Checks that a cache fits activations of `dtype`; True when it is an fp8 cache (with its scales)."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ")
    if k_cache.dtype == dtype:
        return False
    if k_cache.dtype != FP8_KV_DTYPE:
        raise ValueError(f"dtype mismatch: activations {dtype}, cache {k_cache.dtype}")
    num_kv_heads = k_cache.shape[-2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.shape != (num_kv_heads,) or scale.dtype != torch.float32:
            raise ValueError(f"an fp8 cache needs {name}: float32 [{num_kv_heads}] (one scale per kv head)")
    return True


DEFAULT_NUM_SMS = 132  # H100 SXM / H200: used only when the inputs are not on a CUDA device (interpreter)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of `device` (DEFAULT_NUM_SMS off CUDA): what the kernels' split policies fill."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS
