"""Tiny random Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints (written by transformers itself) with a
word-level tokenizer, a Qwen-style chat template that puts `<|vision_start|> <|image_pad|> <|vision_end|>` where a
message has an image part (`<|video_pad|>`: a video part), and the PIL image processor's preprocessor_config.json; HF `generate` on the same prompt as
the reference; and a counter of what a job does with its images (`ImageWatch`)."""
from __future__ import annotations

import contextlib
import io
import json
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import torch

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
WORDS = [f"w{i}" for i in range(300)]
VOCAB = 320
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = (SPECIALS.index(t) for t in
                                                      ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }} "
    "{% elif part['type'] == 'video' %}<|vision_start|> <|video_pad|> <|vision_end|> "
    "{% else %}<|vision_start|> <|image_pad|> <|vision_end|> {% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.3,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    # windows of 56 pixels = 2 x 2 merged tokens, so the test images have several (edge windows smaller)
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, window_size=56,
                       fullatt_block_indexes=[1]),
    # a 4 x 4 learned position grid (resampled to every test image's), deepstack features from blocks 0 and 1 added
    # after the decoder's layers 0 and 1 (of 3)
    "qwen3_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=16,
                     num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
}
VISION["qwen3_vl_moe"] = VISION["qwen3_vl"]  # the same tower
# Qwen3-VL-MoE: every decoder layer 4 experts, top 2, 24 wide (gate/up [E, 48, 64] never square)
TEXT_OVERRIDES = {"qwen3_vl": dict(num_hidden_layers=3, head_dim=16),
                  "qwen3_vl_moe": dict(num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=24)}
# Qwen3-VL's video timestamps ("<1.4 seconds>": two words) the tests' videos give, in Qwen3-VL checkpoints' vocabularies
TIMESTAMP_WORDS = ["seconds>", "<0.2", "<1.2", "<1.4", "<2.2", "<3.2"]
PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16}  # pixels per patch side (x 2 x 2 per image token)


def make_tokenizer(path: Path, specials: list[str] = SPECIALS, chat_template: str = CHAT_TEMPLATE, words: int = 300,
                   extra: list[str] = ()):
    """A word-level tokenizer: `specials` (pad, eos, bos, unk and the model's own), then w0 .. w{words - 1}, then the
    `extra` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(words)] + list(extra))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", additional_special_tokens=specials[4:])
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


def vl_model(kind: str, vision: dict | None = None):
    """transformers' tiny `kind` (qwen2_vl | qwen2_5_vl | qwen3_vl | qwen3_vl_moe) model at its own random init;
    `vision`: fields over its vision config's."""
    import transformers

    cls, model_cls = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
                      "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
                      "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
                      "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration")}[kind]
    text = {**TEXT, **TEXT_OVERRIDES.get(kind, {})}
    config = getattr(transformers, cls)(text_config=text, vision_config={**VISION[kind], **(vision or {})}, image_token_id=IMAGE_TOKEN,
                                        video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                                        vision_end_token_id=VISION_END, eos_token_id=2, tie_word_embeddings=False,
                                        architectures=[model_cls])
    return getattr(transformers, model_cls)(config).eval()


def make_vl_checkpoint(kind: str, path: Path, seed: int = 0, hub_experts: bool = True,
                       vision: dict | None = None) -> Path:
    """A tiny `kind` (qwen2_vl | qwen2_5_vl | qwen3_vl | qwen3_vl_moe) checkpoint with its tokenizer and
    preprocessor_config.json at `path`. Decisive: a wide text init (routers and experts too), and the mergers' outputs
    scaled so images (and deepstack) move the logits. Qwen3-VL-MoE's stacked experts are written as the hub's
    checkpoints store them ([E, in, out]; `hub_experts=False`: as transformers 5 saves them, [E, out, in]); `vision`:
    fields over the vision config's."""
    torch.manual_seed(seed)
    model = vl_model(kind, vision)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and param.dim() >= 2:
                param.normal_(0.0, 0.3)
            elif "visual" in name and param.dim() >= 2:
                param.normal_(0.0, 0.2)
        visual = model.model.visual
        if kind.startswith("qwen3_vl"):
            for merger in (visual.merger, *visual.deepstack_merger_list):
                merger.linear_fc2.weight.mul_(8.0)
        else:
            visual.merger.mlp[2].weight.mul_(8.0)
    model.save_pretrained(path)
    if kind == "qwen3_vl_moe" and hub_experts:
        _transpose_stacked_experts(path / "model.safetensors")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": (2 * PATCH[kind]) ** 2,
        "max_pixels": (2 * PATCH[kind]) ** 2 * 64, "patch_size": PATCH[kind], "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    make_tokenizer(path, extra=TIMESTAMP_WORDS if kind.startswith("qwen3_vl") else ())
    return path


def _transpose_stacked_experts(file: Path) -> None:
    """Rewrites `file` with its stacked experts (`mlp.experts.gate_up_proj` / `down_proj`) transposed in their last two
    dimensions: [E, out, in] as transformers 5 saves them -> [E, in, out] as Qwen3-VL-MoE's hub checkpoints."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    for name, tensor in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = tensor.transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def read_test_images(path: Path, sizes: list[tuple[int, int]]) -> list:
    """Random PNGs of `sizes` (seeds 0, 1, ...) and a second one of sizes[0] (seed 99), through the checkpoint's own
    image processor: `PromptImage`s."""
    from cbatch.io.images import ImageReader
    from cbatch.model.loader import read_checkpoint

    reader = ImageReader(path, read_checkpoint(path).spec.vision)
    made = [reader.read(png_bytes(h, w, seed), f"image{seed}") for seed, (h, w) in enumerate(sizes)]
    return made + [reader.read(png_bytes(*sizes[0], seed=99), "twin")]


def run_requests(engine, requests, params) -> list[list[int]]:
    """Every (prompt ids, images) request through `engine` at once with `params`; their completions in order."""
    seqs = [engine.add_request(ids, params, images=imgs) for ids, imgs in requests]
    assert not any(seq.error for seq in seqs), [seq.error for seq in seqs]
    while engine.has_unfinished():
        engine.step()
    return [seq.output_ids for seq in seqs]


@contextlib.contextmanager
def without_torchvision(monkeypatch, name: str):
    """transformers' module `name` (a video processor's). It imports torchvision, which it needs only to resize
    pixels: where torchvision is missing, the module is imported over empty stand-ins (its settings, config-file
    handling, sampling and size rule need none) and forgotten afterwards."""
    import importlib
    import sys
    import types

    from transformers.utils import is_torchvision_available

    if is_torchvision_available():  # (cached False before any stand-in goes in)
        yield importlib.import_module(name)
        return
    for part in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        monkeypatch.setitem(sys.modules, part, types.ModuleType(part))
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)


def png_bytes(height: int, width: int, seed: int) -> bytes:
    """A random RGB PNG."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def video_bytes(frames: list[np.ndarray], fps: int = 4) -> bytes:
    """An AVI of `frames` (uint8 [H, W, 3] each) at `fps`, PNG-coded: lossless, so decoding gives them back."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="avi") as out:
        stream = out.add_stream("png", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "rgb24"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


def random_frames(count: int, height: int, width: int, seed: int = 0) -> list[np.ndarray]:
    """`count` random RGB frames."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


_HF_MODELS: dict[Path, object] = {}


def hf_model(path: Path):
    """transformers' model of the checkpoint, float32 (loaded once per checkpoint)."""
    import transformers

    if path not in _HF_MODELS:
        config = json.loads((path / "config.json").read_text())
        _HF_MODELS[path] = getattr(transformers, config["architectures"][0]).from_pretrained(path, dtype=torch.float32).eval()
    return _HF_MODELS[path]


def hf_vl_greedy(path: Path, prompt_ids: list[int], images, max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, on the same prompt ids (placeholders expanded) and the same preprocessed images and
    videos (Qwen2.5-VL's videos with their seconds per temporal patch: time_interval / tokens_per_second; Qwen3-VL's
    as one video of all its temporal patches)."""
    model = hf_model(path)
    ids = torch.tensor([prompt_ids])
    kwargs = {}
    stills, videos = [im for im in images or () if not im.video], [im for im in images or () if im.video]
    if images:
        kwargs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int() + 2 * (ids == VIDEO_TOKEN).int()
    if stills:
        kwargs.update(pixel_values=torch.from_numpy(np.concatenate([im.patches() for im in stills])),
                      image_grid_thw=torch.tensor([im.grid for im in stills]))
    if videos:  # (a Qwen3-VL video: its first temporal patch, its crops the others)
        kwargs.update(pixel_values_videos=torch.from_numpy(np.concatenate(
                          [part.patches() for im in videos for part in (im, *im.crops)])),
                      video_grid_thw=torch.tensor([(sum(part.grid[0] for part in (im, *im.crops)), *im.grid[1:])
                                                   for im in videos]))
        per_second = getattr(model.config.vision_config, "tokens_per_second", None)
        if per_second:  # Qwen2.5-VL
            kwargs["second_per_grid_ts"] = torch.tensor([im.time_interval / per_second for im in videos])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


class ImageWatch:
    """While active (`with ImageWatch() as watch:`), counts what a job does with its images, without timing: the
    images the reader opens (`opened`), the decoded ones alive at once (their pixel arrays, each watched by a
    weakref; `peak_alive`), and for each image opened the rows the executor had returned by then (`done_at_open`)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self.opened = self.alive = self.peak_alive = self.done = 0
        self.done_at_open: list[int] = []
        self.on_open: Callable[[int], object] | None = None  # called with k when the k-th image is opened
        self._undo: list = []

    def __enter__(self) -> "ImageWatch":
        from cbatch.io.images import ImageReader
        from cbatch.run.executor import LocalExecutor

        read, poll = ImageReader.read, LocalExecutor.poll
        watch = self

        def counted_read(reader, source, name, *args):
            with watch._lock:
                watch.opened += 1
                watch.done_at_open.append(watch.done)
                if watch.on_open is not None:
                    watch.on_open(watch.opened)
            image = read(reader, source, name, *args)
            with watch._lock:
                watch.alive += 1
                watch.peak_alive = max(watch.peak_alive, watch.alive)
            weakref.finalize(image.pixels, watch._freed)
            return image

        def counted_poll(executor):
            results = poll(executor)
            with watch._lock:
                watch.done += sum(result.last for result in results)
            return results

        ImageReader.read, LocalExecutor.poll = counted_read, counted_poll
        self._undo = [(ImageReader, "read", read), (LocalExecutor, "poll", poll)]
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)

    def _freed(self) -> None:
        with self._lock:
            self.alive -= 1
