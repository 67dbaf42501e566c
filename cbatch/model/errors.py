"""The model package's user-facing errors (their own module so spec, rope, quant, the loader and the default
model share them without cycles)."""
from __future__ import annotations

from cbatch.config import UserError


class UnsupportedModelError(UserError):
    """The checkpoint is not one cbatch can run correctly; the message names what is supported."""


class ModelLoadError(UserError):
    """The model could not be found or read; the message says where and what to do."""
