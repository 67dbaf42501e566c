"""Rows with images on CPU: cbatch's engine against transformers' batched `generate` (left-padded batches, its batch
size tuned on a sample first), on the same random Qwen2.5-VL, rows, images and threads, in the same run. Prints
images/s and output tok/s of each and their ratio, and checks that the two agree on a sample's greedy tokens.

    PYTHONPATH=$PWD python benchmarks/vision_bench.py               # 200 rows, one image each, 56..448 pixel sides
    PYTHONPATH=$PWD python benchmarks/vision_bench.py --rows 16     # a quick check of the script

Both sides get the images preprocessed by the same PIL processor (cbatch: inside its timing, as a job reads them;
transformers: before, so its figure flatters it). Each row decodes its own number of tokens, drawn from
`--max-tokens A:B` (ignore_eos), as captions and answers differ in length: cbatch stops a row at its length;
transformers' `generate` runs a batch to its longest row and keeps each row's first tokens (its batches are sorted
by prompt length, which helps it). Both count the same output tokens. The model: tests/vision_models.py's tokenizer and template with wider shapes
(`--hidden`, `--layers`), random weights: no download. Timings on a shared machine are noisy: the ratio of the
two in one run is the figure.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import vision_models  # noqa: E402
from vision_models import IMAGE_TOKEN, hf_model, make_vl_checkpoint, png_bytes  # noqa: E402


def rows_of(count: int, seed: int, sides: tuple[int, int], lengths: tuple[int, int]) -> list[tuple[bytes, str, int]]:
    """(PNG bytes, question, output tokens) per row: image sides in `sides` pixels (multiples of 28), 4..24 words."""
    rng = random.Random(seed)
    side = lambda: rng.randrange(sides[0], sides[1] + 1, 28)  # noqa: E731
    return [(png_bytes(side(), side(), seed=i), " ".join(rng.choice(vision_models.WORDS) for _ in range(rng.randint(4, 24))),
             rng.randint(*lengths)) for i in range(count)]


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def run_cbatch(path: Path, rows) -> tuple[float, list[list[int]]]:
    """Seconds to read, preprocess and generate every row (all queued at once), and the completions."""
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.io.images import ImageReader, expand_placeholders
    from cbatch.tokenizer import encode_messages

    engine = build_engine(EngineConfig(model=str(path), device="cpu"))
    start = time.perf_counter()
    reader = ImageReader(path, engine.spec.vision)
    seqs = []
    for i, (image, question, length) in enumerate(rows):
        prompt = reader.read(image, f"row {i}")
        ids = encode_messages(engine.tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}])
        params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
        seqs.append(engine.add_request(expand_placeholders(ids, [prompt], engine.spec.vision), params,
                                       images=[prompt]))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, [seq.output_ids for seq in seqs]


def hf_inputs(path: Path, rows):
    """Each row's (prompt ids, PromptImage), preprocessed outside the timing."""
    from cbatch.io.images import ImageReader, expand_placeholders
    from cbatch.model.loader import read_checkpoint
    from cbatch.tokenizer import encode_messages, load_tokenizer

    vision = read_checkpoint(path).spec.vision
    reader, tokenizer = ImageReader(path, vision), load_tokenizer(path)
    out = []
    for i, (image, question, length) in enumerate(rows):
        prompt = reader.read(image, f"row {i}")
        ids = encode_messages(tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}])
        out.append((expand_placeholders(ids, [prompt], vision), prompt, length))
    return out


def run_hf(path: Path, inputs, batch_size: int) -> tuple[float, list[list[int]]]:
    """Seconds for transformers' `generate` over `inputs` in left-padded batches (sorted by length), each batch to
    its longest row's length; completions cut to each row's length."""
    model = hf_model(path)
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
                                 pixel_values=torch.from_numpy(np.concatenate([im.pixels for _, im, _ in batch])),
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
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-sizes", default="4,16,64", help="transformers' batch sizes tried on a sample")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cbatch-vision-bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from cbatch.model.cpu_features import cpu_description

    print(cpu_description())
    heads = max(4, args.hidden // 64)
    half = args.hidden // heads // 2  # rotary pairs per head, split 2:3:3 over (temporal, height, width) as Qwen's
    vision_models.TEXT.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                              num_attention_heads=heads, num_key_value_heads=2,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                               "mrope_section": [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]})
    vision_models.VISION["qwen2_5_vl"].update(out_hidden_size=args.hidden)
    path = make_vl_checkpoint("qwen2_5_vl", args.model_dir)
    rows = rows_of(args.rows, 0, args.image_sides, args.max_tokens)
    inputs = hf_inputs(path, rows)
    sample = inputs[: min(len(inputs), 32)]
    tuned = {b: run_hf(path, sample, b)[0] for b in map(int, args.batch_sizes.split(","))}
    best = min(tuned, key=tuned.get)
    hf_seconds, hf_out = run_hf(path, inputs, best)
    ours_seconds, ours_out = run_cbatch(path, rows)
    checked = min(16, len(rows))
    agree = sum(a == b for a, b in zip(ours_out[:checked], hf_out[:checked]))
    images, tokens = len(rows), sum(length for _, _, length in rows)
    print(f"rows {images}, one image each ({sum(im.num_tokens for _, im, _ in inputs)} image tokens), {tokens} output "
          f"tokens ({args.max_tokens[0]}..{args.max_tokens[1]} a row), {args.threads} threads")
    print(f"cbatch:       {images / ours_seconds:8.2f} images/s  {tokens / ours_seconds:9.1f} output tok/s  (reads + "
          f"preprocesses its images inside the timing)")
    print(f"transformers: {images / hf_seconds:8.2f} images/s  {tokens / hf_seconds:9.1f} output tok/s  (batch {best}, "
          f"tuned over {sorted(tuned)})")
    print(f"ratio {hf_seconds / ours_seconds:.2f}x; greedy tokens equal on {agree}/{checked} sampled rows "
          "(batched padding moves transformers' float32 sums a little)")


if __name__ == "__main__":
    main()
