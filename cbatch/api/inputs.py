"""The prompts the library takes, in vLLM's shapes: a string, `TextPrompt` ({"prompt": ...}), `TokensPrompt`
({"prompt_token_ids": [...]}), or a list of them; read into `RowRequest`s, the rows `cbatch run` tokenizes."""
from __future__ import annotations

from typing import Any, NotRequired, Sequence, TypedDict, Union

from cbatch.config import UserError
from cbatch.io.rows import RowRequest, is_token_ids, text_field


class TextPrompt(TypedDict):
    """A text prompt (tokenized with the model's special tokens, as `cbatch run` does a row's `prompt`)."""

    prompt: str
    multi_modal_data: NotRequired[Any]  # refused: cbatch runs text models only


class TokensPrompt(TypedDict):
    """A prompt given as token ids."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # ignored for the model; returned as the output's `prompt`
    multi_modal_data: NotRequired[Any]


PromptType = Union[str, TextPrompt, TokensPrompt]
_KEYS = ("prompt", "prompt_token_ids")


def as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt, or a list of them, as a list (a list of ints is one prompt's ids given the wrong way)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        raise UserError('give token ids as {"prompt_token_ids": [...]} (a TokensPrompt), not a bare list of ints')
    return prompts


def row_request(index: int, prompt: PromptType) -> RowRequest:
    """The row a prompt is: text (`prompt`) or token ids (`prompt_token_ids`); a UserError naming what is wrong."""
    where = f"prompt {index}"
    if isinstance(prompt, str):
        return RowRequest(index=index, row_id=str(index), prompt=text_field(where, prompt))
    if not isinstance(prompt, dict):
        raise UserError(f"{where}: must be a string, a TextPrompt or a TokensPrompt, got {type(prompt).__name__}")
    unknown = sorted(set(prompt) - set(_KEYS))
    if unknown:
        raise UserError(f"{where}: cbatch does not take {', '.join(unknown)} (text models only: "
                        "give prompt or prompt_token_ids)")
    if "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
        if not is_token_ids(ids):
            raise UserError(f"{where}: prompt_token_ids must be a non-empty list of non-negative integers")
        return RowRequest(index=index, row_id=str(index), prompt_token_ids=ids)
    if "prompt" not in prompt:
        raise UserError(f"{where}: give prompt (a string) or prompt_token_ids")
    return RowRequest(index=index, row_id=str(index), prompt=text_field(f"{where}.prompt", prompt["prompt"]))


__all__ = ["PromptType", "TextPrompt", "TokensPrompt", "as_list", "row_request"]
