"""Embedding throughput on CPU: cbatch's prefill-only engine (length-aware packing: rows of any length share a
step's token budget, no padding) against sentence-transformers' `encode` (padded batches, sorted by length as
it does by default, the batch size tuned for it on a sample first), on the same model, rows and threads, in the
same run. Prints rows/s of each, their ratio, and the cosine between the two on a sample.

    PYTHONPATH=$PWD python benchmarks/embed_bench.py                 # 10,000 rows of 16..512 tokens
    PYTHONPATH=$PWD python benchmarks/embed_bench.py --rows 400      # a quick run

The model: a random Qwen3 decoder saved as a sentence-transformers model (last-token pooling + Normalize, the
Qwen3-Embedding layout) with the tests' word-level tokenizer (tests/embed_models.py): no download. Timings
on a shared machine are noisy: the ratio of the two, taken in one run (alternated, medians), is the figure;
absolute rows/s need a quiet machine. On an oversubscribed machine (load above the core count) multi-threaded
runs penalize cbatch's many smaller ops (one OpenMP barrier each) far more than encode's few large ones:
compare with --threads 1 there, and with the machine's threads on a quiet one.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from embed_models import WORDS, make_st_embedding  # noqa: E402


def texts_of(rows: int, lo: int, hi: int, seed: int) -> list[str]:
    """`rows` texts of lo..hi tokens (uniform; the tokenizer appends EOS to the words)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi) - 1)) for _ in range(rows)]


def run_cbatch(model: Path, texts: list[str], max_num_seqs: int, budget: int) -> tuple[float, torch.Tensor]:
    """Seconds to tokenize and embed `texts` through the engine (all queued, longest-first admission)."""
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.pooling import PoolingParams

    engine = build_engine(EngineConfig(model=str(model), device="cpu", max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=budget, enable_prefix_cache=False))
    pooling, params = PoolingParams("embed", "last", normalize=True), SamplingParams()
    start = time.perf_counter()
    seqs = [engine.add_request(engine.tokenizer.encode(t), params, seq_id=i, pooling=pooling) for i, t in enumerate(texts)]
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    return seconds, torch.stack([s.pooled for s in seqs])


def run_st(st, texts: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = st.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    return time.perf_counter() - start, out.float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs of each; medians reported")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048, help="cbatch's --max-num-batched-tokens")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/cbatch-embed-bench"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    import embed_models

    embed_models.EMBED_BASE.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                                   num_key_value_heads=max(1, args.hidden // 128), head_dim=32,
                                   max_position_embeddings=max(1024, args.max_tokens + 8), initializer_range=0.02)
    model = args.model_dir / f"h{args.hidden}-l{args.layers}"
    if not (model / "modules.json").is_file():
        make_st_embedding(model, "lasttoken")
    texts = texts_of(args.rows, args.min_tokens, args.max_tokens, seed=0)
    st = SentenceTransformer(str(model), device="cpu")
    st.max_seq_length = args.max_tokens + 8
    sample = texts[: min(len(texts), 512)]
    tuned = {bs: run_st(st, sample, bs)[0] for bs in (8, 16, 32, 64, 128)}
    batch_size = min(tuned, key=tuned.get)
    print(f"sentence-transformers batch size tuned on {len(sample)} rows: {batch_size} "
          f"({', '.join(f'{bs}: {s:.2f}s' for bs, s in tuned.items())})")
    st_times, cb_times = [], []
    for _ in range(args.repeats):  # alternated, so both see the same machine; medians
        st_seconds, st_out = run_st(st, texts, batch_size)
        cb_seconds, cb_out = run_cbatch(model, texts, args.max_num_seqs, args.budget)
        st_times.append(st_seconds)
        cb_times.append(cb_seconds)
    st_seconds, cb_seconds = statistics.median(st_times), statistics.median(cb_times)
    cosine = torch.nn.functional.cosine_similarity(cb_out, st_out, dim=1).min().item()
    tokens = sum(len(t.split()) + 1 for t in texts)
    print(f"{args.rows} rows, {tokens} tokens ({args.min_tokens}..{args.max_tokens} per row), hidden {args.hidden}, "
          f"{args.layers} layers, {torch.get_num_threads()} threads")
    print(f"sentence-transformers encode: {args.rows / st_seconds:8.1f} rows/s  ({st_seconds:.1f}s)")
    print(f"cbatch (prefill-only engine): {args.rows / cb_seconds:8.1f} rows/s  ({cb_seconds:.1f}s)")
    print(f"ratio cbatch / sentence-transformers: {st_seconds / cb_seconds:.2f}x (medians of {args.repeats}; "
          f"ratios per pair: {', '.join(f'{s / c:.2f}' for s, c in zip(st_times, cb_times))})   min cosine {cosine:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
