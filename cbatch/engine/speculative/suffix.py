"""Suffix decoding's shared half: what the job's earlier rows did after a context. Offline jobs repeat themselves
across rows (the same answer skeleton, the same JSON keys, the same quoted passage), which a row's own n-grams
cannot see. `SuffixTable` maps every context of min_n..max_n tokens seen in the job's finished outputs (and its
prompts) to the counts of the tokens that followed it; a draft walks it greedily from the row's suffix: the most
frequent continuation of the longest known context, k times.

Bounded memory: at most `max_contexts` contexts, the least recently seen dropped first.
"""
from __future__ import annotations

from collections import OrderedDict

DEFAULT_MAX_CONTEXTS = 1 << 20


class SuffixTable:
    def __init__(self, min_n: int, max_n: int, max_contexts: int = DEFAULT_MAX_CONTEXTS) -> None:
        self.min_n, self.max_n, self.max_contexts = min_n, max_n, max_contexts
        self._next: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: list[int]) -> None:
        """Counts, for every context of `tokens`, the token that followed it."""
        table, lo, hi = self._next, self.min_n, self.max_n
        for p in range(lo, len(tokens)):  # tokens[p] follows the contexts ending at p - 1
            follower = tokens[p]
            for n in range(lo, min(hi, p) + 1):
                key = tuple(tokens[p - n : p])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                else:
                    table.move_to_end(key)
                counts[follower] = counts.get(follower, 0) + 1
        while len(table) > self.max_contexts:
            table.popitem(last=False)

    def match_length(self, tokens: list[int]) -> int:
        """The longest n (min_n..max_n) whose context, the last n of `tokens`, the table knows; 0: none."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            if tuple(tokens[-n:]) in self._next:
                return n
        return 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens: each the most frequent follower (ties: the smallest id) of the longest known context
        ending the row's tokens and the draft so far; stops where no context is known."""
        table, context, out = self._next, tokens[-self.max_n :], []
        for _ in range(k):
            counts = None
            for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
                counts = table.get(tuple(context[-n:]))
                if counts is not None:
                    break
            if counts is None:
                break
            token = min(counts, key=lambda t: (-counts[t], t))
            out.append(token)
            context.append(token)
        return out
