"""Videos in prompts: tiny random Qwen2-VL and Qwen2.5-VL checkpoints give HF `generate`'s greedy float32 tokens on
cbatch's own preprocessing of a video (one video, a video beside an image, chunks cutting the video's run), with
Qwen2.5-VL's temporal M-RoPE spacing; the frame sampling and patch layout against an independent computation; rows
with videos through `cbatch run`, bad videos as error rows naming the row's video."""
from __future__ import annotations

import base64
import io
import re
import shutil
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from cbatch.config import SamplingParams, UserError
from cbatch.io.images import ImageReader
from cbatch.io.row_fields import VideoSource
from cbatch.io.videos import VideoFrames, VideoReader, frame_indices
from cbatch.model.loader import read_checkpoint
from gemma3_vision_models import make_gemma3_checkpoint
from helpers import make_engine
from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from vision_models import (IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, hf_vl_greedy, make_vl_checkpoint,
                           png_bytes, random_frames, run_requests, video_bytes, without_torchvision)

pytest.importorskip("av")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl_model(request, tmp_path_factory):
    path = make_vl_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "model")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def reader(path) -> VideoReader:
    return VideoReader(path, read_checkpoint(path).spec.vision)


def prompt(items, tail: int = 3) -> list[int]:
    """Words, each image's or video's placeholder run between vision start/end, then `tail` words."""
    ids = [4, 10, 11]
    for i, item in enumerate(items):
        ids += [VISION_START, *[VIDEO_TOKEN if item.video else IMAGE_TOKEN] * item.num_tokens, VISION_END, 40 + i]
    return ids + list(range(100, 100 + tail))


def test_greedy_tokens_match_hf_for_a_video_and_a_video_beside_an_image(vl_model):
    videos = reader(vl_model)
    # 8 frames at 2 fps: all 8 sampled, 4 temporal patches of 2 x 2 tokens (Qwen2.5-VL: temporal positions 0, 4, 8,
    # 12 past the start, beyond the text after it: the completion still continues from the prompt's last token, as
    # transformers' generate does)
    clip = videos.read(VideoSource(video_bytes(random_frames(8, 56, 56, seed=1), fps=2)), "videos[0]")
    other = videos.read(VideoSource(video_bytes(random_frames(8, 56, 56, seed=2), fps=2)), "videos[0]")
    image = ImageReader(vl_model, videos.vision).read(png_bytes(56, 84, seed=3), "images[0]")
    assert clip.video and clip.grid == (4, 4, 4) and clip.num_tokens == 16
    assert clip.time_interval == (4.0 if videos.vision.tokens_per_second else 1.0)
    requests = [(prompt([clip]), [clip]), (prompt([image, clip]), [image, clip]), (prompt([other]), [other])]
    outputs = run_requests(make_engine(vl_model, max_model_len=256), requests, GREEDY)
    assert len(set(outputs[0])) > 2, "decisive: greedy output is not one repeated token"
    assert outputs[0] != outputs[2], "the video decides the completion"
    for (ids, items), ours in zip(requests, outputs):
        assert ours == hf_vl_greedy(vl_model, ids, items, GREEDY.max_tokens)
    # a 5-token budget cuts the video's run across steps; its embeddings are computed once and sliced, in tower
    # calls of at most 5 tokens: the video's 4 temporal patches (4 tokens each) one a call, the 6-token image alone
    engine = make_engine(vl_model, max_model_len=256, max_num_batched_tokens=5, enable_prefix_cache=False)
    calls, tower = [], engine.runner.images.visual
    engine.runner.images.visual = lambda pixels, grids: calls.append(list(grids)) or tower(pixels, grids)
    assert run_requests(engine, requests[:2], GREEDY) == outputs[:2]
    assert engine.runner.images.images_encoded == 2  # the video and the image, once each
    assert sorted(calls) == [[(1, 4, 4)]] * 4 + [[(1, 4, 6)]]


def test_decoded_frames_read_as_the_files_sampled_frames(vl_model):
    """vLLM's video as decoded frames: the frames a file's sampling takes, given as an array (their times from the
    metadata, else 2 frames a second), give the file's grid, patches and Qwen2.5-VL temporal spacing, so HF's tokens."""
    videos = reader(vl_model)
    frames = np.stack(random_frames(8, 56, 84, seed=11))
    from_file = videos.read(VideoSource(video_bytes(list(frames), fps=4)), "v")  # (PNG-coded: the same frames)
    picked = frame_indices(8, 4.0, 2.0, 2, 4, 768)  # [0, 2, 4, 6]: 2 frames a second of a 2-second clip
    given = videos.read(VideoSource(VideoFrames.of((frames[picked], {"fps": 4.0, "frames_indices": picked.tolist(),
                                                                     "total_num_frames": 8}))), "v")
    assert (given.grid, given.num_tokens, given.time_interval) == (from_file.grid, from_file.num_tokens,
                                                                    from_file.time_interval) == ((2, 4, 6), 12, (
                                                                        4.0 if videos.vision.tokens_per_second else 1.0))
    np.testing.assert_array_equal(given.pixels, from_file.pixels)
    # without metadata: 2 frames a second (the processors' default), so the same spacing; a frame more or other
    # times are other content
    bare = videos.read(VideoSource(VideoFrames.of(frames[picked])), "v")
    np.testing.assert_array_equal(bare.pixels, from_file.pixels)
    assert bare.time_interval == from_file.time_interval and bare.digest != given.digest
    assert len({given.digest, bare.digest, VideoFrames.of(frames).digest, from_file.digest}) == 4
    np.testing.assert_array_equal(given.reread(), given.pixels)  # a preempted row's patches, made again
    assert run_requests(make_engine(vl_model, max_model_len=256), [(prompt([given]), [given])], GREEDY)[0] == \
        hf_vl_greedy(vl_model, prompt([from_file]), [from_file], GREEDY.max_tokens)


def test_frames_are_sampled_and_patched_as_transformers_does(vl_model):
    # sampling: fps frames a second, at least min_frames (4), a multiple of the temporal patch (2)
    assert frame_indices(8, 4.0, 2.0, 2, 4, 768).tolist() == [0, 2, 4, 6]
    assert frame_indices(30, 30.0, 2.0, 2, 4, 768).tolist() == [0, 7, 15, 22]  # 1 s: 2 frames, raised to 4
    assert frame_indices(9, 2.0, 2.0, 2, 4, 768).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # 9 -> 8 (a multiple of 2)
    assert frame_indices(1, 24.0, 2.0, 2, 4, 768).tolist() == [0]  # shorter than a temporal patch: all of it

    videos = reader(vl_model)
    frames = random_frames(19, 56, 56, seed=5)
    # a 2-frame video of one repeated frame is the image processor's patches of that frame
    still = videos.read(VideoSource(video_bytes([frames[0], frames[0]], fps=1)), "v")
    png = io.BytesIO()
    Image.fromarray(frames[0]).save(png, format="PNG")
    image = ImageReader(vl_model, videos.vision).read(png.getvalue(), "i")
    assert still.grid == image.grid == (1, 4, 4)
    header = videos.read(VideoSource(video_bytes(random_frames(8, 56, 84), fps=4)), "v", decode=False)  # cbatch plan's
    assert (header.grid, header.num_tokens, header.pixels) == ((2, 4, 6), 12, None)
    np.testing.assert_array_equal(still.pixels, image.pixels)

    # 19 sampled frames (preprocessed 16 at a time; the last repeated to fill the tenth temporal patch), against
    # transformers' video patchify written out in numpy over frames rescaled and normalized by hand (56 x 56 needs
    # no resize)
    grid_thw, pixels = videos.patches(iter([Image.fromarray(f) for f in frames]), len(frames))
    mean = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)[:, None, None]
    std = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)[:, None, None]
    video = np.stack([(f.transpose(2, 0, 1).astype(np.float32) / 255 - mean) / std for f in frames + [frames[-1]]])
    t, c, patch, merge = 10, 3, 14, 2  # [F, C, H, W] -> view (t, 2, C, h/m, m, P, w/m, m, P), permute as transformers
    grid = 56 // patch
    view = video.reshape(t, 2, c, grid // merge, merge, patch, grid // merge, merge, patch)
    expected = view.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * grid * grid, c * 2 * patch * patch)
    assert grid_thw == (10, 4, 4)
    np.testing.assert_allclose(pixels, expected, rtol=0, atol=1e-5)


@pytest.fixture
def hf_video_processor(monkeypatch):
    """transformers' own Qwen2VLVideoProcessor module (imported without torchvision where it is missing)."""
    with without_torchvision(monkeypatch, "transformers.models.qwen2_vl.video_processing_qwen2_vl") as module:
        yield module


def with_processor_files(model, path, files: dict[str, dict]):
    """A copy of checkpoint `model` at `path` with processor config `files` (name -> content) added."""
    import json

    shutil.copytree(model, path)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))
    return path


def test_frames_take_the_video_processors_limits_as_transformers_resolves_them(vl_model, tmp_path,
                                                                               hf_video_processor):
    """processor_config.json's video_processor section (transformers 5's file) wins over video_preprocessor_config.json
    and the image's preprocessor_config.json: 784 to 1,568 pixels a frame, while images take 784 to 50,176. A 56 x 84
    video is 28 x 28 pixels a frame (1 token a temporal patch), the image of that size 4 x 6 patches (6 tokens), as
    transformers' video processor made from the folder and its smart_resize give; greedy tokens equal transformers'
    generate on them."""
    model = with_processor_files(vl_model, tmp_path / "model", {
        "processor_config.json": {"video_processor": {"size": {"shortest_edge": 784, "longest_edge": 1568}}},
        "video_preprocessor_config.json": {"max_pixels": 784 * 16}})
    hf = hf_video_processor.Qwen2VLVideoProcessor.from_pretrained(model)
    videos = reader(model)
    assert (videos.limits.min_pixels, videos.limits.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)
    assert (videos.limits.min_frames, videos.limits.max_frames) == (hf.min_frames, hf.max_frames) == (4, 768)
    assert ImageReader(model, videos.vision).pixel_range == (784, 784 * 64)

    data = video_bytes(random_frames(8, 56, 84, seed=4), fps=2)
    clip = videos.read(VideoSource(data), "videos[0]")
    height, width = hf_video_processor.smart_resize(56, 84, 28, hf.size.shortest_edge, hf.size.longest_edge)
    assert clip.grid == (4, height // 14, width // 14) == (4, 2, 2) and clip.num_tokens == 4
    assert videos.read(VideoSource(data), "v", decode=False).grid == clip.grid  # cbatch plan's, from the header
    image = ImageReader(model, videos.vision).read(png_bytes(56, 84, seed=3), "images[0]")
    assert image.grid == (1, 4, 6)
    requests = [(prompt([image, clip]), [image, clip])]
    ours = run_requests(make_engine(model, max_model_len=256), requests, GREEDY)
    assert ours == [hf_vl_greedy(model, *requests[0], GREEDY.max_tokens)]


def test_cap_pixels_per_frame_shares_the_videos_total_as_transformers_does(vl_model, tmp_path, hf_video_processor,
                                                                          monkeypatch):
    """A checkpoint setting `cap_pixels_per_frame` (max_video_tokens 20: 14,112 pixels in all, 2 frames a temporal
    patch): 8 sampled frames get 3,528 pixels each (28 x 56), 4 frames 7,056 (56 x 84 needs no resize); the sizes
    transformers' own resize asks for (its torchvision resize stubbed to report them)."""
    module = hf_video_processor
    model = with_processor_files(vl_model, tmp_path / "model", {"video_preprocessor_config.json": {
        "size": {"shortest_edge": 784, "longest_edge": 784 * 64}, "cap_pixels_per_frame": True,
        "max_video_tokens": 20}})
    hf = module.Qwen2VLVideoProcessor.from_pretrained(model)
    asked = []
    monkeypatch.setattr(module.BaseVideoProcessor, "resize",
                        lambda self, image, size, resample, **kwargs: asked.append((size.height, size.width)))
    videos = reader(model)
    assert videos.limits.cap_pixels_per_frame and videos.limits.max_video_tokens == hf.max_video_tokens == 20
    for frames, expected in ((8, (4, 2, 4)), (4, (2, 4, 6))):
        hf.resize(torch.zeros(1, frames, 3, 56, 84), size=hf.size, resample=None, factor=28, temporal_factor=2,
                  cap_pixels_per_frame=True)
        height, width = asked[-1]
        data = video_bytes(random_frames(frames, 56, 84, seed=frames), fps=2)
        clip = videos.read(VideoSource(data), "v")
        assert clip.grid == (frames // 2, height // 14, width // 14) == expected
        assert videos.read(VideoSource(data), "v", decode=False).grid == expected


def run(model, input_path, out, *flags) -> int:
    code, _, _ = run_inprocess("run", str(input_path), "-o", str(out), "--model", str(model), "--device", "cpu",
                               "--display", "none", "--quiet", "--max-tokens", "6", *map(str, flags))
    return code


def test_video_rows_and_bad_videos_through_cbatch_run(tmp_path, monkeypatch):
    model = make_vl_checkpoint("qwen2_vl", tmp_path / "model")
    clip = video_bytes(random_frames(4, 56, 56, seed=7), fps=2)
    (tmp_path / "clip.avi").write_bytes(clip)
    (tmp_path / "junk.avi").write_bytes(b"this is not a video")
    uri = "data:video/x-msvideo;base64," + base64.b64encode(clip).decode()
    ask = {"type": "text", "text": "w1 w2"}
    rows = [
        {"id": "part",
         "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}}, ask]}]},
        {"id": "field", "messages": [{"role": "user", "content": "w1 w2"}], "videos": [f"file://{tmp_path}/clip.avi"]},
        {"id": "with-image", "messages": [{"role": "user", "content": "w1 w2"}], "videos": [str(tmp_path / "clip.avi")],
         "images": ["data:image/png;base64," + base64.b64encode(png_bytes(56, 56, seed=1)).decode()]},
        {"id": "missing", "messages": [{"role": "user", "content": "w1"}], "videos": [str(tmp_path / "nope.avi")]},
        {"id": "junk", "messages": [{"role": "user", "content": "w1"}], "videos": [str(tmp_path / "junk.avi")]},
        {"id": "text", "messages": [{"role": "user", "content": "w1 w2"}]},
        # a text prompt names its video before its image: the row's `images` and `videos` take their placeholders
        {"id": "prompt", "prompt": "<|vision_start|> <|video_pad|> <|vision_end|> <|vision_start|> <|image_pad|> "
                                   "<|vision_end|> w1 w2", "videos": [str(tmp_path / "clip.avi")],
         "images": ["data:image/png;base64," + base64.b64encode(png_bytes(56, 56, seed=1)).decode()]},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 1
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert out["part"]["completion"] and out["part"]["completion"] == out["field"]["completion"]
    # 4 frames at 2 fps: 2 s, 4 frames sampled, 2 temporal patches of 2 x 2 tokens, between vision start and end
    assert out["part"]["prompt_tokens"] == out["text"]["prompt_tokens"] + 2 + 8
    assert out["with-image"]["prompt_tokens"] == out["text"]["prompt_tokens"] + 2 + 8 + 2 + 4
    assert out["prompt"]["prompt_tokens"] == 2 + 8 + 2 + 4 + 2 and out["prompt"]["completion"]
    assert out["missing"]["error"] == f"`videos[0]` ('{tmp_path}/nope.avi') names a file that does not exist"
    assert out["junk"]["error"].startswith(f"`videos[0]` ('{tmp_path}/junk.avi') cannot be decoded as a video (")

    # the library's chat takes the same video part
    from cbatch import LLM, SamplingParams as Params

    llm = LLM(model=str(model), device="cpu", use_tqdm=False)
    chat = llm.chat(rows[0]["messages"], Params(max_tokens=6, temperature=0.0))
    assert chat[0].outputs[0].text == out["part"]["completion"]
    # and vLLM's multi_modal_data with the video file (a path, bytes), its prompt holding the placeholders
    prompt = {"prompt": rows[-1]["prompt"], "multi_modal_data": {"video": str(tmp_path / "clip.avi"),
                                                                  "image": [png_bytes(56, 56, seed=1)]}}
    made = llm.generate([prompt, {**prompt, "multi_modal_data": {"video": [clip], "image": png_bytes(56, 56, seed=1)}}],
                        Params(max_tokens=6, temperature=0.0))
    assert made[0].outputs[0].text == made[1].outputs[0].text == out["prompt"]["completion"]
    assert len(made[0].prompt_token_ids) == out["prompt"]["prompt_tokens"]
    # the file as a {"bytes", "path"} dict (a row's Parquet struct), and its decoded frames (vLLM's uint8 array)
    frames = np.stack(random_frames(4, 56, 56, seed=7))
    made = llm.generate([{**prompt, "multi_modal_data": {"video": {"bytes": clip, "path": None},
                                                         "image": png_bytes(56, 56, seed=1)}},
                         {**prompt, "multi_modal_data": {"video": frames, "image": png_bytes(56, 56, seed=1)}}],
                        Params(max_tokens=6, temperature=0.0))
    assert made[0].outputs[0].text == made[1].outputs[0].text == out["prompt"]["completion"]
    for bad, says in ((np.zeros((4, 56, 56, 3)), "an array [4, 56, 56, 3] of float64"), (frames[0], "[56, 56, 3]"),
                      ((frames, {"frames_indices": [0, 1]}), "frames_indices must be 4 ascending frame numbers")):
        with pytest.raises(UserError, match=r"prompt 0: multi_modal_data.video\[0\] must be a video file .* or its "
                                            r"decoded frames; its .*" + re.escape(says)):
            llm.generate({"prompt": rows[-1]["prompt"], "multi_modal_data": {"video": bad}})

    # without PyAV: the video rows are error rows saying how to install it; the others complete
    monkeypatch.setitem(sys.modules, "av", None)
    assert run(model, tmp_path / "in.jsonl", tmp_path / "out2.jsonl") == 1
    out2 = {r["id"]: r for r in read_jsonl(tmp_path / "out2.jsonl")}
    assert out2["field"]["error"] == (f"`videos[0]` ('file://{tmp_path}/clip.avi') is a video, which needs PyAV: "
                                      "pip install 'cbatch[video]'")
    assert out2["text"]["completion"] == out["text"]["completion"]


def test_a_video_for_a_model_without_videos_is_an_error_row(tmp_path):
    model = make_gemma3_checkpoint(tmp_path / "model")
    (tmp_path / "clip.avi").write_bytes(video_bytes(random_frames(4, 32, 32), fps=2))
    write_jsonl(tmp_path / "in.jsonl", [{"id": "v", "messages": [{"role": "user", "content": "w1"}],
                                         "videos": [str(tmp_path / "clip.avi")]}])
    assert run(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 1
    error = read_jsonl(tmp_path / "out.jsonl")[0]["error"]
    assert error == ("`videos[0]` is a video; this Gemma3ForConditionalGeneration reads no videos (Qwen2-VL, "
                     "Qwen2.5-VL and Qwen3-VL do)")


def test_a_resume_knows_a_video_by_its_bytes(tmp_path, monkeypatch):
    """A finished row's record keeps its video's digest (of its bytes, tagged as a video); a resume reads the video
    again and refuses when it has other bytes, and resumes to the uninterrupted run's OUTPUT once it is restored."""
    from cbatch.io.images import digest_of, source_digest
    from ops_jobs import part_records, sigterm_after_rows

    model = make_vl_checkpoint("qwen2_vl", tmp_path / "model")
    clips = [video_bytes(random_frames(4, 28, 28, seed=k), fps=2) for k in range(2)]
    for k, clip in enumerate(clips):
        (tmp_path / f"c{k}.avi").write_bytes(clip)
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "messages": [{"role": "user", "content": f"w{i}"}],
                                         "videos": [str(tmp_path / f"c{i % 2}.avi")]} for i in range(8)])
    assert run(model, tmp_path / "in.jsonl", tmp_path / "ref.jsonl", "--max-num-seqs", 2) == 0
    out = tmp_path / "out.jsonl"
    sigterm_after_rows(monkeypatch, 3)  # a real SIGTERM once 3 rows are on disk
    assert run(model, tmp_path / "in.jsonl", out, "--max-num-seqs", 2) == 143
    monkeypatch.undo()
    records = part_records(out)
    assert 0 < len(records) < 8
    video = source_digest(VideoSource("c.avi"), clips[0])
    assert video != digest_of(clips[0])  # the same bytes read as an image are known apart
    assert all(r["image_digests"] == [source_digest(VideoSource(""), clips[r["index"] % 2])] for r in records)

    changed = records[0]["index"] % 2
    (tmp_path / f"c{changed}.avi").write_bytes(video_bytes(random_frames(4, 28, 28, seed=9), fps=2))
    code, _, err = run_inprocess("run", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", str(model), "--device",
                                 "cpu", "--display", "none", "--max-tokens", "6", "--max-num-seqs", "2")
    assert code == 2 and f"with `videos[0]` ('{tmp_path}/c{changed}.avi'), which has other bytes now" in err, err
    (tmp_path / f"c{changed}.avi").write_bytes(clips[changed])
    assert run(model, tmp_path / "in.jsonl", out, "--max-num-seqs", 2) == 0
    assert read_jsonl(out) == read_jsonl(tmp_path / "ref.jsonl")


def test_the_jobs_video_bounds_size_frames_and_its_image_bounds_do_not(tmp_path):
    """--video-max-pixels (EngineConfig.video_max_pixels) bounds video frames over the model's video processor, as
    transformers' from_pretrained(max_pixels=...) would; --image-max-pixels leaves them alone. The tiny checkpoint has
    preprocessor_config.json alone, so frames start at the images' bounds: a 56 x 84 frame is 2 x 3 tokens, a
    4-frame clip 2 temporal patches of 6; at 1,568 pixels a frame is 28 x 28, 1 token. Checked, refused for a model
    without videos, in the output identity."""
    import torch

    from cbatch.config import ConfigError, EngineConfig
    from cbatch.engine.resolve import resolve_model
    from cbatch.model.image_processor import video_limits
    from cbatch.run.identity import output_identity
    from cbatch.tasks.generate_task import GenerateTask

    model = make_vl_checkpoint("qwen2_vl", tmp_path / "model")
    (tmp_path / "clip.avi").write_bytes(video_bytes(random_frames(4, 56, 84, seed=2), fps=2))
    image = "data:image/png;base64," + base64.b64encode(png_bytes(56, 84, seed=1)).decode()
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "v", "messages": [{"role": "user", "content": "w1"}], "videos": [str(tmp_path / "clip.avi")]},
        {"id": "i", "messages": [{"role": "user", "content": "w1"}], "images": [image]},
        {"id": "t", "messages": [{"role": "user", "content": "w1"}]}])

    def tokens(*flags) -> tuple[int, int]:
        """(the video's, the image's) placeholder tokens in a run with `flags`."""
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.jsonl"
        assert run(model, tmp_path / "in.jsonl", out, *flags) == 0
        rows = {r["id"]: r["prompt_tokens"] for r in read_jsonl(out)}
        return rows["v"] - rows["t"] - 2, rows["i"] - rows["t"] - 2  # (less vision start and end)

    assert tokens() == (12, 6)
    assert tokens("--video-max-pixels", 1568) == (2, 6)
    assert tokens("--image-max-pixels", 1568) == (12, 1)
    assert video_limits(model, max_pixels=1568).max_pixels == 1568 and video_limits(model).max_pixels == 784 * 64

    with pytest.raises(ConfigError) as bad:
        EngineConfig(video_min_pixels=800, video_max_pixels=700)
    assert bad.value.field == "video_max_pixels" and "at least --video-min-pixels" in bad.value.reason
    gemma3 = make_gemma3_checkpoint(tmp_path / "gemma3")
    with pytest.raises(ConfigError) as bad:
        resolve_model(EngineConfig(model=str(gemma3), video_max_pixels=10**6))
    assert str(bad.value) == ("video_max_pixels: this Gemma3ForConditionalGeneration reads no videos (Qwen2-VL, "
                              "Qwen2.5-VL and Qwen3-VL do); leave the video settings out")
    identity = output_identity(EngineConfig(video_max_pixels=10**6), GenerateTask(), torch.device("cpu"),
                               torch.float32, 4096)
    assert identity["video_max_pixels"] == 10**6 and "video_min_pixels" not in identity


def test_the_jobs_frame_rate_samples_fewer_frames(tmp_path):
    """--video-fps (EngineConfig.video_fps; the library's mm_processor_kwargs fps) over the processor's 2 frames a
    second: a 16-frame clip at 4 fps (4 s) samples 8 frames, 4 temporal patches of one 28 x 28 token each; at 1 fps 4
    frames, 2 patches. Checked, refused for a model without videos, in the output identity."""
    import torch

    from cbatch.api.engine_args import library_settings
    from cbatch.config import ConfigError, EngineConfig
    from cbatch.engine.resolve import resolve_model
    from cbatch.run.identity import output_identity
    from cbatch.tasks.generate_task import GenerateTask

    model = make_vl_checkpoint("qwen2_vl", tmp_path / "model")
    (tmp_path / "clip.avi").write_bytes(video_bytes(random_frames(16, 28, 28, seed=3), fps=4))
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": "v", "messages": [{"role": "user", "content": "w1"}], "videos": [str(tmp_path / "clip.avi")]},
        {"id": "t", "messages": [{"role": "user", "content": "w1"}]}])

    def video_tokens(*flags) -> int:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.jsonl"
        assert run(model, tmp_path / "in.jsonl", out, *flags) == 0
        rows = {r["id"]: r["prompt_tokens"] for r in read_jsonl(out)}
        return rows["v"] - rows["t"] - 2  # (less vision start and end)

    assert video_tokens() == 4 and video_tokens("--video-fps", 1) == 2
    vision = read_checkpoint(model).spec.vision
    clip = VideoSource(str(tmp_path / "clip.avi"))
    assert VideoReader(model, vision, fps=1.0).read(clip, "v").grid == (2, 2, 2)
    library = library_settings(str(model), {"mm_processor_kwargs": {"fps": 4}}).config  # (vLLM's spelling)
    assert VideoReader.for_config(model, vision, library).read(clip, "v").grid == (8, 2, 2)
    with pytest.raises(ConfigError) as bad:
        EngineConfig(video_fps=0)
    assert bad.value.field == "video_fps"
    with pytest.raises(ConfigError) as bad:
        resolve_model(EngineConfig(model=str(make_gemma3_checkpoint(tmp_path / "gemma3")), video_fps=1.0))
    assert bad.value.field == "video_fps"
    assert output_identity(EngineConfig(video_fps=1.0), GenerateTask(), torch.device("cpu"), torch.float32,
                           4096)["video_fps"] == 1.0
