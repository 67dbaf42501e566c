"""The sampling step alone: 256 rows x a 152k vocabulary (Qwen's), from plain greedy up to every option on.

    python benchmarks/sampler_speed.py                      # 256 x 151936, on CUDA when there is one
    python benchmarks/sampler_speed.py --device cpu --repeats 5
    python benchmarks/sampler_speed.py --quick               # 16 x 4096: checks that it runs

Each case builds the step's `SamplingBatch` from fake running sequences (prompts of --prompt-len tokens,
--output-len tokens generated so far) exactly as the runner does (`SamplingInputs.build`: settings, seeds,
logit_bias / min_tokens entries, penalty token counts brought up to date with the last step's token), then
runs `sample_step` on random float32 logits. "build" is that host work, "sample" the tensor pipeline
(processors, temperature, min_p, top-k/top-p, the seeded race, logprobs). Medians over --repeats steps after
one warm-up; each step appends one token to every sequence, as decoding does.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from cbatch.config import SamplingParams
from cbatch.engine.sampler import sample_step
from cbatch.engine.sampling_inputs import SamplingInputs
from cbatch.engine.sequence import Sequence

CASES = {
    "greedy": SamplingParams(),
    "random": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1),
    "all options": SamplingParams(
        temperature=0.8, top_p=0.95, top_k=50, seed=1, min_p=0.05, repetition_penalty=1.1, presence_penalty=1.5,
        frequency_penalty=0.2, min_tokens=512, stop_token_ids=[7, 11], logit_bias={i: -1.0 for i in range(0, 200, 20)},
        logprobs=5,
    ),
}


def fake_sequences(params: SamplingParams, rows: int, vocab: int, prompt_len: int, output_len: int) -> list[Sequence]:
    rng = random.Random(0)
    seqs = []
    for i in range(rows):
        seq = Sequence(seq_id=i, prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)], params=params,
                       eos_ids=frozenset({2}))
        seq.output_ids = [rng.randrange(vocab) for _ in range(output_len)]
        seqs.append(seq)
    return seqs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(params: SamplingParams, args, device: torch.device) -> dict[str, float]:
    seqs = fake_sequences(params, args.rows, args.vocab, args.prompt_len, args.output_len)
    inputs = SamplingInputs(args.vocab, device, job_seed=0)
    logits = torch.randn(args.rows, args.vocab, device=device) * 4
    build_ms, sample_ms = [], []
    for step in range(args.repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        batch = inputs.build(seqs)
        sync(device)
        t1 = time.perf_counter()
        out = sample_step(logits, batch)
        tokens = out.tokens.tolist()  # the runner's host copy of the sampled tokens
        t2 = time.perf_counter()
        if step:  # the first step is a warm-up (and counts every prompt into the penalty rows)
            build_ms.append((t1 - t0) * 1e3)
            sample_ms.append((t2 - t1) * 1e3)
        for seq, token in zip(seqs, tokens):
            seq.output_ids.append(token)
    return {"build_ms": statistics.median(build_ms), "sample_ms": statistics.median(sample_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="16 rows x 4096 vocabulary, 2 repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.vocab, args.prompt_len, args.output_len, args.repeats = 16, 4096, 64, 16, 2
    device = torch.device(args.device)
    results = {name: measure(params, args, device) for name, params in CASES.items()}
    if args.json:
        print(json.dumps({"rows": args.rows, "vocab": args.vocab, "device": str(device),
                          "threads": torch.get_num_threads(), "cases": results}))
        return
    print(f"{args.rows} rows x {args.vocab} vocab on {device} ({torch.get_num_threads()} threads), "
          f"median of {args.repeats} steps")
    print(f"{'case':<12} {'build ms':>9} {'sample ms':>10}")
    for name, r in results.items():
        print(f"{name:<12} {r['build_ms']:>9.2f} {r['sample_ms']:>10.2f}")


if __name__ == "__main__":
    main()
