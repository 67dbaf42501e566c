"""End to end through the Triton backend (under the interpreter on a CPU, compiled on a GPU): the same greedy
tokens as the torch backend on the same device."""
from __future__ import annotations


import pytest
import torch


pytest.importorskip("triton")

from cbatch.config import SamplingParams  # noqa: E402
from helpers import generate, make_engine, random_prompts, triton_device  # noqa: E402

DEVICE = triton_device()

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)  # each interpreted step costs ~0.5 s: 4 tokens, 3 of them decodes


# (qwen3 on these settings, with the default attention kernels: test_tuned_decode_gemms_keep_greedy_parity)
@pytest.mark.parametrize("arch", ["mistral"])
def test_triton_backend_matches_torch_backend(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    prompts = random_prompts(4, vocab=384, seed=21, max_len=40)  # mistral: crosses its 24-token window
    settings = dict(device=DEVICE, max_num_batched_tokens=24, block_size=8)  # chunked prefill + decode mixed
    expected = generate(make_engine(path, attention_backend="torch", **settings), prompts, PARAMS)
    got = generate(make_engine(path, attention_backend="triton", **settings), prompts, PARAMS)
    assert got == expected


def tuned_backend(monkeypatch, **choice) -> None:
    """Every TritonBackend built from here on starts with `choice` (decode_tiles, split_rule) as if start-up tuning
    had picked it: set before a GPU engine captures its decode graphs, which then run it. Engines built with these
    take tune_kernels=False, so a GPU's own tuning does not replace it."""
    from cbatch.model.backend.triton_backend import TritonBackend

    init = TritonBackend.__init__

    def init_tuned(self) -> None:
        init(self)
        for name, value in choice.items():
            setattr(self, name, value)

    monkeypatch.setattr(TritonBackend, "__init__", init_tuned)


def test_tuned_decode_tiles_and_split_rule_keep_greedy_parity(tiny_checkpoints, monkeypatch):
    """Start-up tuning hands the backend other decode tiles and a split-KV rule (on a GPU; here set by hand, with
    8-key segments so these short contexts split): decode steps (and, on a GPU, the decode graphs' captures) run
    the other tiles, split and unsplit (a launch gives each sequence the segments its own length fills, so the
    short ones stay whole), and the greedy tokens stay the torch backend's. (Every candidate tile and split count
    against float64 attention: test_kernel_tuning.py.)"""
    import importlib

    pa_mod = importlib.import_module("cbatch.kernels.paged_attention")  # the module: the package exports the function
    splits = []
    auto = pa_mod._auto_num_splits
    monkeypatch.setattr(pa_mod, "_auto_num_splits", lambda *args: splits.append(auto(*args)) or splits[-1])
    path = tiny_checkpoints["qwen3"]
    prompts = random_prompts(4, vocab=384, seed=24, max_len=30)
    assert min(map(len, prompts)) < 8  # a sequence shorter than one segment beside the split ones
    settings = dict(device=DEVICE, max_num_batched_tokens=24, block_size=8)
    expected = generate(make_engine(path, attention_backend="torch", **settings), prompts, PARAMS)
    candidates = pa_mod.decode_tile_candidates(32, False)  # the tiny qwen3's heads
    tuned_backend(monkeypatch, decode_tiles=candidates[-1], split_rule=pa_mod.SplitRule(programs_per_sm=6, min_keys=8))
    engine = make_engine(path, attention_backend="triton", tune_kernels=False, **settings)
    assert engine.spec.head_dim == 32 and engine.runner.model.backend.decode_tiles == candidates[-1] != candidates[0]
    assert generate(engine, prompts, PARAMS) == expected
    assert max(splits) >= 2
    assert len({tuple(t) for t in expected}) > 1


@pytest.mark.parametrize("split_sampler", [True, False])
def test_split_sampler_keeps_the_torch_samplers_tokens(split_sampler, tiny_checkpoints, monkeypatch):
    """The sampling kernel with each row's vocabulary split across programs (128-id tiles here: the 384-id
    vocab in 3 splits) and without (--no-split-sampler): the torch backend's greedy and seeded tokens."""
    from cbatch.kernels import sampler as kernel_sampler

    monkeypatch.setattr(kernel_sampler, "_BLOCK", 128)
    chosen = []
    auto = kernel_sampler.auto_num_splits
    monkeypatch.setattr(kernel_sampler, "auto_num_splits", lambda *args: chosen.append(auto(*args)) or chosen[-1])
    path = tiny_checkpoints["qwen3"]
    prompts = random_prompts(4, vocab=384, seed=23, max_len=20)
    params = [SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8 * (i % 2), seed=100 + i) for i in range(4)]
    settings = dict(device=DEVICE, max_num_batched_tokens=24, block_size=8)
    expected = generate(make_engine(path, attention_backend="torch", **settings), prompts, params)
    got = generate(make_engine(path, attention_backend="triton", split_sampler=split_sampler, **settings), prompts, params)
    assert got == expected
    assert (max(chosen) == 3) if split_sampler else chosen == []  # split on: auto, 3 splits; off: 1, never auto
    assert len({tuple(t) for t in expected}) == 4


def test_engines_with_different_backends_coexist(tiny_checkpoints):
    """The backend is the engine's own object: building a Triton engine leaves a torch engine's numerics
    (bit for bit) and its ops untouched, and both run interleaved in one process."""
    path = tiny_checkpoints["qwen3"]
    prompt = random_prompts(1, vocab=384, seed=5, min_len=20, max_len=20)[0]

    torch_engine = make_engine(path, attention_backend="torch", device=DEVICE)
    alone = _logits(torch_engine, prompt)
    triton_engine = make_engine(path, attention_backend="triton")
    beside_triton = _logits(torch_engine, prompt)
    triton_logits = _logits(triton_engine, prompt)
    assert torch.equal(alone, beside_triton)
    assert not torch.equal(alone, triton_logits)  # the Triton kernels round differently...
    torch.testing.assert_close(triton_logits, alone, rtol=1e-4, atol=1e-4)  # ...but compute the same thing
    assert {m.backend.name for m in torch_engine.runner.model.modules() if hasattr(m, "backend")} == {"torch"}


def _logits(engine, prompt: list[int]) -> torch.Tensor:
    """The logits of one prefill of `prompt` through the engine's runner."""
    from cbatch.engine.sequence import Sequence

    engine.reset()
    seq = Sequence(seq_id=0, prompt_ids=prompt, params=PARAMS)
    engine.scheduler.add(seq)
    plan = engine.scheduler.schedule()
    return engine.runner.forward(plan).logits


def test_cli_triton_backend(tiny_checkpoints, tmp_path):
    """`TRITON_INTERPRET=1 cbatch run ... --device cpu --attention-backend triton` gives the torch backend's tokens
    (the torch side in this process: the CLI's own torch path has its tests in test_cli_run.py)."""
    from ops_jobs import cbatch, read_jsonl, write_jsonl

    rows = tmp_path / "rows.jsonl"
    prompts = random_prompts(3, vocab=384, seed=22, max_len=30)
    write_jsonl(rows, [{"prompt_token_ids": p} for p in prompts])
    out = tmp_path / "triton.jsonl"
    proc = cbatch("run", str(rows), "--out", str(out), "--model", str(tiny_checkpoints["llama"]), "--device", "cpu",
                  "--attention-backend", "triton", "--max-tokens", "5", "--ignore-eos", "--token-ids",
                  TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr
    expected = generate(make_engine(tiny_checkpoints["llama"], attention_backend="torch"), prompts,
                        SamplingParams(max_tokens=5, ignore_eos=True))
    assert [row["completion_token_ids"] for row in read_jsonl(out)] == expected
    assert all(len(t) == 5 for t in expected) and len({tuple(t) for t in expected}) > 1


def test_triton_backend_on_cpu_needs_the_interpreter(tiny_checkpoints, monkeypatch):
    from cbatch.config import ConfigError

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        make_engine(tiny_checkpoints["llama"], attention_backend="triton", device="cpu")


def test_overestimated_bounds_and_forced_splits_are_exact():
    """CUDA graphs replay with max_seq_len = the model's limit: upper bounds and many splits change nothing."""
    from cbatch.kernels import paged_attention

    torch.manual_seed(0)
    block, kv_heads, heads, dim = 8, 2, 4, 64
    k_cache = torch.randn(32, block, kv_heads, dim).to(DEVICE)
    v_cache = torch.randn(32, block, kv_heads, dim).to(DEVICE)
    lens = torch.tensor([5, 19, 40], dtype=torch.int32).to(DEVICE)
    table = torch.randperm(32)[:15].view(3, 5).to(torch.int32).to(DEVICE)
    q = torch.randn(3, heads, dim).to(DEVICE)
    qsl = torch.arange(4, dtype=torch.int32).to(DEVICE)
    tight = paged_attention(q, k_cache, v_cache, torch.empty_like(q), qsl, lens, table, 0.125, 1, 40, num_splits=1)
    loose = paged_attention(q, k_cache, v_cache, torch.empty_like(q), qsl, lens, table, 0.125, 1, 4096, num_splits=8)
    assert torch.isfinite(loose).all()
    assert (loose - tight).norm() / tight.norm() < 1e-5


def test_no_split_kv_launches_decode_attention_unsplit(tiny_checkpoints, monkeypatch):
    """--no-split-kv (EngineConfig.split_kv=False): every attention launch forces one key segment, so the kit can
    time split-KV's gain end to end; by default the kernel's policy decides (num_splits=None)."""
    import cbatch.kernels
    from cbatch.engine.resolve import engine_backend
    from cbatch.config import EngineConfig

    assert engine_backend(EngineConfig(attention_backend="triton"), torch.device(DEVICE)).split_kv
    assert not engine_backend(EngineConfig(attention_backend="torch"), torch.device("cpu")).split_kv  # never splits
    real, seen = cbatch.kernels.paged_attention, []

    def recording(*args, num_splits=None, **kwargs):
        seen.append(num_splits)
        return real(*args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(cbatch.kernels, "paged_attention", recording)
    engine = make_engine(tiny_checkpoints["qwen3"], attention_backend="triton", split_kv=False, block_size=8)
    assert engine.runner.model.backend.split_kv is False
    generate(engine, random_prompts(2, vocab=384, seed=5, max_len=12), SamplingParams(max_tokens=2, ignore_eos=True))
    assert seen and set(seen) == {1}


def test_tuned_decode_gemms_keep_greedy_parity(tiny_checkpoints, monkeypatch):
    """Start-up tuning hands the decoder layers Triton GEMMs (on a GPU, inside the decode graphs; here set by hand,
    every batch size, eager), split-K in every other Linear and not in the rest: the same greedy tokens as the
    torch backend, the kernel called for every Linear, in both forms. The split-K config takes 32-wide K steps so
    that the tiny model's K (64, 128) really splits (the candidates' 128-wide steps would leave one segment)."""
    from dataclasses import replace

    import cbatch.kernels.gemm as gemm
    from cbatch.model.layers import Linear
    from cbatch.model.decoder import LlamaForCausalLM

    path = tiny_checkpoints["qwen3"]
    prompts = random_prompts(4, vocab=384, seed=24, max_len=30)
    settings = dict(device=DEVICE, max_num_batched_tokens=24, block_size=8)
    expected = generate(make_engine(path, attention_backend="torch", **settings), prompts, PARAMS)
    # on a CPU the loader swaps each weight for its oneDNN-prepacked copy; the GEMM needs the plain one
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    engine = make_engine(path, attention_backend="triton", **settings)
    model = engine.runner.model
    plain = next(c for c in gemm.GEMM_CANDIDATES if c.split_k == 1 and c.block_m == 16)
    split = replace(next(c for c in gemm.GEMM_CANDIDATES if c.split_k > 1 and c.block_m == 16), block_k=32)
    assert engine.spec.hidden_size // split.block_k >= 2  # every K cut in at least 2 segments
    configs = [plain, split]
    real, calls = gemm.decode_linear, []
    monkeypatch.setattr(gemm, "decode_linear", lambda *args: calls.append(args[3]) or real(*args))
    linears = [m for m in model.layers.modules() if type(m) is Linear]  # qkv, o, gate_up, down
    for i, m in enumerate(linears):
        m.gemm = gemm.DecodeGemm({bucket: configs[i % 2] for bucket in gemm.ROW_BUCKETS}, graphs_only=False)
    assert generate(engine, prompts, PARAMS) == expected
    assert len(calls) >= len(linears) and set(calls) == set(configs) and len(set(configs)) == 2
    assert len({tuple(t) for t in expected}) > 1
