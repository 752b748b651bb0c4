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
    │   ├── LimitUnknown                a permit of a rate limit nobody defined
    │   └── ChargeOutsideStep           ctx.charge where no step's receipt can carry it
    ├── DatabaseUnreachable             nothing answers at the configured database (exit 6)
    │   └── DatabaseLost                a long-lived process's outage outlasted --max-outage
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
    │   └── SheetSuperseded             superseded: row writes refused, the attempt must stop
    ├── OperationRefused                a receiver does not serve a named action (400)
    │   └── WriteIntentUnavailable      the intent admission met an older receiver
    ├── AuthorityError                  a runtime request's credential (403)
    │   ├── TokenInvalid                missing, forged or expired token (401)
    │   ├── CapabilityScope             the token's capabilities do not allow the action
    │   │   └── LifecycleReserved       a run's lifecycle events are the system's, not a play's
    │   ├── RunScope                    the request names another run
    │   └── DeliveryLeaseMismatch       a ledger delivery names another lease than its attempt's
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


class DatabaseLost(DatabaseUnreachable):
    """A long-lived process (a worker, a recovery loop, a waiting or following client) lost
    its database and it did not answer again within the process's ``--max-outage``: the
    process ends (exit 6), so its supervisor restarts it or its caller retries. A shorter
    outage (a restart, a failover) is ridden out (:mod:`worker.outage`)."""

    code = "DATABASE_LOST"


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


class ChargeOutsideStep(InputError):
    """``ctx.charge`` called where no step's receipt can record it: outside a step's body,
    without naming the row step (``step=``) whose receipt will carry it."""

    code = "CHARGE_OUTSIDE_STEP"


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
    """Terminal row writes were refused because this attempt is superseded: it must stop.

    The wire form is the reference runtime's (docs/reference/gateway.md): the code
    ``RUNTIME_SHEET_ATTEMPT_SUPERSEDED``, ``tableNamespace``, ``runId``, ``writeVersion``,
    ``submittedRows`` and every refused row in ``supersededRows`` (``key``, ``reason``,
    ``rowVersionStamp``); the message counts the rows per reason and shows at most five.
    What the attempt fence adds (``stale_attempt``: a newer attempt, a rescue or a cancel
    took the run) is in ``fenceReason``, a field of its own. An older receiver's code,
    ``SHEET_SUPERSEDED``, is still read as this error (:data:`RETIRED_CODES`)."""

    code = "RUNTIME_SHEET_ATTEMPT_SUPERSEDED"
    SAMPLE_SIZE: ClassVar[int] = 5

    def __init__(
        self,
        message: str | None = None,
        *,
        fix: str | None = None,
        sheet: str = "",
        run_id: str = "",
        write_version: int | None = None,
        submitted: int = 0,
        superseded_rows: Iterable[tuple[str, str, int | None]] = (),
        fence_reason: str | None = None,
    ) -> None:
        self.sheet = sheet
        self.run_id = run_id
        self.write_version = write_version
        self.submitted = submitted
        # Every refused row: (row key, reason, the write version stamped on the row now).
        self.superseded_rows = tuple(superseded_rows)
        self.fence_reason = fence_reason
        super().__init__(
            message or self._message(),
            fix=fix
            or "stop the attempt: the admission or attempt that owns the rows finishes them",
        )

    @property
    def counts(self) -> dict[str, int]:
        """Refused rows per reason, in the order reasons first appear."""
        counts: dict[str, int] = {}
        for _key, reason, _version in self.superseded_rows:
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    @property
    def samples(self) -> tuple[tuple[str, str, int | None], ...]:
        """The first :attr:`SAMPLE_SIZE` refused rows (what the message shows)."""
        return self.superseded_rows[: self.SAMPLE_SIZE]

    def _message(self) -> str:
        reasons = ", ".join(f"{reason}={n}" for reason, n in self.counts.items())
        shown = "; ".join(
            f"key={key} row_write_version={'unknown' if version is None else version}"
            for key, _reason, version in self.samples
        )
        version = "none" if self.write_version is None else self.write_version
        return (
            f"{self.code}: sheet {self.sheet!r} refused {len(self.superseded_rows)} of "
            f"{self.submitted} terminal row write(s) of run {self.run_id} at write version "
            f"{version}: a different write version owns the rows ({reasons or 'unreported'}). "
            f"A newer admission of these rows superseded this attempt, which must stop "
            f"running: nothing it writes from now on can be accepted. Sample: {shown}."
        )

    def as_dict(self) -> dict[str, Any]:
        wire = super().as_dict() | {
            "tableNamespace": self.sheet,
            "runId": self.run_id,
            "writeVersion": self.write_version,
            "submittedRows": self.submitted,
            "supersededRows": [
                {"key": key, "reason": reason, "rowVersionStamp": version}
                for key, reason, version in self.superseded_rows
            ],
        }
        if self.fence_reason is not None:
            wire["fenceReason"] = self.fence_reason
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SheetSuperseded:
        """Read the reference's fields; an older receiver's (``SHEET_SUPERSEDED``: sheet,
        run_id, write_version, submitted and up to five samples) too."""
        if "supersededRows" in data:
            rows = [
                (entry.get("key"), entry.get("reason"), entry.get("rowVersionStamp"))
                for entry in data.get("supersededRows") or ()
                if isinstance(entry, Mapping)
            ]
        else:  # an older receiver's samples: [key, reason, version]
            rows = [tuple(sample)[:3] for sample in data.get("samples") or ()]
        version = data.get("writeVersion", data.get("write_version"))
        fence = data.get("fenceReason")
        return cls(
            str(data.get("message") or "") or None,
            fix=data.get("fix"),
            sheet=str(data.get("tableNamespace", data.get("sheet")) or ""),
            run_id=str(data.get("runId", data.get("run_id")) or ""),
            write_version=version if isinstance(version, int) else None,
            submitted=int(data.get("submittedRows", data.get("submitted")) or 0),
            superseded_rows=[
                (str(key), str(reason or "unreported"), stamp if isinstance(stamp, int) else None)
                for key, reason, stamp in rows
            ],
            fence_reason=fence if isinstance(fence, str) else None,
        )


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


class LifecycleReserved(CapabilityScope):
    """A play's credential asked for a run's lifecycle event (``start_run``,
    ``project_run_created``): known actions, granted to no play. The system writes those
    events from the run's state rows (the ledger view), never from play code (403, with the
    capability scope's message on the wire)."""

    code = "RUNTIME_LIFECYCLE_ACTION_RESERVED"


class DeliveryLeaseMismatch(AuthorityError):
    """A keyed ledger delivery names a ``deliveryLeaseOwner`` other than the live lease
    owner of its credential's attempt (403): refused, nothing written, by the receiver and
    again by the statement that appends (``ledger_append_delivered``)."""

    code = "RUNTIME_DELIVERY_LEASE_MISMATCH"


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
    cls = RETIRED_CODES.get(code) or _by_code().get(code, WorkerError)
    message = str(data.get("message") or code)
    common = {"fix": data.get("fix")}
    if cls is SheetSuperseded:
        return SheetSuperseded.from_wire(data)
    error = cls(message, field=data.get("field"), rule=data.get("rule"), **common)
    if cls is WorkerError:
        error.code = code  # type: ignore[misc]
    return error


# Codes an older receiver may still answer with, read as the error that replaced them (never
# raised here, never reused): SHEET_SUPERSEDED became the reference runtime's
# RUNTIME_SHEET_ATTEMPT_SUPERSEDED.
RETIRED_CODES: Mapping[str, type[WorkerError]] = {"SHEET_SUPERSEDED": SheetSuperseded}


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
