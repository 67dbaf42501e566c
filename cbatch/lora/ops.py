"""The LoRA delta of one module for one step: Triton's segmented kernels on a GPU (cbatch/kernels/lora.py),
two small matmuls per adapter slot on the CPU (the reference the kernels are tested against)."""
from __future__ import annotations

import torch

from cbatch.model.onednn import linear


def add_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, step) -> None:
    """out [T, out] += scale * B @ A x for each token with an adapter (in place); a [S, N, in], b [S, out, N]."""
    if x.is_cuda:
        from cbatch.kernels.lora import lora_expand, lora_shrink

        y = lora_shrink(x, a, step.sorted_tokens, step.slot_counts, step.slot_starts, step.max_count)
        lora_expand(y, b, out, step.sorted_tokens, step.slot_counts, step.slot_starts, step.max_count)
        return
    add_lora_torch(x, out, a, b, step.groups)


def add_lora_torch(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   groups: list[tuple[int, slice | torch.Tensor]]) -> None:
    """The same, one slot at a time: `groups` (slot, its tokens' rows: a slice, or an index tensor)."""
    # NOTE: oneDNN (`onednn.linear`, as the base layers): ~1.3-1.8x less CPU time than torch.mm / addmm_ on these
    # thin matmuls (rank columns); a separate add costs less than that
    for slot, rows in groups:
        if isinstance(rows, slice):  # (the common case: admission groups rows by adapter)
            out[rows] += linear(linear(x[rows], a[slot]), b[slot])
        else:  # each token is in one group, so its rows are distinct: a gather and a scatter (index_add_ is
            # many times slower on CPU)
            delta = linear(linear(x.index_select(0, rows), a[slot]), b[slot])
            out.index_copy_(0, rows, out.index_select(0, rows).add_(delta))
