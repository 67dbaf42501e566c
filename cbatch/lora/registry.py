"""The job's adapters by name, from --lora NAME=PATH (repeatable) and --lora-dir (each adapter folder in it,
named by its folder name); the names rows pick them by."""
from __future__ import annotations

import re
from pathlib import Path

from cbatch.config import UserError
from cbatch.lora.adapter import CONFIG_FILE

_NAME = re.compile(r"^[\w.\-:/]+$")


def job_adapters(specs: list[str] | None, folder: Path | None) -> tuple[tuple[str, str], ...]:
    """(name, folder) of every adapter the flags give, in their order; a UserError naming the flag for a
    malformed value, a missing --lora-dir, or a name given twice (the folders themselves are checked in
    preflight, before the job starts)."""
    adapters: list[tuple[str, str]] = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise UserError(f"--lora {spec}: write NAME=PATH, e.g. --lora sql=./adapters/sql")
        if not _NAME.match(name):
            raise UserError(f"--lora {spec}: the name {name!r} may hold letters, digits and . _ - : / only")
        adapters.append((name, path))
    if folder is not None:
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise UserError(f"--lora-dir {folder}: no such folder; give a folder of PEFT adapter folders")
        found = sorted(p for p in folder.iterdir() if (p / CONFIG_FILE).is_file())
        if not found:
            raise UserError(f"--lora-dir {folder}: no adapter folder (with {CONFIG_FILE}) in it")
        adapters += [(p.name, str(p)) for p in found]
    names = [name for name, _ in adapters]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise UserError(f"--lora: the adapter name {twice!r} is given twice; give each adapter its own name")
    return tuple(adapters)


def adapter_digests(adapters: tuple[tuple[str, str], ...], spec, max_rank: int) -> dict[str, str]:
    """name -> a digest of the adapter's files, every adapter checked whole against the model `spec` (None: a
    weightless plan, its config and ranks only): a LoraError naming the first unusable one. What a resumed
    job and the result cache compare."""
    import hashlib
    import json

    from cbatch.lora.adapter import check_adapter

    digests = {}
    for name, path in adapters:
        hashes = check_adapter(name, path, spec, max_rank)
        digests[name] = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
    return digests
