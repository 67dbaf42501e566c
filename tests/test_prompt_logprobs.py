"""prompt_logprobs: HF's log_softmax of every prompt position, whatever the chunking, the prefix cache or
preemption; computed in slices, so a long prompt's peak memory stays bounded (measured in a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from cbatch.config import SamplingParams
from cbatch.engine.engine import run_to_completion
from helpers import make_engine, random_prompts
from tiny_models import hf_model, make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def hf_prompt_logprobs(model, prompt: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each prompt token 1.. given its prefix, the top k ids of each position)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), logprobs.topk(k, dim=-1).indices


def test_prompt_logprobs_match_hf_across_chunks_cache_and_preemption(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    model = hf_model(path)
    shared = random_prompts(1, vocab=384, seed=60, min_len=24, max_len=24)[0]
    prompts = [shared, shared + [7, 8, 9], random_prompts(1, vocab=384, seed=61, min_len=30, max_len=30)[0]]
    # the first row fills the prefix cache; the second shares its prefix but must compute every position
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=30, prompt_logprobs=4, ignore_eos=True),
              SamplingParams(max_tokens=30, prompt_logprobs=2, ignore_eos=True)]
    # chunks of 9 tokens; then a pool that holds the prompts but not the completions: preemptions
    for settings in (dict(max_num_batched_tokens=9), dict(policy="fcfs", num_kv_blocks=16, block_size=8)):
        engine = make_engine(path, **settings)
        outs = run_to_completion(engine, prompts, params)
        assert outs[0].prompt_logprobs is None
        for out, prompt, p in zip(outs[1:], prompts[1:], params[1:]):
            values, top = hf_prompt_logprobs(model, prompt, p.prompt_logprobs)
            assert len(out.prompt_logprobs) == len(prompt) - 1
            torch.testing.assert_close(torch.tensor(out.prompt_logprobs.token), values, rtol=0, atol=1e-4)
            assert [ids[0] for ids in out.prompt_logprobs.top_ids] == top[:, 0].tolist()
            assert all(len(ids) == p.prompt_logprobs for ids in out.prompt_logprobs.top_ids)
    assert engine.scheduler.stats.preemptions > 0


RSS_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[2])
from helpers import make_engine
from cbatch.config import SamplingParams
from cbatch.engine.engine import run_to_completion

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

engine = make_engine(sys.argv[1], max_num_batched_tokens=1024, num_kv_blocks=300)
params = SamplingParams(max_tokens=2, prompt_logprobs=5)
run_to_completion(engine, [[5 + i % 300 for i in range(1500)]], [params])  # warm: allocator, code paths
baseline = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
out = run_to_completion(engine, [[3 + (7 * i) % 500 for i in range(4000)]], [params])[0]
print(json.dumps({"growth": status("VmHWM") - baseline, "positions": len(out.prompt_logprobs),
                  "top": len(out.prompt_logprobs.top_ids[-1]), "first": out.prompt_logprobs.token[0]}))
"""


def test_prompt_logprobs_of_a_long_prompt_stay_in_bounded_memory(tmp_path):
    """A 4,000-token prompt on a 49,152-token vocabulary: its [prompt x vocab] float32 logits would be 786 MB;
    computed in slices, the peak RSS grows by less than 200 MB."""
    vocab = 49152
    path = make_checkpoint("llama", tmp_path / "model", vocab_size=vocab, max_position_embeddings=8192)
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path), str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["positions"] == 3999 and result["top"] == 5 and result["first"] < 0
    assert 4000 * vocab * 4 > 700 << 20  # what a whole-prompt logits tensor would take
    assert result["growth"] < 200 << 20, result
