"""The model package's user-facing error (its own module so spec, rope and quant share it without cycles)."""
from __future__ import annotations

from cbatch.config import UserError


class UnsupportedModelError(UserError):
    """The checkpoint is not one cbatch can run correctly; the message names what is supported."""
