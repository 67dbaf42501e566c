"""Integer weight-only checkpoints made from a float one (tests and the GPU kit's 4-bit e2e line): every decoder
matmul (attention, MLP, experts; not the router, embeddings or lm_head) quantized round-to-nearest with min/max
scales, then packed as each format's reference packer lays it out, written word by word from the documented
layout (cbatch/model/int4.py's docstring), with the quantization_config real checkpoints carry. Beside it, a plain
float checkpoint of the dequantized weights: what HF transformers runs as the reference.

    python tests/int_checkpoints.py SRC DST FORMAT   # e.g. gptq-g128, awq-g128, ct-w4-g128 (see FORMATS)
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds column AWQ_ORDER[i] of its eight


@dataclass(frozen=True)
class Variant:
    format: str  # awq | gptq | ct
    group: int  # -1: per channel
    sym: bool = False
    act_order: bool = False
    bits: int = 4
    gptq_v2: bool = False


FORMATS = {
    "awq-g32": Variant("awq", 32),
    "awq-g128": Variant("awq", 128),
    "gptq-g64-sym-actorder": Variant("gptq", 64, sym=True, act_order=True),
    "gptq-g128": Variant("gptq", 128),
    "gptq-g32-actorder": Variant("gptq", 32, act_order=True),
    "gptq-channel-sym": Variant("gptq", -1, sym=True),
    "gptq-v2-g64": Variant("gptq", 64, gptq_v2=True),
    "ct-w4-g128": Variant("ct", 128, sym=True),
    "ct-w4-g32-asym-actorder": Variant("ct", 32, act_order=True),
    "ct-w4-channel-asym": Variant("ct", -1),
    "ct-w8-g64": Variant("ct", 64, sym=True, bits=8),
}


def quantize(weight: torch.Tensor, v: Variant, seed: int = 0):
    """weight [N, K] -> (q int64 [N, K] unsigned, scales float16 [N, G], zeros int64 [N, G], g_idx int64 [K]).
    Act-order: a random permutation of the input rows, group_size rows to a group."""
    n, k = weight.shape
    group = k if v.group == -1 else v.group
    groups = -(-k // group)
    top = (1 << v.bits) - 1
    if v.act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // group
    else:
        g_idx = torch.arange(k) // group
    # each group's columns side by side: [N, G, group] (a short last group padded with one of its own columns)
    order = torch.sort(g_idx, stable=True).indices
    padded = torch.cat([order, order[-1:].expand(groups * group - k)]) if groups * group > k else order
    cols = weight[:, padded].view(n, groups, group)
    lowest = 1 if v.format == "gptq" and not v.gptq_v2 else 0  # GPTQ v1 stores zero - 1: a zero of 0 cannot be stored
    if v.sym:
        scales = cols.abs().amax(2).clamp_min(1e-6) / ((top + 1) // 2 - 1)
        zeros = torch.full((n, groups), (top + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = cols.amin(2).clamp(max=0), cols.amax(2).clamp(min=0)
        scales = ((hi - lo) / top).clamp_min(1e-6)
        zeros = torch.round(-lo / scales.half().float()).clamp(lowest, top).long()
    scales = scales.half()
    q = torch.round(weight / scales.float()[:, g_idx] + zeros[:, g_idx]).clamp(0, top).long()
    return q, scales, zeros, g_idx


def dequantized(q, scales, zeros, g_idx) -> torch.Tensor:
    return (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


def _words(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """values [..., W * 32/bits] (unsigned) -> int32 [..., W]: value order[i] of each run of 32/bits in bits i*b."""
    per = 32 // bits
    runs = values.reshape(*values.shape[:-1], -1, per)
    word = torch.zeros(runs.shape[:-1], dtype=torch.int64)
    for i in range(per):
        word |= runs[..., order[i] if order else i] << (bits * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack(q, scales, zeros, g_idx, v: Variant) -> dict[str, torch.Tensor]:
    """One layer's stored tensors (names without the layer prefix)."""
    n, k = q.shape
    if v.format == "awq":  # qweight [K, N/8], qzeros [G, N/8], scales [G, N]
        return {"qweight": _words(q.t(), 4, AWQ_ORDER), "qzeros": _words(zeros.t(), 4, AWQ_ORDER),
                "scales": scales.t().contiguous()}
    if v.format == "gptq":  # qweight [K/8, N] (rows in order), qzeros [G, N/8] (zero - 1 in v1), scales [G, N], g_idx [K]
        stored_zeros = zeros if v.gptq_v2 else zeros - 1
        return {"qweight": _words(q, 4).t().contiguous(), "qzeros": _words(stored_zeros.t(), 4),
                "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    offset = 1 << (v.bits - 1)  # compressed-tensors stores signed values + 2^(b-1)
    out = {"weight_packed": _words(q, v.bits), "weight_scale": scales.contiguous(),  # q: already signed + 2^(b-1)
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not v.sym:
        out["weight_zero_point"] = _words(zeros.t(), v.bits).t().contiguous()  # zero + 2^(b-1), packed along N
    if v.act_order:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


def quantization_config(v: Variant) -> dict:
    if v.format == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": v.group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if v.format == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": v.group, "desc_act": v.act_order, "sym": v.sym,
                "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
                "checkpoint_format": "gptq_v2" if v.gptq_v2 else "gptq"}
    weights = {"num_bits": v.bits, "type": "int", "symmetric": v.sym, "strategy": "channel" if v.group == -1 else "group",
               "group_size": None if v.group == -1 else v.group, "actorder": "group" if v.act_order else None,
               "dynamic": False, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                 "input_activations": None, "output_activations": None}}}


def quantized(name: str) -> bool:
    """The decoder matmuls and experts; not the router (mlp.gate), shared-expert gate, norms, embeddings, lm_head."""
    return name.startswith("model.layers.") and name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def make_int_checkpoint(src: Path, dst: Path, variant: Variant | str, dequant_dst: Path | None = None) -> Path:
    """`src` (config.json + safetensors) quantized into `dst` (one model.safetensors); the dequantized float weights into
    `dequant_dst` (the reference HF runs)."""
    v = FORMATS[variant] if isinstance(variant, str) else variant
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    quant, dequant = {}, {}
    for name, tensor in sorted(tensors.items()):
        if not quantized(name) or tensor.dim() != 2:
            quant[name] = dequant[name] = tensor
            continue
        layer = name.removesuffix(".weight")
        # act-order permutes a layer's input rows by its inputs' statistics: q/k/v (gate/up) share their input
        shared_input = re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up|w1|w3)(_proj)?$", ".gate_up", layer))
        q, scales, zeros, g_idx = quantize(tensor.float(), v, seed=zlib.crc32(shared_input.encode()))
        quant.update({f"{layer}.{suffix}": t for suffix, t in pack(q, scales, zeros, g_idx, v).items()})
        dequant[name] = dequantized(q, scales, zeros, g_idx).to(tensor.dtype)
    for folder, state in ((dst, quant), (dequant_dst, dequant)):
        if folder is None:
            continue
        shutil.copytree(src, folder, dirs_exist_ok=True)
        for old in folder.glob("*.safetensors*"):
            old.unlink()
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config(v)}, indent=1))
    return dst


if __name__ == "__main__":
    make_int_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
