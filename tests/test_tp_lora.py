"""LoRA adapters under tensor parallelism (CPU ranks over gloo): three adapters on every projection, two resident at
a time (rows of several adapters in one batch, slots reloaded between steps), give the tokens of one rank at 2 and 4
ranks (at 4, each KV head is held by two ranks: the k/v factors' rows are that head's)."""
from __future__ import annotations

import pytest

from cbatch.config import SamplingParams
from helpers import random_prompts, ranks_generate
from tiny_models import make_lora_adapter

pytest.importorskip("peft")

ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "b": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "gate_proj", "up_proj", "o_proj"]),
    "c": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]),
}
PROMPTS = random_prompts(8, vocab=380, seed=13, min_len=12, max_len=36)
ROW_ADAPTERS = [None, "a", "b", "c", "a", "b", "c", None]
PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True, lora=name) for name in ROW_ADAPTERS]
SETTINGS = dict(max_loras=2, max_lora_rank=16, max_num_batched_tokens=32, max_num_seqs=6)


@pytest.fixture(scope="module")
def lora_case(tiny_checkpoints, tmp_path_factory):
    """(checkpoint, the job's adapters, one rank's tokens per row)."""
    checkpoint = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("tp-lora")
    loras = tuple((name, str(make_lora_adapter(checkpoint, root / name, seed, **config)))
                  for seed, (name, config) in enumerate(ADAPTERS.items()))
    one = ranks_generate(checkpoint, 1, PROMPTS, PARAMS, loras=loras, **SETTINGS)[0]
    base = ranks_generate(checkpoint, 1, PROMPTS, [SamplingParams(max_tokens=10, ignore_eos=True)] * len(PROMPTS))[0]
    # every adapter changes its rows (the test fails with the deltas off, or with one rank's share missing)
    assert all(one[i] != base[i] for i, name in enumerate(ROW_ADAPTERS) if name is not None)
    assert all(one[i] == base[i] for i, name in enumerate(ROW_ADAPTERS) if name is None)
    return checkpoint, loras, one


@pytest.mark.parametrize("ranks", [2, 4])
def test_adapter_rows_give_the_tokens_of_one_rank(ranks, lora_case):
    checkpoint, loras, one = lora_case
    assert ranks_generate(checkpoint, ranks, PROMPTS, PARAMS, loras=loras, **SETTINGS)[0] == one
