"""Thinking models: `chat_template_kwargs` reach the chat template (Qwen3's enable_thinking), and the
`<think>...</think>` part of a completion goes to the `reasoning` column (`--no-reasoning-split` keeps it).

The checkpoint is a tiny Qwen3 with a Qwen3-style think template whose weights follow a script: attention and
MLP outputs are zero, so the next token depends only on the current one, through orthogonal embeddings and an
lm_head that maps each script token to the next. It "thinks", then answers, token for token."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cbatch.tokenizer import encode_messages, load_tokenizer, split_reasoning
from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from tiny_models import make_thinking_checkpoint

THINK_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
EOS = 2  # <|im_end|> in SmolLM2's tokenizer


@pytest.fixture(scope="module")
def thinking_model(smollm2_dir, tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("thinking") / "model"
    tokenizer = make_thinking_checkpoint(path, smollm2_dir, THINK_TEMPLATE)
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    newline = encode_messages(tokenizer, QUESTION)[-1]  # the thinking prompt ends "assistant\n"
    blank = encode_messages(tokenizer, QUESTION, {"enable_thinking": False})[-1]  # the other ends "</think>\n\n"
    maybe, yes = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("Maybe", "Yes"))
    script = {newline: think, think: maybe, maybe: end, end: blank, blank: yes, yes: EOS}
    weights = load_file(path / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    head = torch.zeros_like(weights["lm_head.weight"])
    for i, (token, following) in enumerate(script.items()):
        weights["model.embed_tokens.weight"][token] = 0.0
        weights["model.embed_tokens.weight"][token, i] = 10.0
        head[following, i] = 1.0
    weights["lm_head.weight"] = head
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 1}))
    assert len({newline, blank, think, end, maybe, yes}) == 6
    return path


def test_enable_thinking_false_renders_without_thinking(thinking_model):
    tokenizer = load_tokenizer(thinking_model)
    thinking = tokenizer.decode(encode_messages(tokenizer, QUESTION))
    direct = tokenizer.decode(encode_messages(tokenizer, QUESTION, {"enable_thinking": False}))
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking
    assert direct == thinking + "<think>\n\n</think>\n\n"


def test_reasoning_column_and_chat_template_kwargs(thinking_model, tmp_path):
    rows = [{"id": "think", "messages": QUESTION},
            {"id": "direct", "messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}},
            {"id": "cut", "messages": QUESTION, "max_tokens": 2}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(thinking_model), "--device", "cpu", "--max-tokens", "20"]
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *flags)
    assert code == 0, err
    got = {r["id"]: r for r in read_jsonl(out)}
    assert list(got["think"]) == ["id", "completion", "reasoning", "finish_reason", "prompt_tokens",
                                  "completion_tokens", "error"]
    assert (got["think"]["reasoning"], got["think"]["completion"], got["think"]["finish_reason"]) == ("Maybe", "Yes", "stop")
    assert (got["direct"]["reasoning"], got["direct"]["completion"]) == (None, "Yes")
    tokenizer = load_tokenizer(thinking_model)
    assert got["direct"]["prompt_tokens"] == len(encode_messages(tokenizer, QUESTION, {"enable_thinking": False}))
    assert got["think"]["prompt_tokens"] == len(encode_messages(tokenizer, QUESTION)) < got["direct"]["prompt_tokens"]
    assert (got["cut"]["reasoning"], got["cut"]["completion"], got["cut"]["finish_reason"]) == ("Maybe", "", "length")

    # the job's flag: every row renders without thinking; --no-reasoning-split keeps the raw text
    raw = tmp_path / "raw.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(raw), *flags, "--no-reasoning-split",
                                 "--chat-template-kwargs", '{"enable_thinking": true}')
    assert code == 0, err
    got = {r["id"]: r for r in read_jsonl(raw)}
    assert "reasoning" not in got["think"]
    assert got["think"]["completion"] == "<think>Maybe</think>\n\nYes"
    assert got["direct"]["completion"] == "Yes"  # the row's own kwargs win over the job's
    flagged = tmp_path / "flagged.jsonl"
    code, _, err = run_inprocess("run", str(write_jsonl(tmp_path / "one.jsonl", rows[:1])), "--out", str(flagged), *flags,
                                 "--chat-template-kwargs", '{"enable_thinking": false}')
    assert code == 0, err
    assert (read_jsonl(flagged)[0]["reasoning"], read_jsonl(flagged)[0]["completion"]) == (None, "Yes")


def test_openai_bodies_carry_the_reasoning(thinking_model, tmp_path):
    """--output-format openai: a /v1/responses body's `output` has a `reasoning` item (OpenAI's Responses shape:
    summary [], content [reasoning_text]) before the message; cut while thinking, it is the incomplete last item. A
    chat.completion's message has `reasoning` (vLLM's field), null for a row that did not think; a
    text_completion's text is the raw text."""
    def line(custom_id: str, url: str, **body) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    lines = [line("responses", "/v1/responses", input=QUESTION[0]["content"]),
             line("responses-cut", "/v1/responses", input=QUESTION[0]["content"], max_output_tokens=2),
             line("chat", "/v1/chat/completions", messages=QUESTION),
             line("chat-direct", "/v1/chat/completions", messages=QUESTION,
                  chat_template_kwargs={"enable_thinking": False}),
             line("completion", "/v1/completions", prompt=encode_messages(load_tokenizer(thinking_model), QUESTION))]
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(write_jsonl(tmp_path / "in.jsonl", lines)), "--out", str(out), "--model",
                                 str(thinking_model), "--device", "cpu", "--max-tokens", "20", "--output-format", "openai")
    assert code == 0, err
    body = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    reasoning, message = body["responses"]["output"]
    digest = body["responses"]["id"].removeprefix("resp_")
    assert reasoning == {"type": "reasoning", "id": f"rs_{digest}", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "Maybe"}], "status": "completed"}
    assert (message["type"], message["content"][0]["text"], body["responses"]["status"]) == ("message", "Yes", "completed")
    # usage counts the tokens inside <think>...</think> ("Maybe"), the tags not (as vLLM and OpenAI count them)
    assert body["responses"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 1}
    assert body["responses"]["usage"]["output_tokens"] == 6  # <think> Maybe </think> \n\n Yes <|im_end|>
    assert body["chat"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}
    assert body["chat-direct"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    cut = body["responses-cut"]
    [reasoning] = cut["output"]  # cut while thinking: the reasoning item, incomplete, and no empty message after it
    assert (reasoning["type"], reasoning["content"][0]["text"], reasoning["status"]) == ("reasoning", "Maybe", "incomplete")
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    chat, direct = body["chat"]["choices"][0]["message"], body["chat-direct"]["choices"][0]["message"]
    assert (chat["content"], chat["reasoning"]) == ("Yes", "Maybe")
    assert (direct["content"], direct["reasoning"]) == ("Yes", None)
    # a /v1/completions body is the raw text, thinking included (vLLM's completions endpoint splits no reasoning)
    assert body["completion"]["choices"][0]["text"] == "<think>Maybe</think>\n\nYes"
    # --no-reasoning-split: the raw text in the message, no reasoning item or field
    code, _, err = run_inprocess("run", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "raw.jsonl"), "--model",
                                 str(thinking_model), "--device", "cpu", "--max-tokens", "20", "--output-format",
                                 "openai", "--no-reasoning-split")
    assert code == 0, err
    raw = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(tmp_path / "raw.jsonl")}
    assert [item["type"] for item in raw["responses"]["output"]] == ["message"]
    assert raw["responses"]["output"][0]["content"][0]["text"] == "<think>Maybe</think>\n\nYes"
    assert "reasoning" not in raw["chat"]["choices"][0]["message"]
    assert raw["chat"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}  # no split: no reasoning


def test_reasoning_tokens_count_the_thinking_the_prompt_opened(thinking_model):
    """A template that opens <think> in the prompt: the completion's tokens up to </think> are the reasoning."""
    from cbatch.reasoning_split import ThinkTags, reasoning_format

    tokenizer = load_tokenizer(thinking_model)
    split = reasoning_format(tokenizer)
    assert isinstance(split, ThinkTags)
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    words = tokenizer.encode(" weigh it up", add_special_tokens=False)
    answer = tokenizer.encode("Yes", add_special_tokens=False)
    assert len(words) == 3
    assert split.reasoning_tokens([5, think], [*words, end, *answer]) == 3  # opened by the prompt
    assert split.reasoning_tokens([5, think, 7, end], [*words, end, *answer]) == 0  # the prompt closed it
    assert split.reasoning_tokens([5], [think, *words, end, *answer, think, *words]) == 6  # two blocks, one cut


def test_result_cache_keeps_a_completions_lines_raw_text(thinking_model, tmp_path):
    """A cbatch row and a /v1/completions line of the same tokens and settings: the first is split, the second is
    the raw text, so the result cache does not hand one's record to the other."""
    ids = encode_messages(load_tokenizer(thinking_model), QUESTION)
    flags = ["--model", str(thinking_model), "--device", "cpu", "--max-tokens", "20", "--result-cache", str(tmp_path / "c")]
    split = tmp_path / "split.jsonl"
    code, _, err = run_inprocess("run", str(write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "prompt_token_ids": ids}])),
                                 "--out", str(split), *flags)
    assert code == 0, err
    assert (read_jsonl(split)[0]["reasoning"], read_jsonl(split)[0]["completion"]) == ("Maybe", "Yes")
    line = {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": ids}}
    raw = tmp_path / "raw.jsonl"
    code, _, err = run_inprocess("run", str(write_jsonl(tmp_path / "b.jsonl", [line])), "--out", str(raw), *flags,
                                 "--output-format", "openai")
    assert code == 0, err
    assert read_jsonl(raw)[0]["response"]["body"]["choices"][0]["text"] == "<think>Maybe</think>\n\nYes"


@pytest.mark.parametrize("text,opened,want", [
    ("<think>\nweigh it\n</think>\n\nYes.", False, ("weigh it", "Yes.")),
    ("weigh it</think>Yes.", True, ("weigh it", "Yes.")),  # the template opened <think> in the prompt
    ("<think>still weighing", False, ("still weighing", "")),  # cut off while thinking
    ("\nstill weighing", True, ("still weighing", "")),  # the same, the prompt having opened it (DeepSeek-R1)
    ("Just an answer.", False, (None, "Just an answer.")),
])
def test_split_reasoning(text, opened, want):
    assert split_reasoning(text, opened) == want


def test_a_completion_cut_off_in_the_thinking_its_prompt_opened_is_all_reasoning(thinking_model):
    """DeepSeek-R1's template ends the prompt with <think>: a completion cut off before </think> is reasoning only,
    not an answer (which is what the text alone would say); a prompt that closed the thinking leaves text as it is."""
    from cbatch.reasoning_split import reasoning_format

    tokenizer = load_tokenizer(thinking_model)
    split = reasoning_format(tokenizer)
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    words = tokenizer.encode(" weigh it up", add_special_tokens=False)
    text = tokenizer.decode(words, skip_special_tokens=True)
    assert split.split(text, words, [5, think]) == (text.strip(), "")
    assert split.split(text, words, [5, think, 7, end]) == (None, text)
    assert split.split(text, words, [5]) == (None, text)


def test_reserved_template_kwargs_are_an_error_row(thinking_model, tmp_path):
    rows = [{"id": "a", "messages": QUESTION, "chat_template_kwargs": {"tokenize": False}}]
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--out", str(out), "--model",
                                 str(thinking_model), "--device", "cpu")
    assert code == 1, err
    assert read_jsonl(out)[0]["error"] == "chat_template_kwargs may not set tokenize (cbatch sets it), got {'tokenize': False}"


def test_stop_token_text_and_min_tokens_hold_stop_strings(thinking_model):
    """On the scripted completion `<think>Maybe</think>\n\nYes`: a stop token ends it and stays out of the text
    (vLLM); a stop string completed before min_tokens does not count."""
    from cbatch.config import SamplingParams
    from cbatch.engine.engine import run_to_completion
    from helpers import make_engine

    engine = make_engine(thinking_model)
    tokenizer = engine.tokenizer
    prompt = encode_messages(tokenizer, QUESTION)
    yes = tokenizer.encode("Yes", add_special_tokens=False)[0]
    full, by_token, by_string, held = run_to_completion(engine, [prompt] * 4, [
        SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, stop_token_ids=[yes]),
        SamplingParams(max_tokens=10, stop=["Maybe"]), SamplingParams(max_tokens=10, stop=["Maybe"], min_tokens=3)])
    assert full.text == "<think>Maybe</think>\n\nYes" and full.token_ids[-1] == EOS
    assert by_token.token_ids == full.token_ids[:-1] and by_token.finish_reason == "stop"
    assert by_token.text == "<think>Maybe</think>\n\n"
    assert by_string.text == "<think>" and len(by_string.token_ids) == 2
    assert held.text == full.text and held.finish_reason == "stop"  # "Maybe" came at token 2 < min_tokens


def test_think_tags_of_several_tokens_find_the_prompt_opened_thinking_in_its_text(smollm2_dir):
    """A tokenizer whose <think> is no single token (SmolLM2's): the prompt's last words, decoded, say whether the
    thinking was left open."""
    from cbatch.reasoning_split import ThinkTags

    tokenizer = load_tokenizer(smollm2_dir)
    tags = ThinkTags(tokenizer)
    assert tags.think_ids is None
    opened = tokenizer.encode("User: is it so?\nAssistant: <think>\n", add_special_tokens=False)
    closed = tokenizer.encode("User: is it so?\nAssistant: <think>\n\n</think>\n\n", add_special_tokens=False)
    words = tokenizer.encode("weigh it up", add_special_tokens=False)
    assert tags.split("weigh it up", words, opened) == ("weigh it up", "")
    assert tags.split("weigh it up", words, closed) == (None, "weigh it up")
    assert tags.reasoning_tokens(opened, words) == len(words)
