"""The runtime operation contract: named actions, one capability each, refused loudly.

Play code that runs without database credentials reaches the data plane through a
receiver (a gateway) by naming an action. :data:`OPERATIONS` is the one declarative table
of every action and the capability it needs; :func:`perform` is the receiver.

A receiver refuses, and never guesses:

- an action it does not know: :class:`OperationRefused` (``OPERATION_UNKNOWN``), with the
  actions it knows and the nearest one; an action whose table entry names an older-receiver
  error raises that instead (``sheet.start_with_intent`` -> ``WRITE_INTENT_UNAVAILABLE``),
  because falling back to ``sheet.start`` would admit the run under a newer version;
- a request whose capabilities lack the action's: ``CAPABILITY_MISSING``;
- a payload field the action does not define: :class:`InvalidField` naming it, so a field
  added by a newer sender is never silently ignored by an older receiver.

``known_actions`` models the receiver's release: an older receiver knows a subset.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg

from queues import sheets
from queues.errors import (
    InvalidField,
    OperationRefused,
    WriteIntentUnavailable,
    did_you_mean,
)

SHEET_WRITE = "sheet:write"
RECEIPT_WRITE = "receipt:write"
LEDGER_APPEND = "ledger:append"
LEDGER_PROJECT = "ledger:project"

CAPABILITY_MISSING = "CAPABILITY_MISSING"


@dataclass(frozen=True, slots=True)
class Operation:
    action: str
    capability: str
    # What a receiver that does not know this action raises instead of OPERATION_UNKNOWN.
    older_receiver: type[OperationRefused] = OperationRefused


# The one table of runtime actions and their capabilities. Adding an action here documents
# its authority; a receiver serves it only once a handler is registered in _HANDLERS.
OPERATIONS: Mapping[str, Operation] = {
    op.action: op
    for op in (
        Operation("sheet.start", SHEET_WRITE),
        # A named operation of its own, so an older receiver refuses the opt-in loudly.
        Operation("sheet.start_with_intent", SHEET_WRITE, WriteIntentUnavailable),
        Operation("sheet.complete_rows", SHEET_WRITE),
        Operation("receipt.write", RECEIPT_WRITE),
        Operation("ledger.append", LEDGER_APPEND),
        Operation("ledger.project", LEDGER_PROJECT),
    )
}

Payload = Mapping[str, Any]
Handler = Callable[[psycopg.AsyncConnection[Any], Payload], Awaitable[Mapping[str, Any]]]


@dataclass(frozen=True, slots=True)
class _Served:
    handler: Handler
    required: frozenset[str]
    optional: frozenset[str] = frozenset()

    @property
    def fields(self) -> frozenset[str]:
        return self.required | self.optional


# ---- handlers --------------------------------------------------------------------------

_ROW_FIELDS = frozenset({"key", "input"})
_COMPLETION_FIELDS = frozenset({"key", "output", "status"})


async def _sheet_start(conn: psycopg.AsyncConnection[Any], p: Payload) -> Mapping[str, Any]:
    result = await sheets.admit_page(
        conn,
        org=p["org"],
        sheet=p["sheet"],
        run_id=_uuid(p["run_id"], "run_id"),
        rows=_rows(p["rows"]),
    )
    return result.to_wire()


async def _sheet_start_with_intent(
    conn: psycopg.AsyncConnection[Any], p: Payload
) -> Mapping[str, Any]:
    result = await sheets.admit_page(
        conn,
        org=p["org"],
        sheet=p["sheet"],
        run_id=_uuid(p["run_id"], "run_id"),
        rows=_rows(p["rows"]),
        write_version=_optional_int(p.get("write_version"), "write_version"),
        stable_intent=True,
    )
    return result.to_wire()


async def _sheet_complete_rows(conn: psycopg.AsyncConnection[Any], p: Payload) -> Mapping[str, Any]:
    completions = []
    for index, item in enumerate(_list(p["completions"], "completions")):
        where = f"completions[{index}]"
        _check_fields(_mapping(item, where), _COMPLETION_FIELDS, frozenset({"key"}), where)
        try:
            status = sheets.RowStatus(item.get("status", sheets.RowStatus.DONE))
        except ValueError:
            raise InvalidField(
                f"{where}.status is {item.get('status')!r}",
                field=f"{where}.status",
                rule="done or failed",
                fix="complete rows as done or failed",
            ) from None
        completions.append(sheets.RowCompletion(item["key"], item.get("output"), status))
    result = await sheets.complete_rows(
        conn,
        org=p["org"],
        sheet=p["sheet"],
        run_id=_uuid(p["run_id"], "run_id"),
        write_version=_optional_int(p.get("write_version"), "write_version"),
        completions=completions,
        raise_on_superseded=bool(p.get("raise_on_superseded", False)),
    )
    return result.to_wire()


_SHEET_PAGE = frozenset({"org", "sheet", "run_id", "rows"})

# What this release serves. Register only handlers that exist.
_HANDLERS: Mapping[str, _Served] = {
    "sheet.start": _Served(_sheet_start, _SHEET_PAGE),
    "sheet.start_with_intent": _Served(
        _sheet_start_with_intent, _SHEET_PAGE, frozenset({"write_version"})
    ),
    "sheet.complete_rows": _Served(
        _sheet_complete_rows,
        frozenset({"org", "sheet", "run_id", "completions"}),
        frozenset({"write_version", "raise_on_superseded"}),
    ),
}

SERVED_ACTIONS = frozenset(_HANDLERS)


# ---- the receiver ----------------------------------------------------------------------


def capability_for(action: str) -> str | None:
    """The capability an action needs, or None for an action nobody defined."""
    op = OPERATIONS.get(action)
    return op.capability if op else None


async def perform(
    conn: psycopg.AsyncConnection[Any],
    action: str,
    payload: Mapping[str, Any],
    *,
    capabilities: frozenset[str],
    known_actions: Iterable[str] | None = None,
) -> Mapping[str, Any]:
    """Check and run one named action; return its JSON-shaped result.

    ``known_actions`` is the set of actions this receiver knows (default: every action
    this release serves); pass a subset to act as an older receiver.
    """
    known = SERVED_ACTIONS if known_actions is None else frozenset(known_actions) & SERVED_ACTIONS
    op = OPERATIONS.get(action)
    if action not in known:
        listed = ", ".join(sorted(known)) or "none"
        if op is not None and op.older_receiver is not OperationRefused:
            raise op.older_receiver(
                f"this receiver does not serve {action!r} (it knows: {listed}), and no "
                "other action is a safe substitute",
                field="action",
                rule="an action the receiver knows",
                fix="retry once the runtime rollout reaches this receiver; never fall "
                "back to an action with weaker semantics",
            )
        suggestion = did_you_mean(action, known)
        hint = f" Did you mean {suggestion!r}?" if suggestion else ""
        raise OperationRefused(
            f"unknown action {action!r}; this receiver knows: {listed}.{hint}",
            field="action",
            rule="an action the receiver knows",
            fix=f"use {suggestion!r}" if suggestion else "use one of the known actions",
        )
    assert op is not None  # every served action has a table entry (checked at import)
    if op.capability not in capabilities:
        granted = ", ".join(sorted(capabilities)) or "none"
        raise OperationRefused(
            f"action {action!r} needs capability {op.capability!r}; the request grants: {granted}",
            field="capabilities",
            rule=f"{action} requires {op.capability}",
            fix=f"mint the attempt's token with {op.capability!r}",
            code=CAPABILITY_MISSING,
        )
    served = _HANDLERS[action]
    _check_fields(_mapping(payload, "payload"), served.fields, served.required, "payload")
    return await served.handler(conn, payload)


# ---- payload checks --------------------------------------------------------------------


def _check_fields(
    payload: Mapping[str, Any], allowed: frozenset[str], required: frozenset[str], where: str
) -> None:
    for name in payload:
        if name not in allowed:
            suggestion = did_you_mean(str(name), allowed)
            hint = f"; did you mean {suggestion!r}?" if suggestion else ""
            raise InvalidField(
                f"{where} field {name!r} is not defined for this action{hint} "
                f"(fields: {', '.join(sorted(allowed))})",
                field=f"{where}.{name}",
                rule="only fields the receiver defines; an unknown field is never ignored",
                fix="remove the field, or send it to a receiver whose release defines it",
            )
    missing = sorted(required - payload.keys())
    if missing:
        raise InvalidField(
            f"{where} lacks required field(s): {', '.join(missing)}",
            field=f"{where}.{missing[0]}",
            rule="required",
            fix=f"send {', '.join(missing)}",
        )


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidField(
            f"{where} must be an object, got {type(value).__name__}",
            field=where,
            rule="a JSON object",
            fix=f"send {where} as an object of named fields",
        )
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise InvalidField(
            f"{where} must be a list, got {type(value).__name__}",
            field=where,
            rule="a JSON array",
            fix=f"send {where} as an array",
        )
    return list(value)


def _rows(value: object) -> list[tuple[str, sheets.JSON]]:
    rows: list[tuple[str, sheets.JSON]] = []
    for index, item in enumerate(_list(value, "rows")):
        where = f"rows[{index}]"
        _check_fields(_mapping(item, where), _ROW_FIELDS, frozenset({"key"}), where)
        rows.append((item["key"], item.get("input", {})))
    return rows


def _uuid(value: object, field: str) -> UUID:
    if isinstance(value, UUID):
        return value
    try:
        return UUID(str(value))
    except ValueError:
        raise InvalidField(
            f"{field} must be a UUID, got {value!r:.80}",
            field=field,
            rule="a UUID",
            fix=f"pass the {field} the admission returned",
        ) from None


def _optional_int(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(
            f"{field} must be an integer, got {value!r:.80}",
            field=field,
            rule="an integer or null",
            fix=f"pass the {field} the admission returned, or omit it",
        )
    return value


def _check_table() -> None:
    unlisted = set(_HANDLERS) - set(OPERATIONS)
    if unlisted:  # pragma: no cover - a programming error, caught at import
        raise RuntimeError(f"handlers without a capability entry: {sorted(unlisted)}")


_check_table()
