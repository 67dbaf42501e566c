"""Rows with images on CPU: cbatch's engine against transformers' batched `generate` (left-padded batches, its batch
size tuned on a sample first), on the same random Qwen2.5-VL, rows, images and threads, in the same run. Prints
images/s and output tok/s of each and their ratio, and checks cbatch's greedy tokens against transformers' unbatched
`generate` on a few rows. After transformers' batch size is tuned, the two sides run alternated `--repeats` times
(this shared VM's speed drifts over minutes): the median of the pairs' ratios is the figure.

    PYTHONPATH=$PWD python benchmarks/vision_bench.py                 # 200 rows, one image each, 56..448 pixel sides
    PYTHONPATH=$PWD python benchmarks/vision_bench.py --shape toy     # the first, per-step-bound shape
    PYTHONPATH=$PWD python benchmarks/vision_bench.py --rows 16 --shape toy --batch-sizes 8   # a quick check
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHONPATH=$PWD \
        python benchmarks/vision_bench.py       # both sides as on an AVX2 CPU (MKL's cap: transformers' matmuls)

Both sides preprocess the images with the same PIL processor inside their timing: cbatch on the job's image threads
while it steps (as `cbatch run` does), transformers before its batches (as a script around `generate` does). Each
row decodes its own number of tokens, drawn from `--max-tokens A:B` (no EOS before it: min_tokens, transformers'
min_new_tokens), as captions and answers differ in length: cbatch stops a row at its length; transformers'
`generate` runs a batch to its longest row and keeps each row's first tokens (its batches are sorted by prompt
length, which helps it). Both count the same output tokens. The model: tests/vision_models.py's tokenizer and
template with the shape `--shape` names, random weights: no download. Timings on a shared machine are noisy: the
ratio of the two in one run is the figure.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import vision_models  # noqa: E402
from vision_models import IMAGE_TOKEN, hf_model, make_vl_checkpoint, png_bytes  # noqa: E402


def _mrope(head_dim: int) -> dict:
    """Qwen's rotary with its (temporal, height, width) split 2:3:3 of a head's rotary pairs."""
    half = head_dim // 2
    return {"rope_type": "default", "rope_theta": 1e6,
            "mrope_section": [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]}


# The random model's shapes. `small`: SmolLM2-135M's decoder (the project's CPU reference model) with a tower of
# ~1/10 of its parameters (Qwen2.5-VL-7B's tower is ~1/10 of its decoder), 112-pixel windows as Qwen2.5-VL's.
# `toy`: the shape this script had first (a 4-layer, 256-wide decoder, the tests' 3-block 32-wide tower), where both
# sides are bound by per-step costs.
SHAPES = {
    "small": {"about": "decoder 576 wide x 30 layers (SmolLM2-135M), tower 384 wide x 8 blocks",
              "text": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, rope_parameters=_mrope(64)),
              "vision": dict(depth=8, hidden_size=384, num_heads=6, intermediate_size=1024, out_hidden_size=576,
                             window_size=112, fullatt_block_indexes=[3, 7])},
    "toy": {"about": "decoder 256 wide x 4 layers, tower 32 wide x 3 blocks",
            "text": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, rope_parameters=_mrope(64)),
            "vision": dict(out_hidden_size=256)},
}


def rows_of(count: int, seed: int, sides: tuple[int, int], lengths: tuple[int, int]) -> list[tuple[bytes, str, int]]:
    """(PNG bytes, question, output tokens) per row: image sides in `sides` pixels (multiples of 28), 4..24 words."""
    rng = random.Random(seed)
    side = lambda: rng.randrange(sides[0], sides[1] + 1, 28)  # noqa: E731
    return [(png_bytes(side(), side(), seed=i), " ".join(rng.choice(vision_models.WORDS) for _ in range(rng.randint(4, 24))),
             rng.randint(*lengths)) for i in range(count)]


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def run_cbatch(path: Path, rows, dtype: str) -> tuple[float, list[list[int]]]:
    """Seconds to read, preprocess and generate every row, and the completions. As in `cbatch run`, the images are
    read and preprocessed on the job's image threads (`image_pool`) while the engine steps: a row joins the engine
    once its image is ready, in input order."""
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.io.images import ImageReader, expand_placeholders, image_pool

    engine = build_engine(EngineConfig(model=str(path), device="cpu", dtype=dtype))
    start = time.perf_counter()
    reader = ImageReader(path, engine.spec.vision)
    futures = [image_pool().submit(reader.read, image, f"row {i}") for i, (image, _, _) in enumerate(rows)]
    seqs = []
    while len(seqs) < len(rows) or engine.has_unfinished():
        while len(seqs) < len(rows) and (futures[len(seqs)].done() or not engine.has_unfinished()):
            _, question, length = rows[len(seqs)]
            prompt = futures[len(seqs)].result()
            params = SamplingParams(max_tokens=length, min_tokens=length, temperature=0.0)  # (as `min_new_tokens`)
            seqs.append(engine.add_request(prompt_ids(engine.tokenizer, question, prompt, engine.spec.vision), params,
                                           images=[prompt]))
        if engine.has_unfinished():
            engine.step()
    return time.perf_counter() - start, [seq.output_ids for seq in seqs]


def prompt_ids(tokenizer, question: str, image, vision) -> list[int]:
    """A row's chat prompt (its image, then its question) with the image's placeholder run."""
    from cbatch.io.images import expand_placeholders
    from cbatch.tokenizer import encode_messages

    ids = encode_messages(tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}])
    return expand_placeholders(ids, [image], vision)


def hf_inputs(path: Path, rows) -> tuple[float, list]:
    """Seconds to preprocess every row for transformers (the same PIL processor, one image after another, as a
    script around `generate` does), and each row's (prompt ids, PromptImage, output tokens)."""
    from cbatch.io.images import ImageReader
    from cbatch.model.loader import read_checkpoint
    from cbatch.tokenizer import load_tokenizer

    vision = read_checkpoint(path).spec.vision
    reader, tokenizer = ImageReader(path, vision), load_tokenizer(path)
    start = time.perf_counter()
    out = []
    for i, (image, question, length) in enumerate(rows):
        prompt = reader.read(image, f"row {i}")
        out.append((prompt_ids(tokenizer, question, prompt, vision), prompt, length))
    return time.perf_counter() - start, out


def run_hf(path: Path, inputs, batch_size: int, dtype: str) -> tuple[float, list[list[int]]]:
    """Seconds for transformers' `generate` over `inputs` in left-padded batches (sorted by length), each batch to
    its longest row's length; completions cut to each row's length."""
    model = hf_model(path).to(getattr(torch, dtype))
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i][0]))
    outputs: list[list[int]] = [[] for _ in inputs]
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        batch = [inputs[i] for i in order[first : first + batch_size]]
        width = max(len(ids) for ids, _, _ in batch)
        max_tokens = max(length for _, _, length in batch)
        ids = torch.tensor([[0] * (width - len(x)) + x for x, _, _ in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _, _ in batch])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0,
                                 pixel_values=torch.from_numpy(np.concatenate([im.pixels for _, im, _ in batch])).to(model.dtype),
                                 image_grid_thw=torch.tensor([im.grid for _, im, _ in batch]),
                                 mm_token_type_ids=(ids == IMAGE_TOKEN).int())
        for j, i in enumerate(order[first : first + batch_size]):
            outputs[i] = out[j, width : width + inputs[i][2]].tolist()
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=span, default=(16, 96), help="each row's output tokens, drawn from A:B")
    parser.add_argument("--image-sides", type=span, default=(56, 448), help="image sides in pixels, drawn from A:B")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small",
                        help="the random model's shape: " + "; ".join(f"{k}: {v['about']}" for k, v in SHAPES.items()))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both sides' weights and activations (float32: cbatch's CPU default, token-exact)")
    parser.add_argument("--batch-sizes", default="8,32,64", help="transformers' batch sizes tried on a 64-row sample (then all rows at once too)")
    parser.add_argument("--repeats", type=int, default=3, help="transformers' best batch size and cbatch, alternated")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the checkpoint is written "
                        "(default /tmp/cbatch-vision-bench-SHAPE)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from cbatch.model.cpu_features import cpu_description

    print(cpu_description())
    shape = SHAPES[args.shape]
    vision_models.TEXT.update(shape["text"])
    vision_models.VISION["qwen2_5_vl"].update(shape["vision"])
    print(f"model: random Qwen2.5-VL, {args.shape} shape ({shape['about']})")
    path = make_vl_checkpoint("qwen2_5_vl", args.model_dir or Path(f"/tmp/cbatch-vision-bench-{args.shape}"))
    rows = rows_of(args.rows, 0, args.image_sides, args.max_tokens)
    prep_seconds, inputs = hf_inputs(path, rows)
    sample = inputs[: min(len(inputs), 64)]
    tuned = {}
    for size in map(int, args.batch_sizes.split(",")):
        tuned[size] = run_hf(path, sample, size, args.dtype)[0]
        print(f"transformers, batch {size}: {len(sample) / tuned[size]:.2f} images/s on {len(sample)} rows", flush=True)
    best = min(tuned, key=tuned.get)
    runs = {size: run_hf(path, inputs, size, args.dtype) for size in sorted({best, len(inputs)})}  # (all rows in one batch too)
    for size, (seconds, _) in runs.items():
        print(f"transformers, batch {size}: {len(inputs) / (prep_seconds + seconds):.2f} images/s on {len(inputs)} rows",
              flush=True)
    best = min(runs, key=lambda size: runs[size][0])
    # then the two sides alternated: this shared VM's speed drifts over minutes, so each pair's ratio is a figure
    # and their median the one to quote
    pairs = []
    for repeat in range(args.repeats):
        hf_seconds = prep_seconds + (runs[best][0] if repeat == 0 else run_hf(path, inputs, best, args.dtype)[0])
        ours_seconds, ours_out = run_cbatch(path, rows, args.dtype)
        pairs.append((hf_seconds, ours_seconds))
        print(f"pair {repeat + 1}: transformers {hf_seconds:.1f} s, cbatch {ours_seconds:.1f} s, "
              f"ratio {hf_seconds / ours_seconds:.2f}x", flush=True)
    hf_seconds, ours_seconds = (statistics.median(side) for side in zip(*pairs))
    checked = min(8, len(rows))  # transformers one row at a time (no padding): the reference cbatch must equal
    agree = sum(ours_out[i] == run_hf(path, inputs[i : i + 1], 1, args.dtype)[1][0] for i in range(checked))
    images, tokens = len(rows), sum(length for _, _, length in rows)
    print(f"rows {images}, one image each ({sum(len(ids) for ids, _, _ in inputs)} prompt tokens, of them "
          f"{sum(im.num_tokens for _, im, _ in inputs)} image tokens), {tokens} output "
          f"tokens ({args.max_tokens[0]}..{args.max_tokens[1]} a row), {args.threads} threads, {args.dtype}")
    print(f"cbatch:       {images / ours_seconds:8.2f} images/s  {tokens / ours_seconds:9.1f} output tok/s  (reads + "
          f"preprocesses its images on the job's image threads while it steps; median of {len(pairs)})")
    print(f"transformers: {images / hf_seconds:8.2f} images/s  {tokens / hf_seconds:9.1f} output tok/s  (batch {best}; "
          f"sizes {sorted(tuned)} tried on {len(sample)} rows; preprocessing {prep_seconds:.1f} s before it)")
    print(f"ratio {statistics.median(hf / ours for hf, ours in pairs):.2f}x (median of the pairs'); greedy tokens "
          f"equal to transformers' unbatched `generate` on {agree}/{checked} rows")


if __name__ == "__main__":
    main()
