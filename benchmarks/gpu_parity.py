"""GPU end-to-end correctness: greedy float32 tokens of cbatch on CUDA equal HF transformers on CUDA.

    python benchmarks/gpu_parity.py            # prints one line per (architecture, setting) and a verdict

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


def hf_greedy(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device="cuda"), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                                 max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_parity: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means real float32 matmuls on both sides
    torch.backends.cudnn.allow_tf32 = False
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(1, 70))] for _ in range(8)]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = make_checkpoint(arch, Path(tmp) / arch)
            reference = hf_greedy(path, prompts, 24)
            for name, settings in SETTINGS.items():
                engine = build_engine(EngineConfig(model=str(path), device="cuda", dtype="float32", max_num_seqs=8, **settings))
                got = [o.token_ids for o in run_to_completion(engine, prompts, [SamplingParams(max_tokens=24)] * len(prompts))]
                same = sum(a == b for a, b in zip(got, reference))
                failures += same != len(prompts)
                print(f"{arch:18s} {name:15s} {same}/{len(prompts)} token-identical to HF on {torch.cuda.get_device_name()}")
    print("GPU PARITY:", "PASS" if failures == 0 else f"FAIL ({failures} settings differ)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
