"""The runtime's operations as typed calls: one frozen value per action, run on a connection
with the attempt's claims.

A play's run context builds these and hands them to its transport. In process, the
transport runs them straight on a connection (:func:`queues.operations.perform` checks them
against the claims first); a sandboxed play's transport encodes them into the reference
runtime's wire dicts, and the gateway decodes those back into the same calls (one codec
per action, :data:`queues.operations.ACTIONS`). So a call means the same on both paths, and
every write it makes is fenced by the claims' attempt in its SQL.

A call that names a step carries a :class:`~queues.receipts.StepRef`; its org, play and
fence must be the claims' own (the run scope), which :func:`queues.operations.perform`
checks before it runs.
"""

from __future__ import annotations

import dataclasses
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, ClassVar, Generic, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from queues import children, costs, fields, limits, receipts, runs, sheets
from queues.authority import Claims
from queues.errors import DeliveryLeaseMismatch, InvalidField, StaleAttempt
from queues.fence import refused
from queues.options import RunOptions
from queues.queries import q

AsyncConn = psycopg.AsyncConnection[Any]
JSON = fields.JSON
T = TypeVar("T")
_NO_OPTIONS = RunOptions()  # the lane's policy for every option


class Call(ABC, Generic[T]):
    """One runtime action with its typed arguments; :meth:`run` answers with a ``T``."""

    __slots__ = ()
    action: ClassVar[str]

    @abstractmethod
    async def run(self, conn: AsyncConn, claims: Claims) -> T:
        """Run the action on ``conn`` for the attempt ``claims`` names."""


# ---- receipts --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReceiptClaim(Call[receipts.Claim]):
    action: ClassVar[str] = "runtime_receipt_claim"
    ref: receipts.StepRef
    lease_s: float = receipts.STEP_LEASE_S

    async def run(self, conn: AsyncConn, claims: Claims) -> receipts.Claim:
        return await receipts.claim(conn, self.ref, lease_s=self.lease_s)


@dataclass(frozen=True, slots=True)
class ReceiptComplete(Call[JSON]):
    action: ClassVar[str] = "runtime_receipt_complete"
    ref: receipts.StepRef
    result: JSON = None
    charges: Sequence[costs.Charge] = ()  # what the step cost, recorded with its receipt

    async def run(self, conn: AsyncConn, claims: Claims) -> JSON:
        return await receipts.complete(conn, self.ref, result=self.result, charges=self.charges)


@dataclass(frozen=True, slots=True)
class ReceiptRecord(Call[receipts.Claim]):
    action: ClassVar[str] = "runtime_receipt_record"
    ref: receipts.StepRef
    result: JSON = None
    charges: Sequence[costs.Charge] = ()

    async def run(self, conn: AsyncConn, claims: Claims) -> receipts.Claim:
        return await receipts.record(conn, self.ref, result=self.result, charges=self.charges)


@dataclass(frozen=True, slots=True)
class ReceiptFail(Call[None]):
    action: ClassVar[str] = "runtime_receipt_fail"
    ref: receipts.StepRef
    error: Mapping[str, JSON]
    charges: Sequence[costs.Charge] = ()  # a failed call may have been billed

    async def run(self, conn: AsyncConn, claims: Claims) -> None:
        await receipts.fail(conn, self.ref, error=self.error, charges=self.charges)


@dataclass(frozen=True, slots=True)
class ReceiptSkip(Call[None]):
    action: ClassVar[str] = "runtime_receipt_skip"
    ref: receipts.StepRef

    async def run(self, conn: AsyncConn, claims: Claims) -> None:
        await receipts.skip(conn, self.ref)


@dataclass(frozen=True, slots=True)
class ReceiptsSettled(Call[receipts.Settled]):
    action: ClassVar[str] = "runtime_receipts_settled"
    scope: receipts.Scope

    async def run(self, conn: AsyncConn, claims: Claims) -> receipts.Settled:
        return await receipts.settled(conn, org=claims.org, play=claims.play, scope=self.scope)


@dataclass(frozen=True, slots=True)
class ReceiptsComplete(Call[receipts.PageCompletion]):
    action: ClassVar[str] = "runtime_receipts_complete"
    scope: receipts.Scope
    results: Sequence[tuple[str, JSON]]
    charges: Mapping[str, Sequence[costs.Charge]] = dataclasses.field(default_factory=dict)

    async def run(self, conn: AsyncConn, claims: Claims) -> receipts.PageCompletion:
        return await receipts.complete_many(
            conn,
            org=claims.org,
            play=claims.play,
            scope=self.scope,
            fence=claims.fence,
            results=list(self.results),
            charges=self.charges,
        )


@dataclass(frozen=True, slots=True)
class BudgetReserve(Call[costs.Reservation]):
    """Reserve a step's estimate (or the same estimate for each of a page of row steps,
    as many as fit, in order) against every budget of the run, before the steps run."""

    action: ClassVar[str] = "runtime_budget_reserve"
    scope: receipts.Scope
    keys: Sequence[str]
    estimate: Mapping[str, Decimal]

    async def run(self, conn: AsyncConn, claims: Claims) -> costs.Reservation:
        return await costs.reserve(
            conn,
            fence=claims.fence,
            scope=self.scope.key,
            keys=list(self.keys),
            estimate=dict(self.estimate),
        )


@dataclass(frozen=True, slots=True)
class ReceiptsLookup(Call[dict[str, JSON]]):
    action: ClassVar[str] = "runtime_receipts_lookup"
    scope: receipts.Scope
    keys: Sequence[str]

    async def run(self, conn: AsyncConn, claims: Claims) -> dict[str, JSON]:
        return await receipts.lookup_many(
            conn, org=claims.org, play=claims.play, scope=self.scope, keys=list(self.keys)
        )


# ---- sheets and input ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SheetStart(Call[sheets.AdmitResult]):
    """An admission page, legacy: a version minted on the attempt's first page and reused
    for its later pages. Rows pending under older versions are re-admitted unless the page
    asks not to (``pendingRerunAdmission: false``)."""

    action: ClassVar[str] = "runtime_sheet_start"
    stable_intent: ClassVar[bool] = False
    sheet: str
    rows: Sequence[tuple[str, sheets.JSON]]
    write_version: int | None = None
    pending_rerun_admission: bool = True

    async def run(self, conn: AsyncConn, claims: Claims) -> sheets.AdmitResult:
        return await sheets.admit_page(
            conn,
            org=claims.org,
            sheet=self.sheet,
            fence=claims.fence,
            rows=list(self.rows),
            write_version=self.write_version,
            stable_intent=self.stable_intent,
            pending_rerun_admission=self.pending_rerun_admission,
        )


@dataclass(frozen=True, slots=True)
class SheetStartWithIntent(SheetStart):
    """An admission page under the run's stable write intent: an action of its own, so a
    receiver that does not know it refuses the opt-in instead of ignoring it."""

    action: ClassVar[str] = "runtime_sheet_start_with_intent"
    stable_intent: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class SheetComplete(Call[sheets.CompletionResult]):
    action: ClassVar[str] = "runtime_sheet_complete_map_rows"
    sheet: str
    completions: Sequence[sheets.RowCompletion]
    write_version: int | None = None

    async def run(self, conn: AsyncConn, claims: Claims) -> sheets.CompletionResult:
        return await sheets.complete_page(
            conn,
            org=claims.org,
            sheet=self.sheet,
            fence=claims.fence,
            write_version=self.write_version,
            completions=list(self.completions),
        )


@dataclass(frozen=True, slots=True)
class InputPage(Call["list[tuple[str, Any]] | None"]):
    action: ClassVar[str] = "runtime_input_page"
    page: int = 0

    async def run(self, conn: AsyncConn, claims: Claims) -> list[tuple[str, Any]] | None:
        return await runs.input_page(conn, claims.run_id, self.page)


# ---- events, time, limits, children ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class EventFound:
    found: bool
    payload: Any = None


@dataclass(frozen=True, slots=True)
class EventGet(Call[EventFound]):
    """The latest emit of ``name`` in the run's org since the run was admitted."""

    action: ClassVar[str] = "runtime_event_get"
    name: str

    async def run(self, conn: AsyncConn, claims: Claims) -> EventFound:
        since = await _run_created(conn, claims)
        found, payload = await runs.emitted_payload(
            conn, org=claims.org, name=self.name, since=since
        )
        return EventFound(found, payload)


@dataclass(frozen=True, slots=True)
class EventEmit(Call[runs.Emitted]):
    action: ClassVar[str] = "runtime_event_emit"
    name: str
    payload: Any = None

    async def run(self, conn: AsyncConn, claims: Claims) -> runs.Emitted:
        return await runs.emit(
            conn, org=claims.org, name=self.name, payload=self.payload, fence=claims.fence
        )


@dataclass(frozen=True, slots=True)
class Now(Call[datetime]):
    action: ClassVar[str] = "runtime_now"

    async def run(self, conn: AsyncConn, claims: Claims) -> datetime:
        cur = await conn.execute("SELECT now()")
        row = await cur.fetchone()
        assert row is not None
        now: datetime = row[0]
        return now


@dataclass(frozen=True, slots=True)
class LimitAcquire(Call[limits.Permit]):
    action: ClassVar[str] = "runtime_limit_acquire"
    key: str
    hold: str

    async def run(self, conn: AsyncConn, claims: Claims) -> limits.Permit:
        return await limits.acquire(conn, key=self.key, hold=self.hold, fence=claims.fence)


@dataclass(frozen=True, slots=True)
class LimitRelease(Call[bool]):
    action: ClassVar[str] = "runtime_limit_release"
    hold: str

    async def run(self, conn: AsyncConn, claims: Claims) -> bool:
        return await limits.release(conn, hold=self.hold, fence=claims.fence)


@dataclass(frozen=True, slots=True)
class RunSpawn(Call[children.Spawned]):
    """A child run admitted as the parent's step ``step_key`` (its run scope's)."""

    action: ClassVar[str] = "runtime_run_spawn"
    step_key: str
    play: str
    params: Mapping[str, Any]
    options: RunOptions = _NO_OPTIONS
    priority: int = 0

    async def run(self, conn: AsyncConn, claims: Claims) -> children.Spawned:
        return await children.spawn(
            conn,
            fence=claims.fence,
            org=claims.org,
            parent_play=claims.play,
            release=claims.release,
            step_key=self.step_key,
            play=self.play,
            params=self.params,
            options=self.options,
            priority=self.priority,
        )


@dataclass(frozen=True, slots=True)
class RunGet(Call[children.Child]):
    action: ClassVar[str] = "runtime_run_get"
    child_id: uuid.UUID | str

    async def run(self, conn: AsyncConn, claims: Claims) -> children.Child:
        return await children.get(conn, parent_id=claims.run_id, child_id=self.child_id)


# ---- the run's ledger (keyed outbox deliveries) -------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivered:
    appended: int  # events this delivery stored
    existing: int  # events an earlier delivery of the same key had stored


@dataclass(frozen=True, slots=True)
class LedgerDelivery(Call[Delivered]):
    """A keyed outbox delivery to the run's ledger, fenced by the live lease: the same
    ``key`` delivered twice stores its events once. ``owner`` is the delivery lease's, which
    must be the attempt's live lease owner (the worker holding the run's lease): the
    statement compares the two under the run's lock, and refuses any other
    (:func:`delivery_lease_mismatch`)."""

    key: str
    owner: str

    @abstractmethod
    def events(self) -> list[tuple[str, JSON]]:
        """The (kind, data) events this delivery stores, in order."""

    async def run(self, conn: AsyncConn, claims: Claims) -> Delivered:
        events = self.events()
        cur = await conn.execute(
            q("ledger_append_delivered"),
            {
                "kinds": [k for k, _ in events],
                "datas": [Jsonb(d) for _, d in events],
                "keys": [f"{self.key}#{i}" for i in range(len(events))],
                "delivery_owner": self.owner,
                **claims.fence.params(count=len(events)),
            },
        )
        row = await cur.fetchone()
        assert row is not None
        fenced, delivering, appended, run_attempt, run_state = row
        if not fenced:
            raise refused(
                claims.fence,
                verb="project",
                subject=f"{len(events)} ledger event(s)",
                run_attempt=run_attempt,
                run_state=run_state,
            )
        if not delivering:
            raise delivery_lease_mismatch(self.owner, claims)
        return Delivered(appended=int(appended), existing=len(events) - int(appended))


@dataclass(frozen=True, slots=True)
class AppendRunEvents(LedgerDelivery):
    """A play's own events (``play.<kind>``), appended to its run's ledger."""

    action: ClassVar[str] = "append_run_events"
    kinds_data: Sequence[tuple[str, JSON]] = ()

    def events(self) -> list[tuple[str, JSON]]:
        checked: list[tuple[str, JSON]] = []
        for index, (kind, data) in enumerate(self.kinds_data):
            where = f"events[{index}]"
            # Printable text, as every name is (an operator's terminal shows it).
            name = fields.text(
                kind, field=f"{where}.kind", max_len=fields.MAX_EVENT_NAME, what="kind"
            )
            if not name.startswith("play."):
                raise InvalidField(
                    f"{where}.kind {name!r} is not a play event",
                    field=f"{where}.kind",
                    rule="a play's ledger events are named play.<something>",
                    fix=f"send kind 'play.{name}'",
                )
            checked.append((name, data or {}))
        return checked


@dataclass(frozen=True, slots=True)
class ProjectRunEvents(AppendRunEvents):
    action: ClassVar[str] = "project_run_events"


def delivery_lease_mismatch(named: str | None, claims: Claims) -> DeliveryLeaseMismatch:
    """The refusal of a keyed delivery naming a delivery lease other than its attempt's
    (one wording for the receiver's check and the statement's)."""
    return DeliveryLeaseMismatch(
        f"run {claims.run_id} attempt {claims.attempt}: deliveryLeaseOwner {named!r:.80} is "
        f"not the worker holding the run's lease ({claims.owner!r}); nothing was written",
        field="deliveryLeaseOwner",
        rule="a keyed ledger delivery names its own attempt's lease: the worker holding the "
        "run's lease at that attempt",
        fix="send deliveryLeaseOwner as the worker id the attempt's token was minted for",
    )


# Every call by its action's wire name (the reference's table renders their docstrings).
BY_ACTION: Mapping[str, type[Call[Any]]] = {
    kind.action: kind
    for kind in (
        ReceiptClaim,
        ReceiptComplete,
        ReceiptRecord,
        ReceiptFail,
        ReceiptSkip,
        ReceiptsSettled,
        ReceiptsComplete,
        ReceiptsLookup,
        BudgetReserve,
        SheetStart,
        SheetStartWithIntent,
        SheetComplete,
        InputPage,
        EventGet,
        EventEmit,
        Now,
        LimitAcquire,
        LimitRelease,
        RunSpawn,
        RunGet,
        AppendRunEvents,
        ProjectRunEvents,
    )
}


async def _run_created(conn: AsyncConn, claims: Claims) -> datetime:
    cur = await conn.execute(
        "SELECT created_at FROM wq_runs WHERE id = %(id)s", {"id": claims.run_id}
    )
    row = await cur.fetchone()
    if row is None:
        raise StaleAttempt(f"run {claims.run_id} does not exist", fix="stop this attempt")
    created: datetime = row[0]
    return created
