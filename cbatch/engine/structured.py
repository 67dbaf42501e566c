"""Structured output: a row's completion constrained to a JSON schema, any JSON object, a regex, a choice,
(the library's `structured_outputs.grammar`) an EBNF grammar, or an xgrammar structural tag (a tool call's
wrapper around its arguments' schema).

The grammar engine is xgrammar (docs/structured-output.md says why). Its compiler turns a `Constraint`
into a CompiledGrammar once per engine (cached by the constraint's text), a GrammarMatcher per sequence
follows the sampled tokens, and its bitmask APIs mask the logits of the constrained rows only.

One direction per step, like the rest of the engine:

    runner.forward:  TokenMasks.start(sampling rows)  fills the constrained rows' bitmask in a worker
                     thread while the model runs (nothing advances a matcher during a step)
    runner.execute:  PendingMasks.apply(logits)       -inf outside each grammar, then one `sample` for all rows
    scheduler.update: GrammarState.accept(token)      advances the matcher; a complete grammar finishes
                                                      the row (`stop`), max_tokens still ends it (`length`)

JSON is generated compactly (no free whitespace: a small model cannot loop on blank lines), with the
separators ", " and ": ".
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, Sequence as Seq

import torch

from cbatch.config import Constraint

_JSON_OPTIONS = dict(any_whitespace=False, strict_mode=True)
ANY_JSON_OBJECT = '{"type": "object"}'  # json_object: any object (OpenAI's response_format json_object)


class ConstraintError(ValueError):
    """A constraint the grammar engine cannot use; the message starts with the field (or flag) it came from."""

    def __init__(self, constraint: Constraint, reason: str) -> None:
        name = constraint.source or constraint.kind
        super().__init__(f"{name}: {reason}")


def _engine_message(exc: Exception) -> str:
    """xgrammar's C++ error without its log prefix ('[12:00:00] /project/cpp/x.cc:12: ', 'Check failed: ...: ')."""
    text = str(exc).strip()
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


def _choice_ebnf(text: str) -> str:
    """The grammar of a choice: exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))


def _grammar(constraint: Constraint):
    """The constraint as an xgrammar Grammar (no tokenizer needed); raises the engine's error."""
    import xgrammar as xgr

    kind = constraint.kind
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(constraint.text, **_JSON_OPTIONS)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(ANY_JSON_OBJECT, any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(constraint.text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(constraint.text))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(constraint.text)
    if kind == "structural_tag":  # tool calls (cbatch/tools/choice.py)
        return xgr.Grammar.from_structural_tag(constraint.text)
    raise ValueError(f"unknown constraint kind {kind!r}")


@lru_cache(maxsize=256)
def constraint_problem(constraint: Constraint) -> str | None:
    """Why the grammar engine rejects `constraint` (a malformed schema or regex), or None. Needs no model:
    the job-wide flags are checked with it before anything loads."""
    try:
        _grammar(constraint)
    except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
        return _engine_message(exc)
    return None


class GrammarState:
    """One sequence's matcher: the grammar's state after the tokens sampled so far."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # xgrammar.GrammarMatcher

    def accept(self, token: int) -> bool:
        """Advances by a sampled token; True when the grammar is complete (its stop token accepted).
        Raises RuntimeError if the token breaks the grammar (the mask makes that impossible)."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the sampled token {token} does not fit the grammar (the token mask was not applied)")
        return self.matcher.is_terminated()

    @property
    def needs_mask(self) -> bool:
        return not self.matcher.is_terminated()


class ConstrainedRow(Protocol):
    """What `TokenMasks` reads of a sampling row: an engine `Sequence` (cbatch/engine/sequence.py holds the
    GrammarState, so this module names no sequence)."""

    grammar: GrammarState | None
    num_result_tokens: int | None  # set: a finished static-group member computing padding (no mask)


class Grammars:
    """One engine's grammar compiler over its tokenizer, and every constraint compiled once (by its text).

    The stop tokens are the model's EOS ids: a grammar is complete when one of them is sampled, which
    the mask allows only where the grammar may end."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Seq[int], cache_size: int = 1024) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._matcher_class = xgr.GrammarMatcher
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()  # LRU: CompiledGrammar, or the error text
        self._cache_size = cache_size
        self.num_compiled = 0  # compilations done (a test checks the cache)

    def start(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for `constraint`; raises ConstraintError naming the field for a malformed one."""
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = self._compile(constraint)
            self._compiled[constraint] = compiled
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        if isinstance(compiled, str):
            raise ConstraintError(constraint, compiled)
        return GrammarState(self._matcher_class(compiled))

    def _compile(self, constraint: Constraint) -> Any:
        self.num_compiled += 1
        try:
            return self._compiler.compile_grammar(_grammar(constraint))
        except Exception as exc:  # a malformed schema or regex: the row's error, cached like a grammar
            return _engine_message(exc)


@dataclass(slots=True)
class PendingMasks:
    """A step's bitmask being filled: `rows` index the step's logits (the constrained sampling rows)."""

    future: Future
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits outside each constrained row's grammar to -inf (the other rows are untouched)."""
        import xgrammar as xgr

        bitmask = self.future.result()  # int32 [num sampling rows, ceil(vocab / 32)], on the host
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        with torch.inference_mode():  # the logits are an inference tensor
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)  # xgrammar's kernel (Triton on GPU)


class TokenMasks:
    """The runner's side: fills the bitmask rows of the constrained sampling rows off the main thread.

    NOTE: the host buffer is reused every step; that is safe because a step's masks are applied and its
    tokens read back (a device sync) before the next step fills again."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._worker: ThreadPoolExecutor | None = None
        self._batch_matcher: Any = None
        self._bitmask: torch.Tensor | None = None

    def start(self, seqs: Seq[ConstrainedRow], offsets: Seq[int] | None = None,
              drafts: dict[int, list[int]] | None = None) -> PendingMasks | None:
        """Begins filling the masks of `seqs` (the step's sampling rows, in logits order) that are constrained;
        None when none is. `offsets` (speculative decoding): per row, the drafted tokens (`drafts[seq_id]`) before
        its position: its mask is the grammar's after them (a fork of the matcher advanced through them; the row's
        own matcher is advanced only by `Scheduler.update`)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None and s.num_result_tokens is None and s.grammar.needs_mask]
        if not rows:
            return None
        matchers = [seqs[i].grammar.matcher for i in rows]
        if offsets is not None and any(offsets[i] for i in rows):
            rows, matchers = _draft_matchers(seqs, rows, matchers, offsets, drafts)
        bitmask = self._buffer(len(seqs))
        if self._worker is None:
            import xgrammar as xgr

            self._worker = ThreadPoolExecutor(1, thread_name_prefix="cbatch-grammar")
            self._batch_matcher = xgr.BatchGrammarMatcher()

        def fill() -> torch.Tensor:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            return bitmask

        return PendingMasks(self._worker.submit(fill), rows)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of the host bitmask buffer (grown on demand; pinned for a GPU copy)."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            shape = xgr.get_bitmask_shape(max(num_rows, 64), self.vocab_size)
            self._bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        return self._bitmask[:num_rows]


def _draft_matchers(seqs: Seq[Any], rows: list[int], matchers: list[Any], offsets: Seq[int],
                    drafts: dict[int, list[int]]) -> tuple[list[int], list[Any]]:
    """The rows and matchers of `TokenMasks.start` with each verified draft position's matcher: the one before
    advanced by the draft before it. A position after a draft the grammar refuses, or after the grammar ended,
    gets no mask: its token is never kept (the target's token there differs from the refused draft)."""
    kept_rows, kept = [], []
    current = None
    for i, matcher in zip(rows, matchers):
        j = offsets[i]
        if j == 0:
            current = matcher
        elif current is not None:
            current = current.fork()
            if not current.accept_token(drafts[seqs[i].seq_id][j - 1]) or current.is_terminated():
                current = None
        if current is not None:
            kept_rows.append(i)
            kept.append(current)
    return kept_rows, kept


__all__ = ["ANY_JSON_OBJECT", "ConstrainedRow", "ConstraintError", "GrammarState", "Grammars", "PendingMasks", "TokenMasks",
           "constraint_problem"]
