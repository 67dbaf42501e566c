"""Qwen3-VL videos: transformers' Qwen3VLProcessor writes each temporal patch as its own run after its time
("<1.4 seconds>"), Qwen3VLVideoProcessor samples frames and sizes them for the whole video, and get_rope_index places
each temporal patch as an image. A tiny random Qwen3-VL checkpoint gives HF `generate`'s greedy float32 tokens on
the prompt transformers' processor builds (one video, a video beside an image, chunks cutting the video); the
sampling, sizes and timestamps against transformers' own code; rows through `cbatch run` and `cbatch plan`."""
from __future__ import annotations

import base64
import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cbatch.config import SamplingParams
from cbatch.io.images import ImageReader, expand_placeholders
from cbatch.io.row_fields import VideoSource
from cbatch.io.images import ImageError
from cbatch.io.videos import (VideoFrames, VideoReader, patch_seconds, spread_frame_indices,
                               whole_video_frame_size)
from cbatch.model.loader import read_checkpoint
from helpers import make_engine
from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from vision_models import (VIDEO_TOKEN, hf_vl_greedy, make_vl_checkpoint, png_bytes, random_frames, run_requests,
                           video_bytes, without_torchvision)

pytest.importorskip("av")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# the whole video's pixel bounds (Qwen3VLVideoProcessor's `size`): 4 frames of 64 x 64 at most
VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 4 * 64 * 64}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_vl_checkpoint("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl") / "model")
    (path / "video_preprocessor_config.json").write_text(json.dumps({"size": VIDEO_SIZE}))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def hf_video(monkeypatch):
    """transformers' Qwen3VLVideoProcessor module (imported without torchvision where it is missing)."""
    with without_torchvision(monkeypatch, "transformers.models.qwen3_vl.video_processing_qwen3_vl") as module:
        yield module


def processor_text(text: str, video, indices: np.ndarray, video_fps: float, image=None) -> str:
    """`text` (a chat template's, one `<|video_pad|>`, at most one `<|image_pad|>`) as transformers' Qwen3VLProcessor
    expands it for `video` (sampled at `indices` of a video at `video_fps`) and `image`: its own
    replace_video_token / replace_image_token (its text side alone: no tokenizer or processors are made)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    processor.image_processor = SimpleNamespace(merge_size=2)
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    parts = (video, *video.crops)
    grid = torch.tensor([[len(parts), *video.grid[1:]]])
    metadata = VideoMetadata(total_num_frames=int(indices[-1]) + 1, fps=video_fps, frames_indices=indices)
    text = text.replace("<|video_pad|>", processor.replace_video_token(
        {"video_grid_thw": grid, "video_metadata": [metadata]}, 0), 1)
    if image is not None:
        text = text.replace("<|image_pad|>", processor.replace_image_token(
            {"image_grid_thw": torch.tensor([image.grid])}, 0), 1)
    return text


def test_greedy_tokens_match_transformers_on_its_processors_prompt(qwen3, hf_video, monkeypatch):
    """10 frames at 4 fps: transformers samples 5 (0, 2, 4, 7, 9: 4.5 rounds to even), 3 temporal patches (the last
    frame repeated) at 0.25, 1.375 and 2.25 s; 48 x 80 frames go to 64 x 64 (4 frames' worth within the bounds):
    4 tokens a temporal patch. cbatch's prompt equals the processor's, and its tokens HF generate's."""
    from cbatch.io import videos as videos_module

    decode = videos_module._decode
    vision = read_checkpoint(qwen3).spec.vision
    engine = make_engine(qwen3, max_model_len=256)
    tokenizer = engine.tokenizer
    hf = hf_video.Qwen3VLVideoProcessor.from_pretrained(qwen3)
    from transformers.video_utils import VideoMetadata

    indices = hf.sample_frames(VideoMetadata(total_num_frames=10, fps=4.0))
    assert spread_frame_indices(10, 4.0, hf.fps, hf.min_frames, hf.max_frames).tolist() == indices.tolist() == [
        0, 2, 4, 7, 9]
    assert whole_video_frame_size(5, 48, 80, 32, 2, hf.size.shortest_edge, hf.size.longest_edge) == \
        hf_video.smart_resize(5, 48, 80, 2, 32, hf.size.shortest_edge, hf.size.longest_edge) == (64, 64)

    videos = VideoReader(qwen3, vision)
    clip = videos.read(VideoSource(video_bytes(random_frames(10, 48, 80, seed=1), fps=4)), "videos[0]")
    other = videos.read(VideoSource(video_bytes(random_frames(10, 48, 80, seed=2), fps=4)), "videos[0]")
    image = ImageReader(qwen3, vision).read(png_bytes(64, 96, seed=3), "images[0]")
    parts = (clip, *clip.crops)
    assert [(p.grid, p.num_tokens, p.timestamp) for p in parts] == [((1, 4, 4), 4, s) for s in (0.25, 1.375, 2.25)]

    template = "w1 <|vision_start|> <|video_pad|> <|vision_end|> w2 w3"
    with_image = "w1 <|vision_start|> <|image_pad|> <|vision_end|> w4 <|vision_start|> <|video_pad|> <|vision_end|> w2"
    expected = processor_text(template, clip, indices, 4.0)
    assert "<|vision_start|> <0.2 seconds><|vision_start|><|video_pad|>" in expected and "<1.4 seconds>" in expected
    requests = []
    for text, items in ((template, [clip]), (with_image, [image, clip]), (template, [other])):
        ids = expand_placeholders(tokenizer.encode(text, add_special_tokens=False), items, vision, tokenizer)
        reference = processor_text(text, items[-1], indices, 4.0, items[0] if len(items) > 1 else None)
        assert ids == tokenizer.encode(reference, add_special_tokens=False)
        requests.append((ids, items))
    assert requests[0][0].count(VIDEO_TOKEN) == 12

    outputs = run_requests(engine, requests, GREEDY)
    assert len(set(outputs[0])) > 2, "decisive: greedy output is not one repeated token"
    assert outputs[0] != outputs[2], "the video decides the completion"
    for (ids, items), ours in zip(requests, outputs):
        assert ours == hf_vl_greedy(qwen3, ids, items, GREEDY.max_tokens)
    # the parts' pixels went once encoded: a new engine reads the video again, decoded once for its 3 parts
    decoded = []
    monkeypatch.setattr(videos_module, "_decode", lambda *args: decoded.append(1) or decode(*args))
    assert run_requests(make_engine(qwen3, max_model_len=256), requests[:1], GREEDY) == outputs[:1]
    assert len(decoded) == 1
    # a 5-token budget cuts the runs across steps: each temporal patch and the image encoded once
    engine = make_engine(qwen3, max_model_len=256, max_num_batched_tokens=5, enable_prefix_cache=False)
    assert run_requests(engine, requests[1:2], GREEDY) == outputs[1:2]
    assert engine.runner.images.images_encoded == 4


def test_sizes_and_timestamps_as_transformers_computes_them(qwen3, hf_video, monkeypatch):
    """The frame size rule against transformers' smart_resize (scaled down, up, a side below the factor), the capped
    bound against what its resize asks for, the timestamps against Qwen3VLProcessor's own; the bounds as its
    from_pretrained reads the folder."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for frames, height, width, low, high in ((8, 480, 640, 4096, 16 * 64 * 64), (4, 40, 50, 128 * 1024, 768 * 1024),
                                             (5, 20, 900, 4096, 10**6), (3, 100, 100, 1024, 4 * 1024)):
        assert whole_video_frame_size(frames, height, width, 32, 2, low, high) == \
            hf_video.smart_resize(frames, height, width, 2, 32, low, high)
    for indices, fps in (([0, 2, 4, 7, 9], 4.0), ([0, 7, 15, 22, 30, 37], 29.97), ([3, 4], 1.0)):
        assert patch_seconds(np.array(indices), fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, indices, fps, 2)

    hf = hf_video.Qwen3VLVideoProcessor.from_pretrained(qwen3)
    reader = VideoReader(qwen3, read_checkpoint(qwen3).spec.vision)
    assert (reader.limits.min_pixels, reader.limits.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)
    asked = []
    monkeypatch.setattr(hf_video.BaseVideoProcessor, "resize",
                        lambda self, image, size, resample, **kwargs: asked.append((size.height, size.width)))
    limits = dataclasses.replace(reader.limits, cap_pixels_per_frame=True, max_video_tokens=3)
    hf.max_video_tokens = 3
    hf.resize(torch.zeros(1, 6, 3, 96, 96), size=hf.size, resample=None, factor=32, temporal_factor=2,
              cap_pixels_per_frame=True)
    assert whole_video_frame_size(6, 96, 96, 32, 2, limits.min_pixels, limits.video_max_pixels(6, 32)) == asked[-1]


def test_decoded_frames_with_their_times_read_as_the_files_sampled_frames(qwen3):
    """vLLM's Qwen3-VL video as decoded frames with metadata (the source's fps, the frames' indices): the file's
    temporal patches, sizes and timestamps; without metadata the frames are 2 a second."""
    videos = VideoReader(qwen3, read_checkpoint(qwen3).spec.vision)
    frames = np.stack(random_frames(10, 64, 96, seed=3))
    from_file = videos.read(VideoSource(video_bytes(list(frames), fps=4)), "v")  # (PNG-coded: the same frames)
    picked = spread_frame_indices(10, 4.0, 2.0, 4, 768)
    given = videos.read(VideoSource(VideoFrames.of((frames[picked], {"fps": 4.0, "frames_indices": picked.tolist(),
                                                                     "total_num_frames": 10}))), "v")
    parts, expected = (given, *given.crops), (from_file, *from_file.crops)
    assert len(parts) == len(expected) >= 2
    for part, want in zip(parts, expected):
        assert (part.grid, part.num_tokens, part.timestamp) == (want.grid, want.num_tokens, want.timestamp)
        np.testing.assert_array_equal(part.pixels, want.pixels)
    bare = videos.read(VideoSource(VideoFrames.of(frames[picked])), "v")
    assert [p.timestamp for p in (bare, *bare.crops)] == patch_seconds(np.arange(len(picked)), 2.0, 2)
    with pytest.raises(ImageError, match=r"`v` \(<1 decoded frames of 96 x 64>\) has 1 frame\(s\); the model's video "
                                         r"processor takes at least 2"):
        videos.read(VideoSource(VideoFrames.of(frames[:1])), "v")


def run(model, input_path, out, *flags) -> int:
    code, _, _ = run_inprocess("run", str(input_path), "-o", str(out), "--model", str(model), "--device", "cpu",
                               "--display", "none", "--quiet", "--max-tokens", "6", *map(str, flags))
    return code


def test_video_rows_bad_videos_and_the_plan_through_cbatch(qwen3, tmp_path):
    """Video rows complete with the timestamps in their prompt tokens (the library's chat the same), bad videos are
    error rows naming them (a single frame: Qwen3-VL's processor needs a temporal patch's 2), and `cbatch plan`
    counts the same prompt tokens from the headers."""
    clip = video_bytes(random_frames(4, 64, 64, seed=7), fps=2)  # 4 frames, 2 temporal patches of 4 tokens
    (tmp_path / "clip.avi").write_bytes(clip)
    (tmp_path / "one.avi").write_bytes(video_bytes(random_frames(1, 64, 64), fps=2))
    (tmp_path / "junk.avi").write_bytes(b"this is not a video")
    uri = "data:video/x-msvideo;base64," + base64.b64encode(clip).decode()
    image = "data:image/png;base64," + base64.b64encode(png_bytes(64, 64, seed=1)).decode()
    rows = [
        {"id": "part", "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": uri}}, {"type": "text", "text": "w1 w2"}]}]},
        {"id": "field", "messages": [{"role": "user", "content": "w1 w2"}], "videos": [str(tmp_path / "clip.avi")]},
        {"id": "with-image", "messages": [{"role": "user", "content": "w1 w2"}], "videos": [str(tmp_path / "clip.avi")],
         "images": [image]},
        {"id": "text", "messages": [{"role": "user", "content": "w1 w2"}]},
        {"id": "missing", "messages": [{"role": "user", "content": "w1"}], "videos": [str(tmp_path / "nope.avi")]},
        {"id": "junk", "messages": [{"role": "user", "content": "w1"}], "videos": [str(tmp_path / "junk.avi")]},
        {"id": "one", "messages": [{"role": "user", "content": "w1"}], "videos": [str(tmp_path / "one.avi")]},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(qwen3, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 1
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert out["part"]["completion"] and out["part"]["completion"] == out["field"]["completion"]
    # 2 temporal patches at 0.25 and 1.25 s: each 2 timestamp words, vision start, 4 tokens, vision end
    assert out["part"]["prompt_tokens"] == out["text"]["prompt_tokens"] + 2 + 2 * (2 + 1 + 4 + 1)
    assert out["with-image"]["prompt_tokens"] == out["part"]["prompt_tokens"] + 2 + 4
    assert out["missing"]["error"] == f"`videos[0]` ('{tmp_path}/nope.avi') names a file that does not exist"
    assert out["junk"]["error"].startswith(f"`videos[0]` ('{tmp_path}/junk.avi') cannot be decoded as a video (")
    assert out["one"]["error"] == (f"`videos[0]` ('{tmp_path}/one.avi') has 1 frame(s); the model's video processor "
                                   "takes at least 2 (give a still as an image)")

    from cbatch import LLM, SamplingParams as Params  # the library's chat takes the same video part

    llm = LLM(model=str(qwen3), device="cpu", use_tqdm=False)
    assert llm.chat(rows[0]["messages"], Params(max_tokens=6, temperature=0.0))[0].outputs[0].text == \
        out["part"]["completion"]

    good = [row for row in rows if row["id"] in ("part", "field", "with-image", "text")]
    write_jsonl(tmp_path / "good.jsonl", good)
    code, _, err = run_inprocess("plan", str(tmp_path / "good.jsonl"), "--model", str(qwen3), "--device", "cpu",
                                 "--report", str(tmp_path / "plan.json"), "--no-search")
    assert code == 0, err
    predicted = json.loads((tmp_path / "plan.json").read_text())["predicted"]["prompt_tokens"]
    assert predicted == sum(out[row["id"]]["prompt_tokens"] for row in good)


def test_the_gpu_reserves_largest_frame_bounds_every_whole_video_frame(qwen3, tmp_path):
    """VideoLimits.largest_frame_pixels (the reserve's largest video frame) against the frame sizes of videos of
    2 to 13 frames and many shapes (up to 200:1), uncapped and capped, under the hub's Qwen3-VL bounds (4,096 ..
    25,165,824: half of the top, 12,288 tokens, below its images' 16,384) and small ones where scaling up decides.
    The encoder cache's largest video entry is one such frame (each temporal patch its own entry)."""
    from cbatch.config import EngineConfig
    from cbatch.engine.encoder_memory import encoder_memory
    from cbatch.model.image_processor import VideoLimits

    sides = [1, 3, 16, 31, 33, 50, 64, 97, 200, 333, 640, 1080, 1920, 4000]
    for low, high in ((4096, 25165824), (128 * 1024, 768 * 1024), (64 * 1024, 96 * 1024), (4096, 8192)):
        for cap in (False, True):
            limits = VideoLimits(low, high, cap_pixels_per_frame=cap, max_video_tokens=768, whole_video=True)
            bound, largest = limits.largest_frame_pixels(32), 0
            for frames in range(2, 14):
                for height in sides:
                    for width in sides:
                        try:
                            h, w = whole_video_frame_size(frames, height, width, 32, 2, low,
                                                          limits.video_max_pixels(frames, 32))
                        except ValueError:  # past 200:1
                            continue
                        largest = max(largest, h * w)
            assert largest <= bound, (low, high, cap, largest, bound)
            if (low, high) == (4096, 25165824):
                assert bound == high // 2 == 12288 * 32 * 32

    hub = shutil.copytree(qwen3, tmp_path / "model")
    (hub / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 4096,
                                                                            "longest_edge": 25165824}}))
    memory = encoder_memory(read_checkpoint(hub).spec, torch.float32, hub, EngineConfig(model=str(hub)), 65536)
    assert (memory.largest_video_frame, memory.largest_video) == (12288, 12288)


def test_qwen3_vl_moe_reads_videos_as_qwen3_vl_does(tmp_path):
    """Qwen3-VL-MoE (the same tower and timestamped runs, a Qwen3-MoE decoder): a video row's tokens equal HF
    generate's on the same prompt and frames."""
    path = make_vl_checkpoint("qwen3_vl_moe", tmp_path / "moe")
    (path / "video_preprocessor_config.json").write_text(json.dumps({"size": VIDEO_SIZE}))
    vision = read_checkpoint(path).spec.vision
    engine = make_engine(path, max_model_len=256)
    reader = VideoReader(path, vision)
    clips = [reader.read(VideoSource(video_bytes(random_frames(10, 48, 80, seed=seed), fps=4)), "videos[0]")
             for seed in (1, 2)]
    text = "w1 <|vision_start|> <|video_pad|> <|vision_end|> w2 w3"
    ids = expand_placeholders(engine.tokenizer.encode(text, add_special_tokens=False), clips[:1], vision,
                              engine.tokenizer)
    assert ids.count(VIDEO_TOKEN) == 12  # 3 temporal patches of 4 tokens, each its own run after its time
    outputs = run_requests(engine, [(ids, [clip]) for clip in clips], GREEDY)
    assert len(set(outputs[0])) > 2, "decisive: greedy output is not one repeated token"
    assert outputs[0] != outputs[1], "the video decides the completion"
    assert outputs[0] == hf_vl_greedy(path, ids, clips[:1], GREEDY.max_tokens)
