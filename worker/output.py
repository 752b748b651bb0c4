"""What the commands print, in one convention: JSON with ISO 8601 timestamps, and the exit
status of a run that was waited for."""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from queues.errors import ExitCode

# A waited-for run's exit status by its final state; a run not yet final is NOT_FINISHED.
EXIT_BY_STATE = {
    "succeeded": ExitCode.OK,
    "failed": ExitCode.FAILED,
    "cancelled": ExitCode.CANCELLED,
}


def exit_code_of(state: str) -> int:
    return int(EXIT_BY_STATE.get(state, ExitCode.NOT_FINISHED))


def iso(value: datetime | None) -> str | None:
    """A timestamp as ISO 8601 (what every command prints, text or JSON)."""
    return None if value is None else value.isoformat()


def _jsonable(value: object) -> object:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, uuid.UUID | Decimal | Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def to_json(data: Any) -> str:
    """One JSON document on one line: sorted keys, ISO timestamps, UUIDs as strings."""
    return json.dumps(data, default=_jsonable, sort_keys=True, ensure_ascii=False)
