"""No kernel compiles inside a run after the warm-up, counted by `cbatch.kernels.jit_stats.compiled_variants`.

Under the interpreter (CPU) the counter computes, at every launch, the specialisation key the JIT would
compile for on a GPU, with Triton's own binder: the tests show it moves for a real new variant (a new
tile shape, an unaligned pointer) and does not for new batch sizes, lengths or strides.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cbatch.config import SamplingParams  # noqa: E402
from cbatch.engine.warmup import warm_up  # noqa: E402
from cbatch.kernels import paged_attention  # noqa: E402
from cbatch.kernels.jit_stats import compiled_variants  # noqa: E402
from helpers import generate, make_engine, random_prompts, triton_device  # noqa: E402

DEVICE = triton_device()


def _decode(batch: int, cols: int, dtype=torch.float32, q_offset: int = 0, max_query_len: int = 1) -> None:
    """A launch with head_dim 48, a shape no other test uses: its variants are new to the process's JIT."""
    g = torch.Generator().manual_seed(batch)
    cache = torch.randn(8, 4, 2, 48, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(batch * 4 * 48 + q_offset, generator=g).to(dtype).to(DEVICE)[q_offset:].view(batch, 4, 48)
    table = torch.randint(0, 8, (batch, cols), generator=g, dtype=torch.int32).to(DEVICE)
    lens = torch.full((batch,), 3, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    out = paged_attention(q, cache, cache, torch.empty_like(q), qsl, lens, table, 0.1, max_query_len, 3)
    assert torch.isfinite(out).all()


def test_the_counter_sees_every_kernel_module():
    """Each module of cbatch/kernels whose source defines a launched kernel (@triton.jit ... def *_kernel) is in
    the counter's list, and the counter finds that module's kernels: a new kernel module cannot go uncounted."""
    import re
    from pathlib import Path

    from cbatch.kernels import jit_stats

    package = Path(jit_stats.__file__).parent
    jit_def = re.compile(r"^@triton\.jit[^\n]*\ndef (\w+_kernel)\(", re.M)
    defined = {f"{path.stem}.{name}" for path in package.glob("*.py") for name in jit_def.findall(path.read_text())}
    assert {name.split(".")[0] for name in defined} - set(jit_stats.KERNEL_MODULES) == set()
    assert defined == set(jit_stats.cbatch_kernels())
    assert {"gemm._gemm_kernel", "lora._lora_gemm_kernel", "w4a16._w4a16_kernel",
            "grouped_gemm._grouped_gemm_kernel"} <= defined


def test_counter_counts_real_variants_only():
    _decode(3, 2)
    base = compiled_variants()
    for batch, cols in ((1, 1), (16, 16), (5, 7), (32, 3)):  # sizes and strides equal to 1 or multiples of 16
        _decode(batch, cols)
    assert compiled_variants() == base
    _decode(4, 2, dtype=torch.bfloat16)  # a new dtype is a new binary
    assert compiled_variants() == base + 1
    _decode(4, 2, q_offset=1)  # q no longer 16-byte aligned: the JIT specialises pointers on alignment
    assert compiled_variants() == base + 2
    _decode(4, 2, max_query_len=2)  # a mixed-step launch: another variant
    assert compiled_variants() == base + 3


def test_no_compiles_after_warm_up(tiny_checkpoints):
    """A run with every step class (chunked prefill beside decodes, several batch sizes, greedy, temperature
    and top-k rows) compiles nothing the warm-up did not."""
    engine = make_engine(tiny_checkpoints["qwen3"], attention_backend="triton", max_model_len=48,
                         max_num_batched_tokens=20, max_num_seqs=6, block_size=8,
                         device=DEVICE)
    before = compiled_variants()
    assert warm_up(engine.runner, engine.config, engine.max_model_len) > 5
    warmed = compiled_variants()
    assert warmed > before or before > 0  # the warm-up launched kernels (fresh ones counted)
    prompts = random_prompts(6, vocab=384, seed=31, min_len=3, max_len=24)  # a 20-token chunk, then 6 rows
    # the batch shrinks 6 -> 4 -> 2 -> 1 rows (a size-1 dimension is a specialisation; each step costs ~0.7 s)
    params = [SamplingParams(max_tokens=(2, 2, 3, 3, 4, 5)[i], ignore_eos=True, temperature=0.8 * (i % 2), top_k=3 * (i % 3 == 2),
                             seed=i) for i in range(len(prompts))]
    outputs = generate(engine, prompts, params)
    assert [len(o) for o in outputs] == [p.max_tokens for p in params]
    assert compiled_variants() == warmed
