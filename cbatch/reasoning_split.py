"""Splitting a completion into its reasoning and its answer (the `reasoning` column), by the chat format the model's
template speaks: one `ReasoningFormat` per format, the first whose template markers match chosen (the ground floor:
imports only cbatch/tokenizer.py).

    harmony     gpt-oss: messages `<|channel|>NAME<|message|>BODY<|end|>`, the assistant's turns re-opened by
                `<|start|>assistant`; the `analysis` channel's bodies are the reasoning, the `final` channel's the
                answer. The markers are special tokens, which the completion's text (decoded without special tokens)
                has lost, so the completion's token ids are decoded again with them. (OpenAI's `openai_harmony`
                package renders and parses this format too, but loads its vocabulary from the network on first
                use: cbatch runs offline, so it reads the markers itself.)
    think tags  Qwen3, DeepSeek-R1 and the like: `<think>REASONING</think>ANSWER` (tokenizer.split_reasoning).
"""
from __future__ import annotations

import re
from typing import Protocol, Sequence

from cbatch.tokenizer import (THINK_END, THINK_START, count_thinking, split_reasoning, template_texts, template_thinks,
                              think_token_ids, thinking_opened)


class ReasoningFormat(Protocol):
    def split(self, text: str, token_ids: Sequence[int], prompt_ids: Sequence[int]) -> tuple[str | None, str]:
        """(reasoning or None where the completion has none, answer) of a completion: its text and token ids, and
        its prompt's (which may have opened the reasoning)."""
        ...

    def reasoning_tokens(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """How many of the completion's tokens are its reasoning (OpenAI's usage `reasoning_tokens`); the
        format's markers are not counted (as vLLM's reasoning parsers count)."""
        ...


class ThinkTags:
    """`<think>...</think>`: the text alone says it (the tags are plain text or tokens kept in the text)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.think_ids = think_token_ids(tokenizer)  # (start, end) when each tag is one token, else None

    @staticmethod
    def speaks(templates: list[str], tokenizer) -> "ThinkTags | None":
        return ThinkTags(tokenizer) if template_thinks(tokenizer) else None

    def split(self, text: str, token_ids: Sequence[int], prompt_ids: Sequence[int]) -> tuple[str | None, str]:
        return split_reasoning(text, opened=self.opened(prompt_ids))

    def opened(self, prompt_ids: Sequence[int]) -> bool:
        """The prompt leaves the thinking open (its last think tag is <think>): by the tags' tokens, or for tags of
        several tokens by the prompt's last words decoded."""
        if self.think_ids is not None:
            return thinking_opened(list(prompt_ids), self.think_ids)
        tail = self.tokenizer.decode(list(prompt_ids[-_OPENED_TAIL:]), skip_special_tokens=False)
        return tail.rfind(THINK_START) > tail.rfind(THINK_END)

    def reasoning_tokens(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """The tokens inside the thinking, counted as a thinking budget counts them (opened by the completion's
        <think> or by the prompt). Tags of several tokens: the reasoning text's tokens, encoded again."""
        if self.think_ids is not None:
            return count_thinking(list(token_ids), self.think_ids, self.opened(prompt_ids))[1]
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        reasoning, _ = self.split(text, token_ids, prompt_ids)
        return len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


_OPENED_TAIL = 32  # the prompt's last tokens read for a think tag of several tokens (templates open it at the end)


# harmony's marker tokens (each one special token of gpt-oss's vocabulary)
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
# One harmony message of a completion: its header (channel name, then e.g. " to=functions.f"), an optional
# constraint, and its body up to the message's end marker, the next message's start, or the end of the text.
_HARMONY_MESSAGE = re.compile(
    r"<\|channel\|>(?P<header>[^<]*)(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)"
    r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|<\|channel\|>|\Z)",
    re.DOTALL,
)


class HarmonyChannels:
    """gpt-oss's harmony format: the `analysis` channel is the reasoning, the `final` channel the answer. A
    completion cut off while thinking (no final message) answers ""; one with neither channel's messages (a tool
    call on the `commentary` channel) keeps those messages' bodies as its answer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @staticmethod
    def speaks(templates: list[str], tokenizer) -> "HarmonyChannels | None":
        markers = ("<|channel|>", "<|message|>")
        return HarmonyChannels(tokenizer) if any(all(m in t for m in markers) for t in templates) else None

    def split(self, text: str, token_ids: Sequence[int], prompt_ids: Sequence[int]) -> tuple[str | None, str]:
        return split_harmony(self.tokenizer.decode(list(token_ids), skip_special_tokens=False), text)

    def reasoning_tokens(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """The body tokens of the completion's `analysis` messages: after `<|channel|>analysis...<|message|>`, up
        to the next marker token."""
        marker = {name: self.tokenizer.convert_tokens_to_ids(name) for name in HARMONY_MARKERS}
        header_start, body_start = marker["<|channel|>"], marker["<|message|>"]
        # a message's end, or the next one's start
        ends = set(marker.values()) - {header_start, body_start, marker["<|constrain|>"]}
        count, header, analysis = 0, None, False  # header: the channel header's tokens while reading it
        for token in token_ids:
            if token == header_start:
                header, analysis = [], False
            elif token == body_start and header is not None:  # the header's first word is the channel
                channel = self.tokenizer.decode(header, skip_special_tokens=True).split(" ", 1)[0].strip()
                analysis = channel == "analysis"
                header = None
            elif token in ends:
                header, analysis = None, False
            elif header is not None:
                header.append(token)  # (a constraint's tokens join it: only the first word is read)
            elif analysis:
                count += 1
        return count


def split_harmony(decoded: str, text: str = "") -> tuple[str | None, str]:
    """(analysis bodies, final bodies) of a completion decoded with its special tokens; `text` (without them) is
    the answer when it holds no harmony message at all."""
    messages = [(m.group("header").split(" ", 1)[0].strip(), m.group("body")) for m in _HARMONY_MESSAGE.finditer(decoded)]
    if not messages:
        return None, text
    analysis = [body.strip() for channel, body in messages if channel == "analysis"]
    final = [body.strip() for channel, body in messages if channel == "final"]
    other = [body.strip() for channel, body in messages if channel not in ("analysis", "final")]
    reasoning = "\n\n".join(analysis) if analysis else None
    return reasoning, "\n\n".join(final if final else other)


# the formats in the order they are tried: harmony's markers first (its template may mention anything else)
REASONING_FORMATS = (HarmonyChannels, ThinkTags)


def reasoning_format(tokenizer) -> ReasoningFormat | None:
    """How this model's completions split into reasoning and answer (by its chat template), or None: no split."""
    templates = template_texts(tokenizer)
    for fmt in REASONING_FORMATS:
        found = fmt.speaks(templates, tokenizer)
        if found is not None:
            return found
    return None


__all__ = ["REASONING_FORMATS", "HarmonyChannels", "ReasoningFormat", "ThinkTags", "reasoning_format", "split_harmony"]
