"""Many LoRA adapters in one job against the base model alone, with and without adapter grouping (CPU).

    PYTHONPATH=. python benchmarks/lora_bench.py [--adapters 4 --rows 64 --rank 16 --rounds 3]

A random-weight Llama shape (--hidden, --layers; float32 on the CPU, bfloat16 with --device cuda) and --adapters random PEFT adapters of rank
--rank on all seven projections (written as PEFT folders: adapter_config.json + adapter_model.safetensors). The
job: --rows rows per adapter plus --rows base-model rows, shuffled, each generating --output-len tokens (EOS
ignored). Three engines run the same rows, in turn, --rounds times (medians; the machine's other load hits all
three alike):
    base        every row on the base model (an engine without adapters)
    grouped     the rows with their adapters, admission grouped by adapter (the default)
    ungrouped   the same, --no-lora-grouping (admission in longest-first order, adapters mixed in every step)
Prints output tok/s of each (wall clock, and per CPU-second of this process: less distorted by other processes on a
shared machine) and the adapter runs' share of the base model's. The final figures need a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.resolve import resolve_model
from cbatch.model.spec import parse_spec

PROJ = {"q_proj": ("self_attn", "hidden", "q"), "k_proj": ("self_attn", "hidden", "kv"),
        "v_proj": ("self_attn", "hidden", "kv"), "o_proj": ("self_attn", "q", "hidden"),
        "gate_proj": ("mlp", "hidden", "inter"), "up_proj": ("mlp", "hidden", "inter"),
        "down_proj": ("mlp", "inter", "hidden")}


def model_config(args) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=args.vocab,
                hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                torch_dtype="float32" if args.device == "cpu" else "bfloat16", eos_token_id=2)


def write_adapter(folder: Path, spec, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder with random factors on every projection of every layer."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {"hidden": spec.hidden_size, "q": spec.q_size, "kv": spec.kv_size, "inter": spec.intermediate_size}
    tensors = {}
    for layer in range(spec.num_layers):
        for proj, (block, inp, out) in PROJ.items():
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, sizes[inp], generator=gen) / sizes[inp] ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(sizes[out], rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ), "bias": "none"}))
    return folder


def run_job(engine, rows: list[tuple[list[int], str | None]], output_len: int) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, output tokens) of the rows run to completion."""
    for prompt, adapter in rows:
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, lora=adapter))
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished():
        tokens += sum(len(s.output_ids) for s in engine.step())
    return time.perf_counter() - start, time.process_time() - cpu, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rows", type=int, default=64, help="rows per adapter, and base-model rows")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=None, help="adapter slots (default: --adapters; fewer makes rows "
                   "wait for a slot, where grouping matters most)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt-len", default="32:128")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU: the Triton kernels; bfloat16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    low, high = map(int, args.prompt_len.split(":"))
    names = [f"adapter{i}" for i in range(args.adapters)]
    rows = [([rng.randrange(3, args.vocab) for _ in range(rng.randint(low, high))], name)
            for name in [*names, None] for _ in range(args.rows)]
    rng.shuffle(rows)
    folder = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    (folder / "config.json").write_text(json.dumps(model_config(args)))
    spec = parse_spec(model_config(args), {})
    loras = tuple((name, str(write_adapter(folder / name, spec, args.rank, i))) for i, name in enumerate(names))
    base_config = EngineConfig(device=args.device, max_num_seqs=args.max_num_seqs)
    resolved = resolve_model(base_config, spec)
    base = build_engine(base_config, resolved, random_weights_seed=args.seed)
    adapted = build_engine(replace(base_config, loras=loras, max_lora_rank=args.rank,
                                   max_loras=args.max_loras or args.adapters),
                           resolved, random_weights_seed=args.seed)
    base_rows = [(prompt, None) for prompt, _ in rows]
    runs: dict[str, list[tuple[float, float]]] = {"base": [], "grouped": [], "ungrouped": []}
    for _ in range(args.rounds):
        for name, engine, job in (("base", base, base_rows), ("grouped", adapted, rows), ("ungrouped", adapted, rows)):
            # a fresh scheduler and block pool each run: no prefix-cache hits from the previous round
            engine.reset(**({"lora_grouping": name == "grouped"} if engine is adapted else {}))
            seconds, cpu, tokens = run_job(engine, job, args.output_len)
            runs[name].append((tokens / seconds, tokens / cpu))
    print(f"{len(rows)} rows ({args.adapters} adapters x {args.rows} + {args.rows} base, shuffled), prompts {args.prompt_len}, "
          f"{args.output_len} output tokens each; Llama hidden {args.hidden}, {args.layers} layers, {resolved.dtype}, "
          f"rank {args.rank} on q/k/v/o/gate/up/down, {args.max_loras or args.adapters} slots; {args.device} ({torch.get_num_threads()} threads); "
          f"median of {args.rounds}")
    print("| job | output tok/s | share of base | output tok per CPU-second | share of base |")
    print("|---|---|---|---|---|")
    base_wall, base_cpu = (statistics.median(r[i] for r in runs["base"]) for i in (0, 1))
    for name, rates in runs.items():
        wall, cpu = (statistics.median(r[i] for r in rates) for i in (0, 1))
        print(f"| {name} | {wall:,.1f} | {wall / base_wall:.0%} | {cpu:,.1f} | {cpu / base_cpu:.0%} |")


if __name__ == "__main__":
    main()
