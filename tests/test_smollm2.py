"""The real default model, SmolLM2-135M-Instruct: token-identical to HF on chat prompts, sensible text."""
from __future__ import annotations

import pytest
import torch

from cbatch.config import SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import run_to_completion
from cbatch.tokenizer import encode_messages, load_tokenizer

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colors of the rainbow."}],
    [{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about a cat."}],
]


@pytest.mark.slow
def test_chat_greedy_matches_hf(smollm2_dir):
    import transformers

    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [encode_messages(tokenizer, chat) for chat in CHATS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    reference = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, do_sample=False)
        reference.append(out[0, len(ids):].tolist())
    from cbatch.config import EngineConfig

    engine = build_engine(EngineConfig(model=str(smollm2_dir), device="cpu"))
    outputs = run_to_completion(engine, prompts, [SamplingParams(max_tokens=24)] * len(prompts))
    assert [o.token_ids for o in outputs] == reference
    assert "Paris" in outputs[0].text
