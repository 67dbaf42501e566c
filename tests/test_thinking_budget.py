"""Thinking budgets (`thinking_token_budget`): after N tokens inside <think> the sampler forces </think>, and the
model answers; every token before the budget is the one an unbounded run samples. `reasoning_effort` maps to a
budget per job (cbatch/reasoning.py).

The acceptance model is a tiny random Qwen3 with a thinking template that opens the thinking in the prompt; its
lm_head rows of <think>, </think> and EOS are zero, so among ~49k random logits none of them is ever the argmax:
left alone it thinks until max_tokens, and it never ends its answer by itself either."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cbatch.config import SamplingParams
from cbatch.engine.engine import run_to_completion
from cbatch.engine.sequence import Sequence
from cbatch.engine.thinking import ThinkingBudgets
from cbatch.reasoning import (DEFAULT_EFFORT_BUDGETS, ReasoningEffortError, effort_budget, parse_effort_budgets,
                              with_reasoning_effort)
from cbatch.tokenizer import encode_messages, split_reasoning, think_token_ids
from helpers import make_engine
from test_reasoning import QUESTION, THINK_TEMPLATE, thinking_model  # noqa: F401 (a fixture)
from tiny_models import make_thinking_checkpoint

EOS = 2
OPEN_THINKING_TEMPLATE = (  # the generation prompt opens the thinking (as DeepSeek-R1's and Qwen3-2507's do)
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def random_thinker(chat_tokenizer_dir, tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("random-thinker") / "model"
    tokenizer = make_thinking_checkpoint(path, chat_tokenizer_dir, OPEN_THINKING_TEMPLATE)
    weights = load_file(path / "model.safetensors")
    for token in (*think_token_ids(tokenizer), EOS):
        weights["lm_head.weight"][token] = 0.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 1}))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def thinking_tokens(token_ids: list[int], end: int) -> int:
    """Tokens before the first </think> (the prompt opened the thinking)."""
    return token_ids.index(end) if end in token_ids else len(token_ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_budgets_bound_the_thinking_then_the_model_answers(random_thinker, async_scheduling):
    engine = make_engine(random_thinker, async_scheduling=async_scheduling)
    start, end = think_token_ids(engine.tokenizer)
    prompt = encode_messages(engine.tokenizer, QUESTION)
    assert prompt[-2:] == [start, engine.tokenizer.encode("\n", add_special_tokens=False)[0]]
    budgets = [None, 0, 8, 32]
    greedy = [SamplingParams(max_tokens=48, thinking_token_budget=b) for b in budgets]
    seeded = [SamplingParams(max_tokens=48, temperature=0.8, seed=5, thinking_token_budget=b) for b in (None, 8)]
    outs = run_to_completion(engine, [prompt] * 6, greedy + seeded)  # one batch: each row its own budget
    unbounded, *bounded = outs[:4]
    assert end not in unbounded.token_ids and len(unbounded.token_ids) == 48  # alone it thinks to max_tokens
    for budget, out in zip(budgets[1:], bounded):
        ids = out.token_ids
        assert thinking_tokens(ids, end) == budget  # never more than the budget inside <think> ...
        assert ids[:budget] == unbounded.token_ids[:budget]  # ... the same tokens as unbounded before it
        assert ids[budget] == end and len(ids) == 48 and end not in ids[budget + 1:]
        reasoning, answer = split_reasoning(out.text)
        assert reasoning is not None and answer  # then it answers
        assert (reasoning == "") == (budget == 0)
    sampled_unbounded, sampled = outs[4:]
    assert end not in sampled_unbounded.token_ids
    assert sampled.token_ids[:8] == sampled_unbounded.token_ids[:8] and sampled.token_ids[8] == end
    assert sampled.token_ids[:8] != unbounded.token_ids[:8]  # (it did sample)


def test_speculative_decoding_leaves_budget_rows_alone(random_thinker, monkeypatch):
    """--speculative: a row with a thinking budget does not draft (its forced </think> is decided per sampled
    token), so it decodes as without speculation; rows without one draft beside it. Tokens identical."""
    from cbatch.engine.speculative import Speculator

    engine = make_engine(random_thinker, max_num_seqs=2, policy="fcfs")
    prompt = encode_messages(engine.tokenizer, QUESTION)
    params = [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, thinking_token_budget=6)] * 2
    plain = [o.token_ids for o in run_to_completion(engine, [prompt] * 4, params)]
    kept: dict[int | None, int] = {}
    verified = Speculator.verified

    def count(self, seq, drafted, accepted):
        budget = seq.params.thinking_token_budget
        kept[budget] = kept.get(budget, 0) + accepted
        verified(self, seq, drafted, accepted)

    monkeypatch.setattr(Speculator, "verified", count)
    engine = make_engine(random_thinker, max_num_seqs=2, policy="fcfs", speculative="suffix")
    assert [o.token_ids for o in run_to_completion(engine, [prompt] * 4, params)] == plain
    assert list(kept) == [None] and kept[None] > 0  # the copy of the unbounded row drafted from the first's output


def test_a_budget_closes_the_models_own_thinking(thinking_model):  # noqa: F811
    """The scripted model of test_reasoning.py opens <think> itself and thinks one token ("Maybe"): a budget of 0
    closes it at once and the answer follows; a budget of 1 or more changes nothing."""
    engine = make_engine(thinking_model)
    prompt = encode_messages(engine.tokenizer, QUESTION)
    free, none, one = run_to_completion(engine, [prompt] * 3, [
        SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, thinking_token_budget=0),
        SamplingParams(max_tokens=10, thinking_token_budget=1)])
    assert free.text == one.text == "<think>Maybe</think>\n\nYes"
    assert none.text == "<think></think>\n\nYes" and none.finish_reason == "stop"


def test_a_model_without_think_tokens_refuses_a_budget(tiny_chat_model):
    from cbatch.engine.pooling import PoolingParams

    engine = make_engine(tiny_chat_model)
    params = SamplingParams(max_tokens=4, thinking_token_budget=8)
    seq = engine.add_request([5, 6, 7], params)
    assert seq.error == ("thinking_token_budget: this model's tokenizer has no <think> and </think> tokens, so it has "
                         "no thinking to bound; drop the field (or --thinking-budget)")
    embedding = engine.add_request([5, 6, 7], params, pooling=PoolingParams("embed"))  # generates nothing: moot
    assert embedding.error is None and embedding.params.thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=-1).validate() == (
        "thinking_token_budget must be a non-negative integer (or null = no budget), got -1")


# ---- the counter alone ----------------------------------------------------------------------------------
START, END = 100, 101


def seq(i: int, prompt: list[int], output: list[int], budget: int) -> Sequence:
    s = Sequence(seq_id=i, prompt_ids=prompt, params=SamplingParams(thinking_token_budget=budget), output_ids=list(output))
    s.think_ids = (START, END)
    return s


def test_counter_follows_thinking_blocks():
    budgets = ThinkingBudgets()
    model_opened = seq(0, [5, 6], [START, 7, 8], budget=2)  # inside, 2 used: forced
    prompt_opened = seq(1, [5, START, 9], [7], budget=2)  # inside from the prompt, 1 used
    closed_in_prompt = seq(2, [START, 9, END, 5], [7, 8, 9], budget=0)  # an earlier turn's thinking: not inside
    not_yet = seq(3, [5], [7, 8, 9], budget=0)
    assert budgets.forced([model_opened, prompt_opened, closed_in_prompt, not_yet]) == [(0, END)]
    prompt_opened.output_ids.append(8)
    model_opened.output_ids.append(END)
    assert budgets.forced([model_opened, prompt_opened]) == [(1, END)]  # counted on from where it was
    model_opened.output_ids += [3, START]  # a second block shares the spent budget
    assert budgets.forced([model_opened]) == [(0, END)]
    budgets.release(model_opened)  # preempted: rebuilt from its tokens
    assert budgets.forced([model_opened]) == [(0, END)]
    unbudgeted = Sequence(seq_id=9, prompt_ids=[START], params=SamplingParams())
    assert budgets.forced([unbudgeted]) == []


def test_forced_token_wins_over_every_logit():
    from cbatch.engine.sampler import ForcedTokens, LogitsProcessors, process_logits

    logits = torch.randn(3, 10) * 5
    logits[1, 4] = -float("inf")  # even a banned token
    out = process_logits(logits, LogitsProcessors(forced=ForcedTokens(torch.tensor([1]), torch.tensor([4]))))
    assert out.argmax(dim=-1)[1] == 4 and torch.equal(out[[0, 2]], logits[[0, 2]])
    assert torch.softmax(out[1], dim=-1)[4] == 1.0


# ---- reasoning_effort -----------------------------------------------------------------------------------
def test_reasoning_effort_maps_to_a_budget():
    params = SamplingParams(thinking_token_budget=100)  # the job's --thinking-budget
    assert with_reasoning_effort({"reasoning_effort": "low"}, params).thinking_token_budget == 512
    assert with_reasoning_effort({}, params) is params
    own = with_reasoning_effort({"reasoning_effort": "high", "thinking_token_budget": 7},
                                SamplingParams(thinking_token_budget=7))
    assert own.thinking_token_budget == 7  # the row's own budget wins
    budgets = parse_effort_budgets("low=16, high=4096")
    assert budgets == {"low": 16, "medium": DEFAULT_EFFORT_BUDGETS["medium"], "high": 4096}
    assert with_reasoning_effort({"reasoning_effort": "high"}, params, budgets).thinking_token_budget == 4096
    assert effort_budget("medium") == 2048
    with pytest.raises(ReasoningEffortError, match=r"^reasoning_effort: must be one of 'low', 'medium', 'high', got 'max'$"):
        with_reasoning_effort({"reasoning_effort": "max", "thinking_token_budget": 3}, params)
    with pytest.raises(ReasoningEffortError, match=r"^--reasoning-effort-budgets: 'low=-1' is not EFFORT=TOKENS"):
        parse_effort_budgets("low=-1")
