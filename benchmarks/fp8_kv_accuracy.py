"""What the fp8 (e4m3) KV cache costs in accuracy: cbatch with --kv-cache-dtype fp8 against the same engine
with the KV cache in the model's dtype.

    python benchmarks/fp8_kv_accuracy.py                                  # every tiny architecture, CPU, bfloat16
    python benchmarks/fp8_kv_accuracy.py --device cuda --model /tmp/qwen3-0.6b-random --backend triton

Per model: greedy agreement (the share of generated tokens equal to the reference's up to each request's
first divergence, and the requests identical end to end) and the largest logit error of one prefill and
one decode step over the prompts, absolute and relative to the largest reference logit. The tiny
checkpoints are random (tests/tiny_models.py); weights and prompts are seeded, so the figures repeat.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import random_prompts  # noqa: E402
from tiny_models import ARCHS, make_checkpoint  # noqa: E402

from cbatch.config import EngineConfig, SamplingParams  # noqa: E402
from cbatch.engine.build import build_engine  # noqa: E402
from cbatch.engine.engine import run_to_completion  # noqa: E402
from cbatch.engine.sequence import Sequence  # noqa: E402


def step_logits(engine, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of a prefill of every prompt, then of one decode step (greedy tokens fed back): [2N, vocab]."""
    engine.reset()
    seqs = [Sequence(seq_id=i, prompt_ids=p, params=SamplingParams(max_tokens=2)) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.scheduler.add(seq)
    out = []
    for _ in range(2):
        plan = engine.scheduler.schedule()
        step = engine.runner.forward(plan)
        order = {s.seq_id: i for i, s in enumerate(step.seqs)}
        logits = step.logits[[order[s.seq_id] for s in seqs]].float().cpu()
        out.append(logits)
        engine.scheduler.update(plan, {s.seq_id: int(logits[i].argmax()) for i, s in enumerate(seqs)})
    engine.reset()
    return torch.cat(out)


def compare(model: str, args: argparse.Namespace) -> dict:
    settings = dict(model=model, device=args.device, dtype=args.dtype, attention_backend=args.backend,
                    max_num_seqs=args.num_prompts, enforce_eager=True)  # eager: every step returns its logits
    ref_engine = build_engine(EngineConfig(**settings))
    fp8_engine = build_engine(EngineConfig(kv_cache_dtype="fp8", **settings))
    vocab = ref_engine.spec.vocab_size
    prompts = random_prompts(args.num_prompts, vocab=min(vocab, 30000), seed=3, min_len=8, max_len=args.max_prompt)
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)] * len(prompts)
    ref = [o.token_ids for o in run_to_completion(ref_engine, prompts, params)]
    got = [o.token_ids for o in run_to_completion(fp8_engine, prompts, params)]
    agree = 0
    for a, b in zip(ref, got):
        agree += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    ref_logits, fp8_logits = step_logits(ref_engine, prompts), step_logits(fp8_engine, prompts)
    err = (fp8_logits - ref_logits).abs().max().item()
    return dict(agree=agree / sum(map(len, ref)), identical=sum(a == b for a, b in zip(ref, got)), requests=len(ref),
                max_err=err, rel_err=err / ref_logits.abs().max().item(),
                kv_bytes=(ref_engine.runner.kv_cache.tensor.element_size(), fp8_engine.runner.kv_cache.tensor.element_size()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=[], help="checkpoint folder (repeatable); default: the tiny ones")
    p.add_argument("--arch", action="append", default=[], choices=list(ARCHS), help="tiny architectures (default: all)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    print(f"| model | device | dtype | KV bytes/elem | greedy tokens agreeing | requests identical | max logit error | relative |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        models = args.model or [str(make_checkpoint(arch, Path(tmp) / arch)) for arch in args.arch or ARCHS]
        for model in models:
            r = compare(model, args)
            print(f"| {Path(model).name} | {args.device} | {args.dtype} | {r['kv_bytes'][0]} -> {r['kv_bytes'][1]} | "
                  f"{r['agree']:.1%} | {r['identical']}/{r['requests']} | {r['max_err']:.4f} | {r['rel_err']:.2%} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
