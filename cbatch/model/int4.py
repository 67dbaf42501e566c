"""Integer weight-only checkpoints (W4A16, and compressed-tensors W8A16): which layouts cbatch reads
(`PackedQuant`, from config.json's `quantization_config`), how each stores a layer (`unpack`, to one
canonical form), and a view of a checkpoint in which every packed layer appears as the tensors our model
takes (`PackedTensorView`).

Stored layouts (K: input features, N: output features, g: group size, G = K / g groups; -1: one group):
    awq (GEMM)            qweight int32 [K, N/8]: eight output columns per int32, nibble i holding column
                          8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]; qzeros int32 [G, N/8] in the same order; scales [G, N]
    gptq                  qweight int32 [K/8, N]: eight input rows per int32, nibble i = row 8j + i; qzeros
                          int32 [G, N/8], nibble i = column 8j + i, holding zero - 1 (v1, `checkpoint_format`
                          gptq) or the zero (gptq_v2); scales [G, N]; g_idx int32 [K] (desc_act: any group per row)
    compressed-tensors    weight_packed int32 [N, K/(32/b)]: 32/b input values per int32 in order, each stored
    pack-quantized        as value + 2^(b-1); weight_scale [N, G] ([N, 1] per channel); weight_zero_point int32
                          [N/(32/b), G] (asymmetric only, packed along N the same way); weight_g_idx [K]
                          (actorder group); weight_shape [2] = (N, K)
Every one dequantizes as weight[n, k] = (q[n, k] - zero[n, g_idx[k]]) x scale[n, g_idx[k]] with q and zero
unsigned b-bit integers (a symmetric layout's zero is 2^(b-1)).

Canonical form (`Unpacked`): q uint8 [N, K], scales float32 [N, G], zeros uint8 [N, G], g_idx int32 [K]. The GPU
path's `Int4Linear` and packed `Experts` hold q packed into int32 words in order along K (`pack_int32`), the
scales and zeros as they are. An act-order layer is held with its input rows sorted by group (each group
`group_size` rows in a row, so row k' is in group k' // group_size) and `perm` int32 [K]: sorted row k' is
input k = perm[k'] (the GPU kernel reads x through it; q/k/v and gate/up share their input, hence their perm). Anything else (3- or 8-bit AWQ/GPTQ, AWQ's GEMV
layouts, act-order whose g_idx does not fill its groups, activation quantization) is refused at preflight,
naming the variant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from cbatch.model.errors import UnsupportedModelError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of an int32 holds column AWQ_ORDER[i] of its eight
SUPPORTED_PACKED = ("AWQ GEMM 4-bit", "GPTQ 4-bit (desc_act, sym or asym)", "compressed-tensors pack-quantized int4/int8")
# per format: the tensor that marks a packed layer, and the tensors it comes with
PACKED_TENSORS = {
    "awq": ("qweight", ("qzeros", "scales")),
    "gptq": ("qweight", ("qzeros", "scales", "g_idx")),
    "compressed-tensors": ("weight_packed", ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")),
}


@dataclass(frozen=True, slots=True)
class PackedQuant:
    format: str  # awq | gptq | compressed-tensors
    bits: int  # 4, or 8 (compressed-tensors W8A16)
    group_size: int  # input rows per scale; -1: one scale per output channel
    symmetric: bool  # no zeros stored: the zero is 2^(bits-1)
    act_order: bool  # a g_idx may put any input row in any group (GPTQ desc_act, compressed-tensors actorder)
    zero_offset: int = 0  # added to a stored zero: 1 for GPTQ v1, which stores zero - 1

    @property
    def per_int32(self) -> int:
        return 32 // self.bits

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        order = ", act-order" if self.act_order else ""
        return f"{self.format} int{self.bits} ({group}, {'sym' if self.symmetric else 'asym'}{order})"

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)


def refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what} is not supported; cbatch loads {', '.join(SUPPORTED_PACKED)} and FP8")


def _group_size(value: Any, what: str) -> int:
    if value not in (-1, 16, 32, 64, 128, 256, 512, 1024):  # powers of two: whole K steps of the Triton GEMM
        raise refuse(f"{what} group_size {value!r}")
    return int(value)


def parse_awq(qc: dict[str, Any]) -> PackedQuant:
    bits = qc.get("bits", qc.get("w_bit"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(f"AWQ version {version!r} (only the GEMM layout is read)")
    if bits != 4:
        raise refuse(f"{bits}-bit AWQ")
    if qc.get("zero_point", True) is not True:
        raise refuse("AWQ without zero points (zero_point false)")
    return PackedQuant("awq", 4, _group_size(qc.get("group_size", qc.get("q_group_size")), "AWQ"), False, False)


def parse_gptq(qc: dict[str, Any]) -> PackedQuant:
    bits = qc.get("bits")
    if bits != 4:
        raise refuse(f"{bits}-bit GPTQ")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"GPTQ checkpoint_format {fmt!r}")
    group = _group_size(qc.get("group_size", 128), "GPTQ")
    return PackedQuant("gptq", 4, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)),
                       zero_offset=1 if fmt == "gptq" else 0)


def parse_compressed_tensors(qc: dict[str, Any]) -> PackedQuant:
    """compressed-tensors `pack-quantized`: every config group the same int weight layout, activations unquantized."""
    layouts = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        bits, kind = weights.get("num_bits"), weights.get("type")
        if kind != "int" or bits not in (4, 8):
            raise refuse(f"compressed-tensors {name}: {bits}-bit {kind} pack-quantized weights")
        if group.get("input_activations"):
            raise refuse(f"compressed-tensors {name}: quantized activations (W{bits}A{group['input_activations'].get('num_bits')})")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise refuse(f"compressed-tensors {name}: int weight strategy {strategy!r}")
        group_size = _group_size(weights.get("group_size"), f"compressed-tensors {name}") if strategy == "group" else -1
        actorder = weights.get("actorder")
        if actorder not in (None, "weight", "static", "group", "dynamic"):
            raise refuse(f"compressed-tensors {name}: actorder {actorder!r}")
        layouts.add(PackedQuant("compressed-tensors", bits, group_size, bool(weights.get("symmetric", True)),
                                actorder in ("group", "dynamic")))
    if len(layouts) != 1:
        raise refuse(f"compressed-tensors pack-quantized with {len(layouts)} different weight layouts")
    return layouts.pop()


# ---- unpacking ----------------------------------------------------------------------------------------------
def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """2-D int32 words -> their unsigned `bits`-bit values as uint8, spread along `dim` (0, or -1: the last):
    value i of word j lands at index j * 32/bits + order[i] (order None: i). One value slot at a time, so the
    temporaries are a word tensor's size (a 70B layer's are 30 MB, not 1 GB)."""
    per = 32 // bits
    order = order or tuple(range(per))
    rows, cols = packed.shape
    shape = (rows * per, cols) if dim == 0 else (rows, cols * per)
    out = torch.empty(shape, dtype=torch.uint8, device=packed.device)
    for i, index in enumerate(order):
        values = ((packed >> (bits * i)) & ((1 << bits) - 1)).to(torch.uint8)
        if dim == 0:
            out[index::per] = values
        else:
            out[:, index::per] = values
    return out


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack_int32` (order None): unsigned `bits`-bit values along `dim` (a multiple of
    32/bits) -> int32 words (the top value's bits wrap into the sign bit)."""
    per = 32 // bits
    v = values.movedim(dim, -1)
    words = v[..., 0::per].to(torch.int32)
    for i in range(1, per):
        words |= v[..., i::per].to(torch.int32) << (bits * i)
    return words.movedim(-1, dim).contiguous()


@dataclass(slots=True)
class Unpacked:
    """One layer in canonical form: weight[n, k] = (q[n, k] - zeros[n, g_idx[k]]) x scales[n, g_idx[k]]."""

    q: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor  # uint8 [N, G]
    g_idx: torch.Tensor  # int32 [K]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, computed in float32 and rounded once (what the Triton kernel multiplies by)."""
        idx = self.g_idx.long()
        return ((self.q.float() - self.zeros.float()[:, idx]) * self.scales.float()[:, idx]).to(dtype)


@dataclass(frozen=True, slots=True)
class IntExperts:
    """MoE experts held packed (`moe.Experts.keep_int`): what `fused_moe` needs besides the packed w13 / w2
    (int32 [E, N, K * bits / 32]) and their float32 scales [E, N, groups]."""

    w13_zero: torch.Tensor  # uint8 [E, 2I, groups of H]
    w2_zero: torch.Tensor  # uint8 [E, H, groups of I]
    group_size: int  # -1: one group per output channel
    bits: int


def dequantize_kept(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, perm: torch.Tensor | None,
                    group_size: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """An `Int4Linear`'s packed weight (int32 [N, K*bits/32], act-order: sorted rows and their `perm`) -> [N, K]
    in `dtype`, in the inputs' order (float32 math, one rounding)."""
    q = unpack_int32(weight, bits, -1)
    k = q.shape[1]
    sorted_weight = Unpacked(q, scale.float(), zero, torch.arange(k, device=q.device) // group_size).dequantize(dtype)
    if perm is None:
        return sorted_weight
    out = torch.empty_like(sorted_weight)
    out[:, perm.long()] = sorted_weight
    return out


def sort_by_group(u: Unpacked) -> tuple[torch.Tensor, torch.Tensor]:
    """An act-order layer's (q with its input rows sorted by group [N, K], perm int32 [K]: sorted row k' is
    input perm[k']). The sort is stable, so layers sharing a g_idx share the perm."""
    perm = torch.sort(u.g_idx, stable=True).indices
    return u.q[:, perm], perm.to(torch.int32)


def _sequential_groups(k: int, quant: PackedQuant, device: torch.device | str = "cpu") -> torch.Tensor:
    group = k if quant.group_size == -1 else quant.group_size
    return (torch.arange(k, device=device) // group).to(torch.int32)


def unpack(quant: PackedQuant, get: Callable[[str], torch.Tensor | None], name: str) -> Unpacked:
    """Layer `name` (its prefix, e.g. model.layers.0.mlp.down_proj) from its stored tensors (`get(suffix)`:
    None for one the checkpoint lacks) to canonical form."""
    bits = quant.bits
    if quant.format == "awq":
        q = unpack_int32(get("qweight"), bits, -1, AWQ_ORDER).t()  # [K, N] -> [N, K]
        zeros = unpack_int32(get("qzeros"), bits, -1, AWQ_ORDER).t()
        scales = get("scales").float().t()
        g_idx = _sequential_groups(q.shape[1], quant, q.device)
    elif quant.format == "gptq":
        q = unpack_int32(get("qweight"), bits, 0).t()  # [K/8, N] -> [K, N] -> [N, K]
        scales = get("scales").float().t()
        stored = unpack_int32(get("qzeros"), bits, -1)[:, : scales.shape[0]].t()  # [N, G]
        zeros = (stored.to(torch.int16) + quant.zero_offset).clamp(0, (1 << bits) - 1).to(torch.uint8)
        g_idx = get("g_idx")
        g_idx = _sequential_groups(q.shape[1], quant, q.device) if g_idx is None else g_idx.to(torch.int32)
    else:
        shape = get("weight_shape")
        n, k = (int(v) for v in shape.tolist()) if shape is not None else (None, None)
        q = unpack_int32(get("weight_packed"), bits, -1)[:n, :k]  # [N, K]
        scales = get("weight_scale").float()
        if scales.dim() == 1:
            scales = scales[:, None]
        zero_point = get("weight_zero_point")
        if zero_point is None:
            zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.uint8, device=q.device)
        else:
            zeros = unpack_int32(zero_point, bits, 0)[: q.shape[0]]  # stored zero + 2^(b-1): the unsigned zero
        g_idx = get("weight_g_idx")
        g_idx = _sequential_groups(q.shape[1], quant, q.device) if g_idx is None else g_idx.to(torch.int32)
    return Unpacked(q.contiguous(), scales.contiguous(), zeros.contiguous(), g_idx.contiguous())


# ---- the checkpoint as the loader reads it ------------------------------------------------------------------
KEPT_PARTS = ("weight", "weight_scale", "weight_zero", "weight_perm")  # a kept layer's tensors, our names


class PackedTensorView:
    """A `TensorIndex` of a packed checkpoint as the loader reads it: each packed layer's stored tensors are
    replaced by `<layer>.weight`, dequantized (float32), or, for the layers `keep(layer)` holds packed (the
    GPU path's `Int4Linear`), by KEPT_PARTS in canonical form: weight int32 [N, K/(32/b)] (b-bit values in
    order along K; act-order: rows sorted by group), weight_scale float32 [N, G], weight_zero uint8 [N, G],
    weight_perm int32 [K] (act-order only: `sort_by_group`). Every
    other tensor reads through unchanged. The parts of one layer are read one after another: the last
    unpacked layer is cached."""

    def __init__(self, index, quant: PackedQuant, keep: Callable[[str], bool]) -> None:
        self.index = index
        self.quant = quant
        marker, companions = PACKED_TENSORS[quant.format]
        self.layers = sorted(n.removesuffix("." + marker) for n in index.file_of if n.endswith("." + marker))
        stored = {f"{layer}.{s}" for layer in self.layers for s in (marker, *companions)}
        self.file_of = {n: f for n, f in index.file_of.items() if n not in stored}
        self.dtype_of = {n: index.dtype_of[n] for n in self.file_of}
        self._virtual: dict[str, tuple[str, str]] = {}  # our name -> (layer, part)
        kept_parts = KEPT_PARTS if quant.act_order else KEPT_PARTS[:3]  # in order, row k is in group k // group_size
        for layer in self.layers:
            for part in kept_parts if keep(layer) else ("weight",):
                self.file_of[f"{layer}.{part}"] = index.file_of[f"{layer}.{marker}"]
                self.dtype_of[f"{layer}.{part}"] = "I32"
                self._virtual[f"{layer}.{part}"] = (layer, part)
        self._cached: tuple[str, Unpacked] | None = None

    def unpacked(self, layer: str) -> Unpacked:
        if self._cached is None or self._cached[0] != layer:
            def get(suffix: str) -> torch.Tensor | None:
                name = f"{layer}.{suffix}"
                return self.index.get(name) if name in self.index.file_of else None
            self._cached = (layer, unpack(self.quant, get, layer))
        return self._cached[1]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._virtual:
            return self.index.get(name)
        layer, part = self._virtual[name]
        u = self.unpacked(layer)
        if part == "weight" and layer + ".weight_scale" not in self._virtual:
            return u.dequantize(torch.float32)
        if part == "weight":
            return pack_int32(sort_by_group(u)[0] if self.quant.act_order else u.q, self.quant.bits, 1)
        return {"weight_scale": lambda: u.scales, "weight_zero": lambda: u.zeros,
                "weight_perm": lambda: sort_by_group(u)[1]}[part]()

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in self._virtual:
            return self.index.get_slice(name, dim, start, stop)
        return self.get(name).narrow(dim, start, stop - start)

    def fp8_names(self) -> list[str]:
        return [n for n in self.index.fp8_names() if n in self.file_of]


def check_packed(index, quant: PackedQuant, path) -> None:
    """Preflight, from the safetensors headers and the (small) g_idx tensors: every packed layer has the
    tensors and shapes its format stores, and an act-order g_idx fills its groups. Refuses by name."""
    marker, _ = PACKED_TENSORS[quant.format]
    layers = [n.removesuffix("." + marker) for n in index.file_of if n.endswith("." + marker)]
    if not layers:
        raise refuse(f"{path}: config.json announces {quant.describe()} but no tensor is named *.{marker}; this layout")
    for layer in layers:
        _check_layer(index, quant, layer)


def _shape(index, name: str) -> list[int] | None:
    return index.shape(name) if name in index.file_of else None


def packed_layer_shape(index, quant: PackedQuant, layer: str) -> tuple[int, int]:
    """(N, K) of packed layer `layer`, from its headers (compressed-tensors: its weight_shape)."""
    rows, cols = _shape(index, f"{layer}.{PACKED_TENSORS[quant.format][0]}")
    if quant.format == "awq":  # [K, N/8]
        return cols * quant.per_int32, rows
    if quant.format == "gptq":  # [K/8, N]
        return cols, rows * quant.per_int32
    if f"{layer}.weight_shape" in index.file_of:
        n, k = (int(v) for v in index.get(f"{layer}.weight_shape").tolist())
        return n, k
    return rows, cols * quant.per_int32


def _check_layer(index, quant: PackedQuant, layer: str) -> None:
    per = quant.per_int32
    fmt = quant.format
    packed = f"{layer}.{PACKED_TENSORS[fmt][0]}"
    if index.dtype_of[packed] != "I32":
        raise refuse(f"{packed} stored as {index.dtype_of[packed]} (packed weights are int32); this layout")
    n, k = packed_layer_shape(index, quant, layer)
    if fmt in ("awq", "gptq"):
        scale_name, zero_name, zero_shape = "scales", "qzeros", lambda g: [g, n // per]
    else:
        scale_name, zero_name = "weight_scale", ("weight_zero_point" if not quant.symmetric else None)
        zero_shape = lambda g: [-(-n // per), g]  # noqa: E731
    groups = quant.groups(k)
    scales = _shape(index, f"{layer}.{scale_name}")
    expected = [groups, n] if fmt in ("awq", "gptq") else [n, groups]
    if scales is None or scales != expected:
        what = "AWQ GEMM" if fmt == "awq" else quant.describe()
        raise refuse(f"{layer}: {scale_name} of shape {scales} where {what} with {k} inputs and {n} outputs stores "
                     f"{expected} (another packing, e.g. AWQ GEMV, or a group size the config does not state); this layout")
    if zero_name is not None:
        zeros = _shape(index, f"{layer}.{zero_name}")
        if zeros != zero_shape(groups):
            raise refuse(f"{layer}: {zero_name} of shape {zeros} (expected {zero_shape(groups)}) in {quant.describe()}")
    g_name = f"{layer}.{'g_idx' if fmt == 'gptq' else 'weight_g_idx'}"
    if g_name in index.file_of:
        _check_g_idx(index.get(g_name), quant, k, g_name)


def _check_g_idx(g_idx: torch.Tensor, quant: PackedQuant, k: int, name: str) -> None:
    """Each group holds group_size input rows (the last one the rest), whatever order act-order put them in."""
    groups = quant.groups(k)
    group = k if quant.group_size == -1 else quant.group_size
    g_idx = g_idx.long().reshape(-1)
    expected = torch.full((groups,), group)
    expected[-1] = k - group * (groups - 1)
    if g_idx.numel() != k or g_idx.min() < 0 or g_idx.max() >= groups or \
            not torch.equal(torch.bincount(g_idx, minlength=groups), expected):
        counts = torch.bincount(g_idx.clamp(0), minlength=groups).tolist() if g_idx.numel() else []
        raise refuse(f"act-order with a group mismatch ({name}: {g_idx.numel()} rows in groups of sizes "
                     f"{sorted(set(counts))[:4]}, where group_size {quant.group_size} makes {groups} groups of {group})")
    if not quant.act_order and not torch.equal(g_idx, torch.arange(k) // group):
        raise refuse(f"{name} orders the input rows (act-order) while the config's desc_act/actorder says they are not; "
                     f"a g_idx out of order without act-order")
