"""GPU end-to-end correctness: greedy float32 tokens of cbatch on CUDA equal HF transformers on CUDA.

    python benchmarks/gpu_parity.py            # prints one line per (architecture, setting) and a verdict
    python benchmarks/gpu_parity.py --cpu-dry-run   # the same plumbing on a CPU (interpreter, 2 archs)

Uses the tiny random checkpoints of the test suite (every supported architecture), HF as the reference
on the same GPU, and cbatch with the Triton backend both eager and with decode CUDA graphs, plus the
torch backend on CUDA. Exit code 1 if any setting differs.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import ARCHS, make_checkpoint  # noqa: E402

from cbatch.config import EngineConfig, SamplingParams  # noqa: E402
from cbatch.engine.build import build_engine  # noqa: E402
from cbatch.engine.engine import run_to_completion  # noqa: E402

SETTINGS = {
    "triton+graphs": dict(attention_backend="triton"),
    "triton eager": dict(attention_backend="triton", enforce_eager=True),
    "triton chunked": dict(attention_backend="triton", enforce_eager=True, max_num_batched_tokens=16, block_size=8),
    "torch backend": dict(attention_backend="torch"),
}


def hf_greedy(path: Path, prompts: list[list[int]], max_new: int, device: str) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                 max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


def main(argv: list[str]) -> int:
    dry = "--cpu-dry-run" in argv  # the kit's plumbing check: two architectures, the interpreter, no graphs
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        print("gpu_parity: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means real float32 matmuls on both sides
    torch.backends.cudnn.allow_tf32 = False
    import random

    rng = random.Random(0)
    num_prompts, max_new = (2, 4) if dry else (8, 24)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(1, 70))] for _ in range(num_prompts)]
    archs = ["qwen3", "mistral"] if dry else list(ARCHS)
    settings_of = {k: v for k, v in SETTINGS.items() if not dry or k in ("triton eager", "torch backend")}
    where = "CPU (Triton interpreter)" if dry else torch.cuda.get_device_name()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            path = make_checkpoint(arch, Path(tmp) / arch)
            reference = hf_greedy(path, prompts, max_new, device)
            for name, settings in settings_of.items():
                engine = build_engine(EngineConfig(model=str(path), device=device, dtype="float32", max_num_seqs=8, **settings))
                got = [o.token_ids for o in run_to_completion(engine, prompts, [SamplingParams(max_tokens=max_new)] * len(prompts))]
                same = sum(a == b for a, b in zip(got, reference))
                failures += same != len(prompts)
                print(f"{arch:18s} {name:15s} {same}/{len(prompts)} token-identical to HF on {where}", flush=True)
    print("GPU PARITY:", "PASS" if failures == 0 else f"FAIL ({failures} settings differ)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
