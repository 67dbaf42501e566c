"""The vision tower's budget per step (`--max-image-tokens-per-step`): the image tokens the step's chunks may start.

A chunk that starts an image's placeholder run (engine/images.py) has the runner encode that image in this step
(engine/image_rows.py). The scheduler asks `fit` how many of a chunk's tokens it may take: all, or those before the
first image that would pass what is left of the step's budget; `take` then counts the images of a chunk it scheduled.
An image already started by an earlier step (its run begins before the chunk) or by another chunk of this step (the
same bytes) costs nothing. The step's first image always fits, however large: a lone image larger than the budget
runs alone. Never starving follows from the order the scheduler asks in: running prefills first, oldest first, then
admission, which stops at the first waiting row whose chunk gets no token (scheduler.py)."""
from __future__ import annotations

from cbatch.engine.sequence import Sequence


class EncoderBudget:
    """The image tokens one step's chunks may start; `limit` None: no limit."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.begin_step()

    def begin_step(self) -> None:
        self.used = 0
        self._started: set[str] = set()  # digests of the images this step's chunks start

    def fit(self, seq: Sequence, computed: int, num_new: int) -> int:
        """How many of the `num_new` tokens after `seq`'s first `computed` the step may take (0: none)."""
        if self.limit is None or seq.images is None:
            return num_new
        used, seen = self.used, set()
        for run, image in seq.images.runs:
            if run < computed or image.digest in self._started or image.digest in seen:
                continue
            if run >= computed + num_new:
                break
            if used and used + image.num_tokens > self.limit:
                return run - computed  # up to the image that does not fit
            used += image.num_tokens
            seen.add(image.digest)
        return num_new

    def take(self, seq: Sequence, computed: int, num_new: int) -> None:
        """Counts the images the scheduled chunk of `seq`'s tokens [computed, computed + num_new) starts."""
        if self.limit is None or seq.images is None:
            return
        for run, image in seq.images.runs:
            if computed <= run < computed + num_new and image.digest not in self._started:
                self._started.add(image.digest)
                self.used += image.num_tokens
