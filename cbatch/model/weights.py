"""Where each tensor of a Hugging Face checkpoint goes in our model (`place`), an index of the checkpoint's
tensors across its safetensors files (`TensorIndex`), and the bytes per weight a GPU run of a packed int
checkpoint stores (`stored_bytes_per_weight`: which layers stay packed is this module's `kept_int_module`).

Our model packs what HF keeps apart: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, and every
expert of a MoE layer into two stacked tensors (`experts.w13` [E, 2I, H], `experts.w2` [E, H, I]).
Checkpoints that already fuse them (Phi-3's qkv_proj and gate_up_proj, transformers 5's stacked
experts) map one to one. DeepSeek's MLA projections keep their names (model/mla.py), its `shared_experts` are
our `shared_expert`, and its multi-token-prediction layers (past num_hidden_layers) are skipped.
Mixtral's `block_sparse_moe` and w1/w3/w2 expert names are read too, and a
multimodal Gemma 3's text decoder (`language_model.model.*` or `model.language_model.*`), its SigLIP tower
(`vision_tower.vision_model.*` or `vision_tower.*`: our `visual.*`) and projector (`multi_modal_projector.*`: `visual.projector.*`),
and a Qwen-VL's vision tower (`visual.*` or `model.visual.*`, one to one but Qwen2.5-VL's gated MLP, whose
gate_proj / up_proj pack into `gate_up_proj`). gpt-oss:
`mlp.router` is our `mlp.gate`, `self_attn.sinks` a parameter of its own, and the stacked experts ([E, in, out],
gate/up interleaved, with biases) are transposed and de-interleaved on load; Qwen3-VL-MoE's hub checkpoints store
the stacked experts [E, in, out] too (`expert_stack_layout` tells by shape).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from cbatch.model.int4 import PACKED_TENSORS, PackedQuant, packed_layer_shape
from cbatch.model.quant import UNUSED_QUANT_TENSORS
from cbatch.model.spec import ModelSpec

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1, "w1": 0, "w3": 1}  # w1/w3: Mixtral's expert gate/up
_DOWN = ("down_proj", "w2")
# transformers 5's stacked experts; gpt-oss adds biases, and MXFP4 pairs where the GPU path keeps them (model/mxfp4.py)
_STACKED_EXPERTS = tuple(f"{part}_proj{suffix}" for part in ("gate_up", "down")
                         for suffix in ("", "_bias", "_blocks", "_scales"))
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)$")
_TEXT_DECODER = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")  # multimodal Gemma 3
_BARE_DECODER = ("layers.", "embed_tokens.", "norm.")
_VISUAL = re.compile(r"^(?:model\.)?visual\.")  # a vision-language model's vision tower (model/vision.py)
_TOWER_GATE_UP = re.compile(r"^(visual\.blocks\.\d+\.mlp)\.(gate_proj|up_proj)$")  # Qwen2.5-VL's gated MLP
_SIGLIP = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?")  # Gemma 3's (model/siglip.py)
_SIGLIP_HEAD = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?head\.")  # its pooling head: unused
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.")
# kept in FP8 on the GPU path (MLA's projections but kv_b_proj, which its attention reads as a plain weight)
FP8_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts", "q_proj", "q_a_proj", "q_b_proj",
               "kv_a_proj_with_mqa")
INT_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts")  # kept packed on the GPU path


@dataclass(frozen=True, slots=True)
class Placement:
    """A checkpoint tensor's place: `<module>.<slot>` (or the module's bias or scales), at [expert][rows]
    (None: the whole dimension). `slot` is "weight", or an expert stack's "w13" / "w2"."""

    module: str
    slot: str = "weight"
    expert: int | None = None
    rows: slice | None = None
    transposed: bool = False  # stored [..., in, out] (gpt-oss's experts): ours is [..., out, in]
    interleaved: bool = False  # gate/up stored interleaved along the output (gate 0, up 0, gate 1, ...): ours gate | up

    def param(self, kind: str) -> str:
        """Our parameter for a tensor of this `kind` (weight | bias | scale); scales are `<slot>_scale`."""
        bias = f"{self.slot}_bias" if self.slot in ("w13", "w2") else "bias"  # an expert stack's: w13_bias, w2_bias
        leaf = {"weight": self.slot, "bias": bias, "scale": f"{self.slot}_scale", "zero": f"{self.slot}_zero",
                "perm": f"{self.slot}_perm"}[kind]
        return f"{self.module}.{leaf}"

    def block_rows(self, rows_per_block: int) -> Placement:
        """The same place in a per-block scale grid, whose rows count blocks of weight rows."""
        if self.rows is None:
            return self
        rows = slice(self.rows.start // rows_per_block, -(-self.rows.stop // rows_per_block))
        return Placement(self.module, self.slot, self.expert, rows)

    def stored_dim(self, dim: int, ndim: int) -> int:
        """The stored tensor's dimension that holds our dimension `dim` (of `ndim`): transposed storage swaps the
        last two."""
        if self.transposed and dim >= ndim - 2:
            return 2 * ndim - 3 - dim
        return dim

    def to_ours(self, tensor: torch.Tensor) -> torch.Tensor:
        """A stored tensor in our layout: transposed to [E, out, in]; gate | up halves along the expert stack's
        output rows (dimension 1 of a weight [E, out, in], a bias [E, out], MXFP4 blocks and scales [E, out, ...])."""
        if self.transposed:
            tensor = tensor.transpose(-1, -2)
        if self.interleaved:
            tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        return tensor

    def select(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            tensor = tensor[self.expert]
        return tensor if self.rows is None else tensor[self.rows]


class TensorIndex:
    """Every tensor of a checkpoint folder: its file and dtype, read from the safetensors headers."""

    def __init__(self, files: list[Path]) -> None:
        self.file_of: dict[str, Path] = {}
        self.dtype_of: dict[str, str] = {}  # safetensors dtype names: F32, BF16, F8_E4M3, ...
        self._open = {file: safe_open(str(file), framework="pt") for file in files}  # memory-mapped, closed with the index
        for file, f in self._open.items():
            for name in f.keys():
                self.file_of[name] = file
                self.dtype_of[name] = f.get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._open[self.file_of[name]].get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return list(self._open[self.file_of[name]].get_slice(name).get_shape())

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of dimension `dim` only, read from the file (a tensor-parallel rank's share)."""
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._open[self.file_of[name]].get_slice(name)[index]

    def fp8_names(self) -> list[str]:
        return [n for n, d in self.dtype_of.items() if d.startswith("F8")]


def _packed(sizes: list[int], part: int) -> slice:
    """The rows of part `part` when parts of `sizes` rows are stacked in order."""
    start = sum(sizes[:part])
    return slice(start, start + sizes[part])


def _layer_place(prefix: str, rest: str, spec: ModelSpec) -> Placement | None:
    """`rest`: the module path inside `model.layers.N.` (the tensor name without its last component)."""
    rest = rest.replace("block_sparse_moe.", "mlp.", 1).replace("mlp.shared_experts.", "mlp.shared_expert.", 1)
    parent, _, leaf = rest.rpartition(".")
    if parent == "self_attn" and leaf in _QKV and spec.mla is None:
        return Placement(f"{prefix}self_attn.qkv_proj", rows=_packed([spec.q_size, spec.kv_size, spec.kv_size], _QKV[leaf]))
    expert = _EXPERT.match(rest)
    if expert is not None:
        index, leaf = int(expert.group(1)), expert.group(2)
        size = spec.moe.intermediate_size
        if leaf in _GATE_UP:
            return Placement(f"{prefix}mlp.experts", "w13", index, _packed([size, size], _GATE_UP[leaf]))
        return Placement(f"{prefix}mlp.experts", "w2", index) if leaf in _DOWN else None
    if rest == "mlp.router":  # gpt-oss's router (with a bias)
        return Placement(f"{prefix}mlp.gate")
    if leaf in ("gate_proj", "up_proj"):  # the dense MLP or Qwen2-MoE's shared expert
        size = spec.moe.shared_expert_size if parent == "mlp.shared_expert" else spec.intermediate_size
        return Placement(f"{prefix}{parent}.gate_up_proj", rows=_packed([size, size], _GATE_UP[leaf]))
    return Placement(f"{prefix}{rest}")


def _tower_place(module: str, spec: ModelSpec) -> Placement:
    """A vision tower module's place (`module`: `visual.`-prefixed): Qwen2.5-VL's gated MLP packs gate_proj and
    up_proj into `gate_up_proj` (model/vision.VisionMLP), as the decoder's; the rest one to one."""
    match = _TOWER_GATE_UP.match(module)
    if match is None:
        return Placement(module)
    size = spec.vision.intermediate_size
    return Placement(f"{match.group(1)}.gate_up_proj", rows=_packed([size, size], _GATE_UP[match.group(2)]))


def is_tower_tensor(name: str) -> bool:
    """A vision-language checkpoint's image-encoder tensor (Qwen-VL's `visual.*`, Gemma 3's SigLIP tower and
    projector): held whole on rank 0 in the model dtype, apart from the decoder's weights."""
    return bool(_VISUAL.match(name) or _SIGLIP.match(name) or _PROJECTOR.match(name))


def place(name: str, spec: ModelSpec) -> tuple[Placement, str] | None:
    """HF tensor name -> (where it goes, its kind: weight | bias | scale), or None for tensors we do not use."""
    if _SIGLIP_HEAD.match(name):
        return None
    name = _PROJECTOR.sub("visual.projector.", _SIGLIP.sub("visual.", name))
    if _VISUAL.match(name):  # the vision tower's tensors map one to one (a text-only spec has none)
        module, _, kind = _VISUAL.sub("visual.", name).rpartition(".")
        if spec.vision is not None and kind == "mm_input_projection_weight":  # Gemma 3's projection [E, text]
            return Placement(module, kind), "weight"
        return (_tower_place(module, spec), kind) if spec.vision is not None and kind in ("weight", "bias") else None
    name = _TEXT_DECODER.sub("model.", name).replace("language_model.lm_head.", "lm_head.", 1)
    if name.startswith(_BARE_DECODER):  # a bare decoder saved alone (`Qwen3Model`, sentence-transformers)
        name = "model." + name
    module, _, kind = name.rpartition(".")
    if kind in UNUSED_QUANT_TENSORS or "rotary_emb" in name:
        return None
    if spec.quant is not None and kind == spec.quant.scale_suffix:
        kind = "scale"
    elif spec.quant is not None and spec.quant.packed is not None and kind in ("weight_zero", "weight_perm"):
        kind = kind.removeprefix("weight_")  # a packed layer kept packed (int4.PackedTensorView)
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return Placement(module.removeprefix("model.")), kind
    if name == "lm_head.weight":
        return None if spec.tie_word_embeddings or spec.head != "lm" else (Placement("lm_head"), kind)
    if module == "score" and spec.head == "classify":  # a sequence classification head
        return Placement("score"), kind
    match = _LAYER.match(module)
    if match is None:
        return None
    layer, rest = match.groups()
    if spec.mla is not None and int(layer) >= spec.num_layers:
        return None  # DeepSeek's multi-token-prediction layers (num_nextn_predict_layers): not used
    if kind == "e_score_correction_bias":  # DeepSeek-V3's router bias (moe.GroupLimitedRouter)
        return Placement(f"layers.{layer}.{rest}", "e_score_correction_bias"), "weight"
    if rest.endswith(".experts") and kind in _STACKED_EXPERTS:  # transformers 5's stacked experts (gpt-oss: biases)
        part, _, suffix = kind.partition("_proj")
        gpt_oss = spec.moe is not None and spec.moe.experts_in_out_interleaved
        placement = Placement(f"layers.{layer}.mlp.experts", "w13" if part == "gate_up" else "w2",
                              transposed=gpt_oss and suffix == "", interleaved=gpt_oss and part == "gate_up")
        return placement, {"": "weight", "_bias": "bias", "_blocks": "weight", "_scales": "scale"}[suffix]
    if rest == "self_attn" and kind == "sinks":  # gpt-oss's attention sinks [Hq]
        return Placement(f"layers.{layer}.self_attn", "sinks"), "weight"
    if kind not in ("weight", "bias", "scale", "zero", "perm"):
        return None
    placement = _layer_place(f"layers.{layer}.", rest, spec)
    return None if placement is None else (placement, kind)


def expert_stack_layout(placement: Placement, kind: str, index: TensorIndex, name: str, spec: ModelSpec) -> Placement:
    """`placement` of checkpoint tensor `name`, transposed where it is a float stack of experts stored [E, in, out]
    (Qwen3-VL-MoE's hub checkpoints; transformers 5 saves [E, out, in], ours). Told apart by shape, as transformers
    does: a stack square in its last two dimensions (hidden == 2 x moe_intermediate_size for gate/up) is ours."""
    if (kind != "weight" or placement.slot not in ("w13", "w2") or placement.expert is not None
            or placement.transposed or spec.quant is not None):
        return placement
    size, hidden = spec.moe.intermediate_size, spec.hidden_size
    ours = [2 * size, hidden] if placement.slot == "w13" else [hidden, size]
    turned = index.shape(name)[-2:] == ours[::-1] and ours[0] != ours[1]
    return replace(placement, transposed=True) if turned else placement


def kept_fp8_modules(index: TensorIndex, spec: ModelSpec) -> set[str]:
    """Our modules whose checkpoint weights are FP8 and which the GPU path keeps in FP8: the decoder layers'
    matmuls (anything else FP8, e.g. a router, is dequantized at load)."""
    modules = set()
    for name in index.fp8_names():
        placed = place(name, spec)
        if placed is not None and placed[1] == "weight" and placed[0].module.rpartition(".")[2] in FP8_MODULES:
            modules.add(placed[0].module)
    return modules


def kept_mxfp4_modules(pairs: list[str], spec: ModelSpec) -> set[str]:
    """Our modules that the MXFP4 tensors `pairs` (each stored as `<name>_blocks` + `<name>_scales`) fill: the
    experts, which a backend that `keeps_mxfp4_weights` holds as stored."""
    modules = set()
    for name in pairs:
        placed = place(f"{name}_blocks", spec)
        if placed is not None and placed[0].module.endswith(".experts"):
            modules.add(placed[0].module)
    return modules


def kept_int_module(layer: str, spec: ModelSpec) -> str | None:
    """Our module that packed checkpoint layer `layer` (e.g. model.layers.0.self_attn.q_proj) fills, where the
    GPU path keeps it packed (`Int4Linear`: the decoder matmuls; `Experts.keep_int`: the experts, unless
    act-order, whose per-expert g_idx they do not hold); None: dequantized at load."""
    placed = place(f"{layer}.weight", spec)
    if placed is None or (placed[0].expert is not None and spec.quant.packed.act_order):
        return None
    module = placed[0].module
    return module if module.rpartition(".")[2] in INT_MODULES else None


def stored_bytes_per_weight(index: TensorIndex, quant: PackedQuant, spec: ModelSpec, dtype_bytes: int) -> float:
    """Bytes per weight of the decoder matrices a GPU run of this checkpoint holds, from the headers' real sizes:
    the layers kept packed (`Int4Linear`) at bits/8 per weight plus float32 scales, uint8 zeros per group (and
    an act-order perm); layers dequantized at load (MoE experts) and every float matrix at `dtype_bytes`. A
    vision tower's tensors are left out (`is_tower_tensor`: counted apart, ModelSpec.tower_params)."""
    marker, companions = PACKED_TENSORS[quant.format]
    layers = {n.removesuffix("." + marker) for n in index.file_of if n.endswith("." + marker)}
    beside = {f"{layer}.{c}" for layer in layers for c in companions}
    stored = weights = 0
    kept: set[str] = set()  # our modules: q/k/v (gate/up) share one perm
    for name in index.file_of:
        layer = name.removesuffix("." + marker)
        if is_tower_tensor(name):
            continue
        if layer in layers:
            n, k = packed_layer_shape(index, quant, layer)
            weights += n * k
            module = kept_int_module(layer, spec)
            if module is None:
                stored += n * k * dtype_bytes
            else:
                stored += n * k * quant.bits // 8 + n * quant.groups(k) * 5
                stored += 4 * k if quant.act_order and module not in kept else 0
                kept.add(module)
        elif name not in beside and len(shape := index.shape(name)) >= 2:
            weights += shape[0] * shape[1]
            stored += shape[0] * shape[1] * dtype_bytes
    return stored / max(weights, 1)
