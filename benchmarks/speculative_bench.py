"""Speculative decoding: `--speculative auto` (and any other mode) against off on one engine, two workloads.

    python benchmarks/speculative_bench.py                        # the issue's sizes (256 copy rows, 64 random rows)
    python benchmarks/speculative_bench.py --rows 16 --random-rows 8 --max-tokens 48 --random-output 24:48  # a check

1. copy-heavy: SmolLM2-135M-Instruct (the default model) rewriting and extracting from given passages (repeat
   exactly, the sentences naming a word, a bullet list of the sentences): most of each answer is in its prompt.
2. random: nano-vllm's benchmark workload (random token ids, random lengths, ignore_eos, temperature 0.6; each row
   seeded so both runs draw the same tokens) on the same model, where drafts mostly fail: auto must switch itself
   off (target >= 0.97x). `--random-temperature 0` makes it greedy, where SmolLM2 falls into loops drafts copy.

One engine runs every mode in turn (`Engine.reset(speculative=...)`, after a warm-up); the tokens of each mode are
compared with off's (they must be identical) and output tok/s, the ratio, the acceptance rate and tokens per step
are printed with the CPU's family, model and vector flags. Targets on a quiet machine: >= 1.5x copy-heavy, >= 0.97x
random; a loaded machine's numbers are not comparable (say so when reporting them).

The GPU kit (benchmarks/gpu_session.sh spec) runs it on a random-weight Qwen3-0.6B (`--model`, `--device cuda`):
the copy-heavy prompts are SmolLM2's token ids (`--tokenizer`, the carried one), mapped into the model's vocabulary,
but a random model does not copy, so its drafts rarely hold (its acceptance is reported as measured). `--copying-model
DIR` also writes a variant that loops over the prompts' tokens (attention outputs x 0.02, lm_head rows of every other
token zeroed: its greedy text soon cycles, which the row's own n-grams predict) and runs the copy-heavy workload on
it: the gain where drafts do hold, a stand-in for a model that copies. `--json` is rewritten after every run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import run_to_completion
from cbatch.model.cpu_features import cpu_description
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


def run(engine, prompts, params, mode: str) -> tuple[list[list[int]], dict[str, Any]]:
    """The job on `engine` with `--speculative mode` (a fresh scheduler; the runner, its graphs and tuning kept)."""
    engine.reset(speculative=mode)
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


def compare(name: str, engine, prompts, params, modes: list[str]) -> dict[str, Any]:
    """off, then each mode, on the same engine: figures per mode, its ratio to off and whether its tokens are off's
    (rows that differ, and the first token where the first of them does)."""
    plain_tokens, plain = run(engine, prompts, params, "off")
    result: dict[str, Any] = {"workload": name, "rows": len(prompts), "runs": {"off": plain}}
    print(f"{name}: {len(prompts)} rows, {plain['output_tokens']} output tokens")
    print(f"  {'off':>6}: {describe(plain)}")
    for mode in modes:
        tokens, figures = run(engine, prompts, params, mode)
        differ = [i for i, (a, b) in enumerate(zip(tokens, plain_tokens)) if a != b]
        figures.update(ratio=figures["tok_s"] / plain["tok_s"], identical=not differ, rows_differing=len(differ))
        if differ:
            a, b = tokens[differ[0]], plain_tokens[differ[0]]
            figures["first_difference"] = {"row": differ[0], "token": next((j for j, (x, y) in enumerate(zip(a, b))
                                                                           if x != y), min(len(a), len(b)))}
        result["runs"][mode] = figures
        print(f"  {mode:>6}: {describe(figures)}  ratio {figures['ratio']:.3f}x  tokens identical: {not differ}"
              + (f" ({len(differ)} rows differ; first: {figures['first_difference']})" if differ else ""))
    return result


def describe(r: dict[str, Any]) -> str:
    return (f"{r['tok_s']:8.1f} output tok/s  {r['seconds']:7.1f} s  {r['steps']:5d} steps  "
            f"{r['tokens_per_step']:6.2f} tok/step  drafted {r['drafted']:6d}  accepted {r['accepted']:6d} ({r['acceptance']:.0%})")


def bench_engine(model: Path, device: str, settings: dict[str, Any], seed: int):
    """An engine of `model`, warmed up (one-off costs out of the first timed run)."""
    from cbatch.bench.trial import warm_up

    engine = build_engine(EngineConfig(model=str(model), device=device, **settings))
    warm_up(engine, seed)
    return engine


def release(engine) -> None:
    """Frees an engine's memory (its KV pool takes most of a GPU's) before the next one is built."""
    engine.close()
    del engine
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def into_vocab(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """Token ids of another tokenizer as ids of a vocabulary of `vocab` (the same id where it fits: repeats stay
    repeats)."""
    return [[t % vocab for t in p] for p in prompts]


def copying_checkpoint(source: Path, target: Path, tokens: set[int]) -> Path:
    """A variant of a random-weight checkpoint whose greedy text loops over `tokens`: attention outputs x 0.02 (the
    next token is nearly a function of the current one) and the output rows of every other token zeroed (the argmax
    stays among `tokens`: a function on a few hundred tokens soon cycles). A `target` that holds a checkpoint already
    is kept (a warm machine: the same prompts, the same variant)."""
    import torch
    from safetensors.torch import load_file, save_file

    if (target / "config.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, target / f.name)
    files = sorted(source.glob("*.safetensors"))
    weights = {k: v for f in files for k, v in load_file(f).items()}
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"  # (tied: the embedding)
    others = torch.ones(weights[head].shape[0], dtype=torch.bool)
    others[sorted(tokens)] = False
    weights[head][others] = 0
    for key in [k for k in weights if k.endswith("o_proj.weight")]:
        weights[key] = weights[key] * 0.02
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    if (source / "model.safetensors.index.json").is_file():
        (target / "model.safetensors.index.json").unlink(missing_ok=True)
    return target


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main() -> None:
    from peer_engines import parse_setting  # benchmarks/ is this script's folder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="copy-heavy rows")
    parser.add_argument("--max-tokens", type=int, default=160, help="copy-heavy rows' max_tokens (greedy)")
    parser.add_argument("--random-rows", type=int, default=64)
    parser.add_argument("--random-prompt", type=span, default=(100, 1024), help="random prompts' lengths A:B")
    parser.add_argument("--random-output", type=span, default=(100, 1024), help="random outputs' lengths A:B")
    parser.add_argument("--random-temperature", type=float, default=0.6, help="nano-vllm's 0.6; 0: greedy")
    parser.add_argument("--mode", default="auto", help="the speculative modes compared with off, comma-separated")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer", type=Path, default=None, help="the copy-heavy prompts' tokenizer (default: "
                        "the model's, else $CBATCH_TEST_TOKENIZER_DIR's, else SmolLM2's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ignore-eos", action="store_true", help="copy-heavy rows generate max_tokens (random models)")
    parser.add_argument("--copying-model", type=Path, default=None, help="write the looping variant of --model "
                        "here and run the copy-heavy workload on it first")
    parser.add_argument("--engine-arg", action="append", default=[], type=parse_setting, metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path, default=None, help="the figures, rewritten after every workload")
    args = parser.parse_args()

    if args.device == "cpu":
        print(cpu_description())
    model = args.model or default_model_dir()
    modes = args.mode.split(",")
    settings = {"dtype": args.dtype, **dict(args.engine_arg)}
    if args.max_num_seqs is not None:
        settings["max_num_seqs"] = args.max_num_seqs
    tokenizer = load_tokenizer(prompt_tokenizer(model, args.tokenizer))
    copy_prompts = copy_heavy_prompts(tokenizer, args.rows, args.seed)
    copy_params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)] * len(copy_prompts)
    report: dict[str, Any] = {"model": str(model), "device": args.device, "settings": settings, "workloads": []}
    failed = False

    def record(result: dict[str, Any]) -> None:
        nonlocal failed
        report["workloads"].append(result)
        failed |= not all(r.get("identical", True) for r in result["runs"].values())
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1))

    if args.copying_model is not None:
        from cbatch.model.spec import parse_spec, read_config

        vocab = parse_spec(read_config(model)).vocab_size
        prompts = into_vocab(copy_prompts, vocab)
        copying = copying_checkpoint(model, args.copying_model, {t for p in prompts for t in p})
        engine = bench_engine(copying, args.device, settings, args.seed)
        record(compare("copy-heavy, copying model", engine, prompts, copy_params, modes))
        release(engine)
    engine = bench_engine(model, args.device, settings, args.seed)
    vocab = engine.spec.vocab_size
    record(compare("copy-heavy", engine, into_vocab(copy_prompts, vocab), copy_params, modes))
    prompts, params = random_workload(args.random_rows, args.seed, args.random_prompt, args.random_output, vocab,
                                      args.random_temperature)
    record(compare("random", engine, prompts, params, modes))
    release(engine)
    if failed:
        raise SystemExit("speculation changed tokens (a bug where the engine is batch-invariant: please report it)")


def prompt_tokenizer(model: Path, given: Path | None) -> Path:
    """Where the copy-heavy prompts' tokenizer is: --tokenizer, the model's own, the GPU kit's carried one, SmolLM2."""
    if given is not None:
        return given
    if (model / "tokenizer.json").is_file():
        return model
    carried = os.environ.get("CBATCH_TEST_TOKENIZER_DIR")
    if carried and (Path(carried) / "tokenizer.json").is_file():
        return Path(carried)
    return default_model_dir()


if __name__ == "__main__":
    main()
