"""When a job must end: `--max-wall-time 2h` (from the job's start) or `--deadline 06:00` (local time, the next
time the clock shows it; or a date and time, 2026-11-27T06:00).

At the deadline no new row starts; the rows already running get `--deadline-grace` to finish; then every row
without a result becomes an `expired` row (an error row naming the deadline), OUTPUT is written whole, and the
job exits with EXIT_EXPIRED. Running the same command again runs only the expired rows (as the OpenAI and
Anthropic batch APIs expire a batch's unfinished requests, and a new batch takes them).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Callable

from cbatch.config import UserError
from cbatch.io.outcomes import EXPIRED
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # time.time() at which the job stops starting rows
    grace_s: float  # then the running rows have this long to finish
    flag: str  # as the user gave it, for the expired rows' error: "--max-wall-time 2h"
    clock: Callable[[], float] = time.time

    def passed(self) -> bool:
        return self.clock() >= self.at

    def grace_over(self) -> bool:
        return self.clock() >= self.at + self.grace_s

    @property
    def message(self) -> str:
        return (f"expired: the job's deadline ({self.flag}) came before this row finished; run the same command "
                "again to run it")


def parse_duration(text: str, flag: str) -> float:
    """Seconds in '90s', '45m', '2h', '1h30m', '1d' or a plain number of seconds; a UserError naming `flag`."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise UserError(f"{flag} {text!r}: not a duration; write e.g. 90m, 2h, 1h30m or 3600 (seconds)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_clock(text: str, now: datetime) -> datetime:
    """--deadline: 'HH:MM' (local time: today, or tomorrow when that time has passed) or an ISO date and time."""
    if re.fullmatch(r"\d{1,2}:\d{2}", text.strip()):
        hour, minute = (int(x) for x in text.strip().split(":"))
        if hour > 23 or minute > 59:
            raise UserError(f"--deadline {text!r}: not a time of day; write HH:MM, e.g. 06:00")
        at = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        return at if at > now else at + timedelta(days=1)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UserError(f"--deadline {text!r}: not a time; write HH:MM (local time) or a date and time such as "
                        "2026-11-27T06:00") from None
    if at.tzinfo is not None:
        at = at.astimezone().replace(tzinfo=None)  # compare in local time
    if at <= now:
        raise UserError(f"--deadline {text}: that time has passed already; give a later one")
    return at


def make_deadline(max_wall_time: str | None, deadline: str | None, grace: str, start: float) -> Deadline | None:
    """The job's deadline from its flags (the earlier of the two when both are given), or None."""
    grace_s = parse_duration(grace, "--deadline-grace")
    candidates = []
    if max_wall_time is not None:
        seconds = parse_duration(max_wall_time, "--max-wall-time")
        if seconds <= 0:
            raise UserError(f"--max-wall-time {max_wall_time}: must be longer than 0")
        candidates.append((start + seconds, f"--max-wall-time {max_wall_time}"))
    if deadline is not None:
        at = parse_clock(deadline, datetime.fromtimestamp(start))
        candidates.append((at.timestamp(), f"--deadline {deadline}"))
    if not candidates:
        return None
    at, flag = min(candidates)
    return Deadline(at, grace_s, flag)


__all__ = ["EXPIRED", "Deadline", "make_deadline", "parse_clock", "parse_duration"]
