"""Greedy and temperature sampling over the logits (the GPU path's sampler), each row's vocabulary split
across programs.

The same tokens as `cbatch.engine.sampler.sample` for rows without top-k/top-p (which stay with the torch
sampler): a random row draws argmax(p / E) with p = softmax(logits / T) and E ~ Exp(1) from the same
counter-based hash of (seed, output position, vocab id). Since softmax is monotone and its normaliser is
one number per row, argmax(p / E) = argmax(logits / T - log E): no max, no sum, no softmax pass, and no
[N, vocab] intermediate. Greedy rows (T = 0) take argmax(logits). Ties go to the lowest vocab id, as
torch.argmax's. The two formulas round differently, so a row can differ from the torch sampler only when
two candidates are within a float32 rounding of each other.

Split (`num_splits` > 1): the grid is rows x splits; split s of a row reduces the vocab tiles
[s * tiles_per_split, (s + 1) * tiles_per_split) to a partial (best value, its lowest vocab id), and a
second launch reduces each row's partials in split order (strictly greater wins: an earlier split keeps a
tie). Every element's value is a function of (row's temperature, seed, position, vocab id) only, and
max / first-argmax are exact, so the token does not depend on the split count nor on the other rows of
the batch. Without a split (one program per row walking all the tiles: 75 tiles of 2048 for a 151,936
vocab) a batch of 256 rows is under two programs per SM of an H100/H200, too few loads in flight to
stream the logits at the memory's rate; `auto_num_splits` makes about 4 programs per SM.

Everything is a tensor argument and no size is specialised on, so a CUDA graph can hold it (the decode
graphs sample inside the graph) and one compiled variant serves every batch and split count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, on_device, sm_count

_BLOCK = 2048  # vocab ids per tile: 8 KiB of fp32 logits
_MAX_SPLITS = 128  # a power of 2 (the reduce kernel's tile); >= the tiles of a 262,144 vocab
_PROGRAMS_PER_SM = 4  # the split's target: enough loads in flight per SM to stream the logits


@triton.jit
def _hash32(x):
    """cbatch.engine.sampler._hash32 on uint32: the products there are masked to 32 bits, here they wrap."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _row_key(seeds_ptr, positions_ptr, r):
    """exponential_noise's `row`, from the seed's two 32-bit halves and the position (uint32)."""
    seed = tl.load(seeds_ptr + r)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    pos = (tl.load(positions_ptr + r) & 0xFFFFFFFF).to(tl.uint32)
    return _hash32(_hash32(_hash32(lo) ^ hi) ^ (pos * 0x61C88647))


@triton.jit
def _exponential(row_key, ids):
    """E ~ Exp(1) in float32 for vocab `ids` (uint32) of the row `row_key`: exponential_noise's value."""
    col = _hash32(ids * 0x27D4EB2D)
    return _exponential_from_bits(_hash32(row_key ^ col))


@triton.jit
def _exponential_from_bits(bits):
    """E = -log(u), u = (bits + 0.5) / 2**32, for uint32 `bits`, computed in float32.

    exponential_noise draws bits uniform in [0, 2**32), u = (bits + 0.5) / 2**32 in float64 (never 0 nor 1)
    and rounds E = -log(u) to float32. Here, with no float64 (a software routine on the GPU's FP64 units):
    - u <= 1/2 (bits < 2**31): E = -log(w), w = (bits + 0.5) * 2**-32. Rounding w to float32 costs
      2**-24 relative in w, i.e. 2**-24 absolute in E >= ln 2: at most an ulp of E.
    - u > 1/2: 1 - u = w = (~bits + 0.5) * 2**-32 exactly as above (~bits = 2**32 - 1 - bits < 2**31), and
      E = -log1p(-w). In float32, u itself would lose everything below 2**-24: E near 0, the part of the
      noise that makes unlikely tokens win, would come in steps of 2**-24 (and -log(u) with 24-bit
      uniforms on (0, 1] would even give E = 0 once in 2**24 elements: about one row in a hundred per step
      at a 151,936 vocab: a token chosen whatever its probability). log1p keeps E's relative precision
      down to the smallest E, 2**-33: Goldberg's form log1p(-w) = log(t) * -w / (t - 1), t = fl(1 - w)
      (t - 1 is exact; t == 1 only for w < 2**-25, where log1p(-w) = -w to float32 precision).
    So E is within a few float32 ulps of exponential_noise's everywhere (tests/test_kernels_sampler.py), E
    is never 0 or inf, and the race's outcome differs from the float64 noise's only where two candidates'
    scores lie within that rounding of each other, the same near-ties float32 scores already have.
    (Triton's tl.log on float32 is libdevice's __nv_logf on CUDA, accurate to an ulp, also near 1.)"""
    upper = (bits >> 31) != 0  # u > 1/2
    # ~bits as a xor with all ones (the Triton 3.6 interpreter cannot make uint32 all-ones: -1 overflows)
    w = ((tl.where(upper, bits ^ 0xFFFFFFFF, bits)).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # * 2**-32
    t = 1.0 - w
    log_arg = tl.where(upper, t, w)
    log_val = tl.log(log_arg)  # one log per element: log(t) for the upper half, log(w) for the lower
    one_minus_t = tl.where(t == 1.0, 1.0, 1.0 - t)
    upper_e = tl.where(t == 1.0, w, -log_val * (w / one_minus_t))
    return tl.where(upper, upper_e, -log_val)


@triton.jit(do_not_specialize=["tiles_per_split", "num_splits"])
def _sample_kernel(
    logits_ptr,  # fp32 [N, vocab]
    temperatures_ptr,  # fp32 [N]; 0 = greedy
    seeds_ptr,  # int64 [N]
    positions_ptr,  # int64 [N]: index of the token being sampled within the completion
    out_ptr,  # int64 [N]: the token (num_splits == 1)
    part_val_ptr,  # fp32 [N, num_splits]: each split's best value (num_splits > 1)
    part_id_ptr,  # int64 [N, num_splits]: its lowest vocab id
    vocab,
    stride_l,
    tiles_per_split,
    num_splits,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(temperatures_ptr + r)
    random_row = temp > 0.0
    inv_temp = 1.0 / tl.where(random_row, temp, 1.0)
    row_key = _row_key(seeds_ptr, positions_ptr, r)

    first = split.to(tl.int64) * tiles_per_split * BLOCK
    best = tl.full((), float("-inf"), tl.float32)
    best_id = first  # an all -inf slice: its first id, as torch.argmax's first maximum
    for tile in range(0, tiles_per_split):
        start = first + tile * BLOCK
        ids = start + tl.arange(0, BLOCK)
        ok = ids < vocab
        x = tl.load(logits_ptr + r * stride_l + ids, mask=ok, other=float("-inf"))
        if random_row:
            noise = _exponential(row_key, ids.to(tl.uint32))
            x = tl.where(ok, x * inv_temp - tl.log(noise), float("-inf"))
        tile_best = tl.max(x, 0)
        tile_id = start + tl.argmax(x, 0)  # first maximum within the tile
        better = tile_best > best  # strictly: an earlier tile keeps a tie
        best_id = tl.where(better, tile_id.to(tl.int64), best_id)
        best = tl.where(better, tile_best, best)
    if num_splits == 1:
        tl.store(out_ptr + r, best_id)
    else:
        tl.store(part_val_ptr + r * num_splits + split, best)
        tl.store(part_id_ptr + r * num_splits + split, best_id)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_val_ptr,  # fp32 [N, num_splits]
    part_id_ptr,  # int64 [N, num_splits]
    out_ptr,  # int64 [N]
    num_splits,
    SPLITS_PAD: tl.constexpr,  # a power of 2 >= num_splits (one value for every launch: no recompiles)
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPLITS_PAD)
    vals = tl.load(part_val_ptr + r * num_splits + offs, mask=offs < num_splits, other=float("-inf"))
    first = tl.argmax(vals, 0)  # the first split holding the maximum: the lowest vocab id of a tie
    tl.store(out_ptr + r, tl.load(part_id_ptr + r * num_splits + first))


def auto_num_splits(num_rows: int, vocab: int, device: torch.device) -> int:
    """Splits per row for a launch: about _PROGRAMS_PER_SM programs per SM (256 rows on 132 SMs: 3 splits of
    25 tiles at a 151,936 vocab; a single row: one split per tile), never more splits than tiles or than
    _MAX_SPLITS, 1 once the rows alone fill the GPU. Host integers only (no device sync)."""
    tiles = -(-vocab // _BLOCK)
    want = -(-_PROGRAMS_PER_SM * sm_count(device) // max(1, num_rows))
    return max(1, min(want, tiles, _MAX_SPLITS))


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Token ids int64 [N] for float32 logits [N, vocab]: argmax where temperatures[i] == 0, else the seeded
    exponential race at temperatures[i] (seeds int64 [N], positions int64 [N]). Writes `out` if given.
    num_splits: programs per row over its vocabulary (1 = one program per row, no second launch; None =
    `auto_num_splits`); the tokens are the same for every value."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be float32 [N, vocab] with a contiguous last dim, got {tuple(logits.shape)} {logits.dtype}")
    num_rows, vocab = logits.shape
    for name, t, dtype in (("temperatures", temperatures, torch.float32), ("seeds", seeds, torch.int64),
                           ("positions", positions, torch.int64)):
        if t.shape != (num_rows,) or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} [{num_rows}], got {t.dtype} {tuple(t.shape)}")
    device = check_launchable(logits, temperatures, seeds, positions)
    if num_splits is not None and not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{_MAX_SPLITS}, got {num_splits}")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    tiles = max(1, -(-vocab // _BLOCK))
    splits = auto_num_splits(num_rows, vocab, device) if num_splits is None else min(num_splits, tiles)
    tiles_per_split = -(-tiles // splits)
    splits = -(-tiles // tiles_per_split)  # no empty split (e.g. 75 tiles in 2 splits of 38: 2; in 74: 38 of 2)
    # the partials (not written with one split; allocated anyway: the same argument types, one compiled variant)
    part_val = torch.empty(num_rows, splits, dtype=torch.float32, device=device)
    part_id = torch.empty(num_rows, splits, dtype=torch.int64, device=device)
    with on_device(device):
        _sample_kernel[(num_rows, splits)](
            logits, temperatures, seeds, positions, out, part_val, part_id, vocab, logits.stride(0),
            tiles_per_split, splits,
            BLOCK=_BLOCK,
            num_warps=8,
        )
        if splits > 1:
            _reduce_splits_kernel[(num_rows,)](part_val, part_id, out, splits, SPLITS_PAD=_MAX_SPLITS, num_warps=1)
    return out
