"""Images as a row feature (row_features.py): the rows whose prompt has images get their placeholder tokens' embeddings
from the vision tower, and M-RoPE positions (model/mrope.py); Gemma 3's rows their image runs, which the attention
takes both ways (`StepInputs.image_spans`).

Per step: the build records each image row's chunk (`add_row`; a quiet decode is never recorded: it needs only its
`delta`, read for every scheduled row by `order_keys`); `fill` shifts the rotary positions of image rows by their
delta (text positions are equal on the three axes, so a step without image placeholders keeps 1-D positions and its
decode graph), and for a step whose chunks meet image placeholders writes the 3-D positions and the embedding rows
each chunk takes: a chunk may end inside an image's run, and the next takes the rest. `prepare` encodes every image
of the step that the encoder cache lacks, in vision-tower calls of at most the step's image budget (a video cut
between temporal patches: engine/tower_calls.py), then gathers the slices. The cache (`EncoderCache`,
keyed by the image's digest) keeps an image encoded once across its row's chunks, preemptions and rows sharing it.
A step's images release their pixels once read (`PromptImage.release`): a row holds float32 patches only until its
images are encoded; an image the cache dropped before its row's prefill consumed it (a preempted row, a chunk after
an eviction) is read again from its source (`PromptImage.patches`).

Tensor parallelism: every rank holds the vision tower whole (the language model is split as for text). Rank 0 alone
reads images and keeps the encoder cache; the workers get the step's image slices without pixels (`for_workers`).
The images the cache lacks are encoded a share on each rank (engine/tower_shares.py: rank 0 sends each worker its
images' patches and gathers their embeddings), then rank 0 broadcasts the step's gathered embeddings [image rows,
hidden]; every rank puts the same values in place of its placeholders, rank 0's bit for bit.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import torch

from cbatch.engine.images import PromptImage
from cbatch.engine.row_features import RowFeature
from cbatch.engine.sequence import Sequence
from cbatch.engine.step_inputs import StepInputs
from cbatch.engine.tower_calls import Item, encode
from cbatch.engine.tower_shares import assign_ranks, encode_shared
from cbatch.model.decoder import LlamaForCausalLM

ENCODER_CACHE_TOKENS = 32768  # embeddings kept past their step (LRU): a few pages' worth; a 7B's: 0.22 GiB in bf16


def features_per_row(vision) -> int:
    """Features an image token's row carries: its embedding, then (Qwen3-VL) one per deepstack merger."""
    return 1 + len(vision.deepstack_layers)


def encoder_cache_rows(features: int) -> int:
    """The encoder cache's rows for rows of `features` features each (the embedding, then one per deepstack merger):
    wider rows, fewer of them, the same memory."""
    return ENCODER_CACHE_TOKENS // features


class EncoderCache:
    """digest -> the image's embeddings [num_tokens, hidden] (Qwen3-VL: [num_tokens, hidden * (1 + deepstack)], its
    deepstack features beside them) on the device, least recently used evicted past
    `max_tokens` (never the entries the current step reads: `trim` runs after the gather)."""

    def __init__(self, max_tokens: int = ENCODER_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._tokens = 0

    def get(self, digest: str) -> torch.Tensor | None:
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
        return entry

    def put(self, digest: str, embeds: torch.Tensor) -> None:
        self._entries[digest] = embeds
        self._tokens += embeds.shape[0]

    def make_room(self, tokens: int, keep: set[str]) -> None:
        """Evicts the least recently used entries outside `keep` until `tokens` more fit in `max_tokens` (or none
        outside it is left)."""
        for digest in [d for d in self._entries if d not in keep]:
            if self._tokens + tokens <= self.max_tokens:
                return
            self._tokens -= self._entries.pop(digest).shape[0]

    def trim(self) -> None:
        """Evicts the least recently used entries past `max_tokens`, the most recent one always kept."""
        self.make_room(0, keep={next(reversed(self._entries))} if self._entries else set())

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0


class ImageRows(RowFeature):
    """The image rows of a vision-language model's steps (see the module's docstring)."""

    def __init__(self, model: LlamaForCausalLM, tower_tokens: int | None = None) -> None:
        self.tower_tokens = tower_tokens  # the most image tokens one tower call takes (None: no limit)
        self.visual = model.visual  # whole on every rank; under tensor parallelism each encodes a share (`prepare`)
        self.patch_width = model.spec.vision.patch_dim  # values per patch row the tower takes
        self.comm = model.comm
        self.embed_dtype = model.embed_tokens.weight.dtype  # the embeddings' (the broadcast's) dtype
        self.mrope = bool(model.spec.vision.mrope_section)  # Qwen2-VL: 3-D positions; Gemma 3: 1-D
        # Qwen3-VL's rows carry their deepstack features too (model/vision_qwen3.py): wider rows, fewer of them in
        # the same memory
        features = features_per_row(model.spec.vision)
        self.row_width = model.spec.hidden_size * features
        self.cache = EncoderCache(encoder_cache_rows(features))
        self.images_encoded = 0  # vision-tower runs per image (an image encoded again after eviction counts again)
        self.image_tokens_encoded = 0
        self.images_on_workers = 0  # of those, encoded by another tensor-parallel rank than rank 0
        self._deltas: np.ndarray | None = None
        self._forward: dict[str, Any] = {}
        self.start_step()

    def reset(self) -> None:
        self.cache.clear()
        # (a bench's next trial counts its own)
        self.images_encoded = self.image_tokens_encoded = self.images_on_workers = 0

    def order_keys(self, scheduled: list[tuple[Sequence, int]]) -> np.ndarray | None:
        deltas = [seq.images.delta if seq.images is not None else 0 for seq, _ in scheduled]
        self._deltas = np.asarray(deltas, dtype=np.int64) if any(seq.images is not None for seq, _ in scheduled) else None
        return None

    def start_step(self) -> None:
        self.chunks: list[tuple[Sequence, int, int, int]] = []  # (seq, first token, tokens, first flat row)

    def add_row(self, seq: Sequence, num_new: int, offset: int) -> bool:
        # NOTE: a chunk of the prompt's last token alone is not recorded (a quiet decode may take it): that token is
        # text (engine/images.seq_images), at index + delta on every axis, which `fill`'s shift gives it
        if seq.images is not None and seq.num_computed < seq.images.prompt_len - 1:
            self.chunks.append((seq, seq.num_computed, num_new, offset))
        return False

    def fill(self, inputs: StepInputs, order: np.ndarray | slice, q_lens: np.ndarray) -> None:
        if self._deltas is None:
            return
        positions = inputs.positions + np.repeat(self._deltas[order], q_lens)  # past the prompt: index + delta
        slices: list[tuple[int, PromptImage, int, int]] = []
        for seq, start, num_new, offset in self.chunks:  # prompt tokens: the table (text equal on every axis)
            images = seq.images
            stop = min(start + num_new, images.prompt_len)
            positions[offset : offset + stop - start] = images.positions[0, start:stop]
            slices += [(offset + run + first - start, image, first, end)
                       for run, image, first, end in images.overlapping(start, stop)]
        inputs.positions = positions
        inputs.image_slices = slices
        spans: dict[int, list[tuple[int, int]]] = {}
        for seq, start, num_new, offset in self.chunks:
            if seq.images.bidirectional:  # Gemma 3: the chunk's image runs (whole), attended both ways
                overlapping = seq.images.overlapping(start, start + num_new)
                runs = [(run + first, run + end) for run, _, first, end in overlapping]
                if runs:
                    spans[offset] = runs
        inputs.image_spans = spans or None
        if slices and self.mrope:  # 3-D positions where the chunks meet images
            mrope = np.broadcast_to(positions, (3, positions.shape[0])).copy()  # [3, T]
            for seq, start, num_new, offset in self.chunks:
                stop = min(start + num_new, seq.images.prompt_len)
                mrope[:, offset : offset + stop - start] = seq.images.positions[:, start:stop]
            inputs.mrope_positions = mrope

    def prepare(self, inputs: StepInputs, device: torch.device, put: Callable | None) -> bool:
        self._forward = {}
        if not inputs.image_slices:
            return True
        slices = inputs.image_slices
        rows = np.concatenate([np.arange(row, row + end - first) for row, _, first, end in slices])
        if self.comm.rank == 0:
            self._encode([image for _, image, _, _ in slices], device)
            embeds = torch.cat([self.cache.get(image.digest)[first:end] for _, image, first, end in slices])
            for _, image, _, _ in slices:  # encoded (or found encoded): the cache has them, the row no longer needs them
                image.release()
            self.cache.trim()
            embeds = embeds.to(self.embed_dtype)
        else:  # a tensor-parallel worker: it encodes its share of the step's images, then rank 0's gathered
            self._encode_shared(None, None, device)  # embeddings land here
            embeds = torch.empty(len(rows), self.row_width, dtype=self.embed_dtype, device=device)
        embeds = self.comm.broadcast(embeds)  # (one rank: as it is)
        to_device = put or torch.from_numpy
        self._forward = {"embeds": (to_device(rows).to(device), embeds)}
        if inputs.mrope_positions is not None:
            self._forward["mrope_positions"] = to_device(inputs.mrope_positions).to(device)
        return False  # (image embeddings, 3-D positions: no decode graph)

    def forward_inputs(self) -> dict[str, Any]:
        return self._forward

    @staticmethod
    def for_workers(inputs: StepInputs) -> StepInputs:
        """The step's inputs as the other tensor-parallel ranks get them: the image slices without their images (a
        worker gets the patches of its share of the images to encode over the group, not pickled with the step)."""
        if not inputs.image_slices:
            return inputs
        return replace(inputs, image_slices=[(row, None, first, end) for row, _, first, end in inputs.image_slices])

    def _encode(self, images: list[PromptImage], device: torch.device) -> None:
        """Encodes the images the cache lacks, in tower calls of at most `tower_tokens` (`tower_calls`); under tensor
        parallelism each rank encodes a share of them (`encode_shared`, which the workers join from `prepare`)."""
        missing: dict[str, PromptImage] = {}
        for image in images:
            if image.digest not in missing and self.cache.get(image.digest) is None:
                missing[image.digest] = image
        todo = list(missing.values())
        if not todo and self.comm.world == 1:
            return
        # the cache makes room first: what it holds past its rows while the tower runs is this step's own
        self.cache.make_room(sum(image.num_tokens for image in todo), keep={image.digest for image in images})
        # (a released image's patches are read again from its source: a preempted row the cache had dropped)
        items = [(torch.from_numpy(image.patches()), image.grid, image.num_tokens) for image in todo]
        if self.comm.world == 1:
            encoded = self._run_tower(items, device)
        else:
            owners = assign_ranks([t * h * w for t, h, w in (image.grid for image in todo)], self.comm.world)
            encoded = self._encode_shared(items, owners, device)
            self.images_on_workers += sum(owner != 0 for owner in owners)
        for image, embeds in zip(todo, encoded):
            self.cache.put(image.digest, embeds)
        self.images_encoded += len(todo)
        self.image_tokens_encoded += sum(image.num_tokens for image in todo)

    def _run_tower(self, items: list[Item], device: torch.device) -> list[torch.Tensor]:
        return encode(self.visual, items, self.tower_tokens, device)

    def _encode_shared(self, items: list[Item] | None, owners: list[int] | None, device: torch.device
                       ) -> list[torch.Tensor] | None:
        return encode_shared(self.comm, items, owners, lambda mine: self._run_tower(mine, device), self.patch_width,
                             self.row_width, self.embed_dtype, device)
