"""Sheets: page admission under a write version, and fenced row completion.

A play admits its input rows to a sheet in pages. Each admission resolves a **write
version**, the fencing token it stamps on the rows it owns:

- *legacy* admission mints a fresh version when an attempt starts or resumes (its first
  page; the caller passes that version back for the attempt's later pages, so an attempt
  never supersedes its own earlier pages), and a wake re-admits the run's pending rows
  under a newer version;
- *stable write intent* stores the run's first version on the sheet durably
  (``wq_write_intents``, keyed by run and sheet) in the same transaction as its rows, and
  every later page, retry, wake or recovery of that run reuses it, even with no local
  state. A new run admits a newer intent and takes over the pending rows.

A version the caller carries (``write_version``: saved from an earlier page or an earlier
attempt of the run) is reused as it is, as the reference runtime's mint does, provided it
is one of the run's own versions on the sheet; a first intent that carries one stores it.
Sheet names are normalised (:func:`sheet_name`) before anything is stored or matched.

Every statement is fenced by the writer's attempt (:class:`~queues.fence.Fence`): a stale
attempt admits and completes nothing. Completing rows writes terminal outputs only where
the attempt fence holds, the row still carries the writer's version and is pending; every
other row is reported stale with a :class:`StaleReason`, the reference runtime's four;
what the attempt fence adds is a :class:`FenceReason`, kept apart from them. Lock order
and statement bounds are documented in ``sql/queries/sheets.sql``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple, TypeAlias
from uuid import UUID

import psycopg
import psycopg.errors
from psycopg.types.json import Jsonb

from queues import fields
from queues.errors import (
    InvalidField,
    PayloadTooLarge,
    RunNotFound,
    SheetSuperseded,
    WorkerError,
    WriteVersionMismatch,
)
from queues.fence import Fence, refused
from queues.queries import q

# PAGE_PLAN_NOTE: statements that take a page of keys as arrays run unprepared. After five
# executions psycopg would prepare them server-side, and the generic plan Postgres then
# picks joins the page to the whole sheet with a nested loop, a page's time growing with
# the sheet's rows instead of its own. The page arrays of JSON values are sent
# in binary (%(x)b), which saves most of the client's per-page escaping work.

JSON: TypeAlias = fields.JSON

MAX_PAGE_ROWS = fields.MAX_PAGE_KEYS
MAX_KEY_CHARS = fields.MAX_ROW_KEY


class Disposition(StrEnum):
    """What admitting a page did to one row."""

    ADMITTED = "admitted"  # new: inserted under this write version
    READMITTED = "readmitted"  # was pending under an older version: now owned by this one
    ALREADY_CURRENT = "already_current"  # already pending under this version (a replay)
    ALREADY_TERMINAL = "already_terminal"  # done or failed: untouched
    SUPERSEDED = "superseded"  # pending under a newer version: left to that admission
    # Pending under an older admission and left to it: the page asked for no rerun
    # admission (pendingRerunAdmission false).
    LEFT_PENDING = "left_pending"


class RowStatus(StrEnum):
    """Mirrors the Postgres enum ``wq_row_status``."""

    PENDING = "pending"  # admitted under write_version, not finished
    DONE = "done"  # terminal: output written
    FAILED = "failed"  # terminal: the row failed for good


class StaleReason(StrEnum):
    """Why a row completion was not written: the reference runtime's four reasons."""

    NEWER_WRITE_VERSION = "newer_write_version"  # a later admission (or attempt) owns the row
    OLDER_WRITE_VERSION = "older_write_version"  # the writer's version never admitted it
    ALREADY_TERMINAL = "already_terminal"  # finished already, nothing overwritten: benign
    # Never sent by this receiver: a client's reading of a receiver that gave no (known)
    # reason. Treated as superseded, as every stale versioned write is.
    UNREPORTED = "unreported"


class FenceReason(StrEnum):
    """What the attempt fence adds to a refused completion (``fenceReason`` on the wire, a
    field the reference's client ignores). Its rows are ``newer_write_version`` on the
    reference's fields, and listed in ``supersededKeys``: the attempt must stop."""

    STALE_ATTEMPT = "stale_attempt"  # the writer's attempt no longer owns its run


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
            "writeVersion": self.write_version,
            "stableWriteIntent": self.stable_intent,
            "rows": [{"key": r.key, "disposition": r.disposition.value} for r in self.rows],
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> AdmitResult:
        return cls(
            write_version=int(data["writeVersion"]),
            stable_intent=bool(data.get("stableWriteIntent")),
            rows=tuple(
                RowAdmission(str(r["key"]), Disposition(r["disposition"])) for r in data["rows"]
            ),
        )


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
    # The receiver's explicit stop signal: these rows' refusal supersedes the whole attempt
    # (the reference's supersededKeys). The writer raises SheetSuperseded on it.
    superseded_keys: tuple[str, ...] = ()
    fence: FenceReason | None = None  # the attempt fence refused the page (fenceReason)

    @property
    def superseded(self) -> tuple[StaleRow, ...]:
        """Stale rows that mean another admission owns the rows (every non-benign reason)."""
        return tuple(row for row in self.stale if row.reason not in BENIGN_REASONS)

    @property
    def attempt_stale(self) -> bool:
        """The writer's attempt was refused by the attempt fence: it must stop."""
        return self.fence is FenceReason.STALE_ATTEMPT

    @property
    def submitted(self) -> int:
        return len(self.committed) + len(self.stale)

    def raise_if_superseded(self, *, sheet: str, run_id: UUID | str) -> None:
        """The writer's explicit choice: raise :class:`SheetSuperseded` on any non-benign
        stale row (a completion reports them without raising otherwise)."""
        raise_if_superseded(self, sheet=sheet, run_id=run_id, submitted=self.submitted)

    def raise_if_stopped(self, *, sheet: str, run_id: UUID | str) -> None:
        """Raise :class:`SheetSuperseded` when the receiver said the attempt must stop
        (``supersededKeys``), whatever the writer asked: with the stale rows of those keys
        (a key the receiver gave no stale row for counts as ``unreported``)."""
        if not self.superseded_keys:
            return
        by_key = {row.key: row for row in self.stale}
        rows = [
            by_key.get(key) or StaleRow(key, StaleReason.UNREPORTED, None)
            for key in self.superseded_keys
        ]
        _raise_superseded(self, rows, sheet=sheet, run_id=run_id, submitted=self.submitted)

    def to_wire(self) -> dict[str, JSON]:
        """The reference runtime's shape: committedKeys, staleRows (key, one of its four
        reasons, rowVersionStamp), supersededKeys when the attempt must stop; this
        receiver's additions (replayedKeys, fenceReason) are fields of their own."""
        wire: dict[str, JSON] = {
            "writeVersion": self.write_version,
            "committedKeys": list(self.committed),
            "replayedKeys": list(self.replayed),
            "staleRows": [
                {"key": s.key, "reason": s.reason.value, "rowVersionStamp": s.current_version}
                for s in self.stale
            ],
        }
        if self.superseded_keys:
            wire["supersededKeys"] = list(self.superseded_keys)
        if self.fence is not None:
            wire["fenceReason"] = self.fence.value
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CompletionResult:
        """Parse a receiver's answer; tolerate an older receiver's missing fields.

        A stale entry without a reason (or with one this code does not know) becomes
        ``unreported``, which counts as superseded: every stale versioned write is.
        ``supersededKeys`` is the receiver's stop signal (:meth:`raise_if_stopped`).
        """
        stale: list[StaleRow] = []
        for entry in data.get("staleRows") or data.get("staleKeys") or ():
            if isinstance(entry, str):  # a bare key: a receiver that predates reasons
                stale.append(StaleRow(entry, StaleReason.UNREPORTED, None))
                continue
            try:
                reason = StaleReason(entry.get("reason"))
            except ValueError:
                reason = StaleReason.UNREPORTED
            version = entry.get("rowVersionStamp")
            stale.append(
                StaleRow(str(entry["key"]), reason, version if isinstance(version, int) else None)
            )
        return cls(
            write_version=data.get("writeVersion"),
            committed=tuple(data.get("committedKeys") or ()),
            replayed=tuple(data.get("replayedKeys") or ()),
            stale=tuple(stale),
            superseded_keys=tuple(str(key) for key in data.get("supersededKeys") or ()),
            fence=_fence_reason(data.get("fenceReason")),
        )


def _fence_reason(value: object) -> FenceReason | None:
    try:
        return FenceReason(value) if isinstance(value, str) else None
    except ValueError:
        return None  # a reason this code does not know: supersededKeys still says stop


class Progress(NamedTuple):
    rows_admitted: int
    rows_done: int


# ---- admission -------------------------------------------------------------------------


async def admit_page(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    fence: Fence,
    rows: Sequence[tuple[str, JSON]],
    write_version: int | None = None,
    stable_intent: bool = False,
    pending_rerun_admission: bool = True,
) -> AdmitResult:
    """Admit one page of ``(key, input)`` rows to a sheet, in one transaction; fenced.

    Resolves the write version (stable intent, opt-in: the run's durable intent on the
    sheet, created on first use, from ``write_version`` when the caller carries one;
    legacy: ``write_version`` when given, else the version this attempt minted on its
    first page), inserts new rows and, with ``pending_rerun_admission`` (the default),
    re-admits pending rows of older versions under it; without it they are left to their
    admission (``left_pending``). Returns each row's disposition in page order. Raises
    :class:`WriteVersionMismatch` when ``write_version`` is not one of the run's versions
    on the sheet or disagrees with its stored intent, and :class:`StaleAttempt` when the
    fence no longer holds; nothing is written then.
    """
    fields.org(org)
    sheet = sheet_name(sheet)
    keys = _check_keys([key for key, _ in rows], "rows")
    if write_version is not None and write_version <= 0:
        raise InvalidField(
            f"write_version must be a positive integer, got {write_version}",
            field="write_version",
            rule="a version admitted earlier (> 0)",
            fix="pass the write_version an earlier admission of this run returned",
        )

    # A fence refusal is returned, not raised, inside the transaction: its wq_refusals row
    # commits with it, and the error is raised after (nothing else was written).
    async with conn.transaction():
        admitted = await _admit_in_transaction(
            conn,
            org=org,
            sheet=sheet,
            fence=fence,
            rows=rows,
            keys=keys,
            write_version=write_version,
            stable_intent=stable_intent,
            readmit_pending=pending_rerun_admission,
        )
    if isinstance(admitted, Exception):
        raise admitted
    return admitted


async def _admit_in_transaction(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    fence: Fence,
    rows: Sequence[tuple[str, JSON]],
    keys: list[str],
    write_version: int | None,
    stable_intent: bool,
    readmit_pending: bool,
) -> AdmitResult | WorkerError:
    if stable_intent:
        version = await _resolve_intent(
            conn, org=org, sheet=sheet, fence=fence, expected=write_version, count=len(keys)
        )
    else:
        version = await _attempt_version(
            conn, org=org, sheet=sheet, fence=fence, expected=write_version, count=len(keys)
        )
    if isinstance(version, WorkerError):
        return version
    dispositions: dict[str, Disposition] = {}
    if keys:
        async with _storable("inputs", "rows"):
            cur = await conn.execute(
                q("sheet_admit_rows"),
                {
                    "org": org,
                    "sheet": sheet,
                    "write_version": version,
                    "keys": keys,
                    "inputs": [Jsonb(value) for _, value in rows],
                    "readmit_pending": readmit_pending,
                    **fence.params(count=len(keys)),
                },
                prepare=False,  # see PAGE_PLAN_NOTE
            )
        answer = await cur.fetchall()
        # The version's statement took the fence in this transaction: it still holds.
        assert answer[0][0], "the fence was lost inside the admission's transaction"
        for _fenced, key, inserted in answer:
            if key is not None:
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
    if row_version is not None and row_version > version:
        return Disposition.SUPERSEDED
    # Pending under an older version and not re-admitted: the page asked for no rerun
    # admission (sheet_admit_rows re-admits every such row otherwise).
    return Disposition.LEFT_PENDING


async def _attempt_version(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    fence: Fence,
    expected: int | None,
    count: int,
) -> int | WorkerError:
    """The legacy version of a page: the caller's (one of its run's versions on the sheet,
    reused as it is), else the one this attempt minted on its first page. The version an
    attempt's first page resolves is recorded as the attempt's."""
    cur = await conn.execute(
        q("sheet_version_mint"),
        {"org": org, "sheet": sheet, "write_version": expected, **fence.params(count)},
    )
    row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    fenced, run_attempt, run_state, run_org, version, owned = row
    if not fenced:
        return _admission_refused(fence, org, count, run_attempt, run_state, run_org)
    if expected is None:
        return int(version)
    if not owned:
        raise _not_the_runs(expected, fence, sheet)
    return expected


def _not_the_runs(expected: int, fence: Fence, sheet: str) -> WriteVersionMismatch:
    return WriteVersionMismatch(
        f"write_version {expected} was never admitted for run {fence.run_id} on sheet "
        f"{sheet!r}; nothing was written",
        field="write_version",
        rule="a version an earlier admission of this run on this sheet returned",
        fix="omit write_version (a fresh one is minted, or the run's intent reused), or "
        "pass one an earlier page or attempt of this run got back",
    )


def _admission_refused(
    fence: Fence,
    org: str,
    count: int,
    run_attempt: int | None,
    run_state: str | None,
    run_org: str | None,
) -> WorkerError:
    if run_attempt is None or run_org != org:
        return _run_not_found(org, fence.run_id)
    return refused(
        fence,
        verb="admit",
        subject=f"{count} row(s)",
        run_attempt=run_attempt,
        run_state=run_state,
    )


async def _resolve_intent(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    fence: Fence,
    expected: int | None,
    count: int,
) -> int | WorkerError:
    run_id = fence.run_id
    params = {"org": org, "sheet": sheet, "write_version": expected, **fence.params(count)}
    cur = await conn.execute(q("sheet_intent_claim"), params)
    row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    fenced, run_attempt, run_state, run_org, inserted, existing, owned = row
    if not fenced:
        return _admission_refused(fence, org, count, run_attempt, run_state, run_org)
    version = inserted if inserted is not None else existing
    if version is None:
        # Nothing inserted and nothing seen: a lost insert-if-absent race (the winner has
        # committed by now, but only a new statement can see it; never fall back to the
        # losing candidate), or a caller's version that is not the run's.
        cur = await conn.execute(q("sheet_intent_read"), params)
        reread = await cur.fetchone()
        if reread is None:
            if expected is not None and not owned:
                raise _not_the_runs(expected, fence, sheet)
            raise _run_not_found(org, run_id)  # the winner rolled back, the run is gone
        version = reread[0]
    if expected is not None and expected != version:
        raise WriteVersionMismatch(
            f"write_version {expected} disagrees with write intent {version} admitted for "
            f"run {run_id} on sheet {sheet!r}; nothing was written",
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
    fence: Fence,
    write_version: int | None,
    completions: Sequence[RowCompletion],
    raise_on_superseded: bool = False,
) -> CompletionResult:
    """Write a page of terminal row outputs, fenced by the attempt and the write version.

    :func:`complete_page`, then: when the attempt fence refused the page (the result's
    ``supersededKeys``), :class:`SheetSuperseded` is raised whatever
    ``raise_on_superseded`` says (such an attempt must stop); with ``raise_on_superseded``
    any non-benign stale row raises it too (rows the page committed stay committed).
    """
    result = await complete_page(
        conn,
        org=org,
        sheet=sheet,
        fence=fence,
        write_version=write_version,
        completions=completions,
    )
    sheet = sheet_name(sheet)
    result.raise_if_stopped(sheet=sheet, run_id=fence.run_id)
    if raise_on_superseded:
        result.raise_if_superseded(sheet=sheet, run_id=fence.run_id)
    return result


async def complete_page(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    sheet: str,
    fence: Fence,
    write_version: int | None,
    completions: Sequence[RowCompletion],
) -> CompletionResult:
    """A receiver's completion of a page: one statement, reported, never raised.

    When the attempt fence no longer holds nothing is written: every row comes back stale
    as ``newer_write_version`` (a newer attempt owns the run's rows), the result carries
    ``fence=stale_attempt`` and lists every row in ``superseded_keys``, the stop signal.
    Otherwise only rows that are pending under ``write_version`` are written (an
    unversioned writer, ``write_version=None``, may write pending rows of its own run). A
    row already finished under the same version with the same status and output is an
    idempotent replay and counts as committed. Everything else is stale, with a reason.
    """
    run_id = fence.run_id
    fields.org(org)
    sheet = sheet_name(sheet)
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
    refused_by_fence = False
    if keys:
        async with _storable("outputs", "completions"):
            cur = await conn.execute(
                q("sheet_complete_rows"),
                {
                    "org": org,
                    "sheet": sheet,
                    "write_version": write_version,
                    "keys": keys,
                    "statuses": statuses,
                    "outputs": [Jsonb(c.output) for c in completions],
                    **fence.params(count=len(keys)),
                },
                prepare=False,  # see PAGE_PLAN_NOTE
            )
        by_key = {row[0]: row[1:] for row in await cur.fetchall()}
        for key in keys:
            fenced, written, found, row_run, row_version, status, same_result = by_key[key]
            if not fenced:
                # Said the reference's way: a newer owner has the row (a newer attempt of
                # the run, under its intent); the fence's reason goes in its own field.
                refused_by_fence = True
                stale.append(StaleRow(key, StaleReason.NEWER_WRITE_VERSION, None))
                continue
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

    return CompletionResult(
        write_version=write_version,
        committed=tuple(committed),
        replayed=tuple(replayed),
        stale=tuple(stale),
        superseded_keys=tuple(keys) if refused_by_fence else (),
        fence=FenceReason.STALE_ATTEMPT if refused_by_fence else None,
    )


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
    version (a replay when the result matches, else benign ``already_terminal``). Never
    ``unreported``, the reason a client gives a receiver that named none."""
    if not found:
        return StaleReason.OLDER_WRITE_VERSION  # nothing this writer admitted
    if write_version is None:  # unversioned: fenced by run ownership alone
        if terminal:
            return StaleReason.ALREADY_TERMINAL
        _never_unwritten(row_run == run_id, "an unversioned writer's pending row")
        return StaleReason.NEWER_WRITE_VERSION  # another admission owns the row
    if row_version is None or row_version < write_version:
        return StaleReason.OLDER_WRITE_VERSION
    if row_version > write_version:
        return StaleReason.NEWER_WRITE_VERSION
    if row_run != run_id:
        return StaleReason.OLDER_WRITE_VERSION  # its version, another run's row
    _never_unwritten(not terminal, "a pending row under the writer's version")
    return None


def _never_unwritten(happened: bool, what: str) -> None:
    """The statement writes a pending row of the writer's own run and version under the
    lock it holds, so none can come back unwritten; one that did is a defect to surface,
    never a stale row to report."""
    if happened:
        raise WorkerError(
            f"sheet_complete_rows left {what} unwritten under its lock",
            fix="report this defect; the page was not completed and may be sent again",
        )


def raise_if_superseded(
    result: CompletionResult, *, sheet: str, run_id: UUID | str, submitted: int
) -> None:
    """Raise :class:`SheetSuperseded` when any stale row is not benign.

    Usable on a result parsed from a receiver (:meth:`CompletionResult.from_wire`), where
    ``unreported`` rows count as superseded.
    """
    if result.superseded:
        _raise_superseded(
            result, result.superseded, sheet=sheet, run_id=run_id, submitted=submitted
        )


def _raise_superseded(
    result: CompletionResult,
    rows: Sequence[StaleRow],
    *,
    sheet: str,
    run_id: UUID | str,
    submitted: int,
) -> None:
    raise SheetSuperseded(
        sheet=sheet,
        run_id=str(run_id),
        write_version=result.write_version,
        submitted=submitted,
        superseded_rows=[(row.key, row.reason.value, row.current_version) for row in rows],
        fence_reason=None if result.fence is None else result.fence.value,
    )


# ---- progress --------------------------------------------------------------------------


async def progress(conn: psycopg.AsyncConnection[Any], run_id: UUID) -> Progress:
    """The run's row counters: rows admitted to it and rows it finished."""
    cur = await conn.execute(q("sheet_progress"), {"run_id": run_id})
    row = await cur.fetchone()
    if row is None:
        raise RunNotFound(f"run {run_id} does not exist", fix="check the run id")
    return Progress(int(row[0]), int(row[1]))


# ---- validation ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _storable(what: str, field: str) -> AsyncIterator[None]:
    """A page's JSON values go to Postgres as they are (encoding each twice would cost the
    hot path); a value jsonb cannot hold (NUL, NaN) fails the page's one statement, which
    writes nothing, and is reported as bad input instead of a database error."""
    try:
        yield
    except psycopg.errors.DataError as exc:
        raise InvalidField(
            f"a row's {what[:-1]} cannot be stored: {exc.diag.message_primary}",
            field=field,
            rule="JSON that Postgres can store: no NaN or Infinity, no NUL (U+0000), valid Unicode",
            fix="clean the values (e.g. replace NUL, send NaN as null) and send the page again",
        ) from exc


def sheet_name(value: object, field: str = "sheet") -> str:
    """A sheet's name as it is stored and matched: the caller's, without surrounding
    whitespace and in lower case (as the reference runtime normalises a table namespace),
    so ``"Leads"`` and ``" leads"`` are one sheet, with one write intent per run."""
    fields.text(value, field=field, max_len=fields.MAX_SHEET_NAME, fix="pass the sheet's name")
    assert isinstance(value, str)
    name = value.strip().lower()
    if not name:
        raise InvalidField(
            f"{field} is only whitespace",
            field=field,
            rule="a sheet name with at least one character that is not whitespace",
            fix="pass the sheet's name",
        )
    return name


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
        fields.text(
            key,
            field=f"{field}[{index}].key",
            max_len=MAX_KEY_CHARS,
            what="row key",
            fix="give every row a short, stable identity (an id, not the row's content)",
        )
        assert isinstance(key, str)
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
