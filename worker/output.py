"""What the commands print, in one convention: JSON with ISO 8601 timestamps, text with
what a user or a play wrote made harmless (:func:`printable`), and the exit status of a run
that was waited for."""

from __future__ import annotations

import json
import re
import unicodedata
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


def amount(value: Decimal) -> str:
    """An amount of money or credits as printed: no exponent, no trailing zeros (``1``,
    ``0.002``, ``12.5``)."""
    text = f"{value:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


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
    """One JSON document on one line: sorted keys, ISO timestamps, UUIDs as strings. Every
    character a terminal could act on is a ``\\u`` escape (json escapes C0 controls; DEL,
    C1 controls, bidirectional overrides and lone surrogates are escaped here too, only
    ever inside strings): the same JSON value, and inert on a terminal."""
    text = json.dumps(data, default=_jsonable, sort_keys=True, ensure_ascii=False)
    return _UNSAFE_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


# What json.dumps(ensure_ascii=False) leaves raw that a terminal may act on: DEL, the C1
# controls (U+009B is a one-byte CSI to some terminals), and the Unicode format characters
# that reorder or hide text (bidi embeddings, overrides and isolates, line separators).
_UNSAFE_JSON = re.compile(
    "[\x7f-\x9f\u061c\u200b\u200c\u200e\u200f\u2028-\u202e\u2060-\u206f"
    "\ufeff\ufff9-\ufffb\ud800-\udfff]"
)
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_KEPT = "\u200d"  # the zero-width joiner of emoji sequences (fields allow it in names)


def printable(value: object, *, lines: bool = False) -> str:
    """``value`` as text that is safe to print on a terminal: every control character
    (ESC and so OSC 52 clipboard writes and colour changes, BEL, CR, ...), C1 control,
    bidirectional or invisible format character and lone surrogate is written as a visible
    escape (``\\x1b``, ``\\u202e``). ``lines``: newlines and tabs are kept (a traceback, a
    multi-line message); otherwise they are escaped too, so a value stays on its line.

    The one function every printer of what a user or a play wrote goes through (play
    names, orgs, event kinds, workers, error messages, tracebacks); JSON output is made
    safe by :func:`to_json`."""
    text = value if isinstance(value, str) else str(value)
    if text.isascii() and text.isprintable():
        return text  # the common case, checked in C
    return "".join(_escape(char) if _unsafe(char, lines) else char for char in text)


def _unsafe(char: str, lines: bool) -> bool:
    if lines and char in "\n\t":
        return False
    return char != _KEPT and unicodedata.category(char) in _UNSAFE_CATEGORIES


_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
