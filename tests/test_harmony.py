"""gpt-oss's harmony chat format: prompts rendered by the checkpoint's chat template (here a harmony-like one on
SmolLM2's tokenizer with harmony's special tokens added), and completions split by their channels: `analysis` to
the reasoning column, `final` to the answer (cbatch/reasoning_split.py), chosen by the template's markers."""
from __future__ import annotations

import pytest

from types import SimpleNamespace

from cbatch.config import SamplingParams
from cbatch.reasoning_split import HarmonyChannels, ThinkTags, reasoning_format, split_harmony
from cbatch.tasks.generate_task import GenerateTask
from cbatch.tokenizer import encode_messages

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# gpt-oss's template in small: a system turn, the conversation, past assistant turns on the final channel, and the
# assistant's turn opened for the model to choose its channel
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
CHAT = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def harmony_tokenizer(chat_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def test_prompt_renders_with_the_template(harmony_tokenizer):
    ids = encode_messages(harmony_tokenizer, CHAT, {"reasoning_effort": "high"})
    text = harmony_tokenizer.decode(ids)
    assert text.startswith("<|start|>system<|message|>Reasoning: high<|end|><|start|>user<|message|>Is the sky blue?")
    assert "<|start|>assistant<|channel|>final<|message|>Yes.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Why?<|end|><|start|>assistant")
    for marker in HARMONY_TOKENS[:4]:  # each marker one token, as in o200k_harmony
        assert harmony_tokenizer.convert_tokens_to_ids(marker) in ids


def test_completion_splits_by_channel(harmony_tokenizer):
    split = reasoning_format(harmony_tokenizer)
    assert isinstance(split, HarmonyChannels)
    completion = ("<|channel|>analysis<|message|>Rayleigh scattering favours short wavelengths.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Blue light scatters most.<|return|>")
    ids = harmony_tokenizer.encode(completion, add_special_tokens=False)
    text = harmony_tokenizer.decode(ids, skip_special_tokens=True)  # the completion's text: the markers are gone
    assert "<|channel|>" not in text and "analysis" in text
    assert split.split(text, ids, []) == ("Rayleigh scattering favours short wavelengths.", "Blue light scatters most.")
    cut = harmony_tokenizer.encode("<|channel|>analysis<|message|>Rayleigh", add_special_tokens=False)  # max_tokens
    assert split.split(harmony_tokenizer.decode(cut, skip_special_tokens=True), cut, []) == ("Rayleigh", "")

    analysis = harmony_tokenizer.encode("Rayleigh scattering favours short wavelengths.", add_special_tokens=False)
    assert split.reasoning_tokens([], ids) == len(analysis) > 1  # the analysis body's tokens, the markers not
    assert split.reasoning_tokens([], cut) == len(harmony_tokenizer.encode("Rayleigh", add_special_tokens=False))
    call = harmony_tokenizer.encode('<|channel|>commentary to=functions.get <|constrain|>json<|message|>{"a": 1}<|call|>',
                                    add_special_tokens=False)
    assert split.reasoning_tokens([], call) == 0  # a tool call's body is not reasoning


@pytest.mark.parametrize("decoded, want", [
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>", ("a", "b")),
    ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
     "<|start|>assistant<|channel|>final<|message|> b <|return|>", ("one\n\ntwo", "b")),
    ("<|channel|>final<|message|>only an answer<|return|>", (None, "only an answer")),
    # a tool call on the commentary channel, after some analysis: the call's body is the answer
    ('<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary to=functions.get '
     '<|constrain|>json<|message|>{"city": "Oslo"}<|call|>', ("need weather", '{"city": "Oslo"}')),
    ("no channels at all", (None, "plain")),
])
def test_split_harmony(decoded, want):
    assert split_harmony(decoded, "plain") == want


def test_format_follows_the_template(harmony_tokenizer, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    other.chat_template = "{% for m in messages %}<think></think>{{ m.content }}{% endfor %}"
    assert isinstance(reasoning_format(other), ThinkTags)
    other.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert reasoning_format(other) is None
    assert reasoning_format(None) is None


def test_reasoning_effort_goes_to_a_template_that_reads_it(harmony_tokenizer):
    """gpt-oss's template reads `reasoning_effort` ("Reasoning: high"): a row's effort renders there instead of
    becoming a thinking budget (which a model without <think> tokens would refuse); a row's own budget stays."""
    task = GenerateTask(SamplingParams(max_tokens=4))
    engine = SimpleNamespace(tokenizer=harmony_tokenizer, lora_names=[], vocabulary_error=lambda what, ids: None)
    rows = [{"messages": CHAT, "reasoning_effort": "high"}, {"messages": CHAT},
            {"messages": CHAT, "reasoning_effort": "low", "thinking_token_budget": 7}]
    work = [task.requests(engine, task.parse(i, row)) for i, row in enumerate(rows)]
    high, plain, own = (w.requests[0] for w in work)
    assert high.prompt_ids == encode_messages(harmony_tokenizer, CHAT, {"reasoning_effort": "high"})
    assert "Reasoning: high" in harmony_tokenizer.decode(high.prompt_ids)
    assert high.params.thinking_token_budget is None and high.params.chat_template_kwargs == {"reasoning_effort": "high"}
    assert "Reasoning: medium" in harmony_tokenizer.decode(plain.prompt_ids)
    assert "Reasoning: low" in harmony_tokenizer.decode(own.prompt_ids) and own.params.thinking_token_budget == 7
