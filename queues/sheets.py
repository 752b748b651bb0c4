"""Sheets: page admission under a write version, and fenced row completion.

A play admits its input rows to a sheet in pages. Each admission resolves a **write
version**, the fencing token it stamps on the rows it owns:

- *legacy* admission mints a fresh version on every call, so a retried page or a wake
  re-admits the run's pending rows under a newer version;
- *stable write intent* stores the run's first version on the sheet durably
  (``wq_write_intents``, keyed by run and sheet) in the same transaction as its rows, and
  every later page, retry, wake or recovery of that run reuses it, even with no local
  state. A new run admits a newer intent and takes over the pending rows.

Completing rows writes terminal outputs only where the row still carries the writer's
version and is pending; every other row is reported stale with a :class:`StaleReason`.
Lock order and statement bounds are documented in ``sql/queries/sheets.sql``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple, TypeAlias
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from queues.errors import (
    InvalidField,
    PayloadTooLarge,
    RunNotFound,
    SheetSuperseded,
    WriteVersionMismatch,
)
from queues.queries import q

# PAGE_PLAN_NOTE: statements that take a page of keys as arrays run unprepared. After five
# executions psycopg would prepare them server-side, and the generic plan Postgres then
# picks joins the page to the whole sheet with a nested loop: a page that takes 50 ms
# with a custom plan took 9.6 s at 21,000 rows. The page arrays of JSON values are sent
# in binary (%(x)b), which saves most of the client's per-page escaping work.

JSON: TypeAlias = bool | int | float | str | list["JSON"] | dict[str, "JSON"] | None

MAX_PAGE_ROWS = 5_000
MAX_KEY_CHARS = 512
SUPERSEDED_SAMPLE_SIZE = 5


class Disposition(StrEnum):
    """What admitting a page did to one row."""

    ADMITTED = "admitted"  # new: inserted under this write version
    READMITTED = "readmitted"  # was pending under an older version: now owned by this one
    ALREADY_CURRENT = "already_current"  # already pending under this version (a replay)
    ALREADY_TERMINAL = "already_terminal"  # done or failed: untouched
    SUPERSEDED = "superseded"  # pending under a newer version: left to that admission


class RowStatus(StrEnum):
    """Mirrors the Postgres enum ``wq_row_status``."""

    PENDING = "pending"  # admitted under write_version, not finished
    DONE = "done"  # terminal: output written
    FAILED = "failed"  # terminal: the row failed for good


class StaleReason(StrEnum):
    """Why a row completion was not written."""

    NEWER_WRITE_VERSION = "newer_write_version"  # a later admission owns the row
    OLDER_WRITE_VERSION = "older_write_version"  # the writer's version never admitted it
    ALREADY_TERMINAL = "already_terminal"  # finished already, nothing overwritten: benign
    UNREPORTED = "unreported"  # the receiver gave no (known) reason: treated as superseded


BENIGN_REASONS = frozenset({StaleReason.ALREADY_TERMINAL})


@dataclass(frozen=True, slots=True)
class RowAdmission:
    key: str
    disposition: Disposition


@dataclass(frozen=True, slots=True)
class AdmitResult:
    write_version: int
    stable_intent: bool
    rows: tuple[RowAdmission, ...]  # in page order

    def keys(self, disposition: Disposition) -> tuple[str, ...]:
        return tuple(row.key for row in self.rows if row.disposition is disposition)

    def counts(self) -> dict[Disposition, int]:
        return dict(Counter(row.disposition for row in self.rows))

    def to_wire(self) -> dict[str, JSON]:
        return {
            "write_version": self.write_version,
            "stable_intent": self.stable_intent,
            "rows": [{"key": r.key, "disposition": r.disposition.value} for r in self.rows],
        }


@dataclass(frozen=True, slots=True)
class RowCompletion:
    key: str
    output: JSON
    status: RowStatus = RowStatus.DONE


@dataclass(frozen=True, slots=True)
class StaleRow:
    key: str
    reason: StaleReason
    current_version: int | None  # the version stamped on the row now (None: no row/unknown)


@dataclass(frozen=True, slots=True)
class CompletionResult:
    write_version: int | None
    committed: tuple[str, ...]  # durably accepted, including idempotent replays
    replayed: tuple[str, ...]  # the subset of committed that was already written
    stale: tuple[StaleRow, ...]

    @property
    def superseded(self) -> tuple[StaleRow, ...]:
        """Stale rows that mean another admission owns the rows (every non-benign reason)."""
        return tuple(row for row in self.stale if row.reason not in BENIGN_REASONS)

    def to_wire(self) -> dict[str, JSON]:
        return {
            "write_version": self.write_version,
            "committed": list(self.committed),
            "replayed": list(self.replayed),
            "stale": [
                {"key": s.key, "reason": s.reason.value, "current_version": s.current_version}
                for s in self.stale
            ],
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CompletionResult:
        """Parse a receiver's answer; tolerate an older receiver's missing fields.

        A stale entry without a reason (or with one this code does not know) becomes
        ``unreported``, which counts as superseded: every stale versioned write is.
        """
        stale: list[StaleRow] = []
        for entry in data.get("stale") or ():
            if isinstance(entry, str):  # a bare key: a receiver that predates reasons
                stale.append(StaleRow(entry, StaleReason.UNREPORTED, None))
                continue
            try:
                reason = StaleReason(entry.get("reason"))
            except ValueError:
                reason = StaleReason.UNREPORTED
            version = entry.get("current_version")
            stale.append(
                StaleRow(str(entry["key"]), reason, version if isinstance(version, int) else None)
            )
        return cls(
            write_version=data.get("write_version"),
            committed=tuple(data.get("committed") or ()),
            replayed=tuple(data.get("replayed") or ()),
            stale=tuple(stale),
        )


class Progress(NamedTuple):
    rows_admitted: int
    rows_done: int


# ---- admission -------------------------------------------------------------------------


async def admit_page(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    run_id: UUID,
    rows: Sequence[tuple[str, JSON]],
    write_version: int | None = None,
    stable_intent: bool = False,
) -> AdmitResult:
    """Admit one page of ``(key, input)`` rows to a sheet, in one transaction.

    Resolves the write version (legacy: a fresh one; stable intent: the run's durable
    intent on the sheet, created on first use), inserts new rows and re-admits pending
    rows of older versions under it, and returns each row's disposition in page order.
    Raises :class:`WriteVersionMismatch` when ``write_version`` disagrees with the
    stored intent; nothing is written then.
    """
    _check_name("org", org)
    _check_name("sheet", sheet)
    keys = _check_keys([key for key, _ in rows], "rows")
    if write_version is not None and not stable_intent:
        raise InvalidField(
            f"write_version={write_version} was passed to a legacy admission of sheet "
            f"{sheet!r}, which mints its own version on every call",
            field="write_version",
            rule="only meaningful with stable_intent=True",
            fix="pass stable_intent=True to keep one version across pages and wakes, "
            "or omit write_version",
        )
    if write_version is not None and write_version <= 0:
        raise InvalidField(
            f"write_version must be a positive integer, got {write_version}",
            field="write_version",
            rule="a version admitted earlier (> 0)",
            fix="pass the write_version an earlier admission of this run returned",
        )

    async with conn.transaction():
        if stable_intent:
            version = await _resolve_intent(
                conn, org=org, sheet=sheet, run_id=run_id, expected=write_version
            )
        else:
            version = await _mint_version(conn, org=org, run_id=run_id)
        dispositions: dict[str, Disposition] = {}
        if keys:
            cur = await conn.execute(
                q("sheet_admit_rows"),
                {
                    "org": org,
                    "sheet": sheet,
                    "run_id": run_id,
                    "write_version": version,
                    "keys": keys,
                    "inputs": [Jsonb(value) for _, value in rows],
                },
                prepare=False,  # see PAGE_PLAN_NOTE
            )
            for key, inserted in await cur.fetchall():
                dispositions[key] = Disposition.ADMITTED if inserted else Disposition.READMITTED
            untouched = [key for key in keys if key not in dispositions]
            if untouched:
                # New statement: sees the latest committed state of rows we now hold locked.
                cur = await conn.execute(
                    q("sheet_rows_state"), {"org": org, "sheet": sheet, "keys": untouched}
                )
                for key, status, row_version in await cur.fetchall():
                    dispositions[key] = _untouched_disposition(status, row_version, version)
    return AdmitResult(
        write_version=version,
        stable_intent=stable_intent,
        rows=tuple(RowAdmission(key, dispositions[key]) for key in keys),
    )


def _untouched_disposition(status: str, row_version: int | None, version: int) -> Disposition:
    if status != RowStatus.PENDING:
        return Disposition.ALREADY_TERMINAL
    if row_version == version:
        return Disposition.ALREADY_CURRENT
    # Pending but not re-admitted: only a newer version is left alone (sheet_admit_rows).
    return Disposition.SUPERSEDED


async def _mint_version(conn: psycopg.AsyncConnection[Any], *, org: str, run_id: UUID) -> int:
    cur = await conn.execute(q("sheet_version_mint"), {"org": org, "run_id": run_id})
    row = await cur.fetchone()
    if row is None:
        raise _run_not_found(org, run_id)
    return int(row[0])


async def _resolve_intent(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    run_id: UUID,
    expected: int | None,
) -> int:
    params = {"org": org, "sheet": sheet, "run_id": run_id}
    cur = await conn.execute(q("sheet_intent_claim"), params)
    row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    run_found, inserted, existing = row
    if not run_found:
        raise _run_not_found(org, run_id)
    version = inserted if inserted is not None else existing
    if version is None:
        # Lost the insert-if-absent race: the winner has committed by now, but only a new
        # statement can see it. Never fall back to the losing candidate.
        cur = await conn.execute(q("sheet_intent_read"), params)
        reread = await cur.fetchone()
        if reread is None:  # the winner rolled back and the run is gone (FK cascade)
            raise _run_not_found(org, run_id)
        version = reread[0]
    if expected is not None and expected != version:
        if inserted is not None:
            detail = (
                f"run {run_id} had no write intent on sheet {sheet!r} yet, so write_version "
                f"{expected} was never admitted for it"
            )
        else:
            detail = (
                f"write_version {expected} disagrees with write intent {version} admitted "
                f"for run {run_id} on sheet {sheet!r}"
            )
        raise WriteVersionMismatch(
            f"{detail}; nothing was written",
            field="write_version",
            rule="must equal the run's admitted write intent on the sheet",
            fix="omit write_version (the stored intent is reused) or pass the "
            "write_version an earlier admission of this run returned",
        )
    return int(version)


# ---- completion ------------------------------------------------------------------------


async def complete_rows(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    run_id: UUID,
    write_version: int | None,
    completions: Sequence[RowCompletion],
    raise_on_superseded: bool = False,
) -> CompletionResult:
    """Write a page of terminal row outputs, fenced by the write version; one statement.

    Only rows that are pending under ``write_version`` are written (an unversioned writer,
    ``write_version=None``, may write pending rows of its own run). A row already finished
    under the same version with the same status and output is an idempotent replay and
    counts as committed. Everything else is stale, with a reason. With
    ``raise_on_superseded``, any non-benign stale row raises :class:`SheetSuperseded`
    after the statement (rows it committed stay committed in the caller's transaction).
    """
    _check_name("org", org)
    _check_name("sheet", sheet)
    keys = _check_keys([c.key for c in completions], "completions")
    statuses: list[str] = []
    for index, completion in enumerate(completions):
        status = completion.status
        if status not in (RowStatus.DONE, RowStatus.FAILED):
            raise InvalidField(
                f"completion of row {completion.key!r} has status {status!r}",
                field=f"completions[{index}].status",
                rule="a terminal status: done or failed",
                fix="complete rows as done or failed; pending rows need no write",
            )
        statuses.append(str(status))

    committed: list[str] = []
    replayed: list[str] = []
    stale: list[StaleRow] = []
    if keys:
        cur = await conn.execute(
            q("sheet_complete_rows"),
            {
                "org": org,
                "sheet": sheet,
                "run_id": run_id,
                "write_version": write_version,
                "keys": keys,
                "statuses": statuses,
                "outputs": [Jsonb(c.output) for c in completions],
            },
            prepare=False,  # see PAGE_PLAN_NOTE
        )
        by_key = {row[0]: row[1:] for row in await cur.fetchall()}
        for key in keys:
            written, found, row_run, row_version, status, same_result = by_key[key]
            if written:
                committed.append(key)
                continue
            reason = _stale_reason(
                found=found,
                row_run=row_run,
                row_version=row_version,
                terminal=status is not None and status != RowStatus.PENDING,
                run_id=run_id,
                write_version=write_version,
            )
            if reason is None:
                if same_result:
                    committed.append(key)
                    replayed.append(key)
                    continue
                reason = StaleReason.ALREADY_TERMINAL
            stale.append(StaleRow(key, reason, row_version))

    result = CompletionResult(
        write_version=write_version,
        committed=tuple(committed),
        replayed=tuple(replayed),
        stale=tuple(stale),
    )
    if raise_on_superseded:
        raise_if_superseded(result, sheet=sheet, run_id=run_id, submitted=len(keys))
    return result


def _stale_reason(
    *,
    found: bool,
    row_run: UUID | None,
    row_version: int | None,
    terminal: bool,
    run_id: UUID,
    write_version: int | None,
) -> StaleReason | None:
    """The reason an unwritten row is stale; None for a terminal row of the writer's own
    version (a replay when the result matches, else benign ``already_terminal``)."""
    if not found:
        return StaleReason.OLDER_WRITE_VERSION  # nothing this writer admitted
    if write_version is None:  # unversioned: fenced by run ownership alone
        if terminal:
            return StaleReason.ALREADY_TERMINAL
        if row_run != run_id:
            return StaleReason.NEWER_WRITE_VERSION  # another admission owns the row
        return StaleReason.UNREPORTED  # pending and ours cannot be unwritten under the lock
    if row_version is None or row_version < write_version:
        return StaleReason.OLDER_WRITE_VERSION
    if row_version > write_version:
        return StaleReason.NEWER_WRITE_VERSION
    if terminal:
        return None
    return StaleReason.UNREPORTED  # pending under our version cannot be unwritten under the lock


def raise_if_superseded(
    result: CompletionResult, *, sheet: str, run_id: UUID | str, submitted: int
) -> None:
    """Raise :class:`SheetSuperseded` when any stale row is not benign.

    Usable on a result parsed from a receiver (:meth:`CompletionResult.from_wire`), where
    ``unreported`` rows count as superseded.
    """
    superseded = result.superseded
    if not superseded:
        return
    counts = Counter(row.reason.value for row in superseded)
    reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(counts.items()))
    samples = "; ".join(
        f"{row.key} (row version {_or_none(row.current_version)})"
        for row in superseded[:SUPERSEDED_SAMPLE_SIZE]
    )
    version = _or_none(result.write_version)
    raise SheetSuperseded(
        f"sheet {sheet!r} refused {len(superseded)} of {submitted} row completion(s) from "
        f"run {run_id} at write version {version}: another admission owns those rows "
        f"({reasons}). This attempt is superseded and must stop; nothing it writes to the "
        f"sheet can be accepted any more. Sample rows: {samples}.",
        fix="stop the attempt; the admission that owns the rows will finish them",
    )


def _or_none(value: int | None) -> str:
    return "none" if value is None else str(value)


# ---- progress --------------------------------------------------------------------------


async def progress(conn: psycopg.AsyncConnection[Any], run_id: UUID) -> Progress:
    """The run's row counters: rows admitted to it and rows it finished."""
    cur = await conn.execute(q("sheet_progress"), {"run_id": run_id})
    row = await cur.fetchone()
    if row is None:
        raise RunNotFound(f"run {run_id} does not exist", fix="check the run id")
    return Progress(int(row[0]), int(row[1]))


# ---- validation ------------------------------------------------------------------------


def _check_name(field: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_CHARS:
        raise InvalidField(
            f"{field} must be a non-empty string of at most {MAX_KEY_CHARS} characters, "
            f"got {value!r:.80}",
            field=field,
            rule=f"non-empty string, <= {MAX_KEY_CHARS} characters",
            fix=f"pass the {field} name",
        )


def _check_keys(keys: Sequence[object], field: str) -> list[str]:
    """Validate a page's row keys: bounded page, non-empty bounded strings, no duplicate."""
    if len(keys) > MAX_PAGE_ROWS:
        raise PayloadTooLarge(
            f"a page holds at most {MAX_PAGE_ROWS:,} rows, got {len(keys):,}",
            field=field,
            rule=f"at most {MAX_PAGE_ROWS:,} rows per page",
            fix=f"split the rows into pages of at most {MAX_PAGE_ROWS:,}",
        )
    seen: set[str] = set()
    checked: list[str] = []
    for index, key in enumerate(keys):
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
            raise InvalidField(
                f"row key at {field}[{index}] must be a non-empty string of at most "
                f"{MAX_KEY_CHARS} characters, got {key!r:.80}",
                field=f"{field}[{index}].key",
                rule=f"non-empty string, <= {MAX_KEY_CHARS} characters",
                fix="give every row a short, stable identity (an id, not the row's content)",
            )
        if key in seen:
            raise InvalidField(
                f"row key {key!r} appears twice in one page ({field}[{index}])",
                field=f"{field}[{index}].key",
                rule="row keys are unique within a page",
                fix="deduplicate the page before sending it",
            )
        seen.add(key)
        checked.append(key)
    return checked


def _run_not_found(org: str, run_id: UUID) -> RunNotFound:
    return RunNotFound(
        f"run {run_id} of org {org!r} does not exist; a sheet admission needs its run",
        fix="admit the run first, and pass its id and org",
    )
