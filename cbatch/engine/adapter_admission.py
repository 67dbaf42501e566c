"""What the scheduler asks about LoRA adapters (a row's `params.lora`): at most --max-loras distinct adapters
among the running rows (so a step never needs more slots than the runner has), and an admission order that
takes the waiting rows adapter by adapter (so the adapters do not thrash: a step holds few of them, each with
many rows)."""
from __future__ import annotations

from typing import Callable

from cbatch.engine.sequence import Sequence


class AdapterLimit:
    """An admission (optimistic, reserve) with one more refusal: a row whose adapter is not among the running
    rows' while --max-loras adapters already are ("max_loras": it waits until one of them drains). Base-model
    rows never count. Everything else is the wrapped admission's."""

    def __init__(self, inner, max_loras: int) -> None:
        self.inner = inner
        self.max_loras = max_loras
        self.name = inner.name

    def refuses(self, sched, seq: Sequence, hits: list[int]) -> str | None:
        name = seq.params.lora
        if name is not None:
            running = {s.params.lora for s in sched.running}
            running.discard(None)
            if name not in running and len(running) >= self.max_loras:
                return "max_loras"
        return self.inner.refuses(sched, seq, hits)

    def spare_blocks(self, sched) -> int:
        return self.inner.spare_blocks(sched)


def grouped_by_adapter(new_key: Callable[[], Callable[[Sequence], tuple]]) -> Callable[[], Callable[[Sequence], tuple]]:
    """An admission order's key with the row's adapter group first: groups in the order their first row
    arrived (the base model is a group too), the policy's own order inside each."""

    def make() -> Callable[[Sequence], tuple]:
        inner = new_key()
        groups: dict[str | None, int] = {}

        def key(seq: Sequence) -> tuple:
            return (groups.setdefault(seq.params.lora, len(groups)), *inner(seq))

        return key

    return make
