"""The one error tree of the project.

Every error carries a stable ``code`` (never reused for another meaning), a message that
says what happened, and where it helps, the ``field``, the ``rule`` and the ``fix``.
The CLI prints ``error[CODE]: message`` and exits 2 for :class:`InputError`, 1 otherwise.

SQL raises the same codes as custom SQLSTATEs (class ``WQ``); :func:`translate` maps a
database error onto this tree at one boundary.

::

    WorkerError
    ├── InputError                      bad input, caught at the edge (exit 2)
    │   ├── InvalidField                a value breaks a rule (field, rule, fix)
    │   ├── DatabaseUrlInvalid          DATABASE_URL is not a valid conninfo/URL
    │   ├── DatabaseUnreachable         nothing answers at the configured database
    │   ├── UnknownPlay                 a play name nobody registered
    │   ├── IdempotencyConflict         same key, other play or params
    │   └── PayloadTooLarge             params or input over the limit
    ├── SchemaError
    │   ├── SchemaContractMismatch      the database is not at the code's schema
    │   └── MigrationFailed             a migration file failed to apply
    ├── LaneError
    │   ├── LaneNotPrepared             admission to a lane no worker prepared
    │   ├── LaneReclaimed               admission to a retired lane
    │   └── LaneBusy                    reclaim refused: unfinished runs
    ├── RunError
    │   ├── RunNotFound
    │   └── RunFailed                   a waited-for run ended failed
    ├── FenceError                      a write of a stale attempt or version
    │   ├── StaleAttempt                the attempt no longer owns its run
    │   └── SheetSuperseded             rows now belong to a newer admission
    ├── OperationRefused                a receiver does not know a named operation
    │   └── WriteIntentUnavailable
    ├── WriteVersionMismatch            caller's version disagrees with the stored intent
    └── EmbeddedPostgresError           the embedded default database failed
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import ClassVar

import psycopg
import psycopg.errors


class WorkerError(Exception):
    """Base of every error the project raises on purpose."""

    code: ClassVar[str] = "WORKER_ERROR"
    exit_code: ClassVar[int] = 1

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        rule: str | None = None,
        fix: str | None = None,
        code: str | None = None,
    ) -> None:
        self.message = message
        self.field = field
        self.rule = rule
        self.fix = fix
        if code is not None:
            self.code = code  # type: ignore[misc]  # a subclass-specific refinement
        super().__init__(self.render())

    def render(self) -> str:
        parts = [self.message]
        if self.field and self.rule:
            parts.append(f"({self.field}: {self.rule})")
        if self.fix:
            parts.append(f"Fix: {self.fix}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, str | None]:
        return {
            "code": self.code,
            "message": self.message,
            "field": self.field,
            "rule": self.rule,
            "fix": self.fix,
        }


# ---- input -----------------------------------------------------------------------------


class InputError(WorkerError):
    code = "INPUT_INVALID"
    exit_code = 2


class InvalidField(InputError):
    code = "FIELD_INVALID"


class DatabaseUrlInvalid(InputError):
    code = "DATABASE_URL_INVALID"


class DatabaseUnreachable(InputError):
    code = "DATABASE_UNREACHABLE"


class UnknownPlay(InputError):
    code = "PLAY_UNKNOWN"


class IdempotencyConflict(InputError):
    code = "IDEMPOTENCY_CONFLICT"


class PayloadTooLarge(InputError):
    code = "PAYLOAD_TOO_LARGE"


# ---- schema ----------------------------------------------------------------------------


class SchemaError(WorkerError):
    code = "SCHEMA_ERROR"


class SchemaContractMismatch(SchemaError):
    code = "SCHEMA_CONTRACT_MISMATCH"


class MigrationFailed(SchemaError):
    code = "MIGRATION_FAILED"


# ---- lanes -----------------------------------------------------------------------------


class LaneError(WorkerError):
    code = "LANE_ERROR"


class LaneNotPrepared(LaneError):
    code = "LANE_NOT_PREPARED"


class LaneReclaimed(LaneError):
    code = "LANE_RECLAIMED"


class LaneBusy(LaneError):
    code = "LANE_HAS_UNFINISHED_RUNS"


# ---- runs ------------------------------------------------------------------------------


class RunError(WorkerError):
    code = "RUN_ERROR"


class RunNotFound(RunError):
    code = "RUN_NOT_FOUND"
    exit_code = 2


class RunFailed(RunError):
    code = "RUN_FAILED"


# ---- fences ----------------------------------------------------------------------------


class FenceError(WorkerError):
    code = "FENCED"


class StaleAttempt(FenceError):
    code = "STALE_ATTEMPT"


class SheetSuperseded(FenceError):
    code = "SHEET_SUPERSEDED"


class OperationRefused(WorkerError):
    code = "OPERATION_UNKNOWN"


class WriteIntentUnavailable(OperationRefused):
    code = "WRITE_INTENT_UNAVAILABLE"


class WriteVersionMismatch(WorkerError):
    code = "WRITE_VERSION_MISMATCH"


class EmbeddedPostgresError(WorkerError):
    code = "EMBEDDED_POSTGRES_FAILED"


# ---- helpers ---------------------------------------------------------------------------


def did_you_mean(value: str, choices: Iterable[str]) -> str | None:
    """The nearest valid name, Oban-style, or None when nothing is close."""
    matches = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


_SCHEMA_MISSING = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedColumn,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.UndefinedObject,
)

# Custom SQLSTATEs raised by our SQL (class WQ). Never reuse a code for a new meaning.
SQLSTATE_ERRORS: dict[str, type[WorkerError]] = {
    "WQ001": LaneNotPrepared,
    "WQ002": LaneReclaimed,
    "WQ003": IdempotencyConflict,
    "WQ004": StaleAttempt,
    "WQ005": WriteVersionMismatch,
    "WQ006": RunNotFound,
}


def translate(exc: psycopg.Error) -> WorkerError | None:
    """Map a database error raised by our SQL onto the error tree, or None."""
    diag = exc.diag
    if isinstance(exc, _SCHEMA_MISSING):
        # Admission-only callers skip the contract check: a schema that is missing or
        # behind shows up here, as an unknown table, column or function.
        return SchemaContractMismatch(
            f"the database schema is missing or behind this code: {diag.message_primary}",
            fix="run `worker migrate` (the release step) with this code's release",
        )
    cls = SQLSTATE_ERRORS.get(diag.sqlstate or "")
    if cls is None:
        if isinstance(exc, psycopg.OperationalError):
            return DatabaseUnreachable(
                f"the database connection failed: {str(exc).strip()}",
                fix="check that Postgres is running and DATABASE_URL points at it",
            )
        return None
    return cls(diag.message_primary or str(exc), fix=diag.message_hint)
