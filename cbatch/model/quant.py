"""FP8 checkpoints: which layouts cbatch reads (`QuantSpec`, from config.json's `quantization_config`) and
how a stored FP8 weight becomes a compute-dtype one (`dequantize`).

Read:
    quant_method "fp8" (HF's FineGrainedFP8)   float8_e4m3fn `weight` + float32 `weight_scale_inv`:
                                               one scale per tensor (weight_block_size null) or per
                                               [bn, bk] block (weight_block_size [bn, bk])
    quant_method "compressed-tensors"          float8_e4m3fn `weight` + float32 `weight_scale`, format
                                               float-quantized, 8-bit float weights; strategy tensor,
                                               channel or block
Both scales multiply: weight = fp8 value x scale. Activations are never quantized (weight-only): the
model computes in its dtype with the dequantized weights, so a static activation scheme's `input_scale`
and a kv_cache_scheme's `k_scale`/`v_scale` are not used.

Integer weight-only checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) are described in
cbatch/model/int4.py; their QuantSpec carries the `packed` layout.

Inside cbatch every scale is per output channel ([..., N]; a per-tensor scale is broadcast to its rows so
q/k/v with different scales pack into one matrix) or per block ([..., ceil(N / bn), ceil(K / bk)]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cbatch.model.errors import UnsupportedModelError
from cbatch.model.int4 import SUPPORTED_PACKED, PackedQuant, parse_awq, parse_compressed_tensors, parse_gptq

FP8_DTYPE = torch.float8_e4m3fn
SUPPORTED_QUANTIZATION = ("fp8 (per-tensor or block scales)", "compressed-tensors float8 (tensor, channel or block scales)",
                          "mxfp4 (gpt-oss experts)")
# tensors a quantized checkpoint carries that weight-only dequantization does not use
UNUSED_QUANT_TENSORS = ("input_scale", "k_scale", "v_scale", "output_scale")


@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # fp8 | compressed-tensors | awq | gptq | mxfp4
    block: tuple[int, int] | None  # (rows, cols) a block scale covers; None: per-tensor or per-channel scales
    scale_suffix: str  # the scale tensor beside each `weight`: weight_scale_inv (fp8) | weight_scale
    packed: PackedQuant | None = None  # integer weights (int4.py); None: FP8 (or MXFP4)

    @property
    def mxfp4(self) -> bool:
        """MXFP4 tensors (`*_blocks` + `*_scales`, model/mxfp4.py), dequantized at load on every backend."""
        return self.method == "mxfp4"


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what} is not supported; cbatch loads {', '.join(SUPPORTED_QUANTIZATION + SUPPORTED_PACKED)}")


def _block(value: Any, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise _refuse(f"{what} {value!r}")
    return int(value[0]), int(value[1])


def _fp8(qc: dict[str, Any]) -> QuantSpec:
    if qc.get("scale_fmt", "float") != "float":
        raise _refuse(f"fp8 scale_fmt {qc['scale_fmt']!r}")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise _refuse(f"fp8 expert_dtype {qc['expert_dtype']!r}")
    return QuantSpec("fp8", _block(qc.get("weight_block_size"), "fp8 weight_block_size"), "weight_scale_inv")


def _compressed_tensors(qc: dict[str, Any]) -> QuantSpec:
    fmt = qc.get("format")
    if fmt == "pack-quantized":
        return QuantSpec("compressed-tensors", None, "weight_scale", parse_compressed_tensors(qc))
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r}")
    layouts = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _refuse(f"compressed-tensors {name}: {weights.get('num_bits')}-bit {weights.get('type')} weights")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(f"compressed-tensors {name}: weight strategy {strategy!r}")
        block = _block(weights.get("block_structure"), f"compressed-tensors {name} block_structure")
        if (strategy == "block") != (block is not None):
            raise _refuse(f"compressed-tensors {name}: strategy {strategy!r} with block_structure {block}")
        layouts.add(block)
    if len(layouts) != 1:
        raise _refuse(f"compressed-tensors with {len(layouts)} different weight layouts")
    return QuantSpec("compressed-tensors", layouts.pop(), "weight_scale")


def parse_quantization(qc: dict[str, Any] | None) -> QuantSpec | None:
    """config.json's `quantization_config` -> QuantSpec; anything else refused by name."""
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        sparsity = qc.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise _refuse(f"compressed-tensors sparsity format {sparsity['format']!r}")
        return _compressed_tensors(qc)
    if method == "mxfp4":  # gpt-oss's experts (model/mxfp4.py): dequantized at load, nothing kept quantized
        return QuantSpec("mxfp4", None, "")
    if method in ("awq", "gptq"):
        return QuantSpec(method, None, "weight_scale", parse_awq(qc) if method == "awq" else parse_gptq(qc))
    raise _refuse(f"quantization {method!r}")


def channel_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored per-tensor ([] or [1]) or per-channel ([N] or [N, 1]) scale as float32 [rows]."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(rows)
    if scale.numel() != rows:
        raise ValueError(f"a scale of {scale.numel()} values for {rows} rows")
    return scale


def scale_slice(scale: torch.Tensor, weight_shape: list[int], block: tuple[int, int] | None, dim: int, start: int,
                stop: int) -> torch.Tensor:
    """The float32 scales of a weight's elements [start, stop) along `dim` (of the stored weight [..., N, K]), as
    `dequantize` takes them for that piece: per channel the piece's rows [n] (a row split) or every row [N] (a
    column split); per block the blocks' rows or columns (a piece starts on a block boundary:
    `shard.check_tensor_parallel` refuses other splits)."""
    axis = dim - len(weight_shape)  # -2: rows (output channels), -1: columns (inputs)
    if block is None:
        scale = channel_scales(scale, weight_shape[-2])
        return scale[start:stop] if axis == -2 else scale
    unit = block[0] if axis == -2 else block[1]
    return scale.float().narrow(axis, start // unit, -(-stop // unit) - start // unit)


def expand_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 scales broadcastable to a weight of `shape` [..., N, K]: [..., N, 1] or, per block, [..., N, K]."""
    if block is None:
        return scale.float().unsqueeze(-1)
    rows, cols = shape[-2], shape[-1]
    return scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """weight (fp8 [..., N, K]) x scale, computed in float32 and rounded once to `dtype`: the values the
    Triton kernels multiply by (they dequantize the same way, tile by tile)."""
    return (weight.float() * expand_scales(scale, weight.shape, block)).to(dtype)
