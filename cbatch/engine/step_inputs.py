"""A step's inputs: the plan's rows as one flat batch (`StepInputs`, host arrays small enough to send to every
tensor-parallel rank; input_builder.py makes them from a plan), and its tensors on the device (`to_device`).

Flat batch: input ids and positions [T], query_start_loc [B + 1], seq_lens [B] (context incl. this step),
block_table [B, max_blocks], slot_mapping [T] (slot = block * block_size + offset); logits only for the flat rows
that sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cbatch.engine.staging import HostStaging
from cbatch.model.backend import AttentionMetadata
from cbatch.model.backend.metadata import image_key_ends


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs as host arrays: what the runner builds from a plan, and all a tensor-parallel
    rank needs to run the same step (small: sent to the other ranks every step)."""

    token_ids: list[int]  # [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int64 [B + 1]
    seq_lens: np.ndarray  # int64 [B]
    block_table: np.ndarray  # int32 [B, num_cols]
    slot_mapping: np.ndarray  # int64 [T]
    logits_rows: list[int]  # [N]: the flat rows whose hidden states sample
    prompt_rows: list[tuple[int, list[int], int]]  # (first flat row, the prompt tokens its positions predict, top k)
    copies: list[tuple[int, int]]  # KV block copies (source, destination), before anything else
    swap_out: list[tuple[int, int]]  # (device block, host slot)
    swap_in: list[tuple[int, int]]  # (host slot, device block)
    placeholder_rows: list[int] = field(default_factory=list)  # flat rows whose token the last step samples
    placeholder_sources: list[int] = field(default_factory=list)  # and each one's row in that step's tokens
    lora_slots: np.ndarray | None = None  # int32 [T]: each token's LoRA adapter slot (-1: base); None: no adapter rows
    # images (engine/image_rows.py): M-RoPE's 3-D positions int64 [3, T] where a chunk meets image placeholders, and
    # the embedding rows the step takes: (first flat row, image, its first row, end row); None / []: none (a
    # tensor-parallel worker gets image None: rank 0 broadcasts the embeddings)
    mrope_positions: np.ndarray | None = None
    image_slices: list = field(default_factory=list)
    # Gemma 3's bidirectional image runs: a chunk's first flat row -> [(first, end)) context positions (metadata.py)
    image_spans: dict[int, list[tuple[int, int]]] | None = None
    # the adapter each slot holds (rank 0's `LoraSlots.resident`): a tensor-parallel worker loads the same ones
    lora_resident: tuple[str | None, ...] | None = None

    def to_device(self, dev: torch.device, block_size: int, last_sampled: torch.Tensor | None = None,
                  staging: HostStaging | None = None) -> "_Batch":
        """The step's tensors on `dev` (on a GPU through `staging`'s pinned buffers, copies that do not wait for
        the step in flight); placeholder tokens (asynchronous scheduling) taken from `last_sampled`, the tokens
        the previous step sampled, without a round trip through the host."""
        put = torch.from_numpy if staging is None else staging.to_device
        q_lens = np.diff(self.query_start_loc)
        meta = AttentionMetadata(
            query_start_loc=put(self.query_start_loc.astype(np.int32)),
            seq_lens=put(self.seq_lens.astype(np.int32)),
            block_table=put(self.block_table),
            slot_mapping=put(self.slot_mapping),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            query_lens_host=q_lens.tolist(),
            seq_lens_host=self.seq_lens.tolist(),
            block_size=block_size,
            image_spans=self.image_spans,
            key_ends=put(image_key_ends(q_lens, self.seq_lens, self.image_spans)) if self.image_spans else None,
        )
        input_ids = put(np.array(self.token_ids, dtype=np.int64))
        if self.placeholder_rows:
            rows, sources = (put(np.array(x, dtype=np.int64)) for x in (self.placeholder_rows, self.placeholder_sources))
            input_ids[rows] = last_sampled[sources]
        return _Batch(
            input_ids=input_ids,
            positions=put(self.positions),
            meta=meta,
            logits_indices=put(np.array(self.logits_rows, dtype=np.int64)),
        )


class _Batch:
    __slots__ = ("input_ids", "positions", "meta", "logits_indices")

    def __init__(self, input_ids, positions, meta, logits_indices) -> None:
        self.input_ids = input_ids  # int64 [T]
        self.positions = positions  # int64 [T]
        self.meta = meta
        self.logits_indices = logits_indices  # int64 [N]: rows of the hidden states that sample
