"""Float32 logits straight from the lm_head GEMM (`LlamaForCausalLM.compute_logits`, EngineConfig.fp32_logits).

On a GPU with bfloat16/float16 activations the GEMM writes float32 (torch.mm's out_dtype); the CPU path is
unchanged. Off a GPU the CUDA GEMM is stood in for by a float64 product rounded to float32 (what cuBLAS's
float32 accumulator gives, to its summation order), so the plumbing around it runs here: which weight
(lm_head or tied embeddings), the soft-capping order, and the switch.
"""
from __future__ import annotations

import pytest
import torch

from cbatch.config import EngineConfig
from cbatch.engine.resolve import load_rank_model, resolve_model
from cbatch.model import decoder
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.parallel.comm import SINGLE_RANK

CPU = torch.device("cpu")


def load(path, dtype: str, fp32_logits: bool, device=CPU) -> LlamaForCausalLM:
    config = EngineConfig(model=str(path), device=device.type, dtype=dtype, fp32_logits=fp32_logits)
    return load_rank_model(config, resolve_model(config), SINGLE_RANK, device)


def hidden_states(model: LlamaForCausalLM, rows: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = model.embed_tokens.weight.dtype
    device = model.embed_tokens.weight.device
    return (torch.randn(rows, model.spec.hidden_size, generator=g) * 2).to(dtype).to(device)


def logits_weight(model: LlamaForCausalLM) -> torch.Tensor:
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


@pytest.fixture
def cuda_gemm_on_cpu(monkeypatch):
    """The float32-output GEMM "runs" on the CPU: a float64 product rounded to float32. Plain weights (no
    oneDNN prepacking, which the CPU path does and the GPU's does not)."""
    monkeypatch.setattr(decoder, "FLOAT32_OUT_DEVICES", ("cpu",))
    monkeypatch.setattr(decoder, "mm_float32", lambda a, b: (a.double() @ b.double()).float())
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # an lm_head; tied embeddings + final soft-capping
def test_float32_logits_are_the_exact_products(family, tiny_checkpoints, family_checkpoint, cuda_gemm_on_cpu):
    path = tiny_checkpoints[family] if family in tiny_checkpoints else family_checkpoint(family)
    on, off = load(path, "bfloat16", True), load(path, "bfloat16", False)
    assert (on.lm_head is None) == (family == "gemma2")
    hidden = hidden_states(on)
    exact = (hidden.double() @ logits_weight(on).double().t()).float()
    got, hf = on.compute_logits(hidden), off.compute_logits(hidden)
    assert got.dtype == hf.dtype == torch.float32
    cap = on.spec.final_softcap
    if cap is None:
        assert torch.equal(got, exact)
        assert torch.equal(hf, exact.bfloat16().float()) or torch.equal(hf, decoder.linear(hidden, logits_weight(on)).float())
    else:  # float32 soft-capping of the float32 logits; off: HF's order, all in bfloat16
        assert torch.equal(got, torch.tanh(exact / cap) * cap)
        logits16 = decoder.linear(hidden, logits_weight(on))
        assert torch.equal(hf, (torch.tanh(logits16 / cap) * cap).float())
        assert got.abs().max() <= cap and got.std() > 0.1 * cap  # capped, and not flattened to a constant
    assert not torch.equal(got, hf)  # the 16-bit rounding is gone ...
    ulp16 = hf.abs().clamp_min(2**-6) * 2**-7  # ... and was all the difference: within a bfloat16 rounding or two
    assert ((got - hf).abs() <= 2 * ulp16).all()


def test_the_cpu_path_is_unchanged(tiny_checkpoints):
    """Without the CUDA GEMM (here: the CPU, prepacked weights and all) the switch changes nothing, bit for bit."""
    for dtype in ("bfloat16", "float32"):
        on, off = load(tiny_checkpoints["qwen2"], dtype, True), load(tiny_checkpoints["qwen2"], dtype, False)
        hidden = hidden_states(on, seed=1)
        got = on.compute_logits(hidden)
        assert got.dtype == torch.float32 and got.abs().max() > 0
        assert torch.equal(got, off.compute_logits(hidden))


def test_float32_models_never_take_the_16_bit_gemm(tiny_checkpoints, cuda_gemm_on_cpu, monkeypatch):
    """float32 activations (the GPU parity tests' dtype) keep the plain matmul even where the GEMM runs."""
    model = load(tiny_checkpoints["llama"], "float32", True)
    monkeypatch.setattr(decoder, "mm_float32", lambda a, b: pytest.fail("float32 activations took the 16-bit GEMM"))
    hidden = hidden_states(model, seed=2)
    assert torch.equal(model.compute_logits(hidden), decoder.linear(hidden, model.lm_head.weight))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.mm's out_dtype runs on CUDA")
def test_cuda_gemm_writes_float32_logits_closer_to_float64(tiny_checkpoints):
    """On a GPU: the real cuBLAS GEMM, against the float64 product of the same 16-bit operands."""
    cuda = torch.device("cuda")
    on = load(tiny_checkpoints["llama"], "bfloat16", True, cuda)
    off = load(tiny_checkpoints["llama"], "bfloat16", False, cuda)
    hidden = hidden_states(on, rows=64)
    exact = hidden.double() @ on.lm_head.weight.double().t()
    got, hf = on.compute_logits(hidden), off.compute_logits(hidden)
    assert got.dtype == torch.float32
    err_on, err_off = (got.double() - exact).abs().max().item(), (hf.double() - exact).abs().max().item()
    assert err_on <= 1e-4 * exact.abs().max().item() and err_on < err_off / 4


def test_the_switch_enters_the_resume_fingerprint_and_the_cache_key(tiny_checkpoints, tmp_path):
    """Off, 16-bit logits can change a near-tie: such rows never mix with the default's on resume or in the
    result cache; the default adds nothing (fingerprints and keys written before the switch still hold)."""
    from cbatch.config import SamplingParams
    from cbatch.run.preflight import JobOptions, job_fingerprint
    from cbatch.run.result_cache import generation_identity

    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt_token_ids": [5, 6]}\n')

    def fingerprint(**engine):
        config = EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu", **engine)
        options = JobOptions(input=source, output=tmp_path / "out.jsonl", engine=config, defaults=SamplingParams())
        return job_fingerprint(options, resolve_model(config))

    def identity(**engine):
        return generation_identity("m", EngineConfig(device="cpu", **engine), torch.bfloat16, CPU, 64)

    assert fingerprint(fp32_logits=False) != fingerprint() == fingerprint(split_sampler=False)
    assert identity(fp32_logits=False) != identity() == identity(split_sampler=False)
    assert "fp32_logits" not in identity()
