"""From a checkpoint (folder or hub id) to our model with its weights, packed for fewer matmuls."""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from cbatch.config import UserError
from cbatch.model.backend import Backend
from cbatch.model.llama import LlamaForCausalLM
from cbatch.model.spec import ModelSpec, UnsupportedModelError, parse_spec, read_config

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


class ModelLoadError(UserError):
    """The model could not be found or read; the message says where and what to do."""


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
    raw = read_config(model_dir)
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return Checkpoint(model_dir, parse_spec(raw, generation), raw)


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
                backend: Backend) -> LlamaForCausalLM:
    """An empty (uninitialised) model in place on `device`, computing through `backend`."""
    with _default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(spec, max_positions, backend)
    model = model.to_empty(device=device)
    model.build_rope_cache(device)
    return model.eval().requires_grad_(False)


def load_model(ckpt: Checkpoint, max_positions: int, device: torch.device, dtype: torch.dtype,
               backend: Backend, show_progress: bool = False) -> LlamaForCausalLM:
    model = build_model(ckpt.spec, max_positions, device, dtype, backend)
    files = sorted(ckpt.path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{ckpt.path} has no *.safetensors weights; cbatch reads safetensors checkpoints")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(files), desc="cbatch: loading weights", unit="file", dynamic_ncols=True)
    for file in files:
        if bar is not None:
            bar.update(1)
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = _target(name, ckpt.spec)
                if target is None:
                    continue
                param_name, rows = target
                if param_name not in params:
                    raise ModelLoadError(f"{file.name}: tensor {name} has no place in a {ckpt.spec.architecture}")
                param = params[param_name]
                dest = param.data if rows is None else param.data[rows]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"{file.name}: {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(param_name if rows is None else f"{param_name}[{rows.start}]")
    if bar is not None:
        bar.close()
    missing = [n for n in _expected(params, ckpt.spec) if n not in loaded]
    if missing:
        raise ModelLoadError(f"{ckpt.path}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    return model


def init_random_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> LlamaForCausalLM:
    """Weightless benchmark models: normal(0, std) matrices, unit norms, zero biases."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _target(name: str, spec: ModelSpec) -> tuple[str, slice | None] | None:
    """HF tensor name -> (our parameter, rows of it) or None for tensors we do not use."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return None if spec.tie_word_embeddings else ("lm_head.weight", None)
    match = _LAYER.match(name)
    if match is None:
        return None
    layer, rest = match.groups()
    prefix = f"layers.{layer}."
    module, _, kind = rest.rpartition(".")  # e.g. "self_attn.q_proj", "weight"
    parent, _, leaf = module.rpartition(".")
    if parent == "self_attn" and leaf in _QKV:
        sizes = [spec.q_size, spec.kv_size, spec.kv_size]
        start = sum(sizes[: _QKV[leaf]])
        return f"{prefix}self_attn.qkv_proj.{kind}", slice(start, start + sizes[_QKV[leaf]])
    if parent == "mlp" and leaf in _GATE_UP:
        start = _GATE_UP[leaf] * spec.intermediate_size
        return f"{prefix}mlp.gate_up_proj.{kind}", slice(start, start + spec.intermediate_size)
    if "rotary_emb" in rest:
        return None
    return prefix + rest, None


def _expected(params: dict[str, torch.nn.Parameter], spec: ModelSpec) -> list[str]:
    """Every load target the model needs: packed parameters count once per packed part."""
    names = []
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            names += [f"{name}[{s}]" for s in (0, spec.q_size, spec.q_size + spec.kv_size)]
        elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
            names += [f"{name}[{s}]" for s in (0, spec.intermediate_size)]
        else:
            names.append(name)
    return names


__all__ = [
    "Checkpoint", "ModelLoadError", "UnsupportedModelError", "build_model", "init_random_weights",
    "load_model", "read_checkpoint", "resolve_dtype", "resolve_model_dir", "DTYPE_BY_NAME",
]
