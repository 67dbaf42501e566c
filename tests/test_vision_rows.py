"""Rows with images through `cbatch run` (issue 48): an image given as an OpenAI `image_url` part (data: URI,
file://), a row's `images` path, a Parquet column as Hugging Face datasets store images (struct of bytes/path) or
plain binary gives the same completion; bad images are error rows naming the image, and the other rows complete."""
from __future__ import annotations

import base64
import json
import shutil
import struct
import zlib

import pytest

from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from vision_models import IMAGE_TOKEN, make_vl_checkpoint, png_bytes


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    path = make_vl_checkpoint("qwen2_vl", tmp_path_factory.mktemp("vlrows") / "model")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(model, input_path, out, *flags) -> int:
    code, _, _ = run_inprocess("run", str(input_path), "-o", str(out), "--model", str(model), "--device", "cpu",
                               "--display", "none", "--quiet", "--max-tokens", "6", *map(str, flags))
    return code


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*parts, text: str = "w1 w2") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_one_image_given_every_way_gives_one_completion(vl_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    image, other = png_bytes(56, 84, seed=1), png_bytes(56, 84, seed=2)
    (tmp_path / "page.png").write_bytes(image)
    rows = [
        {"id": "uri", "messages": chat({"type": "image_url", "image_url": {"url": data_uri(image)}})},
        {"id": "file-url", "messages": chat({"type": "image_url", "image_url": {"url": f"file://{tmp_path}/page.png"}})},
        {"id": "images-field", "messages": [{"role": "user", "content": "w1 w2"}], "images": [str(tmp_path / "page.png")]},
        {"id": "other", "messages": chat({"type": "image_url", "image_url": {"url": data_uri(other)}})},
        {"id": "text", "messages": [{"role": "user", "content": "w1 w2"}]},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--report", tmp_path / "report.json") == 0
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    report = json.loads((tmp_path / "report.json").read_text())["images"]
    # three rows give the same bytes: the vision tower encodes them once, and the other image once
    assert {k: report[k] for k in ("rows", "images", "image_tokens", "encoded", "encoded_tokens")} == \
        {"rows": 4, "images": 4, "image_tokens": 24, "encoded": 2, "encoded_tokens": 12}
    assert out["uri"]["completion"] == out["file-url"]["completion"] == out["images-field"]["completion"]
    assert out["uri"]["completion"] != out["other"]["completion"]
    assert out["uri"]["prompt_tokens"] == out["text"]["prompt_tokens"] + 2 + 6  # start, 6 placeholders (4 x 6 patches), end

    messages = pa.array([[{"role": "user", "content": "w1 w2"}]] * 2)
    table = pa.table({"id": ["struct", "binary"], "messages": messages,
                      "images": pa.array([[{"bytes": image, "path": "page.png"}], None],
                                         pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
                      "image": pa.array([None, image], pa.binary())})
    pq.write_table(table, tmp_path / "in.parquet")
    assert run(vl_model, tmp_path / "in.parquet", tmp_path / "out2.jsonl") == 0
    parquet = {r["id"]: r["completion"] for r in read_jsonl(tmp_path / "out2.jsonl")}
    assert parquet == {"struct": out["uri"]["completion"], "binary": out["uri"]["completion"]}

    # fewer pixels, fewer image tokens: --image-max-pixels
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out3.jsonl", "--image-max-pixels", 28 * 28 * 4) == 0
    small = {r["id"]: r for r in read_jsonl(tmp_path / "out3.jsonl")}
    assert small["uri"]["prompt_tokens"] == out["text"]["prompt_tokens"] + 2 + 2  # 56 x 84 scaled to 28 x 56


def test_token_ids_carry_images_as_a_text_prompt_does(vl_model, tmp_path):
    """A row's `prompt_token_ids` hold the image placeholder once per image, as the chat template writes it (vLLM's
    TokensPrompt with multi_modal_data): the same completion as the chat row; ids already expanded to the image's run
    are an error row saying so."""
    from cbatch.io.images import template_parts
    from cbatch.tokenizer import encode_messages, load_tokenizer

    image = png_bytes(56, 84, seed=1)
    messages = chat({"type": "image_url", "image_url": {"url": data_uri(image)}})
    ids = encode_messages(load_tokenizer(vl_model), template_parts(messages))
    assert ids.count(IMAGE_TOKEN) == 1
    expanded = [t for token in ids for t in ([token] * 6 if token == IMAGE_TOKEN else [token])]  # its 6 image tokens
    rows = [{"id": "chat", "messages": messages}, {"id": "ids", "prompt_token_ids": ids, "images": [data_uri(image)]},
            {"id": "expanded", "prompt_token_ids": expanded, "images": [data_uri(image)]}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 1
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert out["ids"]["completion"] == out["chat"]["completion"] and out["ids"]["error"] is None
    assert out["ids"]["prompt_tokens"] == out["chat"]["prompt_tokens"] == len(ids) + 5
    assert "6 image placeholder(s) for 1 image(s)" in out["expanded"]["error"]
    assert "not expanded" in out["expanded"]["error"]


def test_limit_mm_per_prompt_makes_a_row_with_more_images_an_error_row(vl_model, tmp_path):
    """--limit-mm-per-prompt image=1 (vLLM's flag): a row with two images is an error row naming the limit, the
    row with one completes; a bad value is refused before anything runs."""
    image = data_uri(png_bytes(56, 84, seed=1))
    rows = [{"id": "one", "messages": chat({"type": "image_url", "image_url": {"url": image}})},
            {"id": "two", "messages": chat(*[{"type": "image_url", "image_url": {"url": image}}] * 2)},
            # refused before its images are read: the limit is its error, not the missing file
            {"id": "unread", "messages": chat({"type": "image_url", "image_url": {"url": str(tmp_path / "nope.png")}},
                                              {"type": "image_url", "image_url": {"url": image}})}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--limit-mm-per-prompt", "image=1") == 1
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert out["one"]["error"] is None and out["one"]["completion_tokens"] == 6
    for row in ("two", "unread"):
        assert "the prompt has 2 images, more than the 1 the engine's limit_mm_per_prompt" in out[row]["error"]
    code, _, err = run_inprocess("run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "x.jsonl"), "--model",
                                 str(vl_model), "--limit-mm-per-prompt", "images=1")
    assert code == 2 and "--limit-mm-per-prompt: takes image and video counts" in err


def test_the_image_pixel_bounds_are_engine_settings(tmp_path):
    """--image-min-pixels / --image-max-pixels are EngineConfig fields (the reserve for images reads them, as the
    processor does): checked there, refused by resolve_model for a model whose processor takes none, and part of the
    output identity under the names the task's identity gave them, so older fingerprints hold."""
    import torch

    from cbatch.config import ConfigError, EngineConfig
    from cbatch.engine.resolve import resolve_model
    from cbatch.run.identity import output_identity
    from cbatch.tasks.generate_task import GenerateTask
    from gemma3_vision_models import GEMMA_3_4B_CONFIG
    from cbatch.model.spec import parse_spec

    with pytest.raises(ConfigError) as bad:
        EngineConfig(image_min_pixels=800, image_max_pixels=700)
    assert bad.value.field == "image_max_pixels" and "at least --image-min-pixels" in bad.value.reason
    with pytest.raises(ConfigError) as bad:
        resolve_model(EngineConfig(image_max_pixels=10**6), parse_spec(GEMMA_3_4B_CONFIG))
    assert str(bad.value) == ("image_max_pixels: this Gemma3ForConditionalGeneration resizes every image to its "
                              "tower's square; leave the pixel bounds out")
    identity = output_identity(EngineConfig(image_max_pixels=10**6), GenerateTask(), torch.device("cpu"),
                               torch.float32, 4096)
    assert identity["image_max_pixels"] == 10**6 and "image_min_pixels" not in identity


def test_pan_and_scan_is_a_gemma3_setting_of_the_job():
    """--image-pan-and-scan (LLM: image_pan_and_scan, or vLLM's mm_processor_kwargs' do_pan_and_scan) is an
    EngineConfig field in the output identity, refused for a model without pan-and-scan; other processor keywords
    are refused by name."""
    import torch

    from cbatch.api.engine_args import library_settings
    from cbatch.config import ConfigError, EngineConfig, UserError
    from cbatch.engine.resolve import resolve_model
    from cbatch.model.spec import parse_spec
    from cbatch.run.identity import output_identity
    from cbatch.tasks.generate_task import GenerateTask
    from gemma3_vision_models import GEMMA_3_4B_CONFIG

    config = library_settings(None, {"mm_processor_kwargs": {"do_pan_and_scan": True, "max_pixels": 4096}}).config
    assert (config.image_pan_and_scan, config.image_max_pixels) == (True, 4096)
    with pytest.raises(UserError, match="mm_processor_kwargs: cbatch does not take 'crop_size'; it takes do_pan_and_scan"):
        library_settings(None, {"mm_processor_kwargs": {"crop_size": 2}})
    from cbatch.api.inputs import row_request

    with pytest.raises(UserError, match=r"^prompt 3: cbatch takes mm_processor_kwargs for every prompt, not per prompt; "
                                        r"give them to the engine: LLM\(\.\.\., mm_processor_kwargs=\{\.\.\.\}\)$"):
        row_request(3, {"prompt": "x", "mm_processor_kwargs": {"max_pixels": 4096}})
    assert resolve_model(EngineConfig(image_pan_and_scan=False), parse_spec(GEMMA_3_4B_CONFIG)).spec.vision is not None
    text_model = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64,
                  "vocab_size": 10, "intermediate_size": 8, "num_hidden_layers": 1}
    with pytest.raises(ConfigError) as bad:
        resolve_model(EngineConfig(image_pan_and_scan=True), parse_spec(text_model))
    assert str(bad.value) == "image_pan_and_scan: this LlamaForCausalLM reads no images; leave it out"
    identity = output_identity(EngineConfig(image_pan_and_scan=True), GenerateTask(), torch.device("cpu"),
                               torch.float32, 4096)
    assert identity["image_pan_and_scan"] is True


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, its pixel data empty (it is refused before decoding)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def test_bad_images_are_error_rows_naming_the_image(vl_model, tmp_path):
    good = png_bytes(28, 28, seed=3)
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "junk.png").write_bytes(b"this is not an image")
    (tmp_path / "truncated.png").write_bytes(png_bytes(200, 200, seed=4)[:400])
    bad = {
        "missing": (str(tmp_path / "nope.png"), "does not exist"),
        "folder": (str(tmp_path / "folder.png"), "names a folder"),
        "empty": (str(tmp_path / "empty.png"), "is empty"),
        "junk": (str(tmp_path / "junk.png"), "unknown or unsupported format"),
        "bad-base64": ("data:image/png;base64,@@@@", "does not decode"),
        "truncated": (str(tmp_path / "truncated.png"), "cannot be decoded"),
        "huge": (data_uri(_png_header(12_000, 12_000)), "more than the"),
        "sliver": (data_uri(_png_header(2, 1_000)), "aspect ratios up to 200:1"),
    }
    rows = [{"id": name, "messages": [{"role": "user", "content": "w1"}], "images": [source]}
            for name, (source, _) in bad.items()]
    rows.append({"id": "good", "messages": [{"role": "user", "content": "w1"}], "images": [data_uri(good)]})
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 1
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert out["good"]["finish_reason"] == "length" and out["good"]["completion"]
    for name, (_, words) in bad.items():
        error = out[name]["error"]
        assert out[name]["finish_reason"] == "error" and error.startswith("`images[0]` (") and words in error, (name, error)
    assert run(vl_model, tmp_path / "in.jsonl", tmp_path / "out2.jsonl", "--allow-errors") == 0


def test_a_released_image_is_read_again_from_its_source_or_refused_in_one_sentence(vl_model, tmp_path):
    """Once encoded, an image keeps its source, not its pixels: read again it gives the same patches; a file changed
    or gone since its row was queued is an ImageError naming it (the prefix cache knows the image by its bytes)."""
    import numpy as np

    from cbatch.io.images import ImageError, ImageReader
    from cbatch.model.loader import read_checkpoint

    reader = ImageReader(vl_model, read_checkpoint(vl_model).spec.vision)
    path = tmp_path / "page.png"
    path.write_bytes(png_bytes(56, 28, seed=3))
    image = reader.read(str(path), "images[0]")
    pixels = image.pixels.copy()
    image.release()
    assert image.pixels is None and np.array_equal(image.patches(), pixels) and image.pixels is None
    path.write_bytes(png_bytes(56, 28, seed=4))
    with pytest.raises(ImageError, match=r"^`images\[0\]` \('.*page.png'\) has other bytes than when its row was "
                                         r"queued; keep a job's images and videos in place and unchanged until it finishes$"):
        image.patches()
    path.unlink()
    with pytest.raises(ImageError, match=r"^`images\[0\]` \('.*page.png'\) names a file that does not exist, read "
                                         r"again for its preempted row; keep a job's images and videos in place"):
        image.patches()


def test_an_image_for_a_text_model_is_an_error_row(tiny_checkpoints, tmp_path):
    rows = [{"id": "x", "prompt_token_ids": [5, 6], "images": [data_uri(png_bytes(28, 28, 0))]}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(tiny_checkpoints["llama"], tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 1
    error = read_jsonl(tmp_path / "out.jsonl")[0]["error"]
    assert "`images[0]` is an image; this" in error and "reads no images" in error


def test_images_are_read_off_the_engine_loop_and_the_row_waits_outside_the_engine(vl_model, monkeypatch):
    """A row whose image read has not finished waits outside the engine while the engine steps other rows; it
    enters once the read is done (the worker thread is held on an event: no timing involved)."""
    import threading

    from cbatch.config import EngineConfig
    from cbatch.engine.build import build_engine
    from cbatch.io.images import ImageReader
    from cbatch.observe.metrics import JobMetrics
    from cbatch.run.executor import LocalExecutor
    from cbatch.run.job_spec import JobSpec
    from cbatch.tasks.generate_task import GenerateTask

    release, reading = threading.Event(), threading.Event()
    read = ImageReader.read

    def held_read(self, source, name):
        reading.set()
        assert release.wait(60)
        return read(self, source, name)

    monkeypatch.setattr(ImageReader, "read", held_read)
    engine = build_engine(EngineConfig(model=str(vl_model), device="cpu", max_model_len=128))
    executor = LocalExecutor(engine, JobSpec(engine.config, GenerateTask()), JobMetrics())
    executor.submit(0, {"messages": [{"role": "user", "content": "w1"}], "images": [data_uri(png_bytes(28, 56, 5))],
                        "max_tokens": 2})
    executor.submit(1, {"messages": [{"role": "user", "content": "w2"}], "max_tokens": 2})
    assert reading.wait(60) and executor.is_pending(0) and engine.scheduler.num_waiting == 1  # row 1 only
    results = []
    while not results:
        results += executor.poll()  # the engine runs row 1 while row 0's image is still being read
    assert [r.index for r in results] == [1] and executor.busy()
    release.set()
    while executor.busy():
        results += executor.poll()
    assert [r.index for r in results] == [1, 0] and results[1].ok and results[1].prompt_tokens == 10  # 6 text, 4 image


def test_the_triton_backend_gives_hfs_tokens_with_images(vl_model):
    """The GPU path's attention prologue reads each token's own M-RoPE cos/sin row (Triton; under its interpreter
    where there is no GPU)."""
    from cbatch.config import SamplingParams
    from cbatch.io.images import ImageReader
    from helpers import make_engine
    from vision_models import IMAGE_TOKEN, VISION_END, VISION_START, hf_vl_greedy

    engine = make_engine(vl_model, max_model_len=64, attention_backend="triton")
    reader = ImageReader(vl_model, engine.spec.vision)
    images = [reader.read(png_bytes(56, 84, 1), "a"), reader.read(png_bytes(28, 28, 2), "b")]
    ids = [4, 10]
    for image in images:
        ids += [VISION_START, *[IMAGE_TOKEN] * image.num_tokens, VISION_END, 11]
    seq = engine.add_request(ids, SamplingParams(max_tokens=5, temperature=0.0), images=images)
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == hf_vl_greedy(vl_model, ids, images, 5)


def test_openai_lines_carry_images():
    """A /v1/chat/completions body's image_url parts and a /v1/responses body's input_image parts are the row's images."""
    from cbatch.config import SamplingParams
    from cbatch.io.rows import parse_row

    chat_line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "m", "messages": chat({"type": "image_url", "image_url": {"url": "page.png"}})}}
    responses_line = {"custom_id": "r", "method": "POST", "url": "/v1/responses",
                      "body": {"model": "m", "input": [{"role": "user", "content": [
                          {"type": "input_text", "text": "w1"}, {"type": "input_image", "image_url": "page.png"}]}]}}
    chat_row, responses_row = (parse_row(i, line, SamplingParams()) for i, line in enumerate([chat_line, responses_line]))
    assert chat_row.images == [("messages[0].content[0]", "page.png")]
    assert responses_row.images == [("messages[0].content[1]", "page.png")]
    assert [p["type"] for p in responses_row.messages[0]["content"]] == ["text", "image"]
