"""What this CPU computes natively: its ISA flags from /proc/cpuinfo, narrowed by the caps oneDNN and ATen
are told to respect (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY; with MKL_ENABLE_INSTRUCTIONS, how an AVX-512 machine
is run as an AVX2 one).

Used for one decision, whether bfloat16 is native here, and by the benchmarks to print the machine.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

# The instructions that make bfloat16 GEMMs faster than float32 ones: AVX-512 BF16 dot products, AMX tiles
# (x86); BFDOT/BFMMLA (Arm's `bf16` feature).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# ONEDNN_MAX_CPU_ISA values that leave oneDNN without bfloat16 dot products (AVX2_VNNI_2 only converts)
_ONEDNN_CAPS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                       "AVX512_CORE_VNNI"})
# ATEN_CPU_CAPABILITY values below AVX-512
_ATEN_CAPS_WITHOUT_AVX512 = frozenset({"default", "avx2"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's `flags` (x86 Linux) or `Features` (Arm Linux) line; empty where there is none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def vector_isa_flags(flags: Iterable[str]) -> list[str]:
    """The flags that decide LLM speed on x86 (avx2, avx512*, amx*), sorted: what a benchmark table prints."""
    return sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx")))


def has_native_bf16(flags: Iterable[str], env: Mapping[str, str] = os.environ) -> bool:
    """True when the CPU has bfloat16 dot products and neither oneDNN nor ATen is capped below them."""
    if not set(NATIVE_BF16_FLAGS) & set(flags):
        return False
    if env.get("ONEDNN_MAX_CPU_ISA", "").upper() in _ONEDNN_CAPS_WITHOUT_BF16:
        return False
    return env.get("ATEN_CPU_CAPABILITY", "").lower() not in _ATEN_CAPS_WITHOUT_AVX512


def bf16_speed_warning(dtype: torch.dtype, device: torch.device, flags: Iterable[str] | None = None,
                       env: Mapping[str, str] = os.environ) -> str | None:
    """One line for a bfloat16 run on a CPU without native bfloat16 (None otherwise): it works, but is
    slower than float32, which is what `--dtype auto` picks on CPU."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return None
    flags = cpu_flags() if flags is None else frozenset(flags)
    if not flags or has_native_bf16(flags, env):  # no flags: an unknown CPU, nothing to say
        return None
    return ("--dtype bfloat16 on a CPU without native bfloat16 (no avx512_bf16, no AMX, or capped by "
            "ONEDNN_MAX_CPU_ISA/ATEN_CPU_CAPABILITY) runs slower than float32; --dtype auto picks float32 here")


# the variables that run an AVX-512 machine as an AVX2 one: oneDNN's, ATen's and MKL's (torch's float32 matmuls
# go to MKL on Intel CPUs, and its AVX-512 kernels ignore the other two)
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo"), env: Mapping[str, str] = os.environ) -> str:
    """"CPU: <model name> (family F, model M); vector flags: ...[; capped by VAR=value ...]" for a benchmark's
    first line."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    caps = " ".join(f"{name}={env[name]}" for name in ISA_CAP_VARIABLES if env.get(name))
    return (f"CPU: {fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}); vector flags: {' '.join(vector_isa_flags(cpu_flags(cpuinfo))) or 'none'}"
            + (f"; capped by {caps}" if caps else ""))
