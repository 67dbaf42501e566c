"""PEFT LoRA adapters: read one folder (adapter_config.json + adapter_model.safetensors), refuse what cbatch
cannot apply (naming the adapter and the fix), and lay its weights out for our packed projections.

PEFT names a module's factors `base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]); the delta is scale * B @ A with scale = alpha / r, or
alpha / sqrt(r) under rsLoRA. cbatch packs q/k/v into `qkv_proj` and gate/up into `gate_up_proj`: a
projection's factors become one part of its packed module (`PACKED`), whose other parts stay zero.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cbatch.config import UserError
from cbatch.model.spec import ModelSpec

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# HF projection -> (our packed module, its part); a packed module's parts in order
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
PACKED = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}  # our module -> its number of parts
# (a multimodal Gemma 3's text decoder: `model.language_model.layers` or `language_model.model.layers`)
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|model\.)layers\."
                     r"(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(UserError):
    """An adapter cbatch cannot use; the message names the adapter, what is wrong and the fix."""


def module_out_sizes(spec: ModelSpec, module: str) -> list[int]:
    """The rows of each part of our packed `module` (a dense layer's)."""
    return {"qkv_proj": [spec.q_size, spec.kv_size, spec.kv_size], "o_proj": [spec.hidden_size],
            "gate_up_proj": [spec.intermediate_size] * 2, "down_proj": [spec.hidden_size]}[module]


def module_in_size(spec: ModelSpec, module: str) -> int:
    return {"o_proj": spec.q_size, "down_proj": spec.intermediate_size}.get(module, spec.hidden_size)


@dataclass(slots=True)
class LoraPart:
    """One HF projection's factors: a [r, in], b [out, r] (float32), and its scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(slots=True)
class LoraAdapter:
    """A checked adapter: `parts[(layer, our module)][part index]` (absent parts are zero)."""

    name: str
    path: Path
    rank: int  # the largest rank of any of its modules
    parts: dict[tuple[int, str], dict[int, LoraPart]] = field(default_factory=dict)
    file_hashes: dict[str, str] = field(default_factory=dict)  # file name -> sha256 (resume, result cache)


def _fail(name: str, what: str, fix: str) -> LoraError:
    return LoraError(f"LoRA adapter {name!r}: {what}; {fix}")


def file_hashes(path: Path) -> dict[str, str]:
    """sha256 of the adapter's two files (what a resumed job and the result cache compare)."""
    out = {}
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        digest = hashlib.sha256()
        with open(path / file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        out[file] = digest.hexdigest()
    return out


def read_config(name: str, path: Path) -> dict:
    """The adapter's config, with every feature cbatch does not apply refused (before any weight is read)."""
    if not path.is_dir():
        raise _fail(name, f"{path} is not a folder", "give a PEFT adapter folder (adapter_config.json + "
                    "adapter_model.safetensors)")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / file).is_file():
            raise _fail(name, f"{path} has no {file}", "save the adapter with PEFT's save_pretrained "
                        "(safetensors), or point --lora at the right folder")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise _fail(name, f"{path / CONFIG_FILE} is not readable JSON ({exc})", "rewrite it with PEFT") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(name, f"peft_type {peft_type} is not LoRA", "cbatch applies LoRA adapters only")
    if config.get("use_dora"):
        raise _fail(name, "uses DoRA (use_dora: true), which cbatch does not apply",
                    "merge it into the model (PeftModel.merge_and_unload) and run the merged checkpoint")
    if config.get("bias", "none") != "none":
        raise _fail(name, f"trains biases (bias: {config['bias']!r})", "merge it into the model and run the "
                    "merged checkpoint, or train it with bias='none'")
    if config.get("modules_to_save"):
        raise _fail(name, f"saves whole modules ({', '.join(config['modules_to_save'])})",
                    "merge it into the model and run the merged checkpoint")
    if config.get("fan_in_fan_out"):
        raise _fail(name, "uses fan_in_fan_out (Conv1D layers)", "cbatch applies adapters of Linear layers only")
    for key in ("layer_replication", "megatron_config"):
        if config.get(key):
            raise _fail(name, f"sets {key}", "cbatch does not apply it; merge the adapter into the model instead")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a regex string is checked by the tensors it saved)
        other = next((t for t in targets if t.rpartition(".")[2] not in PROJECTIONS), None)
        if other is not None:
            raise _fail(name, f"targets {other}, which cbatch cannot adapt", _TARGETS_FIX)
    return config


_TARGETS_FIX = ("cbatch applies LoRA to q/k/v/o_proj and gate/up/down_proj of the decoder layers; retrain without "
                "that target or merge the adapter into the model")


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module whose name ends with it (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def load_adapter(name: str, path: str | Path, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    """The adapter at `path`, checked against the base model `spec` and `max_rank`: a LoraError naming it
    for anything cbatch cannot apply (DoRA, embedding / lm_head / router / expert targets, biases, a rank
    above --max-lora-rank, shapes that are not this model's)."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    config = read_config(name, path)
    if spec.mla is not None:
        raise _fail(name, f"adapts a {spec.architecture}, whose latent attention cbatch does not adapt yet",
                    "merge the adapter into the model (PeftModel.merge_and_unload) and run the merged checkpoint")
    alpha = config.get("lora_alpha", 8)
    use_rslora = bool(config.get("use_rslora", False))
    adapter = LoraAdapter(name, path, 0, file_hashes=file_hashes(path))
    factors: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            match = _TENSOR.match(key)
            if match is None:
                target = re.sub(r"\.(lora_\w+|base_layer)\..*$|\.weight$", "", key).removeprefix("base_model.model.")
                raise _fail(name, f"targets {target}, which cbatch cannot adapt", _TARGETS_FIX)
            layer, block, proj, which = int(match[1]), match[2], match[3], match[4]
            if proj not in PROJECTIONS or (block == "self_attn") != (PROJECTIONS[proj][0] in ("qkv_proj", "o_proj")):
                raise _fail(name, f"targets layers.{layer}.{block}.{proj}, which cbatch cannot adapt",
                            "cbatch applies LoRA to q/k/v/o_proj and gate/up/down_proj of the decoder layers")
            if layer >= spec.num_layers:
                raise _fail(name, f"has layer {layer}, but the model has {spec.num_layers} layers",
                            "use the adapter of this base model")
            if block == "mlp" and spec.is_sparse(layer):
                raise _fail(name, f"targets the MLP of layers.{layer}, a mixture-of-experts layer",
                            "cbatch applies LoRA to the attention projections of MoE models; retrain with "
                            "target_modules q/k/v/o_proj")
            factors.setdefault((layer, block, proj), {})[which] = f.get_tensor(key).float()
    if not factors:
        raise _fail(name, f"{path / WEIGHTS_FILE} holds no LoRA weights", "save the adapter with PEFT")
    for (layer, block, proj), ab in sorted(factors.items()):
        where = f"layers.{layer}.{block}.{proj}"
        if set(ab) != {"A", "B"}:
            raise _fail(name, f"{where} lacks lora_{'A' if 'A' not in ab else 'B'}", "save the adapter again with PEFT")
        a, b = ab["A"], ab["B"]
        module, part = PROJECTIONS[proj]
        rank = a.shape[0]
        out, inp = module_out_sizes(spec, module)[part], module_in_size(spec, module)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise _fail(name, f"{where} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}, not this model's "
                        f"([r, {inp}], [{out}, r])", "use an adapter trained on this base model")
        if rank > max_rank:
            raise _fail(name, f"{where} has rank {rank}, above --max-lora-rank {max_rank}",
                        f"run with --max-lora-rank {rank} or more")
        module_name = f"model.layers.{layer}.{block}.{proj}"
        lora_alpha = _pattern_value(config.get("alpha_pattern"), module_name, alpha)
        scale = lora_alpha / math.sqrt(rank) if use_rslora else lora_alpha / rank
        adapter.parts.setdefault((layer, module), {})[part] = LoraPart(a, b, float(scale))
        adapter.rank = max(adapter.rank, rank)
    return adapter


def check_adapter(name: str, path: str | Path, spec: ModelSpec | None, max_rank: int) -> dict[str, str]:
    """Preflight: the whole adapter checked (against `spec` where known, else its config and ranks only);
    its file hashes."""
    path = Path(path).expanduser()
    if spec is not None:
        return load_adapter(name, path, spec, max_rank).file_hashes
    config = read_config(name, path)
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise _fail(name, f"has rank {max(ranks)}, above --max-lora-rank {max_rank}",
                    f"run with --max-lora-rank {max(ranks)} or more")
    return file_hashes(path)
