"""The sampling kernel (cbatch/kernels/sampler.py) against the torch sampler and float64 references: its
float32 noise, the vocabulary split across programs (partials, then a reduction per row), greedy ties, and
seeded rows that do not depend on the split count nor on the rest of the batch.

Runs on a GPU when one is present; otherwise through Triton's CPU interpreter (conftest.py). Most tests
shrink the vocab tile to 128 ids (`small_tiles`), so a 1000-id vocabulary has 8 tiles, the last one
partial, and every split boundary lands inside a few milliseconds of interpreted work.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from cbatch.engine.sampler import SamplingBatch, exponential_noise, sample  # noqa: E402
from cbatch.kernels import fused_sample  # noqa: E402
from cbatch.kernels import sampler as kernel_module  # noqa: E402
from helpers import kernel_device  # noqa: E402

DEVICE = kernel_device()
VOCAB = 1000  # 7 full 128-id tiles and one of 104
SPLITS = (1, 2, 3, 5, 100, None)  # 100: more than the tiles (clamped to 8); None: auto_num_splits


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(kernel_module, "_BLOCK", 128)


def run(logits, temps, seeds, positions, num_splits):
    return fused_sample(logits.to(DEVICE), torch.tensor(temps, dtype=torch.float32, device=DEVICE),
                        torch.tensor(seeds, dtype=torch.int64, device=DEVICE),
                        torch.tensor(positions, dtype=torch.int64, device=DEVICE), num_splits=num_splits).cpu()


def torch_sampler(logits, temps, seeds, positions):
    n = len(temps)
    return sample(logits, SamplingBatch(list(temps), [1.0] * n, [0] * n, list(seeds), list(positions)))


def random_case(num_rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=g) * 4
    temps = [0.0 if i % 4 == 0 else (0.3, 0.7, 1.0, 1.6)[i % 4] for i in range(num_rows)]
    seeds = [i * 7919 + seed - (2**40 if i % 5 == 0 else 0) for i in range(num_rows)]  # negative, > 32-bit seeds
    positions = [int(x) for x in torch.randint(0, 3000, (num_rows,), generator=g)]
    return logits, temps, seeds, positions


# ---- the noise -------------------------------------------------------------------------------------------


@triton.jit
def _noise_from_bits_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    bits = tl.load(bits_ptr + offs, mask=ok, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, kernel_module._exponential_from_bits(bits), mask=ok)


@triton.jit
def _row_noise_kernel(seeds_ptr, positions_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = kernel_module._row_key(seeds_ptr, positions_ptr, r)
    tl.store(out_ptr + r * vocab + ids, kernel_module._exponential(key, ids.to(tl.uint32)), mask=ids < vocab)


# float32 noise within this many 2**-24 (about an ulp) of the exact -log(u), relative: Goldberg's log1p is
# within 5 (the rounding of w, t = 1 - w, the log, the division), measured up to 4.75 here; a plain float32
# -log(u) is off by up to 100% near u = 1
NOISE_ULPS = 6


def test_float32_noise_is_the_float64_noise_to_a_few_ulps_everywhere():
    """E = -log(u), u = (bits + 0.5) / 2**32, in float32, against float64 over random bits and the extremes:
    bits near 2**32 (u near 1, E near 0: a plain float32 -log(u) is 0 or off by up to 100% there, since u
    rounds to 1 or to a multiple of 2**-24), around 2**31 (the two formulas' seam) and near 0 (E ~ 22)."""
    g = torch.Generator().manual_seed(3)
    top = 2**32 - 1
    edges = [0, 1, 2, 255, 2**23, 2**24 + 1, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2**25,
             2**32 - 2**24 - 1, top - 2**8, top - 2, top - 1, top]
    near_one = [top - k * 977 for k in range(2000)]  # E from 2**-33 to ~5e-4, where the race's winners live
    bits = torch.tensor(edges + near_one + torch.randint(0, 2**32, (20000,), generator=g).tolist(), dtype=torch.int64)
    out = torch.empty(bits.shape[0], dtype=torch.float32, device=DEVICE)
    _noise_from_bits_kernel[(triton.cdiv(bits.shape[0], 1024),)](bits.to(DEVICE), out, bits.shape[0], BLOCK=1024)
    exact = -torch.log((bits.double() + 0.5) / 2**32)
    got = out.cpu().double()
    assert (got > 0).all() and torch.isfinite(got).all()
    rel = ((got - exact).abs() / exact)
    assert rel.max().item() <= NOISE_ULPS * 2**-24, f"worst {rel.max().item():.3e} at bits {bits[rel.argmax()].item()}"
    assert got[len(edges) - 1].item() == pytest.approx(2**-33, rel=1e-6)  # the smallest E, not 0
    assert got[0].item() == pytest.approx(22.88, abs=0.01)  # the largest, -log(2**-33)


def test_kernel_noise_is_the_torch_samplers_noise():
    """The whole per-element noise, hash included, against `exponential_noise` (float64, rounded to float32)."""
    seeds = torch.tensor([0, 1, -5, 2**40 + 17, -(2**62)], dtype=torch.int64)
    positions = torch.tensor([0, 7, 123456, 2**33 + 3, 5], dtype=torch.int64)
    vocab = 3001
    out = torch.zeros(len(seeds), vocab, dtype=torch.float32, device=DEVICE)
    _row_noise_kernel[(len(seeds), triton.cdiv(vocab, 512))](seeds.to(DEVICE), positions.to(DEVICE), out, vocab,
                                                             BLOCK=512)
    want = exponential_noise(seeds, positions, vocab).double()
    rel = (out.cpu().double() - want).abs() / want
    assert rel.max().item() <= (NOISE_ULPS + 1) * 2**-24  # + the reference's own rounding to float32
    assert want.std().item() == pytest.approx(1.0, abs=0.05)  # Exp(1): a real draw, not a constant


# ---- the split ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", SPLITS)
def test_split_sampler_matches_the_torch_sampler(small_tiles, num_splits):
    logits, temps, seeds, positions = random_case(12, VOCAB, seed=11)
    expected = torch_sampler(logits, temps, seeds, positions)
    got = run(logits, temps, seeds, positions, num_splits)
    assert got.tolist() == expected.tolist()
    random_rows = [i for i, t in enumerate(temps) if t > 0]
    assert any(got[i] != logits[i].argmax() for i in random_rows)  # sampling, not argmax
    assert len(set(got.tolist())) > 10  # and not one token for every row


def test_greedy_ties_go_to_the_lowest_id_across_split_boundaries(small_tiles):
    """With 3 splits of 3 tiles (ids 0-383, 384-767, 768-999) and 8 tiles of 128, ties straddle tiles, splits
    and the partial last tile; torch.argmax's first maximum is the rule."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, VOCAB, generator=g)
    ties = {0: (383, 384, 900), 1: (700, 800, 999), 2: (130, 200, 900), 5: (0, 999), 6: (767, 768)}
    for row, ids in ties.items():
        logits[row, list(ids)] = logits[row].max() + 1
    logits[3] = float("-inf")  # nothing but -inf: id 0, as torch.argmax
    logits[4] = float("-inf")
    logits[4, 999] = 2.0  # the last id of the partial tile, alone
    logits[7, 512:] = logits[7].max() + 3  # a run of equal maxima starting mid-split
    want = [383, 700, 130, 0, 999, 0, 767, 512]
    assert logits.argmax(dim=-1).tolist() == want  # the rule itself
    for num_splits in SPLITS + (4, 8):
        got = run(logits, [0.0] * 8, [1] * 8, [0] * 8, num_splits)
        assert got.tolist() == want, f"num_splits={num_splits}"


def test_masked_random_rows_draw_only_allowed_ids(small_tiles):
    """A temperature row with all but a few ids at -inf (a grammar or ban would look like this) draws one of
    them, the same one for every split count, and the draws spread over the allowed ids."""
    allowed = [5, 383, 384, 990]
    logits = torch.full((6, VOCAB), float("-inf"))
    logits[:, allowed] = 0.0
    drawn = [run(logits, [1.0] * 6, list(range(100, 106)), [3] * 6, s).tolist() for s in SPLITS]
    assert all(d == drawn[0] for d in drawn)
    assert set(drawn[0]) <= set(allowed) and len(set(drawn[0])) >= 3


def test_seeded_rows_ignore_the_split_count_and_the_rest_of_the_batch(small_tiles):
    """A row's token is a function of its own logits, temperature, seed and position: the same alone, in a
    shuffled batch, beside other rows, for any split count (and the torch sampler's)."""
    logits, temps, seeds, positions = random_case(8, VOCAB, seed=23)
    temps = [t or 0.9 for t in temps]  # all random rows
    reference = run(logits, temps, seeds, positions, 1)
    assert reference.tolist() == torch_sampler(logits, temps, seeds, positions).tolist()
    others, o_temps, o_seeds, o_positions = random_case(6, VOCAB, seed=29)
    rows = [6, 2, 7, 0, 5]
    batches = [  # (rows of the case, then how many other rows, split count)
        (list(reversed(range(8))), 0, 3),
        (rows, 6, 2),
        (rows[:2], 3, None),
        ([4], 0, 5),
        ([4], 6, 1),
    ]
    for picked, n_others, num_splits in batches:
        batch_logits = torch.cat([logits[picked], others[:n_others]])
        got = run(batch_logits, [temps[i] for i in picked] + o_temps[:n_others],
                  [seeds[i] for i in picked] + o_seeds[:n_others],
                  [positions[i] for i in picked] + o_positions[:n_others], num_splits)
        assert got[: len(picked)].tolist() == reference[picked].tolist(), (picked, n_others, num_splits)
    # and the draw does depend on the seed and the position (the noise is keyed by them)
    moved = run(logits, temps, seeds, [p + 1 for p in positions], 3)
    reseeded = run(logits, temps, [s + 1 for s in seeds], positions, 3)
    assert moved.tolist() != reference.tolist() and reseeded.tolist() != reference.tolist()


def test_auto_split_fills_the_gpu():
    """About 4 programs per SM (132 SMs off a GPU), never more splits than the 75 tiles of a 151,936 vocab."""
    auto = kernel_module.auto_num_splits
    cpu = torch.device("cpu")
    assert [auto(n, 151936, cpu) for n in (1, 8, 64, 256, 528, 529, 4096)] == [75, 66, 9, 3, 1, 1, 1]
    assert auto(256, 1000, cpu) == 1  # one tile
    assert auto(4, 262144, cpu) == 128  # Gemma 3's vocab: 128 tiles, the reduce kernel's width


def test_num_splits_is_checked():
    logits = torch.zeros(2, 10, device=DEVICE)
    args = (torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE),
            torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="num_splits"):
        fused_sample(logits, *args, num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        fused_sample(logits, *args, num_splits=129)
