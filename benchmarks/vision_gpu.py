"""The GPU kit's `vision` part: an OCR-shaped workload (each row one page image of ~1,000-1,400 visual tokens and a
short question, ~1,000 output tokens, ignore_eos) on a random-weight Qwen2.5-VL-7B shape, built from its config on
the device (no download, no checkpoint on disk), for cbatch or HF transformers (one engine per process: each takes
the GPU's memory). Prints images/s and output tok/s and writes them to --json.

    python benchmarks/vision_gpu.py --engine cbatch --json OUT/vision_cbatch.json
    python benchmarks/vision_gpu.py --engine hf --deadline 160 --json OUT/vision_hf.json \
        --against OUT/vision_cbatch.json
    python benchmarks/vision_gpu.py --cpu-dry-run --engine cbatch ...     tiny shapes on the CPU (the kit's dry run)

Both engines get the same rows and the same images, preprocessed by the same PIL processor before the timing (a
job overlaps it with the GPU on worker threads; its CPU rate is printed apart). cbatch's run also times its vision
tower alone on 8 pages, with the flash varlen attention and with SDPA per segment length. transformers runs one
left-padded batched `generate` of --hf-rows rows (its `max_time` holds it inside --deadline: the tokens it made by
then are its figure).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Qwen2.5-VL-7B-Instruct's config.json shapes (text decoder and vision tower)
QWEN25_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                     tie_word_embeddings=False),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_channels=3, tokens_per_second=2),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False,
)
# the dry run's: tiny, on CPU
TINY = dict(
    text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1,
                     eos_token_id=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
                     tie_word_embeddings=False),
    vision_config=dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, window_size=56,
                       fullatt_block_indexes=[1]),
    image_token_id=8, video_token_id=9, vision_start_token_id=6, vision_end_token_id=7, tie_word_embeddings=False,
)


def shapes(args) -> dict:
    return TINY if args.cpu_dry_run else QWEN25_VL_7B


def hf_config(tiny: bool):
    import transformers

    given = TINY if tiny else QWEN25_VL_7B
    config = transformers.Qwen2_5_VLConfig(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in given.items()})
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def pages(rows: int, tiny: bool, seed: int = 0):
    """One random RGB page per row: 980-1,176 x 756-924 pixels (multiples of 28: 945-1,386 visual tokens each);
    the dry run's 56-112 pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sides = ([56, 84, 112], [56, 84]) if tiny else (range(980, 1177, 28), range(756, 925, 28))
    shapes = [(int(rng.choice(sides[0])), int(rng.choice(sides[1])), 3) for _ in range(rows)]
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in shapes]


def requests(vision, vision_end: int, images, question_len: int, seed: int = 1):
    """(prompt ids with each image's placeholders expanded, its PromptImage) per row, and the preprocessing's
    seconds: vision start, the page's placeholder run, vision end, then a random question."""
    from cbatch.io.images import ImageReader, expand_placeholders

    reader = ImageReader(None, vision)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    out = []
    for i, image in enumerate(images):
        page = reader.read(image, f"page {i}")
        question = rng.integers(100, 300 if vision.image_token_id < 100 else 150000, question_len).tolist()
        ids = [vision.vision_start_token_id, vision.image_token_id, vision_end, *question]
        out.append((expand_placeholders(ids, [page], vision), page))
    return out, time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_cbatch(args, device: torch.device, dtype: torch.dtype) -> dict:
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.resolve import resolve_model
    from cbatch.model.spec import parse_spec

    spec = parse_spec(hf_config(args.cpu_dry_run).to_dict())
    t0 = time.perf_counter()
    config = EngineConfig(device=device.type, dtype=str(dtype).removeprefix("torch."), max_model_len=args.max_model_len,
                          **({"attention_backend": "triton"} if args.cpu_dry_run else {}))
    engine = build_engine(config, resolve_model(config, spec=spec))
    startup = time.perf_counter() - t0
    rows, prep = requests(spec.vision, shapes(args)["vision_end_token_id"], pages(args.rows, args.cpu_dry_run),
                          args.question_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    tower_pages = [(page.pixels, page.grid) for _, page in rows[:8]]  # (the engine releases a page's pixels once encoded)
    sync(device)
    start = time.perf_counter()
    seqs = [engine.add_request(ids, params, images=[page]) for ids, page in rows]
    assert not any(seq.error for seq in seqs), [seq.error for seq in seqs if seq.error][:1]
    while engine.has_unfinished():
        engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(seq.output_ids) for seq in seqs)
    result = dict(engine="cbatch", rows=len(rows), image_tokens=sum(p.num_tokens for _, p in rows),
                  output_tokens=tokens, seconds=seconds, images_per_s=len(rows) / seconds,
                  output_tok_per_s=tokens / seconds, startup_s=startup, preprocess_images_per_s=len(rows) / prep,
                  tower=tower_rates(engine.runner.model.visual, tower_pages, device))
    engine.close()
    return result


def tower_rates(visual, pages: list[tuple[np.ndarray, tuple[int, int, int]]], device: torch.device) -> dict:
    """Pages per second through the vision tower alone (the pages' (patches, grid) in one call), with the flash
    varlen kernel where it runs and with SDPA per segment length."""
    import cbatch.model.vision as vision

    pixels = torch.from_numpy(np.concatenate([patches for patches, _ in pages])).to(device)
    grids = [grid for _, grid in pages]
    rates = {}
    for name, flash in (("flash_varlen", True), ("sdpa_per_length", False)):
        if flash and (device.type != "cuda" or vision._flash_varlen() is None):
            continue
        found = vision._flash_varlen
        vision._flash_varlen = found if flash else (lambda: None)
        try:
            visual(pixels, grids)  # warm-up
            sync(device)
            start, calls = time.perf_counter(), 3
            for _ in range(calls):
                visual(pixels, grids)
            sync(device)
            rates[name] = calls * len(pages) / (time.perf_counter() - start)
        finally:
            vision._flash_varlen = found
    return rates


def run_hf(args, device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    from cbatch.model.spec import parse_spec

    t_begin = time.perf_counter()
    config = hf_config(args.cpu_dry_run)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype,
                                                                            attn_implementation="sdpa").eval()
    startup = time.perf_counter() - t_begin
    vision = parse_spec(config.to_dict()).vision
    rows, prep = requests(vision, shapes(args)["vision_end_token_id"], pages(args.rows, args.cpu_dry_run),
                          args.question_len)
    rows = rows[: args.hf_rows]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([[0] * (width - len(x)) + x for x, _ in rows], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _ in rows], device=device)
    pixels = torch.from_numpy(np.concatenate([im.pixels for _, im in rows])).to(device, dtype)
    grids = torch.tensor([im.grid for _, im in rows], device=device)
    left = args.deadline - (time.perf_counter() - t_begin) - 10  # the rest of the step's budget, less a margin
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                             mm_token_type_ids=(ids == vision.image_token_id).int(), max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, do_sample=False, pad_token_id=0, max_time=max(left, 1.0))
    sync(device)
    seconds = time.perf_counter() - start
    made = out.shape[1] - width
    tokens = made * len(rows)
    return dict(engine="hf", rows=len(rows), image_tokens=sum(p.num_tokens for _, p in rows), output_tokens=tokens,
                seconds=seconds, images_per_s=len(rows) / seconds if made == args.output_len else None,
                output_tok_per_s=tokens / seconds, startup_s=startup, preprocess_images_per_s=len(rows) / prep,
                finished=made == args.output_len, tokens_per_row=made)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("cbatch", "hf"), required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hf-rows", type=int, default=16, help="transformers' rows: one batched generate")
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--deadline", type=float, default=160.0, help="hf: seconds this process may take in all")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--against", type=Path, help="hf: cbatch's JSON, for the ratio")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes, a few rows and tokens, on the CPU")
    args = parser.parse_args()
    if args.cpu_dry_run:
        args.rows, args.hf_rows, args.output_len, args.question_len = min(args.rows, 3), min(args.hf_rows, 2), 4, 5
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    result = (run_cbatch if args.engine == "cbatch" else run_hf)(args, device, dtype)
    shape = "tiny (dry run)" if args.cpu_dry_run else "Qwen2.5-VL-7B shape, random bf16 weights"
    print(f"{result['engine']}: {shape}; {result['rows']} rows, {result['image_tokens']} image tokens, "
          f"{result['output_tokens']} output tokens in {result['seconds']:.1f} s "
          f"(start-up {result['startup_s']:.1f} s)")
    images = f"{result['images_per_s']:.2f} images/s" if result["images_per_s"] is not None else \
        f"images/s n/a (max_time cut it at {result['tokens_per_row']} tokens a row)"
    print(f"{result['engine']}: {images}, {result['output_tok_per_s']:.1f} output tok/s; preprocessing "
          f"{result['preprocess_images_per_s']:.1f} images/s on one CPU thread")
    if result.get("tower"):
        print("cbatch vision tower alone (8 pages a call): " +
              ", ".join(f"{name} {rate:.1f} pages/s" for name, rate in result["tower"].items()))
    if args.against is not None and args.against.is_file():
        ours = json.loads(args.against.read_text())
        result["ratio_output_tok_per_s"] = ours["output_tok_per_s"] / result["output_tok_per_s"]
        print(f"ratio: cbatch {ours['output_tok_per_s']:.1f} / transformers {result['output_tok_per_s']:.1f} output "
              f"tok/s = {result['ratio_output_tok_per_s']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
