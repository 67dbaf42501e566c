"""Prefix caching: the pool's hash table, LRU and ref counts on fake requests, then greedy outputs
through the real engine identical with and without the cache."""
from __future__ import annotations

import random
from functools import partial

import pytest

from cbatch.config import SamplingParams
from cbatch.engine import kv_blocks
from cbatch.engine.kv_blocks import BlockPool, block_hash
from cbatch.engine.sequence import FinishReason
from helpers import advance, fake_scheduler, generate, make_engine
from helpers import fake_seq as seq

make = partial(fake_scheduler, blocks=40, budget=100, caching=True)


def register(pool, block, tokens, parent=None):
    h = block_hash(parent, tuple(tokens))
    assert pool.register(block, h, (parent, tuple(tokens)))
    return h


def test_lru_evicts_least_recently_released_and_prefers_never_cached_blocks():
    pool = BlockPool(4, 2, enable_caching=True)
    a, b, c = pool.allocate(3)
    hashes = {blk: register(pool, blk, [blk, blk + 10]) for blk in (a, b, c)}
    for blk in (a, c, b):  # released in this order: LRU order a, c, b
        pool.release([blk])
    assert pool.num_free == 4 and pool.num_cached == 3
    [d] = pool.allocate(1)
    assert d not in (a, b, c) and pool.evictions == 0  # the never-cached block goes first
    assert pool.allocate(1) == [a] and pool.evictions == 1
    assert pool.lookup(hashes[a], (None, (a, a + 10))) is None  # evicted: its hash is gone
    pool.hold(b)  # a hit takes b out of the LRU: c is now the only evictable block
    assert pool.ref_count(b) == 1 and pool.num_free == 1
    assert pool.allocate(1) == [c]
    assert pool.lookup(hashes[b], (None, (b, b + 10))) == b
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_hit_is_collision_checked_against_stored_tokens_and_parent():
    pool = BlockPool(4, 2, enable_caching=True)
    [blk] = pool.allocate(1)
    h = register(pool, blk, [5, 6])
    assert pool.lookup(h, (None, (5, 6))) == blk
    assert pool.lookup(h, (None, (5, 7))) is None  # same hash, other tokens: a miss
    assert pool.lookup(h, (123, (5, 6))) is None  # same tokens under another parent: a miss
    [other] = pool.allocate(1)
    assert not pool.register(other, h, (None, (5, 7)))  # a taken hash is never overwritten


def test_shared_prefix_hits_and_ref_counts_survive_preemption():
    """A and B share 3 full blocks; B is preempted under pressure (references drop back to A's);
    after A finishes the blocks stay cached and B's recompute hits them again."""
    sched, pool = make(blocks=5, block_size=4)
    prefix = [random.Random(0).randrange(3, 300) for _ in range(12)]
    a, b = seq(0, prefix + [100, 101], max_tokens=20), seq(1, prefix + [200, 201, 202], max_tokens=20)
    sched.add(a)
    advance(sched, sched.schedule())  # A computes its 14-token prompt (3 full blocks + 2 tokens)
    sched.add(b)
    plan = sched.schedule()
    assert (b, 3) in plan.scheduled  # only B's 3 own tokens are computed
    shared = a.block_ids[:3]
    assert b.block_ids[:3] == shared and all(pool.ref_count(x) == 2 for x in shared)
    assert sched.stats.prefix_cache_hit_tokens == 12 and sched.stats.prefix_cache_query_tokens == 14 + 15
    advance(sched, plan)
    advance(sched, sched.schedule())  # both decode: 5 blocks in use, the pool is full
    plan = sched.schedule()  # A needs a 5th block: B (newest) is preempted
    assert plan.preempted == [b] and b.num_computed == 0 and b.block_ids == []
    assert all(pool.ref_count(x) == 1 for x in shared)  # B's references are gone, A's remain
    advance(sched, plan)
    sched.finish(a, FinishReason.STOP)
    assert pool.num_free == pool.num_blocks and all(pool.ref_count(x) == 0 for x in shared)
    hits_before = sched.stats.prefix_cache_hit_tokens
    plan = sched.schedule()  # B comes back: its prefix is still cached
    assert plan.scheduled == [(b, b.num_tokens - 12)] and b.block_ids[:3] == shared
    assert sched.stats.prefix_cache_hit_tokens == hits_before + 12


def test_whole_prompt_hit_still_computes_one_token():
    sched, pool = make(block_size=4)
    prompt = list(range(10, 18))  # exactly 2 full blocks
    first, second = seq(0, prompt), seq(1, prompt)
    sched.add(first)
    advance(sched, sched.schedule())
    sched.add(second)
    plan = sched.schedule()
    assert (second, 4) in plan.scheduled  # block 0 hit, block 1 recomputed: the last token makes the logits
    assert second.block_ids[0] == first.block_ids[0] and second.block_ids[1] != first.block_ids[1]


def test_disabled_cache_never_hits():
    sched, pool = fake_scheduler(blocks=40, budget=100)
    a, b = seq(0, range(3, 20)), seq(1, range(3, 20))
    sched.add(a)
    advance(sched, sched.schedule())
    sched.add(b)
    assert (b, 17) in sched.schedule().scheduled and pool.num_cached == 0


# ---- through the engine: outputs identical with and without the cache -----------------------------
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def shared_prefix_prompts(seed: int = 11) -> list[list[int]]:
    """3 preambles (18..41 tokens) x 4 rows with suffixes of 0..9 tokens, plus unrelated rows."""
    rng = random.Random(seed)
    preambles = [[rng.randrange(3, 384) for _ in range(rng.randint(18, 41))] for _ in range(3)]
    prompts = [p + [rng.randrange(3, 384) for _ in range(rng.randint(0, 9))] for p in preambles for _ in range(4)]
    prompts += [[rng.randrange(3, 384) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    rng.shuffle(prompts)
    return prompts


@pytest.fixture(scope="module")
def cached_workload(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    prompts = shared_prefix_prompts()
    reference = generate(make_engine(path, enable_prefix_cache=False, max_num_seqs=1), prompts, PARAMS)
    return path, prompts, reference


@pytest.mark.parametrize("settings", [
    dict(max_num_seqs=2, block_size=4),
    dict(max_num_seqs=4, max_num_batched_tokens=7, block_size=4),  # chunked prefill over cached prefixes
    dict(max_num_seqs=8, num_kv_blocks=24, block_size=4),  # preemption + eviction
    dict(max_num_seqs=8, num_kv_blocks=24, block_size=4, preemption="swap"),
    dict(policy="static", max_num_seqs=3, block_size=4),
    dict(policy="longest-first", max_num_seqs=3, block_size=8, admission="reserve", num_kv_blocks=16),
])
def test_greedy_outputs_identical_with_prefix_cache(cached_workload, settings):
    path, prompts, reference = cached_workload
    engine = make_engine(path, **settings)
    assert generate(engine, prompts, PARAMS) == reference
    stats = engine.scheduler.stats
    assert stats.prefix_cache_hit_tokens > 0  # the cache really served tokens
    assert engine.pool.num_free == engine.pool.num_blocks  # every reference came back


def test_forced_hash_collisions_never_reuse_wrong_kv(cached_workload, monkeypatch):
    """Every block hashes the same: only the stored-token check stands between a hit and wrong KV."""
    path, prompts, reference = cached_workload
    monkeypatch.setattr(kv_blocks, "block_hash", lambda parent, tokens: 42)
    engine = make_engine(path, max_num_seqs=2, block_size=4)
    assert generate(engine, prompts, PARAMS) == reference
    assert engine.pool.num_cached <= 1  # one hash value: at most one block cached at a time


def test_rows_sharing_a_prefix_wait_one_step_instead_of_computing_it_twice():
    sched, pool = make(block_size=4, budget=100)
    prefix = list(range(50, 62))
    rows = [seq(i, prefix + [200 + i, 300 + i]) for i in range(4)]
    other = seq(9, list(range(100, 110)))
    for s in rows + [other]:
        sched.add(s)
    plan = sched.schedule()
    assert [s for s, _ in plan.scheduled] == [rows[0]]  # the others would compute the same 3 blocks
    assert sched.stats.stalled_prefix_pending == 1
    advance(sched, plan)
    plan = sched.schedule()
    assert [(s, n) for s, n in plan.scheduled if s is not rows[0]] == [(r, 2) for r in rows[1:]] + [(other, 10)]
    assert sched.stats.prefix_cache_hit_tokens == 3 * 12


def test_seeded_sampling_identical_with_prefix_cache(cached_workload):
    path, prompts, _ = cached_workload
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    cached = make_engine(path, max_num_seqs=2, block_size=4)
    plain = make_engine(path, max_num_seqs=5, block_size=4, enable_prefix_cache=False)
    assert generate(cached, prompts, params) == generate(plain, prompts, params)
    assert cached.scheduler.stats.prefix_cache_hit_tokens > 0
