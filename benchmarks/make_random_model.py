"""A random-weight checkpoint of a preset shape, written by HF transformers (benchmarks; no download).

    python benchmarks/make_random_model.py qwen3-0.6b /tmp/qwen3-0.6b-random   # the nano-vllm workload's model
    python benchmarks/make_random_model.py qwen3-0.6b DIR num_hidden_layers=2  # the preset with config overrides

bfloat16, seed 0; does nothing when the folder already holds a config.json (a warm GPU machine keeps it).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from cbatch.model.presets import preset_config
from peer_engines import parse_setting  # benchmarks/ is this script's folder


def main(preset: str, folder: str, **overrides) -> int:
    if (Path(folder) / "config.json").is_file():
        print(f"{folder} exists")
        return 0
    config = {**preset_config(preset), **overrides}
    architecture = config.pop("architectures")[0]
    config.pop("torch_dtype", None)
    hf_config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**config)
    torch.manual_seed(0)
    # initialised on the GPU where there is one (the 0.6B model's random init takes ~30 s on the CPU)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    print(f"saved {folder}: {preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, bfloat16")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3], **dict(map(parse_setting, sys.argv[3:]))))
