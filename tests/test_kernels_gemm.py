"""The decode GEMM (cbatch/kernels/gemm.py) and its start-up selection against cuBLAS (kernels/tuning.py).

Every tuning candidate against a float64 matmul of the same inputs on random values: bf16, fp16 and float32,
N and K that are not multiples of the tiles, with and without bias; split-K gives the same bits run to run and a
row's result does not depend on the other rows. The selection is driven by a fake timer (nothing here depends on
a clock): cuBLAS kept where it is faster, a Triton config where it is, the cache answering the second start, the
budget, a disagreeing candidate refused. The switch: `--no-decode-gemm` never tunes or runs the Triton path.

Runs on a GPU when one is present; otherwise through Triton's CPU interpreter (small shapes)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

import cbatch.kernels.gemm as gemm  # noqa: E402
import cbatch.kernels.tuning as tuning  # noqa: E402
from cbatch.kernels.gemm import GEMM_CANDIDATES, DecodeGemm, GemmConfig, decode_linear, gemm_candidates  # noqa: E402
from helpers import kernel_device  # noqa: E402

DEVICE = kernel_device()
EPS = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24}


def layer(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return w, b


def check(config: GemmConfig, m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False, seed: int = 0):
    """decode_linear against x @ w.T (+ b) in float64 on the same (rounded) inputs: fp32 accumulation over K,
    then one rounding to x's dtype (split-K: fp32 partials summed in fp32), so a few ulps of the result's scale."""
    w, b = layer(n, k, dtype, bias, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    out = decode_linear(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if bias else None, config).cpu()
    assert out.dtype == dtype and out.shape == (m, n)
    magnitude = (x.double().abs() @ w.double().abs().t() + (b.double().abs() if bias else 0)).clamp_min(1e-3)
    err = ((out.double() - ref).abs() / magnitude).max().item()
    assert err <= 2 * EPS[dtype] + 64 * EPS[torch.float32], f"{config}: relative error {err:.2e}"
    return out


@pytest.mark.parametrize("config", GEMM_CANDIDATES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_candidate_matches_the_reference(config, dtype):
    """Rows under, at and over one M tile; N and K not multiples of any tile (a partial last K step and N tile)."""
    for m in (1, config.block_m + 3):
        check(config, m=m, n=72, k=200, dtype=dtype, bias=m > 1, seed=m)


def test_fp16_and_a_short_k_with_split_k():
    check(GEMM_CANDIDATES[0], m=5, n=40, k=96, dtype=torch.float16, bias=True)
    split = next(c for c in GEMM_CANDIDATES if c.split_k == 4)
    check(split, m=3, n=24, k=40, dtype=torch.bfloat16)  # K shorter than one K step: one segment
    check(split, m=3, n=24, k=300, dtype=torch.float16, bias=True)  # 3 K steps: 3 segments of one step


def test_split_k_is_deterministic_and_rows_are_independent():
    """Split-K's ordered second pass: the same bits every run; and a row's output is the same bits whatever the
    batch it runs in (one config), so a batch's composition never changes a row."""
    w, b = (t.to(DEVICE) for t in layer(48, 384, torch.bfloat16, True, seed=3))
    x = torch.randn(20, 384, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    for config in (c for c in GEMM_CANDIDATES if c.split_k > 1):
        first = decode_linear(x, w, b, config)
        assert torch.equal(decode_linear(x, w, b, config), first)
        assert torch.equal(decode_linear(x[:3].contiguous(), w, b, config), first[:3])
        assert not torch.equal(first, torch.zeros_like(first))


def test_candidates_per_bucket():
    assert len(set(GEMM_CANDIDATES)) == len(GEMM_CANDIDATES)
    for bucket in gemm.ROW_BUCKETS:
        fitting = gemm_candidates(bucket)
        assert fitting and all(c.block_m <= bucket <= 4 * c.block_m for c in fitting)
    assert any(c.split_k > 1 for c in gemm_candidates(16))
    assert {c.block_m for c in GEMM_CANDIDATES} == {16, 32, 64}
    table = DecodeGemm({b: GemmConfig(16, 16, 16, 1, 1, split_k=b) for b in gemm.ROW_BUCKETS})  # split_k: a tag
    assert [table.config_for(r).split_k for r in (1, 16, 17, 200, 256)] == [16, 16, 32, 256, 256]
    assert table.config_for(257) is None and gemm.MAX_ROWS == 256


# ---- the selection: cuBLAS or a Triton config per (layer shape, batch bucket) ----

BUCKETS = (16, 64)
SHAPES = [(48, 64, False), (40, 96, True)]  # (N, K, bias): two layer shapes, one with a bias


def layers(dtype=torch.float32):
    return [tuple(t.to(DEVICE) if t is not None else None for t in layer(n, k, dtype, bias, seed=n))
            for n, k, bias in SHAPES]


class FakeTimes:
    """time_us: made-up microseconds per (shape, candidate) from `pick(shape, candidate)`; counts the calls."""

    def __init__(self, pick) -> None:
        self.pick = pick
        self.calls: list[tuple[tuple[int, int, int], str]] = []

    def __call__(self, what, fn) -> float:
        shape, candidate = what
        fn()
        self.calls.append(((shape.n, shape.k, shape.rows), candidate))
        return self.pick(shape, candidate)


def tune(tmp_path, timer, **kwargs):
    kwargs.setdefault("budget_s", 1e9)  # the interpreter's first launches are slow; the budget has its own test
    return tuning.tune_decode_gemms(layers(), torch.device(DEVICE), cache_path=tmp_path / "t.json", buckets=BUCKETS,
                                    time_us=timer, **kwargs)


def test_cublas_is_kept_where_it_is_faster(tmp_path):
    timer = FakeTimes(lambda shape, candidate: 10.0 if candidate == "cublas" else 11.0)
    result = tune(tmp_path, timer)
    assert len(result.choices) == len(SHAPES) * len(BUCKETS)
    assert all(c is None for c in result.choices.values())
    timed = {(key, candidate) for key, candidate in timer.calls}
    for n, k, _ in SHAPES:
        for rows in BUCKETS:
            assert ((n, k, rows), "cublas") in timed
            assert {c for (key, c) in timed if key == (n, k, rows)} == {"cublas", *map(str, gemm_candidates(rows))}
    assert all(result.gemm_for(w, b) is None for w, b in layers())  # no layer gets a DecodeGemm
    assert result.describe()["triton"] == 0 and result.complete and not result.cached


def test_triton_wins_where_faster_and_the_second_start_reads_the_cache(tmp_path):
    """One candidate faster than cuBLAS on the 64-row bucket of the first shape only; the margin keeps cuBLAS
    where Triton is only 1% faster (the second shape)."""
    winner = gemm_candidates(64)[-1]

    def pick(shape, candidate):
        if candidate == "cublas":
            return 10.0
        if candidate == str(winner) and shape.rows == 64:
            return 5.0 if shape.n == 48 else 9.9
        return 20.0

    result = tune(tmp_path, FakeTimes(pick))
    chosen = {(s.n, s.rows): c for s, c in result.choices.items()}
    assert chosen == {(48, 16): None, (48, 64): winner, (40, 16): None, (40, 64): None}
    (w0, b0), (w1, b1) = layers()
    decode = result.gemm_for(w0, b0)
    assert isinstance(decode, DecodeGemm) and result.gemm_for(w1, b1) is None
    assert [decode.config_for(r) for r in (1, 16, 17, 64, 65, 300)] == [None, None, winner, winner, None, None]
    described = result.describe()
    assert described["triton"] == 1 and described["chosen"]["48x64 M<=64"] == str(winner)
    entries = json.loads((tmp_path / "t.json").read_text())
    assert len(entries) == 4 and all(e["complete"] for e in entries.values())

    def never(what, fn):
        raise AssertionError("a cached shape is not timed again")

    again = tune(tmp_path, never)
    assert again.cached and again.choices == result.choices

    from cbatch.observe.report import describe_gemm_tuning

    line = describe_gemm_tuning(described)
    assert "Triton for 1 of 4" in line and str(winner) in line and "48x64 M<=64" in line
    assert "cached" in describe_gemm_tuning(again.describe())


def test_the_budget_leaves_cublas_and_a_shape_tuned_again_next_start(tmp_path):
    timer = FakeTimes(lambda shape, candidate: 10.0 if candidate == "cublas" else 1.0)
    result = tune(tmp_path, timer, budget_s=0.0)
    assert {c for _, c in timer.calls} == {"cublas"}  # every shape's cuBLAS time, no Triton candidate
    assert all(c is None for c in result.choices.values()) and not result.complete
    again = tune(tmp_path, FakeTimes(lambda shape, candidate: 10.0 if candidate == "cublas" else 1.0))
    assert not again.cached and again.complete  # an incomplete entry is tuned again, then Triton wins
    assert all(c is not None for c in again.choices.values())


def test_cublas_timing_failing_leaves_cublas_everywhere(tmp_path, capsys):
    """The reference's own timing fails (a device error): every shape keeps cuBLAS, one warning line, no cache."""
    def timer(what, fn):
        if what[1] == "cublas":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return 1.0

    result = tune(tmp_path, timer)
    assert len(result.choices) == len(SHAPES) * len(BUCKETS) and all(c is None for c in result.choices.values())
    assert not result.complete and "not permitted" in result.error and result.describe()["triton"] == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cbatch: warning: start-up tuning of the decode GEMMs failed")
    assert not (tmp_path / "t.json").exists()


def test_every_bucket_gets_timed_largest_first(tmp_path, monkeypatch):
    """Candidates are compiled and checked before the clock, then timed round by round over the buckets, the
    largest first: a budget that allows three Triton timings times the 64-row bucket's first candidate on both
    shapes, then the 16-row bucket's on the first; the shapes cut short are incomplete (tuned again)."""
    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    launched = []
    real = tuning.decode_linear
    monkeypatch.setattr(tuning, "decode_linear", lambda x, w, b, c: launched.append((w.shape[0], x.shape[0], c))
                        or real(x, w, b, c))

    def one_second_each(shape, candidate):
        if candidate != "cublas":
            clock[0] += 1.0
        return 10.0 if candidate == "cublas" else 5.0

    timer = FakeTimes(one_second_each)
    result = tune(tmp_path, timer, budget_s=2.5)
    triton_calls = [(key, c) for key, c in timer.calls if c != "cublas"]
    assert triton_calls == [((48, 64, 64), str(gemm_candidates(64)[0])), ((40, 96, 64), str(gemm_candidates(64)[0])),
                            ((48, 64, 16), str(gemm_candidates(16)[0]))]
    assert {(n, rows, c) for n, _, _ in SHAPES for rows in BUCKETS for c in gemm_candidates(rows)} <= set(launched)
    assert not result.complete
    entries = {key.split("gemm ")[1]: e["complete"] for key, e in json.loads((tmp_path / "t.json").read_text()).items()}
    assert sum(entries.values()) == 0  # every shape still had a candidate untimed
    order = tuning.gemm_timing_order(list(tuning.gemm_shapes([(torch.empty(8, 16), None)])))
    first_round = order[: len(tuning.ROW_BUCKETS)]
    assert [s.rows for s, _ in first_round] == [256, 128, 64, 32, 16]
    assert all(c == gemm_candidates(s.rows)[0] for s, c in first_round)
    assert len(order) == sum(len(gemm_candidates(b)) for b in tuning.ROW_BUCKETS)


def test_gemm_timings_rotate_through_weight_copies(tmp_path, monkeypatch):
    """Cold-L2 timing: each timed call of a shape runs on the next of ceil(COLD_L2_BYTES / the layer's bytes)
    copies of its weights (one per call, in turn), for cuBLAS and Triton alike."""
    layer_bytes = {n: n * k * 4 + (n * 4 if bias else 0) for n, k, bias in SHAPES}
    monkeypatch.setattr(tuning, "COLD_L2_BYTES", 3 * layer_bytes[48])
    used: dict[tuple[int, str], list[int]] = {}
    real = tuning._gemm
    monkeypatch.setattr(tuning, "_gemm", lambda x, w, b, c: used.setdefault((w.shape[0], str(c)), []).append(
        w.data_ptr()) or real(x, w, b, c))
    periods = {}

    def timer(what, fn):
        shape, candidate = what
        periods[(shape.n, candidate)] = fn.period
        used.pop((shape.n, candidate), None)
        for _ in range(2 * fn.period):
            fn()
        return 10.0 if candidate == "cublas" else 20.0

    tune(tmp_path, timer)
    for n, _, _ in SHAPES:
        copies = -(-3 * layer_bytes[48] // layer_bytes[n])
        for candidate in ("cublas", str(gemm_candidates(16)[0])):
            ptrs = used[(n, candidate)]
            assert periods[(n, candidate)] == copies and len(set(ptrs)) == copies and ptrs[:copies] == ptrs[copies:]
    assert tuning.cold_copies(1) == tuning.MAX_COLD_COPIES and tuning.cold_copies(1 << 40) == 1


def test_a_candidate_that_disagrees_never_wins(tmp_path, monkeypatch):
    broken = gemm_candidates(16)[0]
    real = tuning.decode_linear

    def broken_for_one(x, w, b, config):
        out = real(x, w, b, config)
        return out.neg() if config == broken else out

    monkeypatch.setattr(tuning, "decode_linear", broken_for_one)
    timer = FakeTimes(lambda shape, candidate: 1.0 if candidate == str(broken) else 10.0 - (candidate != "cublas"))
    result = tune(tmp_path, timer)
    assert str(broken) not in {c for _, c in timer.calls}
    assert broken not in result.choices.values() and all(c is not None for c in result.choices.values())


def test_decode_gemm_runs_triton_only_in_a_graph_capture_unless_told(monkeypatch):
    """The engine's DecodeGemm (graphs_only) keeps F.linear for eager launches (and for CPU tensors); with
    graphs_only off it calls the kernel for the buckets that chose it, F.linear for the others."""
    calls = []
    monkeypatch.setattr(gemm, "decode_linear", lambda *args: calls.append(args[3]) or torch.zeros(1))
    monkeypatch.setattr(gemm.F, "linear", lambda x, w, b: torch.ones(1))
    w, b = layer(8, 32, torch.float32, True, seed=1)
    config = gemm_candidates(16)[0]
    x = torch.randn(4, 32)
    assert DecodeGemm({16: config, 64: None})(x, w, b).item() == 1.0 and calls == []
    eager = DecodeGemm({16: config, 64: None}, graphs_only=False)
    assert eager(x, w, b).item() == 0.0 and calls == [config]
    assert eager(torch.randn(40, 32), w, b).item() == 1.0 and calls == [config]  # 64-row bucket: cuBLAS


def test_the_eager_passes_before_a_capture_launch_the_graphs_kernel(monkeypatch):
    """Inside graph_warmup (DecodeGraphs' two passes before each capture) a graphs-only DecodeGemm launches the
    Triton kernel as the capture will, so its module is loaded outside the capture (loading one during a capture
    is a CUDA error, and with the tuning read from the cache nothing else launches it first); after it, eager
    calls are back on F.linear."""
    calls = []
    monkeypatch.setattr(gemm, "decode_linear", lambda *args: calls.append(args[3]) or torch.zeros(1))
    monkeypatch.setattr(gemm.F, "linear", lambda x, w, b: torch.ones(1))
    w, b = layer(8, 32, torch.float32, True, seed=1)
    config = gemm_candidates(16)[0]
    engine_gemm = DecodeGemm({16: config, 64: None})
    with gemm.graph_warmup():
        assert engine_gemm(torch.randn(4, 32), w, b).item() == 0.0 and calls == [config]
    assert engine_gemm(torch.randn(4, 32), w, b).item() == 1.0 and calls == [config]


def _fake_model():
    """A model-like object: two decoder layers of plain Linear (bf16, with and without bias), an lm_head outside."""
    from cbatch.model.layers import Linear

    blocks = nn.ModuleList(nn.ModuleDict({"qkv": Linear(32, 64, bias=False), "down": Linear(48, 32, bias=True)})
                           for _ in range(2)).to(torch.bfloat16)
    return SimpleNamespace(layers=blocks, lm_head=Linear(32, 100, bias=False))


@pytest.mark.parametrize("decode_gemm", [True, False])
def test_the_switch(decode_gemm, monkeypatch):
    """build.tune_kernels on a (pretended) CUDA device: with --decode-gemm the decoder layers' plain 16-bit
    Linear modules are handed to the backend's tune_linears and the report gets its result; with
    --no-decode-gemm tune_linears is never called and no layer gets a Triton GEMM."""
    from cbatch.config import EngineConfig
    from cbatch.engine import build
    from cbatch.model.layers import Linear
    from cbatch.parallel.comm import SINGLE_RANK

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    handed = []

    class Backend:
        supports_tuning = True

        def tune(self, shape, device, max_context):
            assert max_context == 64  # the model's limit: split-KV's probes stop there
            return SimpleNamespace(describe=lambda: {"decode_attention": "tiles"})

        supports_cuda_graphs = True

        def tune_linears(self, linears, device, buckets):
            handed.extend(linears)
            assert buckets == (16, 32, 64)  # --max-num-seqs 40: no bucket past the first that holds 40 rows
            return SimpleNamespace(describe=lambda: {"triton": 0})

    spec = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, mla=None)
    resolved = SimpleNamespace(device=torch.device("cuda"), spec=spec, dtype=torch.bfloat16, max_model_len=64)
    model = _fake_model()
    config = EngineConfig(decode_gemm=decode_gemm, max_num_seqs=40)
    report = build.tune_kernels(config, resolved, Backend(), torch.bfloat16, SINGLE_RANK, model)
    if decode_gemm:
        assert handed == [m for m in model.layers.modules() if isinstance(m, Linear)] and len(handed) == 4
        assert report == {"decode_attention": "tiles", "decode_gemm": {"triton": 0}}
    else:
        assert handed == [] and report == {"decode_attention": "tiles"}
        assert all(m.gemm is None for m in model.layers.modules() if isinstance(m, Linear))
    assert build.tune_kernels(EngineConfig(tune_kernels=False), resolved, Backend(), torch.bfloat16, SINGLE_RANK,
                              model) is None  # --no-kernel-tuning: nothing tuned, cuBLAS everywhere
    eager = build.tune_kernels(EngineConfig(enforce_eager=True), resolved, Backend(), torch.bfloat16, SINGLE_RANK, model)
    assert eager == {"decode_attention": "tiles"}  # no decode graphs: the Triton GEMM would never run
    assert len(handed) == (4 if decode_gemm else 0)
    assert build.gemm_buckets(EngineConfig()) == (16, 32, 64, 128, 256)
    assert build.gemm_buckets(EngineConfig(max_num_seqs=1024, cuda_graph_max_batch=256)) == (16, 32, 64, 128, 256)
    assert build.gemm_buckets(EngineConfig(max_num_seqs=16)) == (16,)


def test_the_flag_sets_the_field():
    from cbatch.cli.flags import engine_flags
    from cbatch.config import EngineConfig

    flag = next(f for f in engine_flags(None) if f.name == "decode_gemm")
    assert flag.field == "decode_gemm" and flag.default is True and flag.decls == ("--decode-gemm/--no-decode-gemm",)
    assert EngineConfig().decode_gemm is True
