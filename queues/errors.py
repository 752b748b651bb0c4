"""The one error tree of the project.

Every error carries a stable ``code`` (never reused for another meaning), a message that
says what happened, and where it helps, the ``field``, the ``rule`` and the ``fix``.
The CLI prints ``error[CODE]: message`` and exits with the error's :class:`ExitCode`: 2 for
bad input (:class:`InputError`), 6 when the database is unreachable, 1 otherwise.

SQL raises the same codes as custom SQLSTATEs (class ``WQ``); :func:`translate` maps a
database error onto this tree at one boundary.

::

    WorkerError
    ├── InputError                      bad input, caught at the edge (exit 2)
    │   ├── InvalidField                a value breaks a rule (field, rule, fix)
    │   ├── DatabaseUrlInvalid          DATABASE_URL is not a valid conninfo/URL
    │   ├── DatabaseUrlMissing          no database URL where the embedded one is refused
    │   ├── AppInvalid                  an --app module that cannot be loaded
    │   ├── UnknownPlay                 a play name nobody registered
    │   ├── IdempotencyConflict         same key, other play or params
    │   ├── PayloadTooLarge             params or input over the limit
    │   └── LimitUnknown                a permit of a rate limit nobody defined
    ├── DatabaseUnreachable             nothing answers at the configured database (exit 6)
    ├── DatabaseError                   the database refused a statement for another reason
    ├── PostgresUnsupported             the server's major version is outside the supported range
    ├── SchemaError
    │   ├── SchemaContractMismatch      the database is not at the code's schema
    │   │   ├── ProcrastinateTooOld     the installed procrastinate predates the database's
    │   │   └── SchemaWindowClosed      a contract step raised the floor above this release
    │   ├── MigrationFailed             a migration file failed to apply (or is malformed)
    │   └── ContractBlockedByLanes      a contract step waits for older releases' lanes
    ├── LaneError
    │   ├── LaneNotPrepared             admission to a lane no worker prepared
    │   ├── LaneDraining                admission to a lane being drained
    │   ├── LaneReclaimed               admission to a retired lane
    │   └── LaneBusy                    reclaim refused: unfinished runs
    ├── RunError
    │   ├── RunNotFound
    │   ├── RunNotRetryable             a retry of a run that did not fail or was not cancelled
    │   └── RunRowInvalid               a claimed run's row no worker can use (the run fails)
    ├── FenceError                      a write of a stale attempt or version
    │   ├── StaleAttempt                the attempt no longer owns its run
    │   └── SheetSuperseded             rows now belong to a newer admission
    ├── OperationRefused                a receiver does not serve a named action (400)
    │   └── WriteIntentUnavailable      the intent admission met an older receiver
    ├── AuthorityError                  a runtime request's credential (403)
    │   ├── TokenInvalid                missing, forged or expired token (401)
    │   ├── CapabilityScope             the token's capabilities do not allow the action
    │   └── RunScope                    the request names another run
    ├── TokenSecretMissing              no secret to sign or verify attempt tokens with
    ├── SandboxUnavailable              a sandboxed play, and no sandbox to run it in
    ├── WriteVersionMismatch            caller's version disagrees with the stored intent
    └── EmbeddedPostgresError           the embedded default database failed
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from enum import IntEnum
from typing import Any, ClassVar

import psycopg
import psycopg.errors


class ExitCode(IntEnum):
    """Every exit status of the ``worker`` command, in one table (printed by
    docs/reference/errors.md)."""

    OK = 0  # done; a waited-for run succeeded
    FAILED = 1  # a waited-for run failed, or the command failed
    BAD_INPUT = 2  # bad input or usage: nothing was written
    CANCELLED = 3  # a waited-for run was cancelled
    TIMED_OUT = 4  # gave up waiting (--wait --timeout): the run goes on
    NOT_FINISHED = 5  # the run has not finished yet (`result` without --wait)
    DATABASE_UNREACHABLE = 6  # nothing answered at the configured database
    INTERRUPTED = 130  # Ctrl-C


class WorkerError(Exception):
    """Base of every error the project raises on purpose."""

    code: ClassVar[str] = "WORKER_ERROR"
    exit_code: ClassVar[int] = ExitCode.FAILED
    http_status: ClassVar[int] = 500  # what the runtime gateway answers with
    # Raised inside an attempt, a refusal is final for its run (the run fails at once)
    # unless a later attempt may not meet it: then it is an ordinary, retried failure.
    passes: ClassVar[bool] = False

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

    def as_dict(self) -> dict[str, Any]:
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
    exit_code = ExitCode.BAD_INPUT
    http_status = 400


class InvalidField(InputError):
    code = "FIELD_INVALID"


class DatabaseUrlInvalid(InputError):
    code = "DATABASE_URL_INVALID"


class DatabaseUrlMissing(InputError):
    code = "DATABASE_URL_MISSING"


class AppInvalid(InputError):
    code = "APP_INVALID"


class DatabaseUnreachable(WorkerError):
    code = "DATABASE_UNREACHABLE"
    exit_code = ExitCode.DATABASE_UNREACHABLE


class PostgresUnsupported(WorkerError):
    """The database server is a Postgres major this release does not support (below
    :data:`queues.server.OLDEST_MAJOR`): refused at ``worker migrate`` and ``worker start``,
    before anything is written."""

    code = "POSTGRES_UNSUPPORTED"


class DatabaseError(WorkerError):
    code = "DATABASE_ERROR"


class UnknownPlay(InputError):
    code = "PLAY_UNKNOWN"


class IdempotencyConflict(InputError):
    code = "IDEMPOTENCY_CONFLICT"


class PayloadTooLarge(InputError):
    code = "PAYLOAD_TOO_LARGE"


class LimitUnknown(InputError):
    """A play asked for a permit of a limit that is not defined (``worker limits set``)."""

    code = "LIMIT_UNKNOWN"


# ---- schema ----------------------------------------------------------------------------


class SchemaError(WorkerError):
    code = "SCHEMA_ERROR"


class SchemaContractMismatch(SchemaError):
    code = "SCHEMA_CONTRACT_MISMATCH"


class ProcrastinateTooOld(SchemaContractMismatch):
    code = "PROCRASTINATE_TOO_OLD"


class SchemaWindowClosed(SchemaContractMismatch):
    """The database is at a newer release's schema, and a contract migration of that
    release raised its compatibility floor above this code's schema: this release can no
    longer run here (a newer one must)."""

    code = "SCHEMA_WINDOW_CLOSED"


class MigrationFailed(SchemaError):
    code = "MIGRATION_FAILED"


class ContractBlockedByLanes(SchemaError):
    """A contract migration waits: lanes of older releases still have unfinished runs or
    live workers, which may need what it removes."""

    code = "CONTRACT_BLOCKED_BY_LANES"


# ---- lanes -----------------------------------------------------------------------------


class LaneError(WorkerError):
    code = "LANE_ERROR"


class LaneNotPrepared(LaneError):
    code = "LANE_NOT_PREPARED"


class LaneDraining(LaneError):
    code = "LANE_DRAINING"


class LaneReclaimed(LaneError):
    code = "LANE_RECLAIMED"


class LaneBusy(LaneError):
    code = "LANE_HAS_UNFINISHED_RUNS"


# ---- runs ------------------------------------------------------------------------------


class RunError(WorkerError):
    code = "RUN_ERROR"


class RunNotFound(RunError):
    code = "RUN_NOT_FOUND"
    exit_code = ExitCode.BAD_INPUT
    http_status = 404


class RunNotRetryable(RunError):
    code = "RUN_NOT_RETRYABLE"
    exit_code = ExitCode.BAD_INPUT
    http_status = 409


class RunRowInvalid(RunError):
    """A claimed run whose stored row a worker cannot use (params or authority that are
    not a JSON object, JSON it cannot read, an authority naming another run): written
    around admission's checks. The worker fails that run with this code, never retried, and
    goes on."""

    code = "RUN_ROW_INVALID"


# ---- fences ----------------------------------------------------------------------------


class FenceError(WorkerError):
    code = "FENCED"
    http_status = 409


class StaleAttempt(FenceError):
    code = "STALE_ATTEMPT"


class SheetSuperseded(FenceError):
    """Row completions were refused: the attempt no longer owns its run, or another
    admission owns the rows. Carries the structured facts of the refusal."""

    code = "SHEET_SUPERSEDED"

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        sheet: str = "",
        run_id: str = "",
        write_version: int | None = None,
        submitted: int = 0,
        counts: Mapping[str, int] | None = None,
        samples: tuple[tuple[str, str, int | None], ...] = (),
    ) -> None:
        self.sheet = sheet
        self.run_id = run_id
        self.write_version = write_version
        self.submitted = submitted
        self.counts = dict(counts or {})
        self.samples = samples  # up to five (row key, reason, row's current version)
        super().__init__(message, fix=fix)

    def as_dict(self) -> dict[str, Any]:
        return super().as_dict() | {
            "sheet": self.sheet,
            "run_id": self.run_id,
            "write_version": self.write_version,
            "submitted": self.submitted,
            "counts": self.counts,
            "samples": [list(sample) for sample in self.samples],
        }


class OperationRefused(WorkerError):
    """A receiver that does not serve a named runtime action (on the wire:
    ``Unsupported action: NAME``, 400)."""

    code = "UNSUPPORTED_ACTION"
    http_status = 400


class WriteIntentUnavailable(OperationRefused):
    """The stable-intent admission reached a receiver that predates it: retry after the
    runtime rollout, never fall back to a legacy admission."""

    code = "RUNTIME_SHEET_WRITE_INTENT_UNAVAILABLE"
    passes = True  # the rollout reaches the receiver: a later attempt gets through


class AuthorityError(WorkerError):
    code = "AUTHORITY_ERROR"
    http_status = 403


class TokenInvalid(AuthorityError):
    """No token, a forged one, or an expired one (401)."""

    code = "TOKEN_INVALID"
    http_status = 401


class CapabilityScope(AuthorityError):
    """The credential's capabilities do not allow the action (on the wire:
    ``Unsupported runtime action capability scope.``, 403)."""

    code = "RUNTIME_CAPABILITY_SCOPE"


class RunScope(AuthorityError):
    """A request names a run other than the one its credential was minted for (403)."""

    code = "RUNTIME_RUN_SCOPE"


class TokenSecretMissing(WorkerError):
    code = "TOKEN_SECRET_MISSING"


class SandboxUnavailable(WorkerError):
    """A sandboxed play, and no sandbox to run it in (bubblewrap is missing, or cannot
    create its namespaces here): the run fails; it never runs unsandboxed."""

    code = "SANDBOX_UNAVAILABLE"


class WriteVersionMismatch(WorkerError):
    code = "WRITE_VERSION_MISMATCH"
    http_status = 409


class EmbeddedPostgresError(WorkerError):
    code = "EMBEDDED_POSTGRES_FAILED"


# ---- helpers ---------------------------------------------------------------------------


def from_wire(data: Mapping[str, Any]) -> WorkerError:
    """The error a receiver answered with (``as_dict`` on the other side), as its class:
    the code picks the class; an unknown code stays a plain :class:`WorkerError` with it."""
    code = str(data.get("code") or WorkerError.code)
    cls = _by_code().get(code, WorkerError)
    message = str(data.get("message") or code)
    common = {"fix": data.get("fix")}
    if cls is SheetSuperseded:
        return SheetSuperseded(
            message,
            fix=data.get("fix"),
            sheet=str(data.get("sheet") or ""),
            run_id=str(data.get("run_id") or ""),
            write_version=data.get("write_version"),
            submitted=int(data.get("submitted") or 0),
            counts=data.get("counts") or {},
            samples=tuple(tuple(x) for x in data.get("samples") or ()),
        )
    error = cls(message, field=data.get("field"), rule=data.get("rule"), **common)
    if cls is WorkerError:
        error.code = code  # type: ignore[misc]
    return error


def _by_code() -> dict[str, type[WorkerError]]:
    found: dict[str, type[WorkerError]] = {}
    todo: list[type[WorkerError]] = [WorkerError]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.code, cls)
        todo.extend(cls.__subclasses__())
    return found


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

# Custom SQLSTATEs raised by our SQL (class WQ), with DETAIL = {"field", "rule"} as JSON and
# HINT = the fix. Never reuse a code for a new meaning: WQ004, WQ005 and WQ006 were assigned
# once and never raised; they stay retired.
SQLSTATE_ERRORS: dict[str, type[WorkerError]] = {
    "WQ001": LaneNotPrepared,  # wq_submit: the lane does not exist
    "WQ002": LaneReclaimed,  # wq_submit: the lane was reclaimed
    "WQ003": IdempotencyConflict,  # wq_submit_same_request: a key reused for another request
    "WQ007": LaneDraining,  # wq_submit: the lane is draining
    "WQ008": InvalidField,  # wq_submit_with_options: a run option this database lacks
    "WQ009": SchemaWindowClosed,  # a worker or lane of a release below the schema floor
    "WQ010": InvalidField,  # the submit functions: a field breaks its rule (migration 0036)
    "WQ011": PayloadTooLarge,  # the submit functions: a JSON value over its size
}


# Connection failures: no SQLSTATE (the client lost or never had a connection), class 08
# (connection exception), or the server shutting down or starting up.
_CONNECTION_SQLSTATES = ("08", "57P01", "57P02", "57P03")


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached (as opposed to a statement the
    database refused: an index row too large is an OperationalError too, but not this)."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith(_CONNECTION_SQLSTATES)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def translate(exc: psycopg.Error) -> WorkerError | None:
    """Map a database error raised by our SQL onto the error tree, or None."""
    diag = exc.diag
    if isinstance(exc, _SCHEMA_MISSING):
        # Admission-only callers skip the contract check: a schema that is missing or
        # behind shows up here, as an unknown table, column or function.
        return SchemaContractMismatch(
            "the database lacks what this code uses: either its schema is missing or "
            "behind this code, or a newer release's contract migration removed it "
            f"({diag.message_primary})",
            fix="`worker migrate --check` with this release tells which: run `worker "
            "migrate` if the database is behind; if it is at a newer release's schema, "
            "this release is outside its window: admit and run with a newer release",
        )
    cls = SQLSTATE_ERRORS.get(diag.sqlstate or "")
    if cls is None:
        if connection_lost(exc):
            return DatabaseUnreachable(
                f"the database connection failed: {_first_line(exc)}",
                fix="check that Postgres is running and DATABASE_URL points at it",
            )
        return None
    field = rule = None
    try:
        detail = json.loads(diag.message_detail or "{}")
    except ValueError:
        detail = {}
    if isinstance(detail, dict):
        field, rule = detail.get("field"), detail.get("rule")
    return cls(diag.message_primary or str(exc), field=field, rule=rule, fix=diag.message_hint)
