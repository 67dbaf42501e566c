"""GPU memory a vision-language model's images take beside a text step, reserved before the KV pool is sized
(memory.gpu_step_and_pool; `cbatch plan`'s GPU pool, plan/devices.py, takes the same reserve off):

- the encoder cache full (engine/image_rows.EncoderCache): its rows, at least one largest image or video (the cache
  keeps one entry however large), x the row width (hidden x (1 + deepstack mergers)) x the embeddings' dtype bytes;
- the vision tower's peak activations for the largest call a step makes: one tower forward over dummy frames of
  that many tokens, measured as a text step's are (a run), or counted (`tower_activation_count`: the plan, which
  has no tower). A call takes at most the step's image budget (its token budget, --max-image-tokens-per-step when
  lower), or one image or one temporal patch of a video larger than that alone (engine/tower_calls.py: a video is
  cut between temporal patches); its frames are at most the largest image the job's processor makes (its
  max_pixels: --image-max-pixels, else the model's processor config) or the largest video frame (its max_pixels:
  --video-max-pixels, else the video processor's: model/image_processor.VideoLimits).

The largest video (Qwen2-VL, Qwen2.5-VL) is the video processor's largest frame x its most temporal patches
(max_frames / 2), never more than max_model_len - 1 tokens (a longer prompt is refused before its video is encoded).
A Qwen3-VL video's temporal patches are images of their own (io/videos.py), each its own cache entry: its largest
entry is one frame, at most half the video processor's max_pixels (VideoLimits.largest_frame_pixels).

The tower runs before the language model's forward (`ImageRows.prepare`) and frees its activations but its output
(kept by the cache, counted above), so a step's peak is the larger of the two: text and tower are not added.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cbatch.config import EngineConfig
from cbatch.engine.image_rows import encoder_cache_rows, features_per_row
from cbatch.engine.tower_calls import tower_budget
from cbatch.model.image_processor import image_processor, max_image_tokens, video_limits
from cbatch.model.siglip_spec import SiglipSpec
from cbatch.model.spec import ModelSpec
from cbatch.model.vision_spec import VisionSpec, takes_videos


def encoder_cache_bytes(hidden_size: int, features: int, dtype_bytes: int, largest_image: int) -> int:
    """The encoder cache's bytes when full: max(its rows, one largest image or video) x hidden x features x dtype
    bytes."""
    return max(encoder_cache_rows(features), largest_image) * hidden_size * features * dtype_bytes


def encoder_step_tokens(max_num_batched_tokens: int, max_image_tokens_per_step: int | None,
                        largest_image: int) -> int:
    """The most image tokens one tower call takes: the step's image budget (engine/tower_calls.py), at least one
    largest frame (an image, or a video's temporal patch)."""
    return max(tower_budget(max_num_batched_tokens, max_image_tokens_per_step), largest_image)


def largest_video_tokens(frame_tokens: int, max_temporal_patches: int, max_model_len: int) -> int:
    """The most placeholder tokens one video gets: its largest frame's tokens x its most temporal patches, within
    a prompt (max_model_len - 1 tokens at most); 0 where the model takes no videos (`frame_tokens` 0)."""
    return min(frame_tokens * max_temporal_patches, max_model_len - 1) if frame_tokens else 0


def dummy_grids(vision: VisionSpec | SiglipSpec, tokens: int, largest_image: int) -> list[tuple[int, int, int]]:
    """Patch grids (t, h, w) of frames adding up to at least `tokens` placeholder tokens, each at most
    `largest_image` (Gemma 3: its one square, as many as it takes). A Qwen frame of n tokens is the near-square
    h x w merged tokens with h x w = n (the tower's windows and positions as for a page; a video's temporal patches
    are frames of their own to the tower)."""
    if isinstance(vision, SiglipSpec):
        side = vision.patches_per_side
        return [(1, side, side)] * -(-tokens // vision.mm_tokens_per_image)
    grids, merge = [], vision.merge_size
    while tokens > 0:
        n = min(tokens, largest_image)
        h = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
        grids.append((1, h * merge, n // h * merge))
        tokens -= n
    return grids


def tower_activation_count(vision: VisionSpec | SiglipSpec, patches: int, dtype_bytes: int) -> int:
    """Bytes of the tower's activations over `patches` patches, counted from its shapes (`cbatch plan`; a run
    measures them). Blocks run one after another and free theirs, so per patch: what the forward holds throughout
    (the float32 input patches, the residual stream; Qwen: the float32 rotary cos and sin, Qwen3-VL's deepstack
    features) plus the larger stage of one block: attention (its norm, qkv, the attention's output; Qwen: q's float32
    rotary temporaries, its copy, rotated half and two products) or the MLP (its norm and its intermediate-width
    outputs: the packed gate | up and their activated product when gated, else fc1 and activation)."""
    width, b = vision.hidden_size, dtype_bytes
    qwen = isinstance(vision, VisionSpec)
    held = 4 * vision.patch_dim + b * width
    attention = b * 5 * width
    if qwen:
        deepstack = b * vision.out_hidden_size * len(vision.deepstack_layers) // vision.merge_size**2
        held += 2 * 4 * vision.head_dim + deepstack
        attention += 4 * 4 * width
    mlp = b * (width + (3 if qwen and vision.gated_mlp else 2) * vision.intermediate_size)
    return patches * (held + max(attention, mlp))


@dataclass(frozen=True)
class EncoderMemory:
    """What a vision-language model reserves for its images on the GPU (see the module's docstring)."""

    vision: VisionSpec | SiglipSpec
    hidden_size: int  # the language model's: the embeddings' width, per feature
    dtype: torch.dtype  # the tower's output's (the model's)
    largest_image: int  # the most placeholder tokens one image gets (the job's processor at its max_pixels)
    visual: torch.nn.Module | None = None  # the vision tower with its merger(s), on the GPU (rank 0's); None: counted
    largest_video_frame: int = 0  # the most tokens of one temporal patch of a video (0: the model takes no videos)
    largest_video: int = 0  # the most tokens of one video's cache entry (`largest_video_tokens`; Qwen3-VL: a frame's)

    @property
    def largest_frame(self) -> int:
        """The most tokens one frame of a tower call has: an image's, or a video's temporal patch's."""
        return max(self.largest_image, self.largest_video_frame)

    @property
    def cache_bytes(self) -> int:
        return encoder_cache_bytes(self.hidden_size, features_per_row(self.vision), self.dtype.itemsize,
                                   max(self.largest_image, self.largest_video))

    def step_grids(self, max_num_batched_tokens: int, max_image_tokens_per_step: int | None
                   ) -> list[tuple[int, int, int]]:
        """The dummy frames of a step's largest tower call."""
        tokens = encoder_step_tokens(max_num_batched_tokens, max_image_tokens_per_step, self.largest_frame)
        return dummy_grids(self.vision, tokens, self.largest_frame)

    def tower_peak(self, max_num_batched_tokens: int, max_image_tokens_per_step: int | None) -> int:
        """Bytes one tower forward over a step's largest call allocates beyond what is held: measured on the
        tower's GPU, or counted without one (`tower_activation_count`)."""
        grids = self.step_grids(max_num_batched_tokens, max_image_tokens_per_step)
        patches = sum(t * h * w for t, h, w in grids)
        if self.visual is None:
            return tower_activation_count(self.vision, patches, self.dtype.itemsize)
        device = next(self.visual.parameters()).device
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        pixels = torch.zeros(patches, self.vision.patch_dim, dtype=torch.float32, device=device)
        out = self.visual(pixels, grids)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
        del out, pixels
        torch.cuda.empty_cache()
        return max(0, peak)

    def reserve(self, text_peak: int, max_num_batched_tokens: int, max_image_tokens_per_step: int | None) -> int:
        """A step's peak with images: the larger of the text step's and the tower's, plus the encoder cache full."""
        tower = self.tower_peak(max_num_batched_tokens, max_image_tokens_per_step)
        return max(text_peak, tower) + self.cache_bytes


def encoder_memory(spec: ModelSpec, dtype: torch.dtype, model_dir: Path | None, config: EngineConfig,
                   max_model_len: int, visual: torch.nn.Module | None = None) -> EncoderMemory | None:
    """The images' reserve of a model (None: a text model): its largest image the one the job's processor makes
    (the model's processor config in `model_dir` under `config`'s image pixel bounds), its largest video frame the
    video processor's (`VideoLimits`; a model that takes videos). `visual`: the tower a run measures; None: counted
    (`cbatch plan`)."""
    vision = spec.vision
    if vision is None:
        return None
    largest = max_image_tokens(image_processor(model_dir, vision, config.image_min_pixels, config.image_max_pixels),
                               vision)
    frame = video = 0
    if takes_videos(vision):
        limits = video_limits(model_dir, config.video_min_pixels, config.video_max_pixels, vision.timestamped_videos)
        factor = vision.patch_size * vision.merge_size
        frame = limits.largest_frame_pixels(factor) // factor**2
        # (Qwen3-VL: each temporal patch is an image of its own, its own cache entry: the largest is one frame)
        patches = 1 if vision.timestamped_videos else limits.max_temporal_patches(vision.temporal_patch_size)
        video = largest_video_tokens(frame, patches, max_model_len)
    return EncoderMemory(vision, spec.hidden_size, dtype, largest, visual, frame, video)
