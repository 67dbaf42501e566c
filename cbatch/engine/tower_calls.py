"""How a step's images and videos go through the vision tower: in calls of at most the step's image budget, so that
one call never passes what the GPU reserved for it (engine/encoder_memory.py).

The budget is the step's token budget (--max-num-batched-tokens), or --max-image-tokens-per-step when lower. An image
is never split: one larger than the budget runs alone. A video is cut between temporal patches into pieces of at most
the budget (at least one temporal patch each): Qwen2-VL's and Qwen2.5-VL's towers attend within a temporal patch
(their windows too) and merge patches within it, so a video's embeddings are its pieces' embeddings one after
another. Pieces and images fill calls in order, a call taking the next one while the sum stays within the budget.
So a call holds at most max(budget, largest image, one temporal patch of the largest video frame) tokens, each of
its frames at most the largest image or video frame: what the reserve's dummy batch is made of.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

# one piece of a call: (index of the image in the step's list, first temporal patch, end temporal patch)
Piece = tuple[int, int, int]
# one image (or video) to encode: (patches [t * h * w, patch width] on the host or the device, grid (t, h, w), tokens)
Item = tuple[torch.Tensor, tuple[int, int, int], int]


def tower_budget(max_num_batched_tokens: int, max_image_tokens_per_step: int | None) -> int:
    """The image tokens one tower call takes (a lone image or temporal patch larger than it runs alone)."""
    return min(max_num_batched_tokens, max_image_tokens_per_step or max_num_batched_tokens)


def tower_calls(items: Sequence[tuple[int, int]], budget: int | None) -> list[list[Piece]]:
    """The tower calls over `items`, each (tokens, temporal patches t) of an image (t = 1) or video: lists of pieces
    in order; `budget` None: one call of everything."""
    if budget is None:
        return [[(index, 0, t) for index, (_, t) in enumerate(items)]] if items else []
    calls: list[list[Piece]] = []
    used = budget  # tokens in the last call (none open yet)
    for index, (tokens, t) in enumerate(items):
        per_patch = tokens // t
        step = max(1, budget // per_patch)  # temporal patches a piece takes
        for first in range(0, t, step):
            end = min(t, first + step)
            size = (end - first) * per_patch
            if used + size > budget:
                calls.append([])
                used = 0
            calls[-1].append((index, first, end))
            used += size
    return calls


def encode(visual: Callable, items: Sequence[Item], budget: int | None, device: torch.device) -> list[torch.Tensor]:
    """Each item's embeddings [tokens, hidden x features] through `visual` (a tower) in `tower_calls`, in order."""
    encoded: list[torch.Tensor | None] = [None] * len(items)  # a video cut in pieces: one buffer, filled in turn
    for call in tower_calls([(tokens, grid[0]) for _, grid, tokens in items], budget):
        rows, grids = [], []  # per piece: its patches, its grid (t, h, w)
        for index, first, end in call:
            patches, (_, h, w), _ = items[index]
            rows.append(patches[first * h * w : end * h * w])
            grids.append((end - first, h, w))
        embeds = visual(torch.cat(rows).to(device), grids)  # [the call's tokens, hidden x features]
        per_patch = [items[index][2] // items[index][1][0] for index, _, _ in call]  # a temporal patch's tokens
        sizes = [(end - first) * per for (_, first, end), per in zip(call, per_patch)]
        for (index, first, end), per, part in zip(call, per_patch, embeds.split(sizes)):
            t, tokens = items[index][1][0], items[index][2]
            if end - first == t:  # whole: its own memory (a view would keep the call's alive)
                encoded[index] = part.clone() if len(call) > 1 else part
                continue
            if encoded[index] is None:
                encoded[index] = part.new_empty(tokens, part.shape[1])
            encoded[index][first * per : end * per] = part
        del embeds
    return encoded
