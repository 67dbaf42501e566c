"""The MLA decode kernel (latent-space attention over the paged latent cache) against the torch path's
`torch_latent_attention` computed in float64. On a GPU when present, else under Triton's CPU interpreter
(small shapes: it runs every program in numpy)."""
import pytest
import torch

pytest.importorskip("triton")

from cbatch.kernels import mla_decode_attention  # noqa: E402
from cbatch.model.backend.mla import torch_latent_attention  # noqa: E402
from helpers import kernel_device  # noqa: E402

DEVICE = kernel_device()


def _step(contexts: list[int], heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype):
    """Queries, a cache of random values everywhere (unused slots too, so reading past a context shows) and a
    shuffled block table whose unused entries name random blocks."""
    gen = torch.Generator().manual_seed(len(contexts) * 7 + heads)
    blocks_per_row = [-(-c // block_size) for c in contexts]
    total = sum(blocks_per_row) + 3
    order = torch.randperm(total, generator=gen)
    table = torch.randint(0, total, (len(contexts), max(blocks_per_row) + 2), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_row):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    cache = torch.randn(total, block_size, 1, rank + rope, generator=gen).to(dtype)
    query = torch.randn(len(contexts), heads, rank + rope, generator=gen).to(dtype)
    return query, cache, table, torch.tensor(contexts, dtype=torch.int32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,rank,rope", [(5, 16, 8), (20, 32, 16)])  # padded heads and rope; two head blocks
def test_mla_decode_kernel_matches_the_torch_path(dtype, tol, heads, rank, rope):
    query, cache, table, lens = _step([1, 7, 30, 16], heads, rank, rope, block_size=4, dtype=dtype)
    got = mla_decode_attention(query.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), lens.to(DEVICE), rank, 0.3)
    want = torch_latent_attention(query.double(), cache.double(), table.long(), lens, rank, 0.3)
    assert got.shape == (4, heads, rank) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    assert want.abs().max() > 0.1  # real values, and rows differ (each its own context)
    assert not torch.allclose(want[1], want[2])
