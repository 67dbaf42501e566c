"""Prompt lookup: a row's next tokens guessed from its own tokens (prompt + output). The longest suffix of the row
(max_n down to min_n tokens) that occurred earlier points at what followed it then; the draft copies from there.

`NgramIndex` keeps, per row, every n-gram's latest position, extended with the tokens added since its last call
(nothing is rescanned): a lookup is one dict probe per n. Memory: (max_n - min_n + 1) entries per token of the row.
"""
from __future__ import annotations


class NgramIndex:
    """One row's n-grams (min_n..max_n tokens) -> the position just after their latest occurrence."""

    __slots__ = ("min_n", "max_n", "_next", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in `_next`

    def extend(self, tokens: list[int]) -> None:
        """Indexes the n-grams of `tokens` (the row's tokens so far: only ever appended to) that have a token after
        them. NOTE: the last token's n-grams are left out: they would point at the row's own end."""
        end = len(tokens) - 1
        nxt, lo, hi = self._next, self.min_n, self.max_n
        for p in range(self._indexed, end):  # n-grams ending at p, followed by tokens[p + 1]
            for n in range(lo, min(hi, p + 1) + 1):
                nxt[tuple(tokens[p - n + 1 : p + 1])] = p + 1
        self._indexed = max(self._indexed, end)

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """(n, the position after the latest earlier occurrence of the row's last n tokens) for the longest n that
        occurred before; (0, -1) when none did. Call `extend(tokens)` first."""
        nxt = self._next
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = nxt.get(tuple(tokens[-n:]))
            if start is not None:
                return n, start
        return 0, -1

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens continuing `tokens` as they continued after the suffix's earlier occurrence. A copy that
        runs into the row's end goes on copying what it copied (a loop repeats)."""
        self.extend(tokens)
        n, start = self.match(tokens)
        if n == 0:
            return []
        return copy_from(tokens, start, k)


def copy_from(tokens: list[int], start: int, k: int) -> list[int]:
    """`k` tokens copied from `tokens[start:]`, wrapping around to `start` when the copy reaches the end (period
    len(tokens) - start: the continuation of a copy of itself)."""
    period = len(tokens) - start
    if period >= k:
        return tokens[start : start + k]
    return [tokens[start + i % period] for i in range(k)]
