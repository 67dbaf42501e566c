"""OpenAI's `reasoning_effort` ("low", "medium", "high") as a thinking budget (`thinking_token_budget`, enforced
by the engine: cbatch/engine/thinking.py), the budget of each effort set per job. The ground floor: imports
only cbatch/config.py.

Which budget a row runs with, first found: its own `thinking_token_budget`, its `reasoning_effort`'s budget,
the job's --thinking-budget, none. A chat template that reads `reasoning_effort` itself (gpt-oss) gets the effort
as a template variable instead (`effort_in_template`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from cbatch.config import SamplingParams, UserError

REASONING_EFFORTS: tuple[str, ...] = ("low", "medium", "high")
# thinking tokens per effort: about a paragraph, a page, a long derivation (a job may set its own)
DEFAULT_EFFORT_BUDGETS: dict[str, int] = {"low": 512, "medium": 2048, "high": 8192}


class ReasoningEffortError(UserError):
    """A bad reasoning_effort (a row field) or effort budgets (a job setting); `field` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


def parse_effort_budgets(text: str, field: str = "--reasoning-effort-budgets") -> dict[str, int]:
    """A job's budgets per effort from "low=256,high=4096" (the efforts not named keep their defaults)."""
    budgets = dict(DEFAULT_EFFORT_BUDGETS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        effort, _, value = item.partition("=")
        effort = effort.strip()
        if effort not in REASONING_EFFORTS or not value.strip().isdigit():
            raise ReasoningEffortError(field, f"{item!r} is not EFFORT=TOKENS with EFFORT one of "
                                              f"{', '.join(REASONING_EFFORTS)}; e.g. low=256,medium=1024,high=4096")
        budgets[effort] = int(value)
    return budgets


def effort_budget(effort: Any, budgets: Mapping[str, int] = DEFAULT_EFFORT_BUDGETS) -> int:
    """The thinking budget of a row's `reasoning_effort`."""
    if effort not in REASONING_EFFORTS:
        raise ReasoningEffortError("reasoning_effort", f"must be one of {', '.join(map(repr, REASONING_EFFORTS))}, "
                                                       f"got {effort!r}")
    return budgets[effort]


def with_reasoning_effort(row: Mapping[str, Any], params: SamplingParams,
                          budgets: Mapping[str, int] = DEFAULT_EFFORT_BUDGETS) -> SamplingParams:
    """`params` (the row's settings, its own thinking_token_budget already read) with the budget of the row's
    `reasoning_effort`, unless the row gives its own thinking_token_budget; `params` itself without an effort."""
    effort = row.get("reasoning_effort")
    if effort is None:
        return params
    budget = effort_budget(effort, budgets)  # (checked even where the row's own budget wins)
    return params if row.get("thinking_token_budget") is not None else replace(params, thinking_token_budget=budget)


def effort_in_template(params: SamplingParams, effort: str, budget_from_effort: bool) -> SamplingParams:
    """`params` for a chat template that reads `reasoning_effort` itself (gpt-oss's harmony template: "Reasoning:
    high" in its system message): the effort as a template variable instead of a thinking budget (dropped where
    the effort set it; the row's own chat_template_kwargs win)."""
    budget = None if budget_from_effort else params.thinking_token_budget
    return replace(params, chat_template_kwargs={"reasoning_effort": effort, **params.chat_template_kwargs},
                   thinking_token_budget=budget)


__all__ = ["DEFAULT_EFFORT_BUDGETS", "REASONING_EFFORTS", "ReasoningEffortError", "effort_budget",
           "effort_in_template", "parse_effort_budgets", "with_reasoning_effort"]
