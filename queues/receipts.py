"""Work receipts: durable steps that run at most once to completion per scope.

``ctx.step(name, fn)`` in the runtime is built from these functions:

1. ``key = step_key(name, seen)`` gives the step its ordinal key (``fetch``, ``fetch#2``).
2. ``claim(...)`` takes the step's receipt for this (run, attempt) and says what to do:
   ``EXECUTE`` (call ``fn``), ``REPLAY`` (use the recorded result), ``SKIPPED``, or ``BUSY``
   (another run's live claim holds it until ``lease_expires_at``; ask again later).
3. After ``fn``: ``complete(..., result=...)``, ``fail(..., error=...)`` or ``skip(...)``.

Commit the claim before calling ``fn``: the execution lock is the committed ``claimed`` row
(owner run and attempt, lease), never a row lock held while ``fn`` runs. Every write is
fenced twice, by the attempt (:class:`~queues.fence.Fence`: the run is running, at this
attempt, under this worker's lease) and, after the claim, by the receipt's owner, so a
stale attempt's write raises :class:`~queues.errors.StaleAttempt` and the newer write
stands. A claim that another run
holds is taken over only once its lease lapses, so a long step keeps its claim alive with
:func:`extend_leases` from the attempt's heartbeat.

Row-level work is batched: :func:`lookup_many` reads a page's paid results in one round
trip, :func:`complete_many` records a page in one statement.

What a step cost (:class:`queues.costs.Charge`) travels with its completion or failure and
is written by the same statement, only when it settles the receipt (:mod:`queues.costs`):
a replay, a repeat after a lost answer and a stale attempt record nothing.

Lock order and bounds are described at the top of ``sql/queries/receipts.sql``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeAlias
from uuid import UUID

import psycopg
from psycopg.rows import class_row

from queues import costs, fields
from queues.errors import InvalidField
from queues.fence import Fence, refused
from queues.queries import own_transaction, q

# PAGE_PLAN_NOTE: statements that take a page of keys as arrays run unprepared. After five
# executions psycopg would prepare them server-side, and the generic plan Postgres then
# picks joins the page to the whole sheet with a nested loop, a page's time growing with
# the sheet's rows instead of its own. The page arrays of JSON values are sent
# in binary (%(x)b), which saves most of the client's per-page escaping work.

JSON: TypeAlias = fields.JSON

SETTLED_MAX = 1000
"""An attempt loads at most this many settled receipts of its run's own scope at its
first step (:func:`settled`); past it, each of its steps claims its receipt first."""
SETTLED_MAX_BYTES = 4 * 1024 * 1024
"""... and at most this much of their results as stored (a result may be large)."""
AsyncConn: TypeAlias = psycopg.AsyncConnection[Any]

STEP_LEASE_S = 60.0  # a step's execution lock; the attempt's heartbeat extends it
MAX_NAME = fields.MAX_STEP_NAME
MAX_KEY = fields.MAX_ROW_KEY
MAX_PAGE = fields.MAX_PAGE_KEYS


class ReceiptStatus(StrEnum):
    """Mirrors the Postgres enum ``wq_receipt_status``."""

    CLAIMED = "claimed"  # an attempt is executing the step; owner and lease are set
    COMPLETED = "completed"  # the result is recorded; later attempts replay it
    FAILED = "failed"  # the step raised; a later attempt may claim it again
    SKIPPED = "skipped"  # the play decided not to execute it; replays as skipped


class ClaimOutcome(StrEnum):
    """What the caller of :func:`claim` does next."""

    EXECUTE = "execute"  # this attempt holds the step: run it, then complete/fail/skip
    REPLAY = "replay"  # completed earlier in this scope: use Claim.result, do not run it
    SKIPPED = "skipped"  # skipped earlier in this scope: do not run it
    BUSY = "busy"  # another run holds a live claim until Claim.lease_expires_at


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a receipt's result is shared.

    The default is the run (``run:<run_id>``): only the run's own attempts replay it. A
    named scope is shared by every run of the same org and play, so a rerun reuses results
    it already paid for.
    """

    key: str

    def __post_init__(self) -> None:
        _check_text("scope", self.key, MAX_NAME + 4, fix="use Scope.of_run or Scope.named")

    @classmethod
    def of_run(cls, run_id: UUID) -> Scope:
        return cls(f"run:{run_id}")

    @classmethod
    def named(cls, name: str) -> Scope:
        _check_text("scope name", name, MAX_NAME, fix="pass a short, stable name")
        if name.startswith("run:"):
            raise InvalidField(
                f"scope name {name!r} is reserved",
                field="scope name",
                rule="must not start with 'run:' (that prefix is the per-run default)",
                fix=f"drop the prefix, e.g. {name[4:] or 'shared'!r}",
            )
        return cls(name)

    def __str__(self) -> str:
        return self.key


@dataclass(frozen=True, slots=True)
class StepRef:
    """One step's receipt, named by its scoped key (org, play, scope, step key), and the
    fence of the attempt that writes it: what every per-step receipt call takes."""

    org: str
    play: str
    scope: Scope
    step_key: str
    fence: Fence


def idempotency_key(org: str, play: str, scope: Scope, step_key: str) -> str:
    """The idempotency key of a step (or a row's step), for a paid call's provider.

    Derived from exactly what identifies the step's receipt (org, play, scope, step key),
    so every attempt of a run, before or after a crash, hands the provider the same key,
    and a step of a named scope the same key in every run that shares it: a provider that
    deduplicates by key (``Idempotency-Key``) charges once for what the receipt records
    once, even when an attempt died between the call and its receipt. Two runs, orgs or
    plays never share one. A hash, so it carries no org or run name to the provider."""
    _check_text("step key", step_key, MAX_NAME + 12, fix="pass the step's name, e.g. 'charge'")
    digest = hashlib.sha256(json.dumps([org, play, scope.key, step_key]).encode()).hexdigest()
    return f"wq-{digest[:40]}"


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: ClaimOutcome
    step_key: str
    result: JSON = None  # the recorded result, for REPLAY
    lease_expires_at: datetime | None = None  # our lease (EXECUTE) or the holder's (BUSY)
    owner_run: UUID | None = None
    owner_attempt: int | None = None


@dataclass(frozen=True, slots=True)
class PageCompletion:
    """What :func:`complete_many` did with each key of a page (each list sorted)."""

    completed: list[str]  # newly completed by this call, with the caller's result
    already: list[str]  # completed or skipped before; the recorded result stands
    busy: list[str]  # a live claim of another run holds it; nothing recorded
    budget_spent: bool = False  # its charges left a budget of the run spent


@dataclass(frozen=True, slots=True)
class Receipt:
    org: str
    play: str
    scope: str
    step_key: str
    status: ReceiptStatus
    owner_run: UUID | None
    owner_attempt: int | None
    lease_expires_at: datetime | None
    result: JSON
    error: JSON
    created_at: datetime
    completed_at: datetime | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", ReceiptStatus(self.status))


# ---- step keys -------------------------------------------------------------------------


def step_key(name: str, seen: dict[str, int]) -> str:
    """The ordinal key of the next step called ``name`` in this attempt (Absurd's rule).

    The first ``fetch`` is ``fetch``, the second ``fetch#2``, then ``fetch#3``. ``seen`` is
    the attempt's counter (mutated); a new attempt starts from an empty one, so the same
    code path maps onto the same keys and replays them.
    """
    _check_text("step name", name, MAX_NAME, fix="pass a short, stable name such as 'fetch'")
    if "#" in name:
        raise InvalidField(
            f"step name {name!r} contains '#'",
            field="step name",
            rule="must not contain '#' (it separates the ordinal suffix, as in 'fetch#2')",
            fix=f"use another separator, e.g. {name.replace('#', '-')!r}",
        )
    n = seen.get(name, 0) + 1
    seen[name] = n
    return name if n == 1 else f"{name}#{n}"


# ---- claim and finish ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ClaimRow:
    fenced: bool
    run_attempt: int | None
    run_state: str | None
    status: str | None
    result: JSON
    owner_run: UUID | None
    owner_attempt: int | None
    lease_expires_at: datetime | None


async def claim(
    conn: AsyncConn,
    ref: StepRef,
    *,
    lease_s: float,
    now: datetime | None = None,
) -> Claim:
    """Claim a step for the fenced attempt, or learn why not, in one statement.

    Takes a missing, failed, lapsed, or own-run-older-attempt receipt (``EXECUTE``); never
    a completed (``REPLAY``) or skipped (``SKIPPED``) one, nor another run's live claim
    (``BUSY``). Raises :class:`StaleAttempt` if the fence no longer holds,
    :class:`RunNotFound` if there is no such run.
    """
    _check_ref(org=ref.org, play=ref.play, step_key=ref.step_key)
    _check_lease(lease_s)
    params = {
        "org": ref.org,
        "play": ref.play,
        "scope": ref.scope.key,
        "step_key": ref.step_key,
        "lease_s": float(lease_s),
        "now": now,
        # The statement is its own transaction: a claim whose loss is harmless may then
        # commit without waiting for its WAL flush (receipt_claim's lazy_commit says when).
        "own_commit": own_transaction(conn),
        **ref.fence.params(),
    }
    async with conn.cursor(row_factory=class_row(_ClaimRow)) as cur:
        await cur.execute(q("receipt_claim"), params)
        row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    if not row.fenced:
        raise refused(
            ref.fence,
            verb="claim",
            subject=f"step {ref.step_key!r}",
            run_attempt=row.run_attempt,
            run_state=row.run_state,
        )
    if row.status == ReceiptStatus.COMPLETED:
        outcome, result, lease = ClaimOutcome.REPLAY, row.result, None
    elif row.status == ReceiptStatus.SKIPPED:
        outcome, result, lease = ClaimOutcome.SKIPPED, None, None
    elif row.status == ReceiptStatus.CLAIMED:
        mine = row.owner_run == ref.fence.run_id and row.owner_attempt == ref.fence.attempt
        outcome = ClaimOutcome.EXECUTE if mine else ClaimOutcome.BUSY
        result, lease = None, row.lease_expires_at
    else:
        # A fenced claim reads a settled receipt or upserts one: never failed or absent.
        raise AssertionError(f"receipt_claim returned status {row.status!r} for {ref.step_key!r}")
    return Claim(
        outcome,
        ref.step_key,
        result=result,
        lease_expires_at=lease,
        owner_run=row.owner_run,
        owner_attempt=row.owner_attempt,
    )


@dataclass(frozen=True, slots=True)
class _FinishRow:
    written: bool
    budget_spent: bool
    fenced: bool
    run_attempt: int | None
    run_state: str | None
    status: str | None
    owner_run: UUID | None
    owner_attempt: int | None
    result: JSON

    def repeats(self, status: ReceiptStatus, fence: Fence) -> bool:
        """Whether an unwritten finish may be this attempt's own earlier one, sent again
        after its answer was lost: under the fence, the receipt settled as asked, by this
        attempt (a completion also compares its result)."""
        return (
            self.fenced
            and self.status == status.value
            and self.owner_run == fence.run_id
            and self.owner_attempt == fence.attempt
        )


async def complete(
    conn: AsyncConn,
    ref: StepRef,
    *,
    result: JSON,
    charges: Sequence[costs.Charge] = (),
    now: datetime | None = None,
) -> JSON:
    """Record the result of a step this attempt holds, with its charges; fenced.

    Returns the result as later attempts will replay it (decoded from the stored JSON, so
    tuples come back as lists), so the first execution and a replay see the same value.
    """
    dumped = _dump(result, what=f"the result of step {ref.step_key!r}", field="result")
    repeated = await _finish(
        conn,
        ReceiptStatus.COMPLETED,
        ref,
        result=dumped,
        error=None,
        charges=charges,
        now=now,
    )
    # A repeat answers with the result stored the first time, as a replay would.
    return repeated.result if repeated is not None else _load(dumped)


async def fail(
    conn: AsyncConn,
    ref: StepRef,
    *,
    error: Mapping[str, JSON],
    charges: Sequence[costs.Charge] = (),
    now: datetime | None = None,
) -> None:
    """Record that a step this attempt holds raised; a later claim may take it again. Its
    charges are recorded all the same: a call that failed may have been billed."""
    dumped = _dump(error, what=f"the error of step {ref.step_key!r}", field="error")
    await _finish(
        conn,
        ReceiptStatus.FAILED,
        ref,
        result=None,
        error=dumped,
        charges=charges,
        now=now,
    )


async def skip(
    conn: AsyncConn,
    ref: StepRef,
    *,
    now: datetime | None = None,
) -> None:
    """Record that the play chose not to execute a step it holds; it replays as skipped."""
    await _finish(
        conn,
        ReceiptStatus.SKIPPED,
        ref,
        result=None,
        error=None,
        charges=(),
        now=now,
    )


async def _finish(
    conn: AsyncConn,
    status: ReceiptStatus,
    ref: StepRef,
    *,
    result: str | None,
    error: str | None,
    charges: Sequence[costs.Charge],
    now: datetime | None,
) -> _FinishRow | None:
    """Write the finish; None when written now, the row when this attempt had written it
    already (a repeat: answered as a success, so a call retried after a lost answer is
    not taken for a refusal); any other unwritten finish is refused."""
    _check_ref(org=ref.org, play=ref.play, step_key=ref.step_key)
    fence = ref.fence
    params = {
        "status": status.value,
        "org": ref.org,
        "play": ref.play,
        "scope": ref.scope.key,
        "step_key": ref.step_key,
        "result": result,
        "error": error,
        "now": now,
        **costs.Charges.of(charges).params(),
        **fence.params(),
    }
    async with conn.cursor(row_factory=class_row(_FinishRow)) as cur:
        await cur.execute(q("receipt_finish"), params)
        row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    if row.written:
        return None
    if row.repeats(status, fence) and (result is None or row.result == _load(result)):
        return row  # the same write again (a completion with another result is refused)
    verb = {"completed": "complete", "failed": "fail", "skipped": "skip"}[status.value]
    fenced = row.run_attempt == fence.attempt and row.run_state == "running"
    reason: str | None = None
    if fenced and row.status is None:
        reason = "it holds no receipt for the step (claim it first)"
    elif fenced:
        reason = f"the receipt is {row.status} by run {row.owner_run} attempt {row.owner_attempt}"
    raise refused(
        fence,
        verb=verb,
        subject=f"step {ref.step_key!r}",
        run_attempt=row.run_attempt,
        run_state=row.run_state,
        reason=reason,
    )


# ---- pages -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PageRow:
    fenced: bool
    budget_spent: bool
    run_attempt: int | None
    run_state: str | None
    completed: list[str]
    already: list[str]
    busy: list[str]


async def complete_many(
    conn: AsyncConn,
    *,
    org: str,
    play: str,
    scope: Scope,
    fence: Fence,
    results: Sequence[tuple[str, JSON]],
    charges: Mapping[str, Sequence[costs.Charge]] | None = None,
    now: datetime | None = None,
) -> PageCompletion:
    """Claim-and-complete a page of steps (row-level work) in one statement; fenced.

    Keys that are already completed or skipped keep their recorded result; a key another
    run holds with a live claim is left alone (``busy``). Everything else (missing, failed,
    lapsed, or held by this run) is completed with the caller's result, and with its
    ``charges`` (by key; a key of another page's is refused). A page holds at most
    :data:`MAX_PAGE` keys, each once.
    """
    _check_ref(org=org, play=play, step_key=None)
    keys = [key for key, _ in results]
    _check_page(keys)
    if not keys:
        return PageCompletion(completed=[], already=[], busy=[])
    dumped = [
        _dump(value, what=f"the result of step {key!r}", field="results") for key, value in results
    ]
    strays = sorted(set(charges or {}) - set(keys))
    if strays:
        raise InvalidField(
            f"charges name step {strays[0]!r}, which is not in the page",
            field="charges",
            rule="charges of the page's own keys",
            fix="send a row's charges with the page that completes the row",
        )
    return await _complete_page(
        conn,
        org=org,
        play=play,
        scope=scope,
        fence=fence,
        keys=keys,
        dumped=dumped,
        charges=charges or {},
        now=now,
        subject=f"a page of {len(keys)} steps (first {keys[0]!r})",
    )


async def _complete_page(
    conn: AsyncConn,
    *,
    org: str,
    play: str,
    scope: Scope,
    fence: Fence,
    keys: list[str],
    dumped: list[str],
    charges: Mapping[str, Sequence[costs.Charge]],
    now: datetime | None,
    subject: str,
) -> PageCompletion:
    params = {
        "org": org,
        "play": play,
        "scope": scope.key,
        "keys": keys,
        "results": dumped,
        "now": now,
        **costs.page_charges(charges),
        **fence.params(count=len(keys)),
    }
    async with conn.cursor(row_factory=class_row(_PageRow)) as cur:
        # A page runs unprepared (see PAGE_PLAN_NOTE); one step (record) is prepared.
        prepare = None if len(keys) == 1 else False
        await cur.execute(q("receipt_complete_many"), params, prepare=prepare)
        row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    if not row.fenced:
        raise refused(
            fence,
            verb="complete",
            subject=subject,
            run_attempt=row.run_attempt,
            run_state=row.run_state,
        )
    return PageCompletion(
        completed=row.completed,
        already=row.already,
        busy=row.busy,
        budget_spent=row.budget_spent,
    )


async def record(
    conn: AsyncConn,
    ref: StepRef,
    *,
    result: JSON,
    charges: Sequence[costs.Charge] = (),
    now: datetime | None = None,
) -> Claim:
    """Claim-and-complete one step that ran without a claim, with its charges, in one
    fenced statement.

    For the steps of a run's own scope, whose only exclusion (other attempts of the run)
    the run's lease already gives: the attempt learns at its first step which of them
    settled before it (:func:`settled`), runs the others, and records each with this, one
    durable commit per step. Returns ``EXECUTE`` with the result as stored (decoded, as a
    replay will see it); ``REPLAY`` or ``SKIPPED`` if the step had settled after all, with
    the recorded result; ``BUSY`` if another run holds a live claim (only a named scope).
    """
    org, play, scope, step_key = ref.org, ref.play, ref.scope, ref.step_key
    _check_ref(org=org, play=play, step_key=step_key)
    dumped = _dump(result, what=f"the result of step {step_key!r}", field="result")
    page = await _complete_page(
        conn,
        org=org,
        play=play,
        scope=scope,
        fence=ref.fence,
        keys=[step_key],
        dumped=[dumped],
        charges={step_key: charges} if charges else {},
        now=now,
        subject=f"step {step_key!r}",
    )
    if page.completed:
        return Claim(ClaimOutcome.EXECUTE, step_key, result=_load(dumped))
    if page.busy:
        return Claim(ClaimOutcome.BUSY, step_key)
    found = await lookup_many(conn, org=org, play=play, scope=scope, keys=[step_key])
    if step_key in found:
        return Claim(ClaimOutcome.REPLAY, step_key, result=found[step_key])
    return Claim(ClaimOutcome.SKIPPED, step_key)


@dataclass(frozen=True, slots=True)
class Settled:
    """The settled receipts of one scope, by step key: (status, recorded result)."""

    receipts: dict[str, tuple[ReceiptStatus, JSON]]
    complete: bool  # False: more than the limit settled; the caller claims step by step


async def settled(
    conn: AsyncConn,
    *,
    org: str,
    play: str,
    scope: Scope,
    limit: int = SETTLED_MAX,
    max_bytes: int = SETTLED_MAX_BYTES,
) -> Settled:
    """The completed and skipped receipts of ``scope``, at most ``limit`` of them and
    ``max_bytes`` of results as stored (no locks); past either, ``complete`` is False."""
    _check_ref(org=org, play=play, step_key=None)
    params = {
        "org": org,
        "play": play,
        "scope": scope.key,
        "limit": limit + 1,
        "max_bytes": max_bytes,
    }
    async with conn.cursor() as cur:
        await cur.execute(q("receipt_settled"), params)
        rows = await cur.fetchall()
    if len(rows) > limit or any(over for *_, over in rows):
        return Settled({}, complete=False)
    return Settled(
        {key: (ReceiptStatus(status), value) for key, status, value, _ in rows}, complete=True
    )


async def lookup_many(
    conn: AsyncConn,
    *,
    org: str,
    play: str,
    scope: Scope,
    keys: Sequence[str],
) -> dict[str, JSON]:
    """The recorded results of the completed steps among ``keys``, in one round trip.

    A resumed attempt calls this for a page and only works on the keys it does not return.
    """
    _check_ref(org=org, play=play, step_key=None)
    keys = list(keys)
    _check_page(keys)
    if not keys:
        return {}
    params = {"org": org, "play": play, "scope": scope.key, "keys": keys}
    async with conn.cursor() as cur:
        await cur.execute(q("receipt_lookup_many"), params, prepare=False)  # see PAGE_PLAN_NOTE
        rows = await cur.fetchall()
    return {key: result for key, result in rows}


@dataclass(frozen=True, slots=True)
class _ExtendRow:
    fenced: bool
    extended: int
    run_attempt: int | None
    run_state: str | None


async def extend_leases(
    conn: AsyncConn,
    *,
    fence: Fence,
    lease_s: float,
    now: datetime | None = None,
) -> int:
    """Extend the lease of every step this attempt holds (call it from the heartbeat).

    Returns how many claims were extended. Raises :class:`StaleAttempt` when the attempt
    no longer owns its run.
    """
    _check_lease(lease_s)
    params = {"lease_s": float(lease_s), "now": now, **fence.params()}
    async with conn.cursor(row_factory=class_row(_ExtendRow)) as cur:
        await cur.execute(q("receipt_extend_leases"), params)
        row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    if not row.fenced:
        raise refused(
            fence,
            verb="extend the leases of",
            subject="its claimed steps",
            run_attempt=row.run_attempt,
            run_state=row.run_state,
        )
    return row.extended


async def get(
    conn: AsyncConn, *, org: str, play: str, scope: Scope, step_key: str
) -> Receipt | None:
    """One receipt by its scoped key, or None."""
    params = {"org": org, "play": play, "scope": scope.key, "step_key": step_key}
    async with conn.cursor(row_factory=class_row(Receipt)) as cur:
        await cur.execute(q("receipt_get"), params)
        return await cur.fetchone()


# ---- helpers ---------------------------------------------------------------------------


def _check_text(field: str, value: object, max_len: int, *, fix: str) -> None:
    fields.text(value, field=field, max_len=max_len, fix=fix)


def _check_ref(*, org: str | None, play: str | None, step_key: str | None) -> None:
    if org is not None:
        fields.org(org)
    if play is not None:
        fields.text(play, field="play", max_len=fields.MAX_PLAY, fix="pass the run's play")
    if step_key is not None:
        _check_text("step key", step_key, MAX_KEY, fix="build it with step_key(name, seen)")


def _check_lease(lease_s: float) -> None:
    ok = isinstance(lease_s, int | float) and not isinstance(lease_s, bool)
    if not (ok and math.isfinite(lease_s) and lease_s > 0):
        raise InvalidField(
            f"lease_s is {lease_s!r}",
            field="lease_s",
            rule="a finite number of seconds > 0",
            fix="pass the lane's lease TTL (lease_ttl_s)",
        )


def _check_page(keys: list[str]) -> None:
    if len(keys) > MAX_PAGE:
        raise InvalidField(
            f"a page of {len(keys)} keys is too large",
            field="keys",
            rule=f"at most {MAX_PAGE} keys per call (bounds locks and WAL per statement)",
            fix=f"split the work into pages of {MAX_PAGE}",
        )
    seen: set[str] = set()
    for key in keys:
        _check_text("step key", key, MAX_KEY, fix="use the row's stable key")
        if key in seen:
            raise InvalidField(
                f"step key {key!r} appears twice in one page",
                field="keys",
                rule="each key at most once per page",
                fix="deduplicate the page, keeping one result per key",
            )
        seen.add(key)


def _dump(value: object, *, what: str, field: str) -> str:
    return fields.encode(
        value,
        field=field,
        what=what,
        max_bytes=fields.MAX_RESULT_BYTES,
        fix="return plain data, e.g. convert objects with a to_dict() or str()",
    )


def _load(text: str) -> JSON:
    loaded: JSON = json.loads(text)
    return loaded


async def extend_for_attempts(
    conn: AsyncConn,
    *,
    owner: str,
    leases: Sequence[tuple[UUID, int]],
    lease_s: float,
    now: datetime | None = None,
) -> None:
    """Extend the step leases held by several live attempts of one worker in one statement.

    The worker's heartbeat calls this with the (run, attempt) pairs whose run leases it
    has just renewed, so a step longer than its lease keeps its execution lock. Fenced:
    an attempt that no longer owns its run under ``owner``'s lease extends nothing.
    """
    if not leases:
        return
    await conn.execute(
        q("receipt_extend_for_attempts"),
        {
            "owner": owner,
            "run_ids": [run_id for run_id, _ in leases],
            "attempts": [attempt for _, attempt in leases],
            "lease_s": lease_s,
            "now": now,
        },
    )
