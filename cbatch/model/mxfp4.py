"""MXFP4 weights (OCP microscaling FP4), as gpt-oss checkpoints store their experts, dequantized at load.

Layout of a stored weight W [..., N, K] (N output rows, K inputs, K a multiple of 32):
    <name>_blocks   uint8 [..., N, K / 32, 16]   two FP4 (e2m1) values a byte: element 2j in the low nibble,
                                                  element 2j + 1 in the high nibble, 32 elements a block
    <name>_scales   uint8 [..., N, K / 32]       one e8m0 scale a block: the exponent, biased by 127
    W[..., n, 32 g + i] = e2m1(nibble i of block g) x 2 ** (scale[..., n, g] - 127)
An e2m1 nibble is sign | 2-bit exponent | 1-bit mantissa: the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives. Each product is exact in float32 and in bfloat16 (a 1-bit mantissa times a power of two; bfloat16
has float32's exponent range), so dequantizing to either gives the same values as HF's
`convert_moe_packed_tensors` (tests/test_gpt_oss.py compares).

The checkpoint's experts, as HF reads them, are the dequantized W transposed ([..., K, N]: gpt-oss's
`gate_up_proj` [E, hidden, 2 x intermediate], `down_proj` [E, intermediate, hidden]); `Mxfp4TensorView`
presents each `<name>_blocks` + `<name>_scales` pair as that tensor `<name>`, so the loader reads an MXFP4
checkpoint exactly as the same model saved in floats, except on a backend that `keeps_mxfp4_weights` (Triton): it
holds the experts' blocks and scales as stored, and its grouped GEMM decodes them in registers.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from cbatch.model.errors import ModelLoadError

BLOCK = 32  # elements per e8m0 scale
SCALE_BIAS = 127
# e2m1 values by nibble: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (float32 or bfloat16: exact)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit "
                         f"(blocks [..., G, {BLOCK // 2}], scales [..., G])")
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).to(dtype).flatten(-2)  # x 2 ** exponent: exact


class Mxfp4TensorView:
    """A `TensorIndex` of an MXFP4 checkpoint as the loader reads it: each `<name>_blocks` + `<name>_scales` pair
    is the tensor `<name>`, dequantized to `dtype` and transposed to [..., K, N] (the layout HF's gpt-oss
    experts hold; a view, so our [..., N, K] is a transpose away), except the pairs in `kept` (those a backend
    holds as stored: the GPU path), which read through as they are, like every other tensor."""

    def __init__(self, index, dtype: torch.dtype, kept: frozenset[str] = frozenset()) -> None:
        self.index = index
        self.dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # exact either way
        self.pairs = [name for name in mxfp4_pairs(index) if name not in kept]
        stored = {f"{name}{suffix}" for name in self.pairs for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX)}
        self.file_of = {n: f for n, f in index.file_of.items() if n not in stored}
        self.dtype_of = {n: index.dtype_of[n] for n in self.file_of}
        for name in self.pairs:
            self.file_of[name] = index.file_of[name + BLOCKS_SUFFIX]
            self.dtype_of[name] = "F32" if self.dtype == torch.float32 else "BF16"

    def get(self, name: str) -> torch.Tensor:
        if name not in self.pairs:
            return self.index.get(name)
        weight = dequantize_mxfp4(self.index.get(name + BLOCKS_SUFFIX), self.index.get(name + SCALES_SUFFIX), self.dtype)
        return weight.transpose(-1, -2)  # [..., K, N]

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of dimension `dim` of the view [..., K, N], dequantized from only the stored blocks
        that hold them (a tensor-parallel rank's share: its outputs N, or its inputs K, read in whole blocks of 32)."""
        if name not in self.pairs:
            return self.index.get_slice(name, dim, start, stop)
        ndim = len(self.shape(name))
        offset = 0
        if dim == ndim - 2:  # inputs: the blocks of 32 holding [start, stop), trimmed after dequantizing
            stored_dim, first, last, offset = ndim - 1, start // BLOCK, -(-stop // BLOCK), start % BLOCK
        else:  # outputs (the stored rows, one dimension up) or the expert dimension
            stored_dim, first, last = (ndim - 2 if dim == ndim - 1 else dim), start, stop
        blocks = self.index.get_slice(name + BLOCKS_SUFFIX, stored_dim, first, last)
        scales = self.index.get_slice(name + SCALES_SUFFIX, stored_dim, first, last)
        weight = dequantize_mxfp4(blocks, scales, self.dtype).transpose(-1, -2)  # [..., K, N]
        return weight.narrow(dim, offset, stop - start)

    def shape(self, name: str) -> list[int]:
        if name not in self.pairs:
            return self.index.shape(name)
        *rows, groups, half = self.index.shape(name + BLOCKS_SUFFIX)
        return [*rows[:-1], groups * half * 2, rows[-1]]

    def fp8_names(self) -> list[str]:
        return [n for n in self.index.fp8_names() if n in self.file_of]


def stored_bytes_per_weight(index, dtype_bytes: int) -> float:
    """Bytes per weight of the matrices a GPU run of this checkpoint holds (the Triton backend keeps MXFP4 as
    stored): 4 bits a weight plus an e8m0 byte per 32, and every other matrix at `dtype_bytes` (for `cbatch plan`)."""
    pairs = set(mxfp4_pairs(index))
    stored = weights = 0.0
    for name in index.file_of:
        if name.endswith(SCALES_SUFFIX) and name.removesuffix(SCALES_SUFFIX) in pairs:
            continue  # counted with its blocks
        shape = index.shape(name)
        count = math.prod(shape)
        if name.endswith(BLOCKS_SUFFIX) and name.removesuffix(BLOCKS_SUFFIX) in pairs:
            weights += 2 * count
            stored += count + 2 * count / BLOCK  # the blocks' bytes, and a scale byte per 32 weights
        elif len(shape) >= 2:
            weights += count
            stored += count * dtype_bytes
    return stored / max(weights, 1.0)


def mxfp4_pairs(index) -> list[str]:
    """The names of the checkpoint's MXFP4 tensors (each stored as `<name>_blocks` + `<name>_scales`)."""
    return sorted(n.removesuffix(BLOCKS_SUFFIX) for n in index.file_of if n.endswith(BLOCKS_SUFFIX))


def check_mxfp4(index, path: Path) -> None:
    """Preflight, from the safetensors headers: every MXFP4 tensor has its scales, uint8 both, in shapes that fit."""
    pairs = mxfp4_pairs(index)
    if not pairs:
        raise ModelLoadError(f"{path}: config.json says quant_method mxfp4 but no tensor is stored as *{BLOCKS_SUFFIX} "
                             f"+ *{SCALES_SUFFIX}; the checkpoint looks damaged")
    for name in pairs:
        blocks, scales = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
        if scales not in index.file_of:
            raise ModelLoadError(f"{path}: MXFP4 tensor {blocks} has no {scales}")
        if index.dtype_of[blocks] != "U8" or index.dtype_of[scales] != "U8":
            raise ModelLoadError(f"{path}: MXFP4 tensors {blocks} and {scales} must be uint8 (U8), got "
                                 f"{index.dtype_of[blocks]} and {index.dtype_of[scales]}")
        b_shape, s_shape = index.shape(blocks), index.shape(scales)
        if b_shape[:-1] != s_shape or b_shape[-1] != BLOCK // 2:
            raise ModelLoadError(f"{path}: MXFP4 {blocks} {b_shape} and {scales} {s_shape} do not fit "
                                 f"(blocks [..., G, {BLOCK // 2}], scales [..., G])")
