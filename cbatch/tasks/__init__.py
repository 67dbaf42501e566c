"""Tasks: what a job asks of each row (base.py says what a task owns). A task is one file, NAME_task.py in this
folder, whose class registers itself as NAME (`@register`): config.TASKS reads the names from the file names (the
command line lists them without importing torch), and this package imports every such file."""
from __future__ import annotations

import importlib
from pathlib import Path

from cbatch.config import TASK_FILE_SUFFIX
from cbatch.tasks.base import ParsedRow, Part, PendingRow, Request, RowWork, Task, TaskError, make_task, task_class
from cbatch.tasks.results import Record, RowResult

for _path in sorted(Path(__file__).parent.glob(f"*{TASK_FILE_SUFFIX}")):  # registers each task
    importlib.import_module(f"{__name__}.{_path.stem}")

__all__ = ["ParsedRow", "Part", "PendingRow", "Record", "Request", "RowResult", "RowWork", "Task", "TaskError",
           "make_task", "task_class"]
