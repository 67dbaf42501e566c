"""The library's request settings in vLLM's shapes: `SamplingParams` (cbatch's, plus vLLM's `structured_outputs` /
`guided_decoding` and a lone `stop` string), `StructuredOutputsParams` (`GuidedDecodingParams`, its older name) and
`LoRARequest`. Imports no torch: `import cbatch` stays light."""
from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

from cbatch.config import Constraint, SamplingParams as _RowSamplingParams, UserError
from cbatch.io.constraints import choice_text, regex_text, schema_text


@dataclass(slots=True)
class StructuredOutputsParams:
    """What a completion must match: one of a JSON schema (`json`: an object or its text), any JSON object
    (`json_object=True`), a regex, a `choice` of strings, or an EBNF `grammar` (xgrammar's dialect, GBNF-like:
    `root ::= ...`; Lark grammars are not converted)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self, source: str) -> Constraint:
        """The engine's constraint; `source` ("structured_outputs") prefixes the field in error messages."""
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise UserError(f"{source}: give exactly one of json, regex, choice, grammar, json_object "
                            f"(got {', '.join(given) or 'none'})")
        name = given[0]
        field = f"{source}.{name}"
        if name == "json":
            return Constraint("json_schema", schema_text(field, self.json), field)
        if name == "regex":
            return Constraint("regex", regex_text(field, self.regex), field)
        if name == "choice":
            return Constraint("choice", choice_text(field, list(self.choice)), field)
        if name == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise UserError(f"{field}: must be a non-empty EBNF grammar string")
            return Constraint("grammar", self.grammar, field)
        if self.json_object is not True:
            raise UserError(f"{field}: must be True or None, got {self.json_object!r}")
        return Constraint("json_object", "", field)


class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name of `StructuredOutputsParams` (`SamplingParams(guided_decoding=...)`)."""

    __slots__ = ()


@dataclass(slots=True)
class SamplingParams(_RowSamplingParams):
    """cbatch's sampling settings (vLLM's names and meanings, the row format's fields: docs/sampling.md) plus
    vLLM's `structured_outputs=StructuredOutputsParams(...)` or `guided_decoding=GuidedDecodingParams(...)`,
    which become the `constraint`. Defaults are cbatch's: greedy (`temperature` 0) and `max_tokens` 256."""

    structured_outputs: InitVar[StructuredOutputsParams | None] = None
    guided_decoding: InitVar[StructuredOutputsParams | None] = None

    def __post_init__(self, structured_outputs: StructuredOutputsParams | None,
                      guided_decoding: StructuredOutputsParams | None) -> None:
        if isinstance(self.stop, str):  # vLLM takes one stop string as it is
            self.stop = [self.stop]
        given = [(name, value) for name, value in (("structured_outputs", structured_outputs),
                                                   ("guided_decoding", guided_decoding)) if value is not None]
        if len(given) > 1 or (given and self.constraint is not None):
            raise UserError("SamplingParams: give one of structured_outputs, guided_decoding, constraint")
        if given:
            name, value = given[0]
            if not isinstance(value, StructuredOutputsParams):
                raise UserError(f"{name}: must be a StructuredOutputsParams, got {type(value).__name__}")
            self.constraint = value.constraint(name)


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's LoRA request: the adapter `lora_name` (a PEFT folder at `lora_path`) for the prompts it is given
    with. cbatch names adapters by `lora_name`; `lora_int_id` is kept for vLLM's scripts and must be positive."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise UserError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise UserError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer, "
                            f"got {self.lora_int_id!r}")
        if not self.lora_path:
            raise UserError(f"LoRARequest {self.lora_name!r}: give lora_path, the adapter's PEFT folder")


__all__ = ["GuidedDecodingParams", "LoRARequest", "SamplingParams", "StructuredOutputsParams"]
