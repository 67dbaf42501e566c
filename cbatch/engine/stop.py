"""Stop strings, checked incrementally: each sampled token decodes only a short window of new text.

The window trick is the one incremental detokenizers use (vLLM's, HF's TextStreamer): decode the tokens
from `prefix_offset` twice, up to `read_offset` and to the end; the text between is what the new tokens
add. Text that ends in U+FFFD (an incomplete UTF-8 sequence split across tokens) waits for the next
token. A stop string can only newly appear in the last `len(stop) - 1` characters plus the new text,
so only that tail is searched.
"""
from __future__ import annotations


class StopChecker:
    """Accumulates one completion's text and says when a stop string first appears in it."""

    __slots__ = ("_tokenizer", "stops", "_ids", "_prefix_offset", "_read_offset", "text", "_tail", "match_from")

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self._tokenizer = tokenizer
        self.stops = stops
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # the completion's text so far (what `decode(ids, skip_special_tokens=True)` gives)
        self._tail = max(len(s) for s in stops) - 1  # characters a stop string can reach back
        self.match_from: int | None = None  # where in `text` the search that found the stop string began

    def append(self, token: int, may_stop: bool = True) -> bool:
        """Adds a sampled token; True once the text contains a stop string. With `may_stop` False (before
        min_tokens) the text grows but is not searched: a stop string completed then does not count."""
        self._ids.append(token)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        after = decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # nothing printable yet (a special token, or half a character)
        start = max(0, len(self.text) - self._tail)
        self.text += after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not may_stop or not any(stop in self.text[start:] for stop in self.stops):
            return False
        self.match_from = start
        return True


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Index where the earliest stop string at or after `start` begins in `text`, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
