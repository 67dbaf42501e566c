"""From a checkpoint (folder or hub id) to our model with its weights, packed for fewer matmuls."""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from cbatch.model.backend import Backend
from cbatch.model.errors import ModelLoadError, UnsupportedModelError
from cbatch.model.int4 import PackedTensorView, check_packed
from cbatch.model.layers import Fp8Linear, Int4Linear
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.model.moe import Experts
from cbatch.model.mxfp4 import BLOCK as MXFP4_BLOCK, Mxfp4TensorView, check_mxfp4, mxfp4_pairs
from cbatch.model.quant import FP8_DTYPE, channel_scales, dequantize, scale_slice
from cbatch.model.shard import Piece, Shard
from cbatch.model.spec import ModelSpec, parse_spec, read_config
from cbatch.model.weights import (Placement, TensorIndex, expert_stack_layout, kept_fp8_modules, kept_int_module,
                                  kept_mxfp4_modules, place)
from cbatch.parallel.comm import SINGLE_RANK, Communicator

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    spec: ModelSpec
    raw_config: dict[str, Any]


def resolve_model_dir(model: str) -> Path:
    """A local folder as is; otherwise a hub id looked up through the HF cache (downloads if online)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"--model {model}: expected a checkpoint folder (config.json + *.safetensors), got a file")
        return path
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise ModelLoadError(f"--model {model}: no such folder, and not a hub id of the form org/name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # network, auth, missing repo: one message either way
        raise ModelLoadError(
            f"--model {model}: not a local folder and not in the Hugging Face cache "
            f"({type(exc).__name__}); download it once with `huggingface-cli download {model}` or pass a folder"
        ) from None


def read_checkpoint(model_dir: Path) -> Checkpoint:
    """The checkpoint's config, and its weights' FP8 layout checked from the safetensors headers: anything
    cbatch cannot run is refused here, before any weight loads."""
    raw = read_config(model_dir)
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    spec = parse_spec(raw, generation)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        index = TensorIndex(files)
        _check_fp8(index, spec, model_dir)
        _check_packed(index, spec, model_dir)
        if spec.quant is not None and spec.quant.mxfp4:
            check_mxfp4(index, model_dir)
    return Checkpoint(model_dir, spec, raw)


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (token-exact with HF; bfloat16 is ~2x faster on CPUs with avx512_bf16 or
    AMX, see benchmarks/NOTES.md, and is a --dtype away); the checkpoint's dtype on GPU."""
    if name != "auto":
        return DTYPE_BY_NAME[name]
    if device.type == "cpu":
        return torch.float32
    return DTYPE_BY_NAME.get(str(spec.torch_dtype), torch.bfloat16)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(spec: ModelSpec, max_positions: int, device: torch.device, dtype: torch.dtype,
                backend: Backend, fp8_modules: set[str] = frozenset(), comm: Communicator = SINGLE_RANK,
                int_modules: set[str] = frozenset(), mxfp4_modules: set[str] = frozenset()) -> LlamaForCausalLM:
    """An empty (uninitialised) model in place on `device`, computing through `backend` (one tensor-parallel
    rank's share of it with `comm` of several ranks); the modules named in `fp8_modules` hold FP8 weights and
    scales (`Fp8Linear`, `Experts.keep_fp8`), those in `int_modules` packed integer weights (`Int4Linear`), the
    experts in `mxfp4_modules` MXFP4 blocks and scales (`Experts.keep_mxfp4`)."""
    with _default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(spec, max_positions, backend, comm)
        for name in sorted(fp8_modules):
            _keep_fp8(model, name, model.spec, backend)
        for name in sorted(int_modules):
            module = model.get_submodule(name)
            if isinstance(module, Experts):
                module.keep_int(spec.quant.packed)
                continue
            parent, _, leaf = name.rpartition(".")
            packed = Int4Linear(module.in_features, module.out_features, module.bias is not None, spec.quant.packed, backend)
            setattr(model.get_submodule(parent), leaf, packed)
        for name in sorted(mxfp4_modules):
            model.get_submodule(name).keep_mxfp4()
    model = model.to_empty(device=device)
    model.build_rope_cache(device)
    if model.expert_load is not None:
        model.expert_load.allocate(device)
    return model.eval().requires_grad_(False)


def _keep_fp8(model: LlamaForCausalLM, name: str, spec: ModelSpec, backend: Backend) -> None:
    module = model.get_submodule(name)
    block = spec.quant.block
    if isinstance(module, Experts):
        module.keep_fp8(block)
        return
    parent, _, leaf = name.rpartition(".")
    fp8 = Fp8Linear(module.in_features, module.out_features, module.bias is not None, block, backend)
    setattr(model.get_submodule(parent), leaf, fp8)


def load_model(ckpt: Checkpoint, max_positions: int, device: torch.device, dtype: torch.dtype,
               backend: Backend, show_progress: bool = False, comm: Communicator = SINGLE_RANK) -> LlamaForCausalLM:
    """The checkpoint's model on `device` (this tensor-parallel rank's share of it: `comm`). FP8 weights stay
    FP8 where the backend `keeps_fp8_weights` (Triton: its kernels dequantize tile by tile); for any other they
    are dequantized here, once. `show_progress`: a tqdm bar over the checkpoint's tensors."""
    files = sorted(ckpt.path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{ckpt.path} has no *.safetensors weights; cbatch reads safetensors checkpoints")
    index = TensorIndex(files)
    spec = ckpt.spec  # the full model's: placements are found in it, then cut to this rank's share
    keep = kept_fp8_modules(index, spec) if backend.keeps_fp8_weights else set()
    int_keep: set[str] = set()
    if spec.quant is not None and spec.quant.packed is not None:
        packed = spec.quant.packed

        def keep_packed(layer: str) -> bool:  # Int4Linear where the backend takes packed weights
            module = kept_int_module(layer, spec) if backend.keeps_int_weights else None
            if module is not None and packed.act_order and _row_parallel(module, spec, comm.world):
                module = None  # its rank's input rows fall in any group: held dequantized (`_row_parallel`)
            if module is not None:
                int_keep.add(module)
            return module is not None

        index = PackedTensorView(index, packed, keep_packed)  # the other packed layers read dequantized
    mxfp4_keep: set[str] = set()
    if spec.quant is not None and spec.quant.mxfp4:
        kept = frozenset(mxfp4_pairs(index)) if backend.keeps_mxfp4_weights else frozenset()
        mxfp4_keep = kept_mxfp4_modules(sorted(kept), spec)
        index = Mxfp4TensorView(index, dtype, kept)  # the others read dequantized, as a float checkpoint's
    model = build_model(spec, max_positions, device, dtype, backend, keep, comm, int_keep, mxfp4_keep)
    params = dict(model.named_parameters())
    filled = {name: 0 for name in params}  # elements written per parameter
    _zero_vocab_padding(model, spec.vocab_size, filled)
    names = list(index.file_of)
    if show_progress:
        from tqdm.auto import tqdm

        names = tqdm(names, desc="cbatch: loading weights", unit="tensor", dynamic_ncols=True)
    shard = Shard(comm.rank, comm.world)
    for name in names:
        placed = place(name, spec)
        if placed is None or (placed[1] == "scale" and not _kept(placed[0], keep | int_keep | mxfp4_keep)):
            continue  # unused, or the scale of a weight dequantized below
        placement, kind = placed
        placement = expert_stack_layout(placement, kind, index, name, spec)
        placement = shard.local_expert(placement, spec)  # expert parallelism: this rank's experts only
        if placement is None:
            continue
        target = placement.param(kind)
        if target not in params:
            raise ModelLoadError(f"{index.file_of[name].name}: tensor {name} has no place in a {spec.architecture}")
        param = params[target].data
        if kind == "perm":  # act-order: q/k/v (gate/up) share their input, so their g_idx (and perm) agree
            filled[target] = _load_perm(index, name, param, filled[target])
            continue
        weight_ndim = params[placement.param("weight")].dim() if kind == "scale" else param.dim()
        pieces = shard.pieces(placement, kind, spec)
        stored_ndim = weight_ndim - (placement.expert is not None)  # the checkpoint weight's: [..., N, K]
        if pieces is not None and placement.module in int_keep:
            pieces = _packed_pieces(pieces, kind, spec.quant.packed)
        elif pieces and placement.module in mxfp4_keep:
            pieces = _mxfp4_pieces(pieces)
        elif pieces and kind == "scale" and pieces[0].dim >= stored_ndim - 2:  # a kept FP8 weight's scales: with
            # their rows, or their blocks (not a stack of whole experts, split on its expert dimension)
            pieces = _fp8_scale_pieces(pieces, spec.quant.block, stored_ndim)
        if pieces is None:
            filled[target] += _load_whole(index, name, placement, kind, param, spec)
        else:
            read = _piece_reader(index, name, kind, param, spec)
            filled[target] += _load_pieces(index, name, placement, param, pieces, read)
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ModelLoadError(f"{ckpt.path}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    return model


def _load_whole(index: TensorIndex, name: str, placement: Placement, kind: str, param: torch.Tensor,
                spec: ModelSpec) -> int:
    """Copies checkpoint tensor `name` to its place in `param`; returns the elements written."""
    block = spec.quant.block if spec.quant is not None else None
    where = placement.block_rows(block[0]) if kind == "scale" and block is not None else placement
    dest = where.select(param)
    tensor = placement.to_ours(_read(index, name, placement, kind, dest, spec))
    _check_shape(index, name, tensor, dest)
    dest.copy_(tensor)
    return dest.numel()


def _load_pieces(index: TensorIndex, name: str, placement: Placement, param: torch.Tensor, pieces: list[Piece],
                 read: Callable[[Piece], torch.Tensor]) -> int:
    """Copies this rank's pieces of checkpoint tensor `name` (`Shard.pieces`) into `param`, read piece by piece
    (`read`: safetensors slices, the rank never holds the whole tensor); a row-parallel bias off rank 0 (no
    pieces) becomes zeros."""
    dest = param if placement.expert is None else param[placement.expert]
    if not pieces:
        dest.zero_()
        return dest.numel()
    written = 0
    for piece in pieces:  # (in our dimensions: a transposed tensor is read along its stored one, then turned)
        part = placement.to_ours(read(replace(piece, dim=placement.stored_dim(piece.dim, dest.dim()))))
        target = dest.narrow(piece.dim, piece.dst_start, piece.src_stop - piece.src_start)
        _check_shape(index, name, part, target)
        target.copy_(part)
        written += target.numel()
    return written


def _piece_reader(index: TensorIndex, name: str, kind: str, param: torch.Tensor,
                  spec: ModelSpec) -> Callable[[Piece], torch.Tensor]:
    """How a rank reads a piece of checkpoint tensor `name`: a slice of the file; an FP8 weight's slice
    dequantized with its share of the scales (a float parameter: `quant.scale_slice`); a kept FP8 weight's
    scales, the pieces of its channels or blocks (`_fp8_scale_pieces`; a per-tensor scale broadcast to rows)."""
    quant = spec.quant
    fp8 = quant is not None and quant.packed is None and not quant.mxfp4
    if fp8 and kind == "scale":
        rows = index.shape(f"{name.rpartition('.')[0]}.weight")[-2]
        scale = index.get(name)
        full = channel_scales(scale, rows) if quant.block is None else scale.float()
        return lambda piece: full.narrow(piece.dim, piece.src_start, piece.src_stop - piece.src_start)
    if fp8 and index.dtype_of[name] == "F8_E4M3" and param.dtype != FP8_DTYPE:
        scale, shape = _scale_of(index, name, spec), index.shape(name)

        def dequantized(piece: Piece) -> torch.Tensor:
            part = index.get_slice(name, piece.dim, piece.src_start, piece.src_stop)
            scales = scale_slice(scale, shape, quant.block, piece.dim, piece.src_start, piece.src_stop)
            return dequantize(part, scales, quant.block, param.dtype)

        return dequantized
    return lambda piece: index.get_slice(name, piece.dim, piece.src_start, piece.src_stop)


def _fp8_scale_pieces(pieces: list[Piece], block: tuple[int, int] | None, weight_ndim: int) -> list[Piece] | None:
    """A kept FP8 weight's pieces (`Shard.pieces`, in rows or columns of the stored weight, of `weight_ndim`
    dimensions) as pieces of its scales: per channel,
    a column split's rows and nothing of a row split (each rank holds every output channel's scale: None); per
    block, the blocks those rows or columns fill (whole blocks: `check_tensor_parallel`)."""
    rows = pieces[0].dim == weight_ndim - 2
    if block is None:
        return pieces if rows else None
    unit = block[0] if rows else block[1]
    return [Piece(p.dim, p.src_start // unit, -(-p.src_stop // unit), p.dst_start // unit) for p in pieces]


def _mxfp4_pieces(pieces: list[Piece]) -> list[Piece]:
    """Kept MXFP4 experts' pieces (blocks [E, N, K / 32, 16], scales [E, N, K / 32]): a split of the inputs (dim 2)
    counted in blocks of 32 (whole blocks: `check_tensor_parallel`); output rows and whole experts as they are."""
    return [Piece(2, p.src_start // MXFP4_BLOCK, p.src_stop // MXFP4_BLOCK, p.dst_start // MXFP4_BLOCK) if p.dim == 2
            else p for p in pieces]


def _load_perm(index, name: str, param: torch.Tensor, filled: int) -> int:
    perm = index.get(name)
    if filled and not torch.equal(param, perm):
        raise ModelLoadError(f"{index.file_of[name].name}: {name} orders its input rows unlike the layers packed "
                             f"with it (act-order g_idx differ); cbatch packs q/k/v and gate/up into one matmul")
    param.copy_(perm)
    return param.numel()


def _row_parallel(module: str, spec: ModelSpec, world: int) -> bool:
    """Whether `module` splits its inputs across the `world` ranks (o_proj, down_proj). An act-order layer's g_idx
    scatters each group over the input rows, so a rank's share of them is no set of whole groups: the GPU path,
    whose W4A16 kernel reads one scale row per group of `group_size` sorted rows, holds such a layer dequantized
    (its column-parallel layers stay packed: they take every input row, with the whole g_idx)."""
    split = Shard(0, world).ranges(module, spec)
    return world > 1 and split is not None and split[0] == "row"


def _packed_pieces(pieces: list[Piece], kind: str, packed) -> list[Piece] | None:
    """A tensor-parallel rank's pieces of a packed layer: output rows as they are; input columns (row-parallel)
    counted in int32 words for the weight and in groups for scales and zeros (whole groups: `check_tensor_parallel`;
    one per-channel group: every rank holds it)."""
    if not pieces or pieces[0].dim == 0 or kind == "bias":
        return pieces
    if kind == "weight":
        unit = packed.per_int32
    elif packed.group_size == -1:
        return None
    else:
        unit = packed.group_size
    return [Piece(p.dim, p.src_start // unit, p.src_stop // unit, p.dst_start // unit) for p in pieces]


def _check_shape(index: TensorIndex, name: str, tensor: torch.Tensor, dest: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ModelLoadError(
            f"{index.file_of[name].name}: {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
        )


def _zero_vocab_padding(model: LlamaForCausalLM, vocab_size: int, filled: dict[str, int]) -> None:
    """A tensor-parallel rank whose vocab rows run past the vocabulary: those rows are zeros (counted as loaded)."""
    start = model.embed_tokens.start
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in filled:
            weight = model.get_parameter(name).data
            padding = max(0, start + weight.shape[0] - max(start, vocab_size))
            weight[weight.shape[0] - padding :].zero_()
            filled[name] += weight[weight.shape[0] - padding :].numel()


def _kept(placement: Placement, keep: set[str]) -> bool:
    return placement.module in keep


def _check_fp8(index: TensorIndex, spec: ModelSpec, path: Path) -> None:
    names = index.fp8_names()
    if not names:
        return
    if spec.quant is None:
        raise ModelLoadError(f"{path}: {names[0]} is FP8 but config.json has no quantization_config")
    other = next((n for n in names if index.dtype_of[n] != "F8_E4M3"), None)
    if other is not None:
        raise UnsupportedModelError(f"{path}: {other} is {index.dtype_of[other]}; cbatch reads float8_e4m3fn (F8_E4M3) weights")


def _check_packed(index: TensorIndex, spec: ModelSpec, path: Path) -> None:
    if spec.quant is not None and spec.quant.packed is not None:
        check_packed(index, spec.quant.packed, path)
        return
    packed = next((n for n in index.file_of if n.endswith((".qweight", ".weight_packed"))), None)
    if packed is not None:
        raise ModelLoadError(f"{path}: {packed} is a packed integer weight but config.json has no quantization_config")


def _read(index: TensorIndex, name: str, placement: Placement, kind: str, dest: torch.Tensor,
          spec: ModelSpec) -> torch.Tensor:
    """The checkpoint tensor as `dest` takes it: FP8 dequantized for a float parameter, a scale reshaped
    to our layout (per channel [rows], or the block rows of a packed part)."""
    tensor = index.get(name)
    block = spec.quant.block if spec.quant is not None else None
    if kind == "zero" or (kind == "scale" and (spec.quant.packed is not None or spec.quant.mxfp4)):
        return tensor  # a packed layer's, already in our layout (int4.PackedTensorView), or MXFP4 e8m0 scales
    if kind == "scale":
        return _scale_rows(tensor, placement, dest, block, name)
    if tensor.dtype == FP8_DTYPE and dest.dtype != FP8_DTYPE:
        scale = _scale_of(index, name, spec)
        scale = channel_scales(scale, tensor.shape[0]) if block is None else scale
        return dequantize(tensor, scale, block, dest.dtype)
    return tensor


def _scale_of(index: TensorIndex, name: str, spec: ModelSpec) -> torch.Tensor:
    """The stored scale of FP8 weight `name`."""
    scale_name = f"{name.rpartition('.')[0]}.{spec.quant.scale_suffix}"
    if scale_name not in index.file_of:
        raise ModelLoadError(f"{index.file_of[name].name}: FP8 tensor {name} has no {spec.quant.scale_suffix}")
    return index.get(scale_name)


def _scale_rows(scale: torch.Tensor, placement: Placement, dest: torch.Tensor, block: tuple[int, int] | None,
                name: str) -> torch.Tensor:
    """A part's scales for the rows `placement` packs it into: per channel, or per block of rows."""
    rows = placement.rows
    if block is None:
        return channel_scales(scale, dest.shape[0])
    if rows is not None and (rows.start % block[0] or (rows.stop - rows.start) % block[0]):
        raise ModelLoadError(f"{name}: a block-quantized part of {rows.stop - rows.start} rows at row {rows.start} "
                             f"cannot pack with {block[0]}-row blocks")
    return scale


def init_random_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> LlamaForCausalLM:
    """Weightless benchmark models: normal(0, std) matrices, unit norms, zero biases. Drawn on the model's
    device (drawing a large MoE on the CPU and copying it over is slow), so the same seed gives the same
    weights on the same kind of device."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.data.fill_(0.0 if model.spec.norm_unit_offset else 1.0)  # a unit scale either way
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.copy_(torch.randn(param.shape, generator=gen, device=device) * std)
    return model


__all__ = [
    "Checkpoint", "ModelLoadError", "UnsupportedModelError", "build_model", "init_random_weights",
    "load_model", "read_checkpoint", "resolve_dtype", "resolve_model_dir", "DTYPE_BY_NAME",
]
