"""Gemma 3 with images (issue 48): a tiny random Gemma3ForConditionalGeneration with its SigLIP tower gives HF
`generate`'s greedy float32 tokens (one image, two, text rows beside image rows, images of several pixel sizes, an
image after text chunked across steps, a row preempted mid-prefill, a prefix-cache hit ending inside an image); the
image tokens attend to each other both ways (HF's causal output differs), so a chunk never ends inside an image; two
tensor-parallel ranks give one rank's tokens. Pan-and-scan: a wide or tall image's crops, each an image of its own,
give transformers' processor's prompt ids and pixels and `generate`'s tokens; `cbatch plan` counts them from the
header as the run does."""
from __future__ import annotations

import json
import shutil

import pytest

from cbatch.config import SamplingParams
from gemma3_vision_models import BOI, BOS, EOI, IMAGE, TOKENS_PER_IMAGE, hf_gemma3_greedy, make_gemma3_checkpoint
from helpers import make_engine
from vision_models import png_bytes, read_test_images, run_requests

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SIZES = [(56, 84), (28, 28), (112, 56)]  # pixels (every image is resized to 42 x 42: 9 tokens each)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_vision") / "model")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def images(gemma3):
    """SIZES' images through the model's PIL processor, and a second image of SIZES[0]'s size."""
    return read_test_images(gemma3, SIZES)


def prompt(images, words: list[int], tail: int = 3) -> list[int]:
    """BOS, words, then each image's run as the processor expands it (boi, soft tokens, eoi) and a word, then text."""
    ids = [BOS, *words]
    for i, image in enumerate(images):
        ids += [BOI, *[IMAGE] * image.num_tokens, EOI, 40 + i]
    return ids + list(range(100, 100 + tail))


def run(engine, requests):
    return run_requests(engine, requests, GREEDY)


def references(path, requests) -> list[list[int]]:
    return [hf_gemma3_greedy(path, ids, imgs, GREEDY.max_tokens) for ids, imgs in requests]


def test_greedy_tokens_match_hf_one_image_two_and_text_rows(gemma3, images):
    requests = [(prompt(images[:1], [10, 11]), images[:1]),
                (prompt(images[:2], [12]), images[:2]),  # two images of different pixel sizes
                (prompt([images[2]], [13, 14, 15]), [images[2]]),
                (prompt([], [16, 17]), None)]  # a text row in the same batch
    outputs = run(make_engine(gemma3, max_model_len=256), requests)
    assert outputs == references(gemma3, requests)
    assert len(set(outputs[0])) > 2, "decisive: greedy output is not one repeated token"
    # the image decides (the same prompt with another image of the same size), and so does its bidirectional
    # attention: HF with every token causal gives other tokens
    twin = run(make_engine(gemma3, max_model_len=256), [(requests[0][0], [images[3]])])[0]
    assert twin != outputs[0]
    assert hf_gemma3_greedy(gemma3, *requests[1], GREEDY.max_tokens, bidirectional=False) != outputs[1]


def test_chunked_prefill_keeps_each_image_whole_under_preemption(gemma3, images):
    """A 12-token budget: a long text before an image is chunked across steps, but no chunk ends inside an image's
    9-token run (it stops before it); 12 blocks of 4 tokens cannot hold the rows at once, so prefills are preempted
    part-way (recomputed) and each image is encoded once."""
    requests = [(prompt([images[0]], list(range(20, 37)), tail=4), [images[0]]),
                (prompt(images[1:3], [37, 38]), images[1:3]),
                (prompt([images[2]], list(range(50, 60))), [images[2]])]
    engine = make_engine(gemma3, max_model_len=128, max_num_batched_tokens=12, num_kv_blocks=12, block_size=4,
                         enable_prefix_cache=False)
    seqs = [engine.add_request(ids, GREEDY, images=imgs) for ids, imgs in requests]
    # each row's image runs [start, end) (a finished row lets go of its images)
    runs = [[(start, start + TOKENS_PER_IMAGE) for start, _ in seq.images.runs] for seq in seqs]
    preempted_at: list[tuple[int, int]] = []  # (computed tokens, prompt length) of each preemption
    chunks: list[tuple[int, int, int]] = []  # (row, first token, tokens) of every prompt chunk
    preempt, schedule = engine.scheduler._preempt, engine.scheduler.schedule

    def noting(seq, plan):
        preempted_at.append((seq.num_computed, seq.prompt_len))
        preempt(seq, plan)

    def scheduling():
        plan = schedule()
        chunks.extend((seqs.index(seq), seq.num_computed, n) for seq, n in plan.scheduled
                      if seq in seqs and seq.num_computed < seq.prompt_len)
        return plan

    engine.scheduler._preempt, engine.scheduler.schedule = noting, scheduling
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_ids for seq in seqs] == references(gemma3, requests)
    assert any(0 < computed < prompt_len for computed, prompt_len in preempted_at), preempted_at
    assert any(n < 12 and first + n < len(requests[row][0]) for row, first, n in chunks)  # a chunk cut short
    for row, first, n in chunks:  # never ends inside a run
        assert not any(start < first + n < end for start, end in runs[row]), (row, first, n)
    assert engine.runner.images.images_encoded == 3


def test_a_prefix_cache_hit_may_end_inside_an_image(gemma3, images):
    """The second of two equal rows reuses whole blocks up to its last prompt token: the last one ends inside the
    image's run (its earlier tokens' KV already saw the whole image); the rest of the run attends both ways."""
    ids = prompt([images[1]], [60, 61, 62])  # the run is tokens 5..13; blocks of 4 end at 8 and 12, inside it
    engine = make_engine(gemma3, max_model_len=128, block_size=4, max_num_batched_tokens=16)
    first = run(engine, [(ids, [images[1]])])[0]
    again = run(engine, [(ids, [images[1]])])[0]
    assert first == again == references(gemma3, [(ids, [images[1]])])[0]
    hits = engine.scheduler.stats.prefix_cache_hit_tokens
    assert hits == 4 * ((len(ids) - 1) // 4) and 5 < hits < 5 + TOKENS_PER_IMAGE + len(ids) - 14


def test_a_budget_smaller_than_an_image_is_refused_in_one_sentence(gemma3, images):
    engine = make_engine(gemma3, max_model_len=128, max_num_batched_tokens=8)
    seq = engine.add_request(prompt(images[:1], [10]), GREEDY, images=images[:1])
    assert seq.error == ("an image of this Gemma3ForConditionalGeneration is 9 tokens, computed in one step, more "
                         "than --max-num-batched-tokens 8; raise it to at least 9")


def test_the_tower_matches_hfs_image_features(gemma3, images):
    """Every image of a step in one batched call gives transformers' projected embeddings of each."""
    import numpy as np
    import torch

    from cbatch.model.backend.registry import make_backend
    from cbatch.model.loader import load_model, read_checkpoint
    from gemma3_vision_models import hf_gemma3, pixel_values

    cpu = torch.device("cpu")
    model = load_model(read_checkpoint(gemma3), 64, cpu, torch.float32, make_backend("auto", cpu))
    ours = model.visual(torch.from_numpy(np.concatenate([image.patches() for image in images])),
                        [image.grid for image in images])
    with torch.no_grad():
        ref = hf_gemma3(gemma3).model.get_image_features(pixel_values(images)).pooler_output
    assert ours.shape == (len(images) * TOKENS_PER_IMAGE, 64)
    ref = ref.reshape(ours.shape)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()  # float32 rounding (conv vs matmul)


def test_the_placeholder_expands_as_hfs_processor_does(gemma3, images):
    """A chat template's one <start_of_image> per image -> "\\n\\n", boi, the image's soft tokens, eoi, "\\n\\n" (the
    newlines as the tokenizer encodes them), as Gemma3Processor expands it."""
    from cbatch.io.images import expand_placeholders
    from cbatch.model.loader import read_checkpoint

    class Newlines:  # a tokenizer that encodes "\n\n" as one token, 99
        def encode(self, text, add_special_tokens=True):
            assert text == "\n\n" and not add_special_tokens
            return [99]

    vision = read_checkpoint(gemma3).spec.vision
    got = expand_placeholders([BOS, 10, BOI, 11, BOI, 12], images[:2], vision, Newlines())
    run_ = [99, BOI, *[IMAGE] * TOKENS_PER_IMAGE, EOI, 99]
    assert got == [BOS, 10, *run_, 11, *run_, 12]


def test_rows_with_images_through_cbatch_run(gemma3, images, tmp_path):
    """`cbatch run` on chat rows: the template's <start_of_image> expanded to the image's run (HF's tokens for
    the expanded prompt), a text row beside, a bad image an error row naming it."""
    import base64

    from gemma3_vision_models import CHAT_TEMPLATE, SPECIALS
    from vision_models import make_tokenizer
    from ops_jobs import read_jsonl, run_inprocess, write_jsonl

    gemma3 = shutil.copytree(gemma3, tmp_path / "model")  # (the module's checkpoint stays without a tokenizer)
    tokenizer = make_tokenizer(gemma3, SPECIALS, CHAT_TEMPLATE)
    image = png_bytes(*SIZES[0], seed=0)  # images[0]'s bytes
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    chat = [{"role": "user", "content": [{"type": "text", "text": "w1 w2"}, {"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": "w3"}]}]
    rows = [{"id": "image", "messages": chat}, {"id": "text", "messages": [{"role": "user", "content": "w1 w2 w3"}]},
            {"id": "bad", "messages": [{"role": "user", "content": "w1"}], "images": ["data:image/png;base64,@@"]}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    code, _, _ = run_inprocess("run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model",
                               str(gemma3), "--device", "cpu", "--display", "none", "--quiet", "--max-tokens", "8")
    assert code == 1  # the bad image's row
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "w1 w2"},
                                                                       {"type": "image"}, {"type": "text", "text": "w3"}]}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    at = ids.index(BOI)
    expanded = ids[:at] + [BOI, *[IMAGE] * TOKENS_PER_IMAGE, EOI] + ids[at + 1 :]  # ("\n\n" is no token here)
    assert out["image"]["prompt_tokens"] == len(expanded) == out["text"]["prompt_tokens"] + 11
    assert out["image"]["completion"] == tokenizer.decode(hf_gemma3_greedy(gemma3, expanded, images[:1], 8),
                                                          skip_special_tokens=True)
    assert out["bad"]["finish_reason"] == "error" and out["bad"]["error"].startswith("`images[0]` (")
    # `cbatch plan` places the images as the run does: a step budget below one image refuses the image's row
    code, _, err = run_inprocess("plan", str(tmp_path / "in.jsonl"), "--model", str(gemma3), "--device", "cpu",
                                 "--max-tokens", "8", "--max-num-batched-tokens", "8", "--no-search",
                                 "--report", str(tmp_path / "plan.json"))
    assert code == 1, err
    assert {r["id"]: r["error"][:40] for r in json.loads((tmp_path / "plan.json").read_text())["errors"]} == {
        "image": "an image of this Gemma3ForConditionalGen", "bad": out["bad"]["error"][:40]}


def test_the_triton_backend_gives_hfs_tokens_with_images(gemma3, images):
    """The Triton paged-attention kernel takes the image runs' key ends in its own mask (under the Triton interpreter
    where there is no GPU)."""
    ids = prompt(images[:2], [12])
    engine = make_engine(gemma3, max_model_len=64, attention_backend="triton")
    seq = engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0.0), images=images[:2])
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == hf_gemma3_greedy(gemma3, ids, images[:2], 3)
    assert seq.output_ids != hf_gemma3_greedy(gemma3, ids, images[:2], 3, bidirectional=False)


def test_two_ranks_give_the_tokens_of_one(gemma3, images):
    """-tp 2 over gloo: each rank holds the SigLIP tower and projector and encodes a share of a step's images, rank 0
    broadcasts the step's embeddings; the worker's heads attend with the same bidirectional image runs (sent with the
    step) and the same 1-D positions. Rows with one image, two, and a long text before an image chunked across steps under a 12-token
    budget (the chunks, which never end inside an image, are rank 0's scheduler's): the tokens are one rank's."""
    requests = [(prompt(images[:1], [10, 11]), images[:1]),
                (prompt(images[1:3], [12]), images[1:3]),
                (prompt([images[3]], list(range(20, 37)), tail=4), [images[3]]),
                (prompt([], [16, 17]), None)]
    outputs = {}
    for tp, budget in ((1, 12), (2, 12), (2, 128)):  # 128: the first step encodes every image, a share on each rank
        engine = make_engine(gemma3, tensor_parallel_size=tp, max_model_len=128, max_num_batched_tokens=budget)
        try:
            assert engine.runner.model.visual is not None  # every rank holds the tower whole
            outputs[tp, budget] = run(engine, requests)
            assert engine.runner.images.images_encoded == 4
            assert (engine.runner.images.images_on_workers > 0) == (budget == 128)
        finally:
            engine.close()
    assert outputs[2, 12] == outputs[1, 12] == outputs[2, 128]
    assert len({tuple(o) for o in outputs[1, 12]}) == len(requests)  # decisive: every row its own tokens


# ---- pan-and-scan ---------------------------------------------------------------------------------------------
PAN_SIZES = [(20, 50), (30, 30), (60, 24)]  # (height, width): wide (3 crops at >= 8 pixels), square (none), tall (3)


def test_pan_and_scan_cuts_the_crops_transformers_cuts():
    """cbatch's crop rule (from the size alone) against transformers' on arrays of many shapes and settings."""
    import numpy as np
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from cbatch.model.image_processor import PanAndScan

    sizes = [(20, 50), (60, 24), (30, 30), (30, 35), (30, 37), (896, 2000), (2000, 896), (300, 1000), (100, 2000),
             (512, 1023), (256, 1100), (9, 40)]
    counts = set()
    for setting in (PanAndScan(min_crop=8), PanAndScan(), PanAndScan(min_crop=8, max_crops=2, min_ratio=1.5)):
        for height, width in sizes:
            theirs = Gemma3ImageProcessorPil().pan_and_scan(np.zeros((1, height, width)), setting.min_crop,
                                                            setting.max_crops, setting.min_ratio)
            ours = setting.boxes(height, width)
            assert [(b - t, r - l) for l, t, r, b in ours] == [c.shape[1:] for c in theirs], (setting, height, width)
            counts.add(len(ours))
    assert counts == {0, 2, 3, 4}  # (the sizes reach every case: none, 2 .. max_crops)


@pytest.fixture(scope="module")
def pan_images():
    import io

    from PIL import Image

    return [Image.open(io.BytesIO(png_bytes(h, w, seed=k))) for k, (h, w) in enumerate(PAN_SIZES)]


def test_pan_and_scan_gives_transformers_prompt_and_tokens(gemma3, pan_images, tmp_path):
    """mm_processor_kwargs={"do_pan_and_scan": True} over a checkpoint whose file leaves it off (its crop size 8
    read from the file): a wide, a square and a tall image in one chat give Gemma3Processor's input_ids (crop text,
    one run per crop) and transformers' greedy tokens on its pixel_values (the crops among them)."""
    import torch

    from cbatch import LLM, SamplingParams
    from gemma3_vision_models import CHAT_TEMPLATE, SPECIALS, hf_gemma3, hf_gemma3_processor, with_pan_and_scan
    from vision_models import make_tokenizer

    path = with_pan_and_scan(gemma3, tmp_path / "model", None)
    tokenizer = make_tokenizer(path, SPECIALS, CHAT_TEMPLATE)
    parts = [{"type": "text", "text": "w1 w2"}, *({"type": "image_pil", "image_pil": im} for im in pan_images),
             {"type": "text", "text": "w3"}]
    llm = LLM(model=str(path), device="cpu", use_tqdm=False, mm_processor_kwargs={"do_pan_and_scan": True})
    got = llm.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]

    text = tokenizer.apply_chat_template([{"role": "user", "content": [p if p["type"] == "text" else {"type": "image"}
                                                                       for p in parts]}],
                                         add_generation_prompt=True, tokenize=False)
    ref = hf_gemma3_processor(path)(text=[text], images=[pan_images], do_pan_and_scan=True,
                                    pan_and_scan_min_crop_size=8, return_tensors="pt")
    assert got.prompt_token_ids == ref["input_ids"][0].tolist()
    assert got.prompt_token_ids.count(BOI) == ref["pixel_values"].shape[0] == 1 + 3 + 1 + 1 + 3  # crops: 3, 0, 3
    with torch.no_grad():
        out = hf_gemma3(gemma3).generate(**ref, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert got.outputs[0].token_ids == out[0, ref["input_ids"].shape[1]:].tolist()
    assert len(set(got.outputs[0].token_ids)) > 2, "decisive: greedy output is not one repeated token"


def test_plan_counts_pan_and_scan_crops_as_the_run_does(gemma3, tmp_path):
    """A checkpoint whose file asks for pan-and-scan: `cbatch run` cuts the wide image's crops (3 more runs, the
    crop text) and `cbatch plan` counts the same prompt and image tokens from the header; the header's count is
    the full read's (the crops' digests too); a released crop is read again from the source; --no-image-pan-and-scan
    takes the crops off."""
    from cbatch.io.images import ImageReader
    from cbatch.model.loader import read_checkpoint
    from gemma3_vision_models import CHAT_TEMPLATE, SPECIALS, with_pan_and_scan
    from ops_jobs import read_jsonl, run_inprocess, write_jsonl
    from vision_models import make_tokenizer

    path = with_pan_and_scan(gemma3, tmp_path / "model", True)
    make_tokenizer(path, SPECIALS, CHAT_TEMPLATE)
    sources = [png_bytes(h, w, seed=k) for k, (h, w) in enumerate(PAN_SIZES[:2])]  # wide, square
    reader = ImageReader(path, read_checkpoint(path).spec.vision)
    for source, crops in zip(sources, (3, 0)):
        full, counted = reader.read(source, "a"), reader.read(source, "a", decode=False)
        assert [(c.digest, c.num_tokens) for c in counted.crops] == [(c.digest, c.num_tokens) for c in full.crops]
        assert len(full.crops) == crops and counted.pixels is None
        assert all(c.pixels.shape == full.pixels.shape for c in full.crops)
    wide = reader.read(sources[0], "a")
    crop = wide.crops[1]  # released once encoded, a crop's patches are read again from the image's source
    kept = crop.pixels
    crop.release()
    assert crop.pixels is None and (crop.patches() == kept).all() and not (kept == wide.crops[0].pixels).all()
    for k, source in enumerate(sources):
        (tmp_path / f"p{k}.png").write_bytes(source)
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"w{i}"}], "images": [str(tmp_path / f"p{i % 2}.png")],
             "max_tokens": 2} for i in range(4)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    common = ("--model", str(path), "--device", "cpu", "--no-search")
    code, _, err = run_inprocess("run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model",
                                 str(path), "--device", "cpu", "--display", "none", "--quiet",
                                 "--report", str(tmp_path / "run.json"))
    assert code == 0, err
    tokens = {r["id"]: r["prompt_tokens"] for r in read_jsonl(tmp_path / "out.jsonl")}
    # a wide row: 3 crop runs (boi, 9 soft tokens, eoi) and the crop text's 15 words (unknown to the tiny vocabulary)
    assert tokens["0"] - tokens["1"] == 3 * (TOKENS_PER_IMAGE + 2) + 15
    assert json.loads((tmp_path / "run.json").read_text())["images"]["image_tokens"] == 2 * (4 + 1) * TOKENS_PER_IMAGE
    planned = {}
    for flag in ("--image-pan-and-scan", "--no-image-pan-and-scan"):
        code, _, err = run_inprocess("plan", str(tmp_path / "in.jsonl"), *common, flag,
                                     "--report", str(tmp_path / "plan.json"))
        assert code == 0, err
        planned[flag] = json.loads((tmp_path / "plan.json").read_text())["predicted"]["prompt_tokens"]
    assert planned["--image-pan-and-scan"] == sum(tokens.values())
    assert planned["--no-image-pan-and-scan"] == sum(tokens.values()) - 2 * (3 * (TOKENS_PER_IMAGE + 2) + 15)
