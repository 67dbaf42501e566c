"""Scale-out: one job over many engines (Ray actors, one per GPU), and a Ray Data callable.

Ray is an optional extra (`pip install "cbatch[ray]"`); nothing here imports it at module load.
"""
from __future__ import annotations

INSTALL_HINT = "Ray is not installed; install it with: pip install \"cbatch[ray]\" (or pip install \"ray[data]>=2.9\")"


class RayMissingError(ImportError):
    """`--ray` without Ray installed; the message says how to install it."""


def require_ray():
    """The `ray` module, or RayMissingError with the install command."""
    try:
        import ray
    except ImportError:
        raise RayMissingError(INSTALL_HINT) from None
    return ray


LOCAL = "local"  # `--ray` without an address: start a local Ray instance


def normalize_ray_flag(argv: list[str]) -> list[str]:
    """Lets `--ray` take an optional ADDRESS: a bare `--ray` becomes `--ray=local`.

    The next word is the address only if it looks like one (`auto`, `local`, `ray://...`, `host:port`),
    so `cbatch run --ray prompts.jsonl --out o.jsonl` still reads prompts.jsonl as the input.
    """
    import re
    from pathlib import Path

    out: list[str] = []
    for i, word in enumerate(argv):
        out.append(word)
        if word != "--ray":
            continue
        following = argv[i + 1] if i + 1 < len(argv) else None
        is_address = following is not None and (
            following in ("auto", LOCAL) or following.startswith("ray://")
            or (re.fullmatch(r"[\w.\-\[\]]+:\d+", following) is not None and not Path(following).exists())
        )
        if not is_address:
            out[-1] = f"--ray={LOCAL}"
    return out


__all__ = ["INSTALL_HINT", "LOCAL", "RayMissingError", "normalize_ray_flag", "require_ray"]
