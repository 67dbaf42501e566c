"""Start-up tuning of decode attention (cbatch/kernels/tuning.py): every candidate computes the reference's
attention, the tuner keeps the fastest candidate that agrees with the first, and the choice is cached per
device, stack and shape. Timing is injected (a table of made-up times), so nothing here depends on a clock."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

import cbatch.kernels.tuning as tuning  # noqa: E402
from cbatch.kernels.paged_attention import DecodeTiles, SplitRule, decode_tile_candidates  # noqa: E402
from cbatch.kernels import paged_attention  # noqa: E402
from helpers import kernel_device  # noqa: E402
from test_kernels_attention import dequantize, make_batch, quantize, reference_attention, rel_err  # noqa: E402

DEVICE = kernel_device()
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def unhurried(monkeypatch):
    """The interpreter's launches are slow on a loaded CPU: no test here runs into the tiles' budget unless it
    passes its own (the budget has its test)."""
    monkeypatch.setattr(tuning, "ATTENTION_BUDGET_S", 1e9)


@pytest.mark.parametrize("kv, head_dim", [("bf16", 256), ("fp8", 64)])  # each cache dtype, each head size once
def test_every_candidate_matches_the_reference(head_dim, kv):
    """Each candidate's decode launch (split or not) equals float64 attention on random inputs, NaN-poisoned out."""
    spec = [(1, 70), (1, 1), (1, 141), (1, 33)]  # decode rows: (q_len, seq_len)
    batch = make_batch(spec, 4, 2, head_dim, 16, torch.float32, seed=head_dim)
    q = batch["q"].to(torch.bfloat16)
    k, v, k_scale, v_scale = batch["k_cache"], batch["v_cache"], None, None
    if kv == "fp8":
        g = torch.Generator().manual_seed(7)
        k_scale, v_scale = ((torch.rand(2, generator=g) + 0.25).to(DEVICE) for _ in range(2))
        k, v = quantize(k, k_scale).to(DEVICE), quantize(v, v_scale).to(DEVICE)
        ref_k, ref_v = dequantize(k, k_scale), dequantize(v, v_scale)
    else:
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        ref_k, ref_v = k.float(), v.float()
    ref = reference_attention(q, ref_k, ref_v, batch["query_start_loc"], batch["seq_lens"], batch["block_table"],
                              head_dim ** -0.5)
    candidates = decode_tile_candidates(head_dim, kv == "fp8")
    assert len(candidates) == len(set(candidates)) >= 4
    if head_dim > 128:
        assert max(c.tile_n for c in candidates) <= 64
    for tiles in candidates:
        for splits in (None, 3):
            out = torch.full_like(q, float("nan"))
            paged_attention(q, k, v, out, batch["query_start_loc"], batch["seq_lens"], batch["block_table"],
                            head_dim ** -0.5, 1, 141, num_splits=splits, k_scale=k_scale, v_scale=v_scale,
                            decode_tiles=tiles)
            assert torch.isfinite(out).all(), f"{tiles}, splits {splits}: rows left unwritten"
            assert rel_err(out, ref) < 1e-2, f"{tiles}, splits {splits}"


SHAPE = tuning.DecodeShape(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.bfloat16,
                           kv_dtype=torch.bfloat16, batch=2, context=40)


class FakeTimes:
    """time_us: a made-up time per candidate (the last candidate fastest), counting the calls."""

    def __init__(self, candidates: list[DecodeTiles]) -> None:
        self.times = {c: 100.0 - i for i, c in enumerate(candidates)}
        self.calls: list[DecodeTiles] = []

    def __call__(self, tiles: DecodeTiles, fn) -> float:
        fn()
        self.calls.append(tiles)
        return self.times[tiles]


def test_the_fastest_candidate_wins_and_is_cached(tmp_path):
    cache = tmp_path / "tuning.json"
    candidates = decode_tile_candidates(64, False)
    timer = FakeTimes(candidates)
    result = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=cache, time_us=timer)
    assert timer.calls == candidates  # each timed once, in order
    assert result.tiles == candidates[-1] and result.default == candidates[0] and not result.cached
    assert json.loads(cache.read_text())[result.shape]["tiles"] == {"tile_n": result.tiles.tile_n,
                                                                   "num_warps": result.tiles.num_warps,
                                                                   "num_stages": result.tiles.num_stages}

    def never(tiles, fn):
        raise AssertionError("a cached shape is not timed again")

    again = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=cache, time_us=never)
    assert again.cached and again.tiles == result.tiles
    other = tuning.tune_decode_attention(SHAPE.__class__(**{**SHAPE.__dict__, "batch": 1}), torch.device(DEVICE),
                                         cache_path=cache, time_us=FakeTimes(candidates))
    assert not other.cached  # another shape is another key
    assert len(json.loads(cache.read_text())) == 2


def test_a_damaged_cache_is_tuned_again_and_rewritten(tmp_path):
    cache = tmp_path / "tuning.json"
    cache.write_text("{not json")
    candidates = decode_tile_candidates(64, False)
    result = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=cache, time_us=FakeTimes(candidates))
    assert not result.cached and result.shape in json.loads(cache.read_text())


def test_the_budget_stops_after_the_first_candidate(tmp_path, monkeypatch):
    """Every candidate is compiled and checked before the budget's clock starts (with no budget, each still
    launched once, before the one timing); the entry cut short says so and is tuned again next start."""
    candidates = decode_tile_candidates(64, False)
    events = []
    real = tuning.paged_attention
    monkeypatch.setattr(tuning, "paged_attention",
                        lambda *a, decode_tiles=None, **kw: events.append(("launch", decode_tiles)) or
                        real(*a, decode_tiles=decode_tiles, **kw))
    timer = FakeTimes(candidates)

    def timed(tiles, fn):
        events.append(("timed", tiles))
        return timer(tiles, fn)

    result = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=tmp_path / "t.json", budget_s=0.0,
                                          time_us=timed)
    assert timer.calls == candidates[:1] and result.tiles == candidates[0] and not result.complete
    first_timing = events.index(("timed", candidates[0]))
    assert {t for kind, t in events[:first_timing] if kind == "launch"} == set(candidates)
    assert json.loads((tmp_path / "t.json").read_text())[result.shape]["complete"] is False
    again = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=tmp_path / "t.json",
                                         time_us=FakeTimes(candidates))
    assert not again.cached and again.complete and again.tiles == candidates[-1]
    assert tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=tmp_path / "t.json").cached


def test_a_candidate_that_disagrees_never_wins(tmp_path, monkeypatch):
    """The fastest candidate computes something else (here: made to): the tuner refuses it."""
    candidates = decode_tile_candidates(64, False)
    broken = candidates[-1]
    real = tuning.paged_attention

    def paged_attention_broken_for_one(*args, decode_tiles=None, **kwargs):
        out = real(*args, decode_tiles=decode_tiles, **kwargs)
        if decode_tiles == broken:
            out.mul_(-1.0)
        return out

    monkeypatch.setattr(tuning, "paged_attention", paged_attention_broken_for_one)
    timer = FakeTimes(candidates)
    result = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=tmp_path / "t.json", time_us=timer)
    assert broken not in timer.calls and result.tiles == candidates[-2]


def test_a_candidate_the_device_cannot_run_is_skipped(tmp_path, monkeypatch, capsys):
    """The fastest candidate fails to launch here (made to raise, as one past a smaller GPU's shared memory
    would): the tuner goes on without it, silently; the policy's own tiles failing leaves those tiles in place,
    with one warning line, and nothing cached."""
    candidates = decode_tile_candidates(64, False)
    real = tuning.paged_attention

    def fails_for(bad):
        def launch(*args, decode_tiles=None, **kwargs):
            if decode_tiles == bad:
                raise RuntimeError("out of resource: shared memory")
            return real(*args, decode_tiles=decode_tiles, **kwargs)
        return launch

    monkeypatch.setattr(tuning, "paged_attention", fails_for(candidates[-1]))
    timer = FakeTimes(candidates)
    result = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=tmp_path / "t.json", time_us=timer)
    assert candidates[-1] not in timer.calls and result.tiles == candidates[-2] and result.error is None
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(tuning, "paged_attention", fails_for(candidates[0]))
    fallback = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=tmp_path / "u.json",
                                            time_us=FakeTimes(candidates))
    assert_fell_back(fallback.tiles, candidates[0], fallback, capsys, "decode attention's tiles", "out of resource")
    assert not (tmp_path / "u.json").exists()


def assert_fell_back(chosen, default, result, capsys, what: str, error: str) -> None:
    """A tuner that met a device error: the policy's default chosen, the result says so, one warning line."""
    assert chosen == default and result.error is not None and error in result.error and not result.complete
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cbatch: warning: start-up tuning of {what} failed") \
        and error in lines[0] and "defaults" in lines[0], lines
    assert result.describe()["error"] == result.error


def test_a_timer_that_fails_leaves_the_policys_tiles(tmp_path, capsys):
    """The timer itself fails (a device that cannot record events, say): one warning line, the defaults."""
    def broken(tiles, fn):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    result = tuning.tune_decode_attention(SHAPE, torch.device(DEVICE), cache_path=tmp_path / "t.json", time_us=broken)
    assert_fell_back(result.tiles, decode_tile_candidates(64, False)[0], result, capsys, "decode attention's tiles",
                     "illegal memory access")
    assert "more detail" not in result.error  # one line


def test_the_described_shape_is_the_one_tuned():
    """The engine's 256 x 2048 step of Qwen3-0.6B (8 kv heads x 128) fits the synthetic budget whole, bf16 (2 GiB of
    K and V) and fp8; a short budget (a GPU with little free memory) shortens the context, and the key says so."""
    from cbatch.engine.build import TUNING_BATCH, TUNING_CONTEXT

    for kv_dtype in (torch.bfloat16, FP8):
        qwen3 = tuning.DecodeShape(16, 8, 128, 16, torch.bfloat16, kv_dtype, TUNING_BATCH, TUNING_CONTEXT)
        assert tuning.fitted_shape(qwen3, tuning.MAX_SYNTHETIC_BYTES) == qwen3
    assert qwen3.kv_bytes_per_key * TUNING_BATCH * TUNING_CONTEXT == 1 << 30  # fp8: 1 GiB
    short = tuning.fitted_shape(qwen3, 256 << 20)
    assert short.context == 512 and short.batch == TUNING_BATCH
    assert "context 512" in short.key("GPU") and "context 2048" in qwen3.key("GPU")
    assert tuning.synthetic_budget(torch.device("cpu")) == tuning.MAX_SYNTHETIC_BYTES


def test_an_fp8_shape_tunes_on_data_drawn_on_the_device(tmp_path):
    """fp8 K/V are drawn through half-precision slabs (no RNG kernel for fp8): finite, varied values, and every
    candidate agrees with the first on them."""
    shape = tuning.DecodeShape(**{**SHAPE.__dict__, "kv_dtype": FP8})
    call, check = tuning._synthetic_launch(shape, torch.device(DEVICE))
    out = check(decode_tile_candidates(64, True)[0])
    assert torch.isfinite(out).all() and out.std() > 0
    candidates = decode_tile_candidates(64, True)
    timer = FakeTimes(candidates)
    result = tuning.tune_decode_attention(shape, torch.device(DEVICE), cache_path=tmp_path / "t.json", time_us=timer)
    assert timer.calls == candidates and result.tiles == candidates[-1]


# Split-KV tuning on a tiny model (2 kv heads) and a 1-SM "GPU", so short contexts split: the pool holds 4
# sequences of 64 keys; probes of 2 and 4 sequences at 32 and 64 keys.
SPLIT_SHAPE = tuning.DecodeShape(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.bfloat16,
                                 kv_dtype=torch.bfloat16, batch=4, context=64)
RULES = [SplitRule(6, 512), SplitRule(8, 16), SplitRule(16, 8)]  # default first: it never splits here


@pytest.fixture
def small_probes(monkeypatch):
    monkeypatch.setattr(tuning, "SPLIT_PROBE_BATCHES", (2, 4))
    monkeypatch.setattr(tuning, "SPLIT_PROBE_CONTEXTS", (32, 64))


class SplitTimes:
    """time_us for split launches: made-up microseconds per launch split count (100 for those not named); the
    calls (batch, context, splits, segments filled) in order."""

    def __init__(self, **us: float) -> None:
        self.us = {int(count.removeprefix("s")): t for count, t in us.items()}
        self.calls: list[tuple[int, int, int, int]] = []

    def __call__(self, what: tuple[int, int, int, int], fn) -> float:
        fn()
        self.calls.append(what)
        return self.us.get(what[2], 100.0)


def failing_launches(monkeypatch, message: str, **when) -> None:
    """tuning's paged_attention raises `message` (as a device error would) on the launches whose keyword
    arguments hold `when`; the others run."""
    real = tuning.paged_attention

    def launch(*args, **kwargs):
        if all(kwargs.get(key) == value for key, value in when.items()):
            raise RuntimeError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning, "paged_attention", launch)


def tune_splits(tmp_path, timer, **kwargs):
    kwargs.setdefault("budget_s", 1e9)  # the interpreter's launches are slow on a loaded CPU; the budget has its test
    return tuning.tune_decode_splits(SPLIT_SHAPE, decode_tile_candidates(64, False)[0], torch.device(DEVICE), 64,
                                     cache_path=tmp_path / "t.json", rules=RULES, num_sms=1, time_us=timer, **kwargs)


def test_split_probes_are_where_the_rules_launches_differ(small_probes):
    """(2 x 32): 4 programs, rule (8, 16) splits in 2, (16, 8) in 4; (4 x 32): 8 programs, only (16, 8) splits.
    A launch is split for the longest context (64): (16, 16) splits 2 rows in 4, of which 32 keys fill 2."""
    probes = tuning.split_probes(SPLIT_SHAPE, 64, 1, RULES)
    assert {p: sorted(launches) for p, launches in probes.items()} == {
        (2, 32): [(1, 1), (2, 2), (4, 4)], (2, 64): [(1, 1), (2, 2), (4, 4)], (4, 32): [(1, 1), (2, 2)],
        (4, 64): [(1, 1), (2, 2)]}
    assert probes[(2, 32)][(4, 4)] == SplitRule(16, 8)  # each launch with a rule that makes it
    assert (2, 64) not in tuning.split_probes(SPLIT_SHAPE, 32, 1, RULES)  # past the model's limit
    wider = tuning.split_probes(SPLIT_SHAPE, 64, 1, RULES + [SplitRule(16, 16)])
    assert sorted(wider[(2, 32)]) == [(1, 1), (2, 2), (4, 2), (4, 4)] and sorted(wider[(2, 64)]) == sorted(probes[(2, 64)])
    half_pool = SPLIT_SHAPE.__class__(**{**SPLIT_SHAPE.__dict__, "batch": 2})  # 2 x 64 keys: 8 blocks
    assert sorted(tuning.split_probes(half_pool, 64, 1, RULES)) == [(2, 32), (2, 64), (4, 32)]  # 4 x 64: 16 blocks


def test_the_rule_closest_to_the_fastest_wins_and_is_cached(tmp_path, small_probes):
    timer = SplitTimes(s4=50.0)  # 4 segments fastest where offered; elsewhere the counts tie
    result = tune_splits(tmp_path, timer)
    assert result.rule == SplitRule(16, 8) and result.default == RULES[0] and result.complete and not result.cached
    assert sorted(timer.calls) == sorted((b, c, *launch) for (b, c), launches in
                                         tuning.split_probes(SPLIT_SHAPE, 64, 1, RULES).items() for launch in launches)
    assert result.scores[str(SplitRule(16, 8))] < result.scores[str(RULES[0])]

    def never(what, fn):
        raise AssertionError("a cached rule is not timed again")

    again = tune_splits(tmp_path, never)
    assert again.cached and again.rule == result.rule
    from cbatch.observe.report import describe_split_tuning

    line = describe_split_tuning(result.describe())
    assert line.startswith(str(SplitRule(16, 8))) and f"default {RULES[0]}" in line and "tuned in" in line
    assert describe_split_tuning(again.describe()) == f"{SplitRule(16, 8)} (cached; default {RULES[0]})"


def test_the_default_rule_stays_when_splitting_does_not_pay(tmp_path, small_probes):
    result = tune_splits(tmp_path, SplitTimes(s1=50.0))
    assert result.rule == RULES[0] and min(result.scores, key=result.scores.get) == str(RULES[0])


def test_a_split_count_that_disagrees_is_never_picked(tmp_path, small_probes, monkeypatch):
    """4 segments are fastest, then 2, but 4 is made to compute something else: the rule that needs 4 cannot win."""
    real = tuning.paged_attention

    def broken_at_four(*args, num_splits=None, **kwargs):
        out = real(*args, num_splits=num_splits, **kwargs)
        if num_splits == 4:
            out.mul_(-1.0)
        return out

    monkeypatch.setattr(tuning, "paged_attention", broken_at_four)
    timer = SplitTimes(s4=30.0, s2=50.0)
    result = tune_splits(tmp_path, timer)
    assert all(n != 4 for _, _, n, _ in timer.calls)
    assert str(SplitRule(16, 8)) not in result.scores and result.rule == SplitRule(8, 16)


def test_a_split_count_the_device_cannot_run_is_never_picked(tmp_path, small_probes, monkeypatch):
    """A split variant that fails on this device (here: made to raise, as a launch past the GPU's shared memory
    would) leaves its rule unscored; tuning goes on."""
    failing_launches(monkeypatch, "out of resource: shared memory", num_splits=4)
    result = tune_splits(tmp_path, SplitTimes(s4=30.0, s2=50.0))
    assert str(SplitRule(16, 8)) not in result.scores and result.rule == SplitRule(8, 16) and result.complete


def test_the_split_budget_stops_after_the_first_probe(tmp_path, small_probes):
    timer = SplitTimes(s4=50.0)
    result = tune_splits(tmp_path, timer, budget_s=0.0)
    assert {(b, c) for b, c, *_ in timer.calls} == {(2, 32)} and not result.complete
    assert not tune_splits(tmp_path, SplitTimes(s4=50.0)).cached  # an incomplete entry is tuned again


def test_every_launch_tuning_offers_matches_the_reference(small_probes):
    """The synthetic launches tuning times, each at each probe, against the unsplit one (itself held to float64
    attention in tests/test_kernels_attention.py); (4, 2): a launch split in 4 whose sequences fill 2 segments
    (the other two only mark themselves empty) gives the bits of a launch split in 2."""
    pool = tuning._SyntheticKV(SPLIT_SHAPE, torch.device(DEVICE))
    tiles = decode_tile_candidates(64, False)[0]
    probes = tuning.split_probes(SPLIT_SHAPE, 64, 1, RULES + [SplitRule(16, 16)])
    for (batch, context), launches in probes.items():
        call, check = pool.launch(batch, context)
        reference = check(tiles, 1).double()
        for (splits, filled), rule in launches.items():
            out = check(tiles, splits, rule)
            assert torch.isfinite(out).all() and rel_err(out, reference) < 1e-2, (batch, context, splits, filled)
    call, check = pool.launch(2, 32)
    assert torch.equal(check(tiles, 4, SplitRule(16, 16)), check(tiles, 2))


def test_the_unsplit_launch_failing_leaves_the_policys_rule(tmp_path, small_probes, monkeypatch, capsys):
    """The unsplit launch (what every decode step runs) fails: the split tuner keeps the default rule, one warning."""
    failing_launches(monkeypatch, "CUDA error: unspecified launch failure", num_splits=1)
    result = tune_splits(tmp_path, SplitTimes(s4=30.0))
    assert_fell_back(result.rule, RULES[0], result, capsys, "split-KV's rule", "unspecified launch failure")
    assert not (tmp_path / "t.json").exists()  # tuned again next start


def test_an_engine_on_a_failing_device_starts_on_the_defaults(capsys, monkeypatch):
    """build.tune_kernels with the real Triton backend on a "cuda" device this machine cannot reach (every
    tuner's first CUDA call raises, as a device error would): tiles, split rule and GEMMs are the policy's,
    one warning line per tuner, and the report says why."""
    from types import SimpleNamespace

    from cbatch.config import EngineConfig
    from cbatch.engine import build
    from cbatch.model.backend.triton_backend import TritonBackend
    from cbatch.observe.report import describe_attention_tuning, describe_gemm_tuning, describe_split_tuning
    from cbatch.parallel.comm import SINGLE_RANK
    from test_kernels_gemm import _fake_model

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    spec = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64, mla=None)
    resolved = SimpleNamespace(device=torch.device("cuda"), spec=spec, dtype=torch.bfloat16, max_model_len=4096)
    backend, model = TritonBackend(), _fake_model()
    report = build.tune_kernels(EngineConfig(max_num_seqs=40), resolved, backend, torch.bfloat16, SINGLE_RANK, model)
    default_tiles = decode_tile_candidates(64, False)[0]
    assert backend.decode_tiles == default_tiles and backend.split_rule == tuning.split_rule_candidates()[0]
    assert report["decode_attention"] == str(default_tiles) and report["kv_splits"]["rule"] == str(backend.split_rule)
    assert report["decode_gemm"]["triton"] == 0 and report["decode_gemm"]["shapes"] == 2 * 3  # 2 shapes x 3 buckets
    assert all(m.gemm is None for m in model.layers.modules() if hasattr(m, "gemm"))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" failed")[0] for line in lines] == [
        "cbatch: warning: start-up tuning of decode attention's tiles", "cbatch: warning: start-up tuning of "
        "split-KV's rule", "cbatch: warning: start-up tuning of the decode GEMMs"]
    for line in (describe_attention_tuning(report), describe_split_tuning(report["kv_splits"]),
                 describe_gemm_tuning(report["decode_gemm"])):
        assert "tuning failed, the defaults run" in line


def test_split_timings_rotate_through_disjoint_block_tables(small_probes, monkeypatch):
    """Cold-L2 timing of a small probe: the timed call runs each of several disjoint block tables in turn (as many
    as the pool holds, up to COLD_L2_BYTES of the launch's K/V); the check uses one table."""
    pool = tuning._SyntheticKV(SPLIT_SHAPE, torch.device(DEVICE))  # 16 blocks; a 2 x 32 launch reads 4
    tables = pool.block_tables(2, 32)
    assert len(tables) == 4 and all(t.shape == (2, 2) for t in tables)
    assert sorted(torch.cat([t.flatten() for t in tables]).tolist()) == list(range(16))  # disjoint, the whole pool
    launch_bytes = 4 * SPLIT_SHAPE.block_size * SPLIT_SHAPE.kv_bytes_per_key
    monkeypatch.setattr(tuning, "COLD_L2_BYTES", 2 * launch_bytes)
    assert len(pool.block_tables(2, 32)) == 2 and len(pool.block_tables(4, 64)) == 1  # the pool's one launch
    seen = []
    real = tuning.paged_attention
    monkeypatch.setattr(tuning, "paged_attention", lambda *a, **kw: seen.append(a[6].data_ptr()) or real(*a, **kw))
    timed, check = pool.launch(2, 32)
    run = timed(decode_tile_candidates(64, False)[0], 2, RULES[1])
    assert run.period == 2
    for _ in range(4):
        run()
    assert len(set(seen)) == 2 and seen[:2] == seen[2:]
