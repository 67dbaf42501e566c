"""Making a rename or a new file survive a power loss: fsync the folder that holds it."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsyncs the folder `path` (best effort: a file system that cannot open folders has nothing to sync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
