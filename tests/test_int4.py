"""Integer weight-only checkpoints (AWQ GEMM, GPTQ, compressed-tensors pack-quantized): tiny random models
quantized by tests/int_checkpoints.py give, on the CPU in float32, the greedy tokens HF transformers gives with
the dequantized weights; the packers agree with an unpack written here from each format's documented layout;
variants cbatch does not read are refused before loading, by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cbatch.config import SamplingParams
from cbatch.model.errors import UnsupportedModelError
from cbatch.model.int4 import PackedQuant, unpack
from cbatch.model.quant import parse_quantization
from cbatch.model.spec import parse_spec
from helpers import generate, make_engine, random_prompts, ranks_generate
from int_checkpoints import FORMATS, make_int_checkpoint, pack, quantize, quantization_config
from tiny_models import hf_greedy, hf_model

PROMPTS = random_prompts(2, vocab=384, seed=11, min_len=8, max_len=24)


# ---- the layouts -----------------------------------------------------------------------------------------
def _nibbles(word: int, bits: int) -> list[int]:
    return [(word >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)]


def _reference_unpack(stored: dict[str, torch.Tensor], fmt: str, bits: int, n: int, k: int):
    """(q [N, K], zeros [N, G] or None) read word by word as each format documents its layout."""
    q = torch.zeros(n, k, dtype=torch.int64)
    zeros = None
    if fmt == "awq":  # qweight [K, N/8]: word (k, j) nibble i = column 8j + [0,2,4,6,1,3,5,7][i]
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        for row in range(k):
            for j, word in enumerate(stored["qweight"][row].tolist()):
                for i, value in enumerate(_nibbles(word, 4)):
                    q[8 * j + order[i], row] = value
        qz = stored["qzeros"]
        zeros = torch.zeros(n, qz.shape[0], dtype=torch.int64)
        for g in range(qz.shape[0]):
            for j, word in enumerate(qz[g].tolist()):
                for i, value in enumerate(_nibbles(word, 4)):
                    zeros[8 * j + order[i], g] = value
    elif fmt == "gptq":  # qweight [K/8, N]: word (r, n) nibble i = input row 8r + i; qzeros [G, N/8] hold zero - 1
        for r in range(k // 8):
            for col, word in enumerate(stored["qweight"][r].tolist()):
                for i, value in enumerate(_nibbles(word, 4)):
                    q[col, 8 * r + i] = value
        qz = stored["qzeros"]
        zeros = torch.zeros(n, qz.shape[0], dtype=torch.int64)
        for g in range(qz.shape[0]):
            for j, word in enumerate(qz[g].tolist()):
                for i, value in enumerate(_nibbles(word, 4)):
                    zeros[8 * j + i, g] = value + 1
    else:  # weight_packed [N, K/(32/b)]: word (n, j) value i = input 8j + i, stored as signed + 2^(b-1)
        per = 32 // bits
        for row in range(n):
            for j, word in enumerate(stored["weight_packed"][row].tolist()):
                for i, value in enumerate(_nibbles(word, bits)):
                    q[row, per * j + i] = value
        if "weight_zero_point" in stored:  # [N/(32/b), G], packed along N
            zp = stored["weight_zero_point"]
            zeros = torch.zeros(n, zp.shape[1], dtype=torch.int64)
            for r in range(zp.shape[0]):
                for g, word in enumerate(zp[r].tolist()):
                    for i, value in enumerate(_nibbles(word, bits)):
                        zeros[per * r + i, g] = value
    return q, zeros


@pytest.mark.parametrize("variant", ["awq-g32", "gptq-g32-actorder", "ct-w4-g32-asym-actorder", "ct-w8-g64"])
def test_packed_layouts_read_back_as_documented(variant):
    v = FORMATS[variant]
    n, k = 16, 64
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    q, scales, zeros, g_idx = quantize(weight, v, seed=5)
    stored = pack(q, scales, zeros, g_idx, v)
    ref_q, ref_zeros = _reference_unpack(stored, v.format, v.bits, n, k)
    assert torch.equal(ref_q, q)
    if ref_zeros is not None:
        assert torch.equal(ref_zeros, zeros)
    # cbatch's unpack: the same values, in canonical form
    config = quantization_config(v)
    spec = parse_quantization(config)
    assert isinstance(spec.packed, PackedQuant)
    u = unpack(spec.packed, stored.get, "layer")
    assert torch.equal(u.q.long(), q) and torch.equal(u.zeros.long(), zeros) and torch.equal(u.g_idx.long(), g_idx)
    assert torch.equal(u.scales, scales.float())
    expected = (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
    assert torch.equal(u.dequantize(torch.float32), expected)
    assert (weight - expected).abs().max() < 0.6 * scales.float().max()  # quantization error within a step


# ---- greedy tokens against HF on the dequantized weights --------------------------------------------------
CASES = [
    ("llama", "awq-g32"),
    ("llama", "gptq-g128"),
    ("llama", "ct-w8-g64"),
    ("llama3-rope-tied", "gptq-channel-sym"),
    ("qwen3", "gptq-g64-sym-actorder"),
    ("qwen3", "ct-w4-g32-asym-actorder"),
    ("qwen3", "gptq-v2-g64"),
    ("qwen3_moe", "ct-w4-g128"),  # the experts too; AWQ and asymmetric ones: the Triton test below
]


@pytest.fixture(scope="module")
def int_checkpoint(tiny_checkpoints, family_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    made = {}

    def get(arch: str, variant: str):
        if (arch, variant) not in made:
            src = tiny_checkpoints[arch] if arch in tiny_checkpoints else family_checkpoint(arch)
            quant, dequant = root / f"{arch}-{variant}", root / f"{arch}-{variant}-dequant"
            made[arch, variant] = (make_int_checkpoint(src, quant, variant, dequant), dequant)
        return made[arch, variant]

    return get


@pytest.mark.parametrize("arch, variant", CASES)
def test_int_checkpoint_greedy_matches_hf_on_the_dequantized_weights(arch, variant, int_checkpoint):
    quant, dequant = int_checkpoint(arch, variant)
    reference = [hf_greedy(hf_model(dequant), p, 6) for p in PROMPTS]
    assert len({tuple(r) for r in reference}) > 1 and any(len(set(r)) > 2 for r in reference)  # decisive
    engine = make_engine(quant)  # CPU: dequantized once, at load
    assert all(p.dtype in (torch.float32, torch.int64) for p in engine.runner.model.parameters())
    assert generate(engine, PROMPTS, SamplingParams(max_tokens=6)) == reference


# ---- refusals --------------------------------------------------------------------------------------------
_SHAPE = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 10,
          "intermediate_size": 8, "num_hidden_layers": 1}
_CT_W4 = quantization_config(FORMATS["ct-w4-g128"])


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit GPTQ is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit GPTQ is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv_fast"}, "AWQ version 'gemv_fast'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 100}, "AWQ group_size 100"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization 'bitsandbytes' is not supported"),
    ({**_CT_W4, "config_groups": {"group_0": {"weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128}}}},
     "3-bit int pack-quantized weights"),
    ({**_CT_W4, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                                              "input_activations": {"num_bits": 8, "type": "int"}}}}, r"quantized activations \(W4A8\)"),
    ({**_CT_W4, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     "int weight strategy 'tensor'"),
    ({**_CT_W4, "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}},
     "compressed-tensors sparsity format 'sparse-24-bitmask'"),
    ({**_CT_W4, "format": "marlin-24"}, "compressed-tensors format 'marlin-24'"),
])
def test_unsupported_variants_are_refused_by_name(qconfig, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_spec({**_SHAPE, "quantization_config": qconfig})


def _rewrite(src, dst, edit):
    folder = shutil.copytree(src, dst)
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_checkpoints_whose_tensors_do_not_match_the_config_are_refused_at_preflight(int_checkpoint, tmp_path):
    from cbatch.model.loader import ModelLoadError, read_checkpoint

    quant, _ = int_checkpoint("llama", "gptq-g32-actorder")

    def mismatch(tensors):  # act-order whose g_idx puts 33 rows in group 0 and 31 in group 1
        name = "model.layers.0.self_attn.q_proj.g_idx"
        g = tensors[name].clone()
        g[(g == 1).nonzero()[0]] = 0
        tensors[name] = g

    with pytest.raises(UnsupportedModelError, match="act-order with a group mismatch .*q_proj.g_idx"):
        read_checkpoint(_rewrite(quant, tmp_path / "mismatch", mismatch))

    awq, _ = int_checkpoint("llama", "awq-g32")

    def gemv(tensors):  # AWQ's GEMV layout: qweight [N, K/8], scales [K/g, N] padded
        for name in [n for n in tensors if n.endswith(".qweight")]:
            k, n8 = tensors[name].shape
            tensors[name] = torch.zeros(n8 * 8, k // 8, dtype=torch.int32)

    with pytest.raises(UnsupportedModelError, match="another packing, e.g. AWQ GEMV"):
        read_checkpoint(_rewrite(awq, tmp_path / "gemv", gemv))

    bare = _rewrite(awq, tmp_path / "bare", lambda t: None)
    config = json.loads((bare / "config.json").read_text())
    config.pop("quantization_config")
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="qweight is a packed integer weight but config.json has no quantization_config"):
        read_checkpoint(bare)


# ---- tensor parallelism ----------------------------------------------------------------------------------
def test_two_cpu_ranks_give_the_tokens_of_one(int_checkpoint):
    """Dequantized at load, each rank reads its share of the dequantized weights (group-aligned: g32). (Act-order
    checkpoints: tests/test_tp_quant.py.)"""
    quant, _ = int_checkpoint("llama", "awq-g32")
    prompts = random_prompts(3, 384, seed=3, min_len=10, max_len=30)
    one, _ = ranks_generate(quant, 1, prompts)
    two, _ = ranks_generate(quant, 2, prompts)
    assert two == one and len({tuple(t) for t in one}) > 1


def test_a_split_that_cuts_a_group_is_refused_naming_it():
    from cbatch.config import ConfigError
    from cbatch.model.shard import check_tensor_parallel

    spec = parse_spec({**_SHAPE, "intermediate_size": 256, "hidden_size": 256, "num_key_value_heads": 4,
                       "quantization_config": quantization_config(FORMATS["gptq-g128"])})
    check_tensor_parallel(spec, 2)  # 128 rows of o_proj and down_proj input per rank: whole groups
    with pytest.raises(ConfigError, match=r"split the o_proj input .* of 256 into 64 rows, not whole groups of 128"):
        check_tensor_parallel(spec, 4)


@pytest.mark.parametrize("arch, variant", [("llama", "awq-g32"), ("qwen3_moe", "ct-w4-channel-asym")])
def test_packed_shards_are_the_slices_of_the_whole(arch, variant, int_checkpoint):
    """The GPU path keeps layers packed: each rank's packed rows (column-parallel) or words and groups
    (row-parallel) dequantize to its slice of the whole layer, experts included."""
    from cbatch.model.backend.triton_backend import TritonBackend
    from cbatch.model.int4 import dequantize_kept
    from cbatch.model.layers import Int4Linear
    from cbatch.model.loader import load_model, read_checkpoint
    from test_tensor_parallel import _Rank

    quant, _ = int_checkpoint(arch, variant)
    ckpt = read_checkpoint(quant)
    models = [load_model(ckpt, 64, torch.device("cpu"), torch.float32, TritonBackend(), comm=_Rank(r, w))
              for r, w in ((0, 1), (0, 2), (1, 2))]

    def dense(model, name):
        m = model.get_submodule(name)
        if name.endswith("experts"):  # expert 3's down projection
            group = m.w2.shape[2] * 8 if m.int_layout[0] == -1 else m.int_layout[0]
            return dequantize_kept(m.w2[3], m.w2_scale[3], m.w2_zero[3], None, group, 4, torch.float32)
        assert isinstance(m, Int4Linear)
        return dequantize_kept(m.weight, m.weight_scale, m.weight_zero, m.weight_perm, m.group_size, m.bits, torch.float32)

    names = [("layers.0.self_attn.o_proj", 1), ("layers.0.self_attn.qkv_proj", None)]
    names += [("layers.1.mlp.experts", 1)] if arch == "qwen3_moe" else [("layers.1.mlp.down_proj", 1), ("layers.0.mlp.gate_up_proj", 0)]
    for name, dim in names:
        whole, halves = dense(models[0], name), [dense(m, name) for m in models[1:]]
        if dim == 1:
            assert torch.equal(torch.cat(halves, dim=1), whole)
        elif dim == 0:  # gate | up, each split: rank r holds gate[r] | up[r]
            gate, up = whole.chunk(2)
            assert torch.equal(halves[0], torch.cat([gate.chunk(2)[0], up.chunk(2)[0]]))
            assert torch.equal(halves[1], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
        else:  # q | k | v: each rank a half of every part
            assert sum(h.shape[0] for h in halves) == whole.shape[0]
            assert all(any(torch.equal(row, w) for w in whole) for h in halves for row in h[:4])


# ---- the GPU path: packed weights through the W4A16 GEMM ---------------------------------------------------
@pytest.mark.parametrize("arch, variant", [("llama", "gptq-g32-actorder"), ("qwen3", "awq-g32"),
                                           ("qwen3_moe", "ct-w4-channel-asym")])
def test_weights_stay_packed_with_the_triton_backend(arch, variant, int_checkpoint):
    """Attention and dense MLP matmuls held packed (Int4Linear, a quarter of the float bytes at 4 bits) and run
    by the W4A16 kernel (under the interpreter here), MoE experts packed too and run by the fused-MoE kernel's
    int mode; HF's tokens."""
    pytest.importorskip("triton")
    from cbatch.model.layers import Int4Linear

    quant, dequant = int_checkpoint(arch, variant)
    engine = make_engine(quant, attention_backend="triton")
    model = engine.runner.model
    packed = {name for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert {"layers.0.self_attn.qkv_proj", "layers.1.self_attn.o_proj"} <= packed
    assert ("layers.0.mlp.gate_up_proj" in packed) == (arch != "qwen3_moe")
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int32
    if arch == "qwen3_moe":
        assert model.layers[0].mlp.experts.w13.dtype == model.layers[1].mlp.experts.w2.dtype == torch.int32
    reference = [hf_greedy(hf_model(dequant), PROMPTS[0], 3)]
    assert generate(engine, PROMPTS[:1], SamplingParams(max_tokens=3)) == reference


@pytest.mark.parametrize("arch, variant", [("llama", "gptq-g32-actorder"), ("qwen3_moe", "ct-w8-g64")])
def test_plan_counts_the_packed_bytes_a_gpu_run_holds(arch, variant, int_checkpoint):
    """`cbatch plan`'s bytes per weight (from the safetensors headers) == the loaded GPU-path model's (packed
    words, float32 scales, uint8 zeros; experts and float matrices in bf16), and below bf16's 2."""
    from cbatch.engine.resolve import ResolvedModel
    from cbatch.model.backend.triton_backend import TritonBackend
    from cbatch.model.loader import load_model, read_checkpoint
    from cbatch.observe.roofline import stored_bytes_per_weight
    from cbatch.plan.devices import gpu_bytes_per_weight

    quant, _ = int_checkpoint(arch, variant)
    ckpt = read_checkpoint(quant)
    planned = gpu_bytes_per_weight(ResolvedModel(ckpt.spec, torch.device("cuda"), torch.bfloat16, 64, ckpt))
    model = load_model(ckpt, 64, torch.device("cpu"), torch.bfloat16, TritonBackend())
    assert planned == pytest.approx(stored_bytes_per_weight(model), rel=1e-9)
    assert planned < 2.0
