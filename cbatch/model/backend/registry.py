"""The compute backends by their --attention-backend name: how to make each, and where it runs.

Each backend's own file, NAME_backend.py, registers it as NAME (`register`, its last lines) when
cbatch/model/backend/__init__.py imports it; nothing else changes the registry. config.ATTENTION_BACKENDS reads the
same names from the file names (tests/test_registries.py holds them to each other).

`auto` picks, among the backends made for the device's type, the first registered one that can run there; a
fallback backend (plain torch) only where none of the others can, with a note for each one it passed over.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from cbatch.model.backend.protocol import Backend


class BackendUnavailable(ValueError):
    """The backend cannot run on this device; the message says what to use instead."""


def _runs_anywhere(device: torch.device) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class Registration:
    """How to make one backend, and where it runs."""

    make: Callable[[], Backend]  # the factory (the backend's class)
    devices: tuple[str, ...]  # the device types it is made for: `auto` chooses among the backends made for a device
    unavailable: Callable[[torch.device], str | None] = _runs_anywhere  # why not on a device (naming the fix); None: it runs
    fallback: bool = False  # `auto` picks it only where no other backend made for the device can run
    passed_over: Callable[[], str] | None = None  # the note when `auto` passes it over for another


_REGISTRY: dict[str, Registration] = {}  # filled once, as the backends' modules are imported


def register(name: str, make: Callable[[], Backend], devices: tuple[str, ...], *,
             unavailable: Callable[[torch.device], str | None] = _runs_anywhere, fallback: bool = False,
             passed_over: Callable[[], str] | None = None) -> None:
    """Registers a backend under its --attention-backend `name` (see `Registration` for the rest)."""
    if name in _REGISTRY:
        raise ValueError(f"a backend named {name!r} is registered already")
    _REGISTRY[name] = Registration(make, devices, unavailable, fallback, passed_over)


def registered() -> Mapping[str, Registration]:
    """Every registered backend by name, read-only."""
    return MappingProxyType(_REGISTRY)


def auto_choice(device: torch.device) -> tuple[str, list[str]]:
    """The backend `auto` runs on `device`, and the notes of the backends made for it that it passed over."""
    made_for = [(name, entry) for name, entry in _REGISTRY.items() if device.type in entry.devices]
    notes = []
    for name, entry in sorted(made_for, key=lambda item: item[1].fallback):  # stable: registration order, fallbacks last
        if entry.unavailable(device) is None:
            return name, notes
        if entry.passed_over is not None:
            notes.append(entry.passed_over())
    raise BackendUnavailable(f"no compute backend runs on {device.type}")


def backend_name(name: str, device: torch.device) -> str:
    """The backend --attention-backend `name` means on `device`: itself, or the one `auto` picks."""
    return auto_choice(device)[0] if name == "auto" else name


def make_backend(name: str, device: torch.device) -> Backend:
    """A fresh backend that --attention-backend `name` means on `device`; BackendUnavailable when it cannot run
    there."""
    entry = _REGISTRY[backend_name(name, device)]
    if (reason := entry.unavailable(device)) is not None:
        raise BackendUnavailable(reason)
    return entry.make()
