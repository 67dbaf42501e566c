"""Speculative decoding on CPU: `--speculative auto` against off on the same engine settings, two workloads.

    python benchmarks/speculative_bench.py                        # the issue's sizes (256 copy rows, 64 random rows)
    python benchmarks/speculative_bench.py --rows 16 --random-rows 8 --max-tokens 48 --random-output 24:48  # a check

1. copy-heavy: SmolLM2-135M-Instruct (the default model) rewriting and extracting from given passages (repeat
   exactly, the sentences naming a word, a bullet list of the sentences): most of each answer is in its prompt.
2. random: nano-vllm's benchmark workload (random token ids, random lengths, ignore_eos, temperature 0.6; each row
   seeded so both runs draw the same tokens) on the same model, where drafts mostly fail: auto must switch itself
   off (target >= 0.97x). `--random-temperature 0` makes it greedy, where SmolLM2 falls into loops drafts copy.

Each pair runs off then auto in this process; the tokens of the two runs are compared (they must be identical) and
output tok/s, the ratio, the acceptance rate and tokens per step are printed with the CPU's family, model and
vector flags. Targets on a quiet machine: >= 1.5x copy-heavy, >= 0.97x random; a loaded machine's numbers are not
comparable (say so when reporting them).
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import run_to_completion
from cbatch.model.cpu_features import cpu_flags, vector_isa_flags
from cbatch.model.default_model import default_model_dir
from cbatch.tokenizer import encode_messages, load_tokenizer

SUBJECTS = ["The committee", "A small robot", "The old bridge", "Our lab", "The river", "A young engineer",
            "The market", "The library", "A quiet village", "The new compiler"]
VERBS = ["reviewed", "measured", "rebuilt", "described", "crossed", "tested", "reported", "studied", "moved", "printed"]
OBJECTS = ["the annual budget", "seven copper wires", "a broken lantern", "the northern wall", "forty paper maps",
           "the morning train", "a list of names", "the blue notebook", "three wooden chairs", "the city archive"]
TAILS = ["before the storm.", "after a long delay.", "with great care.", "in the early spring.", "for the first time.",
         "without any help.", "during the festival.", "at the end of May.", "near the harbour.", "twice in one week."]
KEYWORDS = ["the", "a", "of"]


def passage(rng: random.Random, sentences: int) -> list[str]:
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}"
            for _ in range(sentences)]


def copy_heavy_prompts(tokenizer, rows: int, seed: int) -> list[list[int]]:
    """Chat prompts asking to repeat, extract from or list a generated passage."""
    rng = random.Random(seed)
    prompts = []
    for i in range(rows):
        text = passage(rng, rng.randint(4, 8))
        body = " ".join(text)
        task = i % 3
        if task == 0:
            ask = f"Repeat the following passage exactly, word for word.\n\n{body}"
        elif task == 1:
            ask = f"Copy every sentence of this passage that contains the word \"{rng.choice(KEYWORDS)}\".\n\n{body}"
        else:
            ask = f"Rewrite this passage as a bullet list, one sentence per bullet, keeping the words.\n\n{body}"
        prompts.append(encode_messages(tokenizer, [{"role": "user", "content": ask}]))
    return prompts


def random_workload(rows: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    vocab: int, temperature: float = 0.6) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's benchmark shape: random token ids and lengths, every row to its length (ignore_eos), sampled at
    its temperature (0.6) with a seed per row."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(rows)]
    params = [SamplingParams(max_tokens=rng.randint(*output_range), ignore_eos=True, temperature=temperature,
                             seed=seed * 100_003 + i if temperature > 0 else None) for i in range(rows)]
    return prompts, params


def run(model: Path, prompts, params, speculative: str, settings: dict) -> tuple[list[list[int]], dict]:
    engine = build_engine(EngineConfig(model=str(model), device="cpu", speculative=speculative, **settings))
    start = time.perf_counter()
    outputs = run_to_completion(engine, prompts, params)
    seconds = time.perf_counter() - start
    stats = engine.scheduler.stats
    tokens = sum(len(o.token_ids) for o in outputs)
    return [o.token_ids for o in outputs], {
        "seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds, "steps": stats.steps,
        "tokens_per_step": tokens / max(stats.steps, 1), "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens, "acceptance": stats.acceptance_rate,
    }


def compare(name: str, model: Path, prompts, params, mode: str, settings: dict) -> None:
    plain_tokens, plain = run(model, prompts, params, "off", settings)
    spec_tokens, spec = run(model, prompts, params, mode, settings)
    same = spec_tokens == plain_tokens
    print(f"{name}: {len(prompts)} rows, {plain['output_tokens']} output tokens; tokens identical: {same}")
    for label, r in (("off", plain), (mode, spec)):
        print(f"  {label:>6}: {r['tok_s']:8.1f} output tok/s  {r['seconds']:7.1f} s  {r['steps']:5d} steps  "
              f"{r['tokens_per_step']:6.2f} tok/step  drafted {r['drafted']:6d}  accepted {r['accepted']:6d} "
              f"({r['acceptance']:.0%})")
    print(f"  ratio {mode}/off: {spec['tok_s'] / plain['tok_s']:.3f}x")
    if not same:
        raise SystemExit(f"{name}: speculation changed tokens (a bug: please report it)")


def cpu_description() -> str:
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return (f"CPU: {fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}); vector flags: {' '.join(vector_isa_flags(cpu_flags())) or 'none'}")


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="copy-heavy rows")
    parser.add_argument("--max-tokens", type=int, default=160, help="copy-heavy rows' max_tokens (greedy)")
    parser.add_argument("--random-rows", type=int, default=64)
    parser.add_argument("--random-prompt", type=span, default=(100, 1024), help="random prompts' lengths A:B")
    parser.add_argument("--random-output", type=span, default=(100, 1024), help="random outputs' lengths A:B")
    parser.add_argument("--random-temperature", type=float, default=0.6, help="nano-vllm's 0.6; 0: greedy")
    parser.add_argument("--mode", default="auto", help="the speculative mode compared with off")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    args = parser.parse_args()

    print(cpu_description())
    model = args.model or default_model_dir()
    settings = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    tokenizer = load_tokenizer(model)
    prompts = copy_heavy_prompts(tokenizer, args.rows, args.seed)
    compare("copy-heavy", model, prompts, [SamplingParams(max_tokens=args.max_tokens)] * len(prompts), args.mode,
            settings)
    prompts, params = random_workload(args.random_rows, args.seed, args.random_prompt, args.random_output,
                                      len(tokenizer), args.random_temperature)
    compare("random", model, prompts, params, args.mode, settings)


if __name__ == "__main__":
    main()
