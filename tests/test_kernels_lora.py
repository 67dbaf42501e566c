"""The LoRA shrink/expand kernels against the torch path (cbatch/lora/ops.py), on small shapes: several slots,
base-model tokens mixed in, slots whose tokens are not contiguous, a slot with more tokens than one tile."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from cbatch.kernels.lora import lora_expand, lora_shrink  # noqa: E402
from cbatch.lora.ops import add_lora_torch  # noqa: E402
from cbatch.lora.runtime import LoraStep  # noqa: E402
from helpers import kernel_device  # noqa: E402

DEVICE = kernel_device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segmented_delta_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    num_tokens, in_size, out_size, slots, rank_cols = 37, 48, 80, 3, 24
    x = torch.randn(num_tokens, in_size, generator=g).to(dtype)
    a = (torch.randn(slots, rank_cols, in_size, generator=g) * 0.3).to(dtype)
    b = (torch.randn(slots, out_size, rank_cols, generator=g) * 0.3).to(dtype)
    base = torch.randn(num_tokens, out_size, generator=g).to(dtype)
    rng = np.random.default_rng(1)
    token_slots = rng.integers(-1, slots, num_tokens).astype(np.int32)
    token_slots[:20] = 1  # one slot with more tokens than a tile
    token_slots[20] = -1
    step = LoraStep()
    step.set(token_slots, slots, torch.device("cpu"))
    ref = base.clone().float()
    add_lora_torch(x.float(), ref, a.float(), b.float(), step.groups)
    per_token = base.clone().double()  # the definition, token by token
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            per_token[t] += b[slot].double() @ (a[slot].double() @ x[t].double())
    torch.testing.assert_close(ref.double(), per_token, rtol=1e-5, atol=1e-4)
    dev = torch.device(DEVICE)
    to = lambda t: t.to(dev)  # noqa: E731
    out = to(base.clone())
    y = lora_shrink(to(x), to(a), to(step.sorted_tokens), to(step.slot_counts), to(step.slot_starts), step.max_count)
    lora_expand(y, to(b), out, to(step.sorted_tokens), to(step.slot_counts), to(step.slot_starts), step.max_count)
    out = out.cpu().float()
    untouched = torch.from_numpy(token_slots < 0)
    assert torch.equal(out[untouched], base.float()[untouched])  # base-model rows exactly as they were
    assert not torch.allclose(ref[~untouched], base.float()[~untouched], atol=1e-2)  # the deltas are real
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * 10)


def test_warm_up_runs_every_module_once(tiny_checkpoints, tmp_path):
    """LoraSlots.warm_up (what a GPU engine runs before serving) goes through every adapted module's delta."""
    import json

    from safetensors.torch import save_file

    from cbatch.lora.adapter import load_adapter
    from cbatch.lora.runtime import LoraSlots
    from helpers import make_engine

    engine = make_engine(tiny_checkpoints["llama"])
    model = engine.runner.model
    tensors = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": torch.ones(shape)
               for i in range(model.spec.num_layers) for ab, shape in (("A", (4, 64)), ("B", (64, 4)))}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    slots = LoraSlots(model, [load_adapter("x", tmp_path, model.spec, 8)], 2, 8)
    assert len(slots.targets) == model.spec.num_layers
    slots.warm_up()
    assert slots.step.active is False  # the model's own step state is untouched
