"""What a vision-language model reserves on the GPU for its images before the KV pool (engine/encoder_memory.py): the
encoder cache full and the vision tower's largest step, with real model shapes counted by hand; the dummy image batch
the tower is measured on is a valid batch of the tower (run on CPU)."""
from __future__ import annotations

import re
import shutil
from dataclasses import replace

import pytest
import torch

from cbatch.config import EngineConfig
from cbatch.engine.encoder_memory import EncoderMemory, dummy_grids, encoder_cache_bytes, encoder_step_tokens
from cbatch.engine.memory import bytes_per_block, kv_blocks_in_gpu_memory
from helpers import make_engine
from ops_jobs import run_inprocess, write_jsonl
from gemma3_vision_models import GEMMA_3_4B_CONFIG
from vision_models import make_vl_checkpoint


# Qwen2.5-VL-7B-Instruct's config.json (the fields cbatch reads)
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "hidden_act": "silu",
    "image_token_id": 151655, "vision_start_token_id": 151652, "tie_word_embeddings": False,
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
                      "in_chans": 3}}

def test_encoder_cache_bytes_of_real_shapes():
    # Qwen2.5-VL-7B: hidden 3584, no deepstack, bf16; its processor's max_pixels 12,845,056 = 16,384 tokens of 28 x 28
    # pixels, fewer than the cache's 32,768 rows: 32,768 x 3,584 x 2 bytes
    assert encoder_cache_bytes(3584, 1, 2, largest_image=16384) == 32768 * 3584 * 2 == 234_881_024
    # Qwen3-VL-8B: hidden 4096, 3 deepstack mergers (4 features a row: 8,192 rows), but one largest image (16,384
    # tokens of 32 x 32 pixels) stays in the cache whole: 16,384 x 4,096 x 4 x 2 bytes
    assert encoder_cache_bytes(4096, 4, 2, largest_image=16384) == 16384 * 16384 * 2 == 536_870_912
    # gemma-3-4b: hidden 2560, 256 tokens an image
    assert encoder_cache_bytes(2560, 1, 2, largest_image=256) == 32768 * 2560 * 2


def test_a_steps_image_tokens_and_their_dummy_images():
    from cbatch.model.spec import parse_spec

    assert encoder_step_tokens(8192, None, 16384) == 16384  # one largest image runs alone past the budget
    assert encoder_step_tokens(8192, None, 1280) == 8192
    assert encoder_step_tokens(8192, 2048, 1280) == 2048  # --max-image-tokens-per-step
    assert encoder_step_tokens(2048, 4096, 1280) == 2048  # a step's chunks start images within its budget
    vision = parse_spec(QWEN2_5_VL_7B).vision
    grids = dummy_grids(vision, 8192, 1280)  # 6 pages of 1,280 tokens (32 x 40 merged), one of 512 (16 x 32)
    assert grids == [(1, 64, 80)] * 6 + [(1, 32, 64)]
    assert sum(vision.tokens_for_grid(grid) for grid in grids) == 8192
    assert dummy_grids(vision, 7, 64) == [(1, 2, 14)]  # a prime count: one row of merged tokens
    gemma = parse_spec(GEMMA_3_4B_CONFIG).vision  # every image one 64 x 64 patch square, 256 tokens
    assert encoder_step_tokens(1000, None, 256) == 1000
    assert dummy_grids(gemma, 1000, 256) == [(1, 64, 64)] * 4 and gemma.patch_dim == 3 * 14 * 14


def test_a_steps_reserve_is_the_larger_peak_and_the_cache(monkeypatch):
    """The tower runs before the language model's forward: the larger of the two peaks, not their sum, plus the
    encoder cache full."""
    from cbatch.model.spec import parse_spec

    spec = parse_spec(QWEN2_5_VL_7B)
    encoder = EncoderMemory(spec.vision, spec.hidden_size, torch.bfloat16, largest_image=16384)
    asked = []
    monkeypatch.setattr(EncoderMemory, "tower_peak", lambda self, *args: asked.append(args) or 3 * 2**30)
    assert encoder.cache_bytes == 234_881_024
    assert encoder.reserve(2 * 2**30, 8192, None) == 3 * 2**30 + 234_881_024
    assert encoder.reserve(5 * 2**30, 8192, 4096) == 5 * 2**30 + 234_881_024
    assert asked == [(8192, None), (8192, 4096)]


def test_the_reserve_comes_out_of_the_kv_pool():
    """An 80 GiB GPU at 0.9, 17 GiB in use, a 2 GiB text step: Qwen2.5-VL-7B's encoder cache (234,881,024 bytes)
    takes that many bytes of KV blocks (57,344 bytes a token: 2 x 28 layers x 4 KV heads x 128 x 2)."""
    from cbatch.model.spec import parse_spec

    spec = parse_spec(QWEN2_5_VL_7B)
    config = EngineConfig(model="x", max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=True,
                          gpu_memory_utilization=0.9, block_size=16)
    assert bytes_per_block(spec, torch.bfloat16, 16) == 57344 * 16
    args = (config, spec, torch.bfloat16, 32768, 80 * 2**30, 17 * 2**30)
    text = kv_blocks_in_gpu_memory(*args, 2 * 2**30)
    with_images = kv_blocks_in_gpu_memory(*args, 2 * 2**30 + encoder_cache_bytes(3584, 1, 2, 16384))
    budget = 80 * 2**30 * 0.9 - 19 * 2**30
    assert (text, with_images) == (int(budget // (57344 * 16)), int((budget - 234_881_024) // (57344 * 16)))
    assert text - with_images == 256  # 234,881,024 / 917,504 = 256 blocks exactly


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "gemma3"])
def vl_model(request, tmp_path_factory):
    from gemma3_vision_models import make_gemma3_checkpoint

    path = tmp_path_factory.mktemp(request.param) / "model"
    path = make_gemma3_checkpoint(path) if request.param == "gemma3" else make_vl_checkpoint(request.param, path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_tower_runs_the_dummy_batch_and_the_reader_knows_the_largest_image(vl_model):
    """The dummy images are a batch the tiny towers take (a step of 75 image tokens, at most 64 an image: Qwen's
    max_pixels (2 x patch)^2 x 64; Gemma 3's tiny images are 9 tokens each, 9 of them)."""
    from cbatch.model.image_processor import image_processor, max_image_tokens

    model = make_engine(vl_model, max_model_len=64).runner.model
    vision = model.spec.vision
    largest = max_image_tokens(image_processor(vl_model, vision), vision)
    grids = dummy_grids(vision, 75, largest)
    pixels = torch.zeros(sum(t * h * w for t, h, w in grids), vision.patch_dim)
    out = model.visual(pixels, grids)
    if vision.tower == "siglip":
        assert largest == 9 and len(grids) == 9 and out.shape[0] == 81
    else:
        assert largest == 64 and len(grids) == 2 and out.shape[0] == 75


def test_the_gpu_sizing_takes_the_reserve(monkeypatch):
    """`gpu_step_and_pool` (the GPU's sizing, its CUDA measurements stubbed): the pool is sized with the step's
    reserve for images in place of the text step's peak, the tower measured at the step's limits."""
    from cbatch.engine import memory
    from cbatch.model.spec import parse_spec

    spec = parse_spec(QWEN2_5_VL_7B)
    encoder = EncoderMemory(spec.vision, spec.hidden_size, torch.bfloat16, largest_image=16384)
    asked, sized_with = [], []
    monkeypatch.setattr(memory, "profile_activation_peak", lambda make_runner, config, length: 2**30)
    monkeypatch.setattr(EncoderMemory, "tower_peak", lambda self, *args: asked.append(args) or 3 * 2**30)
    monkeypatch.setattr(memory, "gpu_kv_blocks", lambda *args: sized_with.append(args[-1]) or 10**6)
    config = EngineConfig(model="x", max_num_seqs=128, max_num_batched_tokens=4096, max_image_tokens_per_step=1024)
    sized, blocks = memory.gpu_step_and_pool(config, spec, torch.bfloat16, 4096, None, encoder)
    assert (sized.max_num_seqs, sized.max_num_batched_tokens, blocks) == (128, 4096, 10**6)
    assert asked == [(4096, 1024)]
    assert sized_with == [3 * 2**30 + 234_881_024]
    sized_with.clear()
    memory.gpu_step_and_pool(config, spec, torch.bfloat16, 4096, None)  # a text model: its step's peak alone
    assert sized_with == [2**30]


# Qwen2.5-VL-7B-Instruct's preprocessor_config.json (the fields cbatch reads)
QWEN2_5_VL_7B_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor"}
# one patch of its tower counted (bf16): held through the forward 4 x 1,176 (float32 pixels) + 2 x 1,280 (residual)
# + 2 x 4 x 80 (float32 rotary cos, sin) = 7,904; a block's attention stage 2 x 5 x 1,280 + 4 x 4 x 1,280 (q's float32
# rotary temporaries) = 33,280, larger than its MLP stage 2 x (1,280 + 4 x 3,420) = 29,920
QWEN2_5_VL_7B_PATCH_BYTES = 7904 + 33280


def config_folder(path, config: dict, preprocessor: dict | None = None):
    """A checkpoint folder of config.json (and preprocessor_config.json) alone: enough to plan, or to size a reserve."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path


def test_the_jobs_image_max_pixels_sizes_the_reserve(tmp_path):
    """The reserve's largest image is the one the job's processor makes: Qwen2.5-VL-7B's max_pixels 12,845,056 are
    16,384 tokens of 28 x 28 pixels, --image-max-pixels 1,003,520 are 1,280. A step of 8,192 tokens encodes one
    16,384-token image alone (65,536 patches) under the model's bound, 8,192 tokens (32,768 patches) under the job's:
    32,768 x 41,184 bytes less of tower (counted; the cache is its 32,768 rows either way). A bound above the model's
    reserves more: 32,768-token images, 131,072 patches."""
    from cbatch.engine.encoder_memory import encoder_memory, tower_activation_count
    from cbatch.model.loader import read_checkpoint

    folder = config_folder(tmp_path / "qwen2.5-vl-7b", QWEN2_5_VL_7B, QWEN2_5_VL_7B_PREPROCESSOR)
    spec = read_checkpoint(folder).spec
    assert tower_activation_count(spec.vision, 1, 2) == QWEN2_5_VL_7B_PATCH_BYTES == 41_184

    def reserve(**bounds) -> tuple[int, int]:
        encoder = encoder_memory(spec, torch.bfloat16, folder, EngineConfig(model=str(folder), **bounds), 32768)
        return encoder.largest_image, encoder.reserve(2**30, 8192, None)  # (a 1 GiB text step: the tower's larger)

    assert reserve() == (16384, 65536 * 41_184 + 234_881_024) == (16384, 2_933_915_648)
    assert reserve(image_max_pixels=1_003_520) == (1280, 32768 * 41_184 + 234_881_024)
    assert reserve()[1] - reserve(image_max_pixels=1_003_520)[1] == 1_349_517_312
    assert reserve(image_max_pixels=28 * 28 * 32768) == (32768, 131072 * 41_184 + 234_881_024)
    # a text model has none
    text = parse_text_spec()
    assert encoder_memory(text, torch.bfloat16, None, EngineConfig(), 32768) is None


def test_the_run_sizes_its_reserve_with_the_jobs_bounds(vl_model):
    """build_engine's reserve (on a GPU; its construction only, here) reads the engine config's pixel bounds: the
    tiny Qwen processors' 64-token images, 16 under --image-max-pixels (merge x patch)^2 x 16."""
    from types import SimpleNamespace

    from cbatch.engine.build import _encoder_memory
    from cbatch.model.loader import read_checkpoint

    checkpoint = read_checkpoint(vl_model)
    resolved = SimpleNamespace(device=torch.device("cuda"), checkpoint=checkpoint, dtype=torch.bfloat16,
                               max_model_len=64)
    model = SimpleNamespace(spec=checkpoint.spec, visual=torch.nn.Identity())
    if checkpoint.spec.vision.tower == "siglip":  # Gemma 3: its one square (pixel bounds are refused for it)
        assert _encoder_memory(resolved, model, EngineConfig()).largest_image == 9
        return
    assert _encoder_memory(resolved, model, EngineConfig()).largest_image == 64
    vision = checkpoint.spec.vision
    config = EngineConfig(image_max_pixels=(vision.patch_size * vision.merge_size) ** 2 * 16)
    encoder = _encoder_memory(resolved, model, config)
    assert encoder.largest_image == 16 and encoder.visual is model.visual
    assert _encoder_memory(SimpleNamespace(**{**vars(resolved), "device": torch.device("cpu")}), model, config) is None


def parse_text_spec():
    """Qwen2.5-VL-7B's language model alone, as a text checkpoint (Qwen2ForCausalLM of the same shapes)."""
    from cbatch.model.spec import parse_spec

    return parse_spec(text_config_of(QWEN2_5_VL_7B))


def text_config_of(config: dict) -> dict:
    drop = ("vision_config", "image_token_id", "vision_start_token_id", "rope_scaling")
    return {**{k: v for k, v in config.items() if k not in drop}, "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2"}


def test_the_plans_gpu_pool_takes_the_images_reserve_as_a_run_does(tmp_path):
    """`cbatch plan --device-kind h100` on a Qwen2.5-VL-7B-shaped config-only folder against its language model
    alone: the weights grow by the tower (676,550,144 parameters x 2 bytes: tests/test_tower_params.py); the same
    text step (1,553,989,632 bytes counted: 8,192 tokens x 56,832 values x 2 bytes + 1,024 rows x 152,064 float32
    logits), but the step's peak is the images' reserve (engine/encoder_memory.py, as a run's, the tower's
    activations counted): 65,536 patches x 41,184 bytes + the 234,881,024-byte cache, 1,379,926,016 bytes more.
    With the tower's 1,353,100,288 bytes: 2,978.8 blocks of 16 tokens at 917,504 bytes, so 2,979 fewer blocks
    (each pool rounds down): 47,664 fewer KV tokens."""
    from cbatch.engine.memory import with_step_limits
    from cbatch.engine.resolve import resolve_model
    from cbatch.plan.devices import activation_estimate, gpu_kind

    vl_folder = config_folder(tmp_path / "qwen2.5-vl-7b", QWEN2_5_VL_7B, QWEN2_5_VL_7B_PREPROCESSOR)
    text_folder = config_folder(tmp_path / "qwen2.5-7b", text_config_of(QWEN2_5_VL_7B))
    cuda = torch.device("cuda")
    config = with_step_limits(EngineConfig(max_model_len=32768), cuda)  # as the plan sizes a GPU's step
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 8192)
    h100 = gpu_kind("H100")
    vl, text = (resolve_model(replace(config, model=str(folder)), device=cuda) for folder in (vl_folder, text_folder))
    tower = 676_550_144 * 2
    assert h100.weight_bytes_per_rank(config, vl) - h100.weight_bytes_per_rank(config, text) == tower == 1_353_100_288
    assert activation_estimate(config, vl) == activation_estimate(config, text) == 1_553_989_632
    reserve = 65536 * QWEN2_5_VL_7B_PATCH_BYTES + 234_881_024
    assert reserve - 1_553_989_632 == 1_379_926_016 == 1504 * 917_504
    vl_blocks, text_blocks = (h100.kv_pool(config, model).num_blocks for model in (vl, text))
    assert 2978 < (1_379_926_016 + tower) / 917_504 < text_blocks - vl_blocks == 2979
    assert (text_blocks - vl_blocks) * config.block_size == 47_664
    # what `cbatch plan` reports: the KV tokens in the pool
    write_jsonl(tmp_path / "in.jsonl", [{"id": "0", "prompt_token_ids": [1, 2, 3, 4], "max_tokens": 4}])
    pool_tokens = []
    for folder in (vl_folder, text_folder):
        code, stdout, err = run_inprocess("plan", str(tmp_path / "in.jsonl"), "--model", str(folder), "--device-kind",
                                          "h100", "--max-model-len", "32768", "--no-search")
        assert code == 0, err
        pool_tokens.append(int(re.search(r"([\d,]+) tokens in the pool", stdout)[1].replace(",", "")))
    assert pool_tokens == [vl_blocks * 16, text_blocks * 16] and pool_tokens[1] - pool_tokens[0] == 47_664
    # a lower --image-max-pixels (1,280-token images): the tower's 32,768 patches (1,349,517,312 bytes) are below
    # the text step, so the step's peak is the text step's and the cache (with the tower's weights: 1,730.8 blocks)
    lower = replace(config, image_max_pixels=1_003_520)
    weights = h100.weight_bytes_per_rank(config, vl)
    assert 32768 * QWEN2_5_VL_7B_PATCH_BYTES < 1_553_989_632
    assert h100.kv_pool(lower, vl).num_blocks == kv_blocks_in_gpu_memory(
        lower, vl.spec, torch.bfloat16, 32768, 80 * 2**30, weights, 1_553_989_632 + 234_881_024) == text_blocks - 1731


def test_tower_calls_cut_videos_between_temporal_patches():
    """A step's images and videos in tower calls of at most the budget (engine/tower_calls.py): images whole (one past
    the budget alone), a video (t temporal patches) in pieces of budget // its tokens a temporal patch."""
    from cbatch.engine.tower_calls import tower_budget, tower_calls

    # an image of 10, a video of 4 temporal patches of 16 tokens (pieces of 2), an image of 30; budget 40
    assert tower_calls([(10, 1), (64, 4), (30, 1)], 40) == [[(0, 0, 1)], [(1, 0, 2)], [(1, 2, 4)], [(2, 0, 1)]]
    assert tower_calls([(10, 1), (8, 2), (20, 1)], 40) == [[(0, 0, 1), (1, 0, 2), (2, 0, 1)]]  # all within it
    assert tower_calls([(50, 1), (5, 1)], 40) == [[(0, 0, 1)], [(1, 0, 1)]]  # a lone image past the budget
    assert tower_calls([(100, 2)], 40) == [[(0, 0, 1)], [(0, 1, 2)]]  # a temporal patch past it: one a call
    assert tower_calls([(10, 1), (64, 4)], None) == [[(0, 0, 1), (1, 0, 4)]]  # no limit: one call
    assert tower_budget(8192, None) == 8192 and tower_budget(8192, 2048) == 2048 and tower_budget(2048, 4096) == 2048


QWEN2_5_VL_7B_VIDEO = {**QWEN2_5_VL_7B, "video_token_id": 151656}  # (the real config has it)


def test_videos_in_the_reserve(tmp_path):
    """Qwen2.5-VL-7B with its video token: its preprocessor_config.json alone gives video frames the images' bounds
    (16,384 tokens a temporal patch, as transformers' video processor reads that file), which --image-max-pixels
    leaves alone: a tower call still takes a 16,384-token frame (65,536 patches), not 8,192 tokens. A
    video_preprocessor_config.json of 602,112 pixels (768 tokens a frame) lets the job's 1,280-token images bound the
    call to the step's 8,192 tokens (32,768 patches), as --video-max-pixels 602,112 does. A video is at most
    max_model_len - 1 tokens (65,535 at 65,536: the cache grows past its 32,768 rows to hold it)."""
    import json

    from cbatch.engine.encoder_memory import encoder_memory
    from cbatch.model.loader import read_checkpoint

    folder = config_folder(tmp_path / "qwen2.5-vl-7b", QWEN2_5_VL_7B_VIDEO, QWEN2_5_VL_7B_PREPROCESSOR)
    spec = read_checkpoint(folder).spec

    def encoder(max_model_len: int = 32768, **bounds):
        return encoder_memory(spec, torch.bfloat16, folder, EngineConfig(model=str(folder), **bounds), max_model_len)

    plain, lowered = encoder(), encoder(image_max_pixels=1_003_520)
    assert (plain.largest_image, plain.largest_video_frame, plain.largest_video) == (16384, 16384, 32767)
    assert (lowered.largest_image, lowered.largest_video_frame) == (1280, 16384)
    for memory in (plain, lowered):
        assert memory.step_grids(8192, None) == [(1, 256, 256)]  # one 128 x 128-token frame
        assert memory.reserve(2**30, 8192, None) == 65536 * QWEN2_5_VL_7B_PATCH_BYTES + 234_881_024
    longer = encoder(65536)
    assert longer.largest_video == 65535 and longer.cache_bytes == 65535 * 3584 * 2 == 469_754_880
    assert longer.reserve(2**30, 8192, None) == 65536 * QWEN2_5_VL_7B_PATCH_BYTES + 469_754_880

    # the job's --video-max-pixels bounds the frames as that file would
    flagged = encoder(image_max_pixels=1_003_520, video_max_pixels=768 * 28 * 28)
    assert flagged.largest_video_frame == 768
    assert flagged.reserve(2**30, 8192, None) == 32768 * QWEN2_5_VL_7B_PATCH_BYTES + 234_881_024
    (folder / "video_preprocessor_config.json").write_text(json.dumps({"max_pixels": 768 * 28 * 28}))
    capped = encoder(image_max_pixels=1_003_520)
    assert (capped.largest_video_frame, capped.largest_video) == (768, 32767)  # 384 temporal patches pass 32,767
    assert capped.step_grids(8192, None) == [(1, 64, 80)] * 6 + [(1, 32, 64)]  # frames of at most 1,280 tokens
    assert capped.reserve(2**30, 8192, None) == 32768 * QWEN2_5_VL_7B_PATCH_BYTES + 234_881_024
    assert encoder(2048).largest_video == 2047  # (a short context bounds a video below max_frames)


def test_the_plans_gpu_pool_takes_the_videos_reserve(tmp_path):
    """`cbatch plan`'s GPU pool takes the run's reserve with videos (the same encoder_memory, at the plan's
    max_model_len): at 65,536 tokens Qwen2.5-VL-7B's cache holds a 65,535-token video, beside the 16,384-token frame's
    tower call (65,536 patches counted)."""
    from cbatch.engine.memory import with_step_limits
    from cbatch.engine.resolve import resolve_model
    from cbatch.plan.devices import activation_estimate, gpu_kind

    folder = config_folder(tmp_path / "qwen2.5-vl-7b", QWEN2_5_VL_7B_VIDEO, QWEN2_5_VL_7B_PREPROCESSOR)
    cuda = torch.device("cuda")
    config = with_step_limits(EngineConfig(model=str(folder), max_model_len=65536), cuda)
    model = resolve_model(config, device=cuda)
    h100 = gpu_kind("H100")
    peak = max(activation_estimate(config, model), 65536 * QWEN2_5_VL_7B_PATCH_BYTES) + 469_754_880
    assert h100.kv_pool(config, model).num_blocks == kv_blocks_in_gpu_memory(
        config, model.spec, torch.bfloat16, 65536, 80 * 2**30, h100.weight_bytes_per_rank(config, model), peak)


def test_the_encoder_cache_makes_room_before_the_tower_runs():
    """A step's new embeddings (a long video's) go beside what the cache keeps, so it evicts its least recently
    used entries first, never the ones the step reads (`keep`), until they fit in its rows or none is left."""
    from cbatch.engine.image_rows import EncoderCache

    cache = EncoderCache(max_tokens=10)
    for digest, tokens in (("a", 4), ("b", 3), ("c", 3)):
        cache.put(digest, torch.zeros(tokens, 2))
    cache.make_room(5, keep={"a"})  # "b" goes (3 free), then "c" (6 free): "a" stays though least recent
    assert [d for d in ("a", "b", "c") if cache.get(d) is not None] == ["a"]
    cache.put("d", torch.zeros(2, 2))
    cache.make_room(20, keep={"d"})  # more than its rows: all but what the step reads
    assert [d for d in ("a", "d") if cache.get(d) is not None] == ["d"]
    cache.make_room(1, keep=set())  # room already: nothing goes
    assert cache.get("d") is not None
