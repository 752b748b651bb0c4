"""What paid work costs, and budgets nobody can overspend.

**Charges.** A play says what a step cost with ``ctx.charge(amount, unit="credits",
provider="clearbit")`` inside the step's body (or, for a row of a rows page, with
``step=<the row's step key>``). The charges travel with the step's receipt and are written
by the very statement that settles it (``receipt_finish``, ``receipt_complete_many``), so a
charge is recorded exactly when its receipt is: never for a replayed step, never twice for
a completion sent again after its answer was lost, never for a stale attempt (the same
fence refuses both). A failed step's charges are recorded too (a call that failed may
have been billed), with ``outcome = 'failed'``.

**Budgets.** :func:`set_budget` caps the charges of one unit over a period (``day``,
``month`` in UTC, or ``none``) for an org, an org's play, or one run (also set at submit:
``Submission.budget``). A step that declares an estimate (``ctx.step(..., cost=2)``,
``ctx.reserve_steps(keys, cost=1)`` for rows) reserves it first with :func:`reserve`, in
one statement under the row locks of every budget that applies; the completion that
records the step's charges releases the reservation and adds the charges, under the same
locks. So workers racing on one budget cannot together reserve past it, and spend past it
only by what their steps charged beyond their estimates.

**A run that would overspend pauses.** A reservation that does not fit because the budget
is spent leaves the run ``sleeping`` on the wait event ``$budget:<epoch>``
(:data:`BUDGET_EXHAUSTED` is its ``wait_reason``), free of its worker; a budget write of
its org (a raise, a delete) wakes it in the same transaction, and a budget with a period
wakes it when the period rolls over. :func:`pause` writes the suspension only while the
org's budget epoch is the one the refusal saw, so a raise between the refusal and the
pause hands the run straight back instead of leaving it asleep.

Lock order and bounds: ``sql/queries/costs.sql``; the model: ``docs/explanation/costs.md``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

import psycopg
from psycopg.rows import class_row

from queues import fields, runs
from queues.errors import InvalidField, RunNotFound
from queues.fence import Fence, refused
from queues.outcomes import Finish, FinishStatus
from queues.queries import q

DEFAULT_UNIT = "credits"
PERIODS = ("day", "month", "none")
Period = Literal["day", "month", "none"]
MAX_AMOUNT = Decimal(10) ** 12  # one charge, one estimate, one budget (wq_cost_rules)
NAME_RULE = (
    "lower-case letters, digits, '.', '_', ':' or '-', starting with a letter or digit, "
    "up to 100 characters"
)
BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"  # a paused run's wait_reason
# A paused run's wait event: $budget:<the org's epoch> (read in SQL by wq_wait_reason).
WAIT_PREFIX = "$budget:"
GROUPS = ("run", "org", "play", "provider", "day")  # what costs() groups by

AsyncConn = psycopg.AsyncConnection[Any]


# ---- the field rules ----------------------------------------------------------------------


def check_amount(value: object, *, field: str = "amount") -> Decimal:
    """An amount (a charge, an estimate, a budget's limit): a finite number from 0 to
    :data:`MAX_AMOUNT`, as a Decimal (a float is taken by its shortest repr: 0.1 is 0.1)."""
    number: Decimal | None = None
    if isinstance(value, Decimal):
        number = value
    elif isinstance(value, int) and not isinstance(value, bool):
        number = Decimal(value)
    elif isinstance(value, float) and math.isfinite(value):
        number = Decimal(repr(value))
    elif isinstance(value, str):
        try:
            number = Decimal(value.strip())
        except InvalidOperation:
            number = None
    if number is None or not number.is_finite() or not (0 <= number <= MAX_AMOUNT):
        raise InvalidField(
            f"{field} is {fields.shown(value)}",
            field=field,
            rule=f"a finite number from 0 to {MAX_AMOUNT:,}",
            fix="pass what the call cost, e.g. 1 or 0.002",
        )
    return number


def check_name(value: object, *, field: str, what: str, example: str) -> str:
    """A unit or a provider name: the rule of a limit key."""
    name = fields.text(value, field=field, max_len=100, what=what)
    if not fields.LIMIT_KEY.fullmatch(name):
        raise InvalidField(
            f"invalid {what} {fields.shown(name)}",
            field=field,
            rule=NAME_RULE,
            fix=f"name the {what} like {example}",
        )
    return name


def check_unit(value: object, *, field: str = "unit") -> str:
    return check_name(value, field=field, what="unit", example="credits or usd")


def check_provider(value: object, *, field: str = "provider") -> str | None:
    if value is None:
        return None
    return check_name(value, field=field, what="provider", example="clearbit or openai")


def check_period(value: object, *, field: str = "period") -> Period:
    if value not in PERIODS:
        raise InvalidField(
            f"{field} is {fields.shown(value)}",
            field=field,
            rule="day, month or none (days and months in UTC)",
            fix="pass day, month or none",
        )
    period: Period = value  # type: ignore[assignment]
    return period


# ---- charges and estimates ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Charge:
    """What one call of a step cost (checked): ``ctx.charge``'s record."""

    amount: Decimal
    unit: str = DEFAULT_UNIT
    provider: str | None = None

    @classmethod
    def checked(
        cls, amount: object, unit: object = DEFAULT_UNIT, provider: object = None
    ) -> Charge:
        return cls(check_amount(amount), check_unit(unit), check_provider(provider))


@dataclass(frozen=True, slots=True)
class Charges:
    """A step's charges as its settling statement takes them: one entry per (unit,
    provider), summed (a step's receipt records each pair once)."""

    units: list[str]
    providers: list[str]  # '' for a charge that named none
    amounts: list[Decimal]

    @classmethod
    def of(cls, charges: Iterable[Charge]) -> Charges:
        summed: dict[tuple[str, str], Decimal] = {}
        for c in charges:
            key = (c.unit, c.provider or "")
            summed[key] = summed.get(key, Decimal(0)) + c.amount
        pairs = sorted(summed.items())
        return cls([u for (u, _), _ in pairs], [p for (_, p), _ in pairs], [a for _, a in pairs])

    def params(self) -> dict[str, Any]:
        return {
            "charge_units": self.units,
            "charge_providers": self.providers,
            "charge_amounts": self.amounts,
        }


NO_CHARGES = Charges([], [], [])


def page_charges(by_key: Mapping[str, Sequence[Charge]]) -> dict[str, Any]:
    """A page's charges as ``receipt_complete_many`` takes them: (key, unit, provider,
    amount) side by side, one entry per key and (unit, provider)."""
    keys: list[str] = []
    units: list[str] = []
    providers: list[str] = []
    amounts: list[Decimal] = []
    for key in sorted(by_key):
        one = Charges.of(by_key[key])
        keys += [key] * len(one.units)
        units += one.units
        providers += one.providers
        amounts += one.amounts
    return {
        "charge_keys": keys,
        "charge_units": units,
        "charge_providers": providers,
        "charge_amounts": amounts,
    }


Estimate = dict[str, Decimal]  # unit -> amount, for one step (or one row's step)


def estimate_of(cost: object, *, field: str = "cost") -> Estimate:
    """A step's declared estimate: a number (in :data:`DEFAULT_UNIT`) or a mapping of unit
    to amount (``{"usd": 0.01, "credits": 1}``)."""
    if isinstance(cost, Mapping):
        return {
            check_unit(unit, field=f"{field}.unit"): check_amount(amount, field=f"{field}.amount")
            for unit, amount in cost.items()
        }
    return {DEFAULT_UNIT: check_amount(cost, field=field)}


# ---- budgets -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunBudget:
    """A run's own budget as a submission sets it (``budget=50``, ``--budget 50``)."""

    limit: Decimal
    unit: str = DEFAULT_UNIT
    period: Period = "none"

    @classmethod
    def checked(cls, value: object, *, field: str = "budget") -> RunBudget:
        """A number (a limit in :data:`DEFAULT_UNIT`, no period), or a mapping with
        ``limit`` and optionally ``unit`` and ``period``."""
        if isinstance(value, RunBudget):
            return value
        if not isinstance(value, Mapping):
            return cls(check_amount(value, field=field))
        unknown = sorted(set(value) - {"limit", "unit", "period"})
        if unknown or "limit" not in value:
            raise InvalidField(
                f"{field} has {'field ' + repr(unknown[0]) if unknown else 'no limit'}",
                field=field,
                rule="a limit (a number), or {limit, unit, period}",
                fix="pass e.g. budget=50 or {'limit': 50, 'unit': 'usd', 'period': 'day'}",
            )
        return cls(
            check_amount(value["limit"], field=f"{field}.limit"),
            check_unit(value.get("unit", DEFAULT_UNIT), field=f"{field}.unit"),
            check_period(value.get("period", "none"), field=f"{field}.period"),
        )

    @classmethod
    def parse(cls, text: str, *, field: str = "--budget") -> RunBudget:
        """``LIMIT[:UNIT[:PERIOD]]`` (``50``, ``10:usd``, ``5:usd:day``), as the CLI takes it."""
        parts = text.split(":")
        if len(parts) > 3:
            raise InvalidField(
                f"{field} is {fields.shown(text)}",
                field=field,
                rule="LIMIT[:UNIT[:PERIOD]]",
                fix="pass e.g. --budget 50 or --budget 5:usd:day",
            )
        unit = parts[1] if len(parts) > 1 else DEFAULT_UNIT
        period = parts[2] if len(parts) > 2 else "none"
        return cls(
            check_amount(parts[0], field=field),
            check_unit(unit, field=field),
            check_period(period, field=field),
        )

    def as_json(self) -> dict[str, Any]:
        return {"limit": number(self.limit), "unit": self.unit, "period": self.period}


@dataclass(frozen=True, slots=True)
class Budget:
    id: int
    org: str
    play: str | None  # None: every play of the org (or a run's own budget)
    run_id: uuid.UUID | None  # a run's own budget
    unit: str
    period: str  # day | month | none
    limit_amount: Decimal
    spent: Decimal  # charged in the current period
    reserved: Decimal  # held by the live reservations of its runs' steps now
    period_start: datetime | None  # None: period none
    period_end: datetime | None  # when it rolls over (None: never)
    created_at: datetime
    updated_at: datetime
    updated_by: str | None

    @property
    def scope(self) -> Literal["org", "play", "run"]:
        return "run" if self.run_id is not None else "play" if self.play else "org"

    @property
    def remaining(self) -> Decimal:
        return max(Decimal(0), self.limit_amount - self.spent - self.reserved)

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.limit_amount

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data |= {"scope": self.scope, "remaining": self.remaining, "exhausted": self.exhausted}
        return _plain(data)


def _target(
    org: object, play: object, run_id: object
) -> tuple[str | None, str | None, uuid.UUID | None]:
    """Whose budget: an org's (play None), an org's play's, or a run's (no org or play)."""
    if run_id is not None:
        if play is not None:
            raise InvalidField(
                "a run's budget names no play",
                field="play",
                rule="a budget is an org's, an org's play's, or one run's",
                fix="drop play, or drop run_id",
            )
        try:
            rid = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
        except ValueError:
            raise InvalidField(
                f"run_id is {fields.shown(run_id)}",
                field="run_id",
                rule="a run id (UUID)",
                fix="pass the id `worker submit` printed",
            ) from None
        return (None if org is None else fields.org(org)), None, rid
    if org is None:
        raise InvalidField(
            "a budget needs an org or a run",
            field="org",
            rule="an org (with an optional play), or a run id",
            fix="pass org (e.g. --org acme)",
        )
    checked_play = None if play is None else fields.play_name(play, field="play")
    return fields.org(org), checked_play, None


async def set_budget(
    conn: AsyncConn,
    *,
    limit: object,
    org: object = None,
    play: object = None,
    run_id: object = None,
    unit: object = DEFAULT_UNIT,
    period: object = "none",
    actor: str | None = None,
    now: datetime | None = None,
) -> Budget:
    """Define or redefine a budget of an org, an org's play, or a run, and wake the runs it
    paused (in one transaction). A new budget counts the charges recorded from now on;
    redefined with the same period it keeps what it spent, with another it starts over."""
    org_, play_, rid = _target(org, play, run_id)
    values = {
        "org": org_,
        "play": play_ or "",
        "run_id": rid,
        "unit": check_unit(unit),
        "period": check_period(period),
        "limit": check_amount(limit, field="limit"),
        "actor": actor,
        "now": now,
    }
    async with conn.transaction():
        cur = await conn.execute(q("budget_set_run" if rid else "budget_set_org"), values)
        row = await cur.fetchone()
        if row is None:
            raise RunNotFound(f"no run {rid}", fix="check the id with `worker runs list`")
        budget = await _one(conn, row[0], now=now)
        await _wake(conn, budget, reason="set")
    return budget


async def delete_budget(
    conn: AsyncConn,
    *,
    org: object = None,
    play: object = None,
    run_id: object = None,
    unit: object = DEFAULT_UNIT,
) -> bool:
    """Delete a budget (the runs it paused are woken in the same transaction); False when
    there was none."""
    org_, play_, rid = _target(org, play, run_id)
    params = {"org": org_, "play": play_ or "", "run_id": rid, "unit": check_unit(unit)}
    async with conn.transaction():
        found = [b for b in await list_budgets(conn, org=org_, play=play_, run_id=rid)]
        cur = await conn.execute(q("budget_delete"), params)
        gone = await cur.fetchone()
        if gone is None:
            return False
        for budget in found:
            if budget.id == gone[0]:
                await _wake(conn, budget, reason="deleted")
    return True


async def list_budgets(
    conn: AsyncConn,
    *,
    org: str | None = None,
    play: str | None = None,
    run_id: uuid.UUID | None = None,
    now: datetime | None = None,
) -> list[Budget]:
    """Budgets (of one org, play or run), with what each spent in its current period and
    what live reservations hold against it."""
    params = {"org": org, "play": play, "run_id": run_id, "now": now}
    async with conn.cursor(row_factory=class_row(Budget)) as cur:
        await cur.execute(q("budget_list"), params)
        return await cur.fetchall()


async def _one(conn: AsyncConn, budget_id: int, *, now: datetime | None) -> Budget:
    for budget in await list_budgets(conn, now=now):
        if budget.id == budget_id:
            return budget
    raise AssertionError(f"budget {budget_id} was written and is not there")


async def _wake(conn: AsyncConn, budget: Budget, *, reason: str) -> int:
    """Wake the runs paused on a budget of ``budget``'s org that it may have held back."""
    cur = await conn.execute(
        q("budget_wake"),
        {
            "org": budget.org,
            "play": budget.play if budget.scope == "play" else None,
            "run_id": budget.run_id,
            "reason": reason,
        },
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


# ---- a step's reservation -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one request to reserve a step's (or a page of row steps') estimate got."""

    granted: int  # how many of the keys, in their order, were reserved
    requested: int
    budgets: int  # how many budgets apply to the run (0: none, nothing to check)
    exhausted: bool  # the next key was refused by spending alone: pause the run
    wake_at: datetime | None  # when the budgets that refused it roll over (None: never)
    budget_id: int | None  # a budget that refused the next key
    epoch: int  # the org's budget epoch the decision was made at (for the pause)

    @property
    def complete(self) -> bool:
        return self.granted >= self.requested


async def reserve(
    conn: AsyncConn,
    *,
    fence: Fence,
    scope: str,
    keys: Sequence[str],
    estimate: Mapping[str, Decimal],
    now: datetime | None = None,
) -> Reservation:
    """Reserve ``estimate`` for each of ``keys`` (step keys of ``scope``: a run's own is
    ``run:<id>``) against every budget of the fenced attempt's run, as many keys as fit, in
    order; fenced (:class:`StaleAttempt` when the attempt no longer owns its run)."""
    keys = list(keys)
    params = {
        "scope": scope,
        "keys": keys,
        "units": list(estimate),
        "amounts": list(estimate.values()),
        "now": now,
        **fence.params(count=len(keys)),
    }
    cur = await conn.execute(q("budget_reserve"), params)
    row = await cur.fetchone()
    assert row is not None  # the statement always returns one row
    fenced, run_attempt, run_state, granted, budgets, exhausted, wake_at, budget_id, epoch = row[:9]
    if not fenced:
        raise refused(
            fence,
            verb="reserve the estimate of",
            subject=f"{len(keys)} step(s) (first {keys[0]!r})" if keys else "no step",
            run_attempt=run_attempt,
            run_state=run_state,
        )
    return Reservation(
        granted=int(granted),
        requested=len(keys),
        budgets=int(budgets),
        exhausted=bool(exhausted),
        wake_at=wake_at,
        budget_id=budget_id,
        epoch=int(epoch),
    )


def wait_event(epoch: int) -> str:
    """The wait event of a run paused on a budget refused at ``epoch``."""
    return f"{WAIT_PREFIX}{epoch}"


def paused_epoch(event: str | None) -> int | None:
    """The epoch of a budget pause's wait event, or None for any other event."""
    if event is None or not event.startswith(WAIT_PREFIX):
        return None
    tail = event[len(WAIT_PREFIX) :]
    return int(tail) if tail.isdigit() else None


async def pause(
    conn: AsyncConn, *, worker_id: str, finish_: Finish, org: str, epoch: int
) -> FinishStatus | None:
    """Write the suspension of a run refused by its budget at ``epoch``, unless a budget of
    its org was written since (then None: nothing written, hand the run back so it asks
    again). The org's epoch is read FOR SHARE until the suspension commits, so a budget
    write either comes first (and is seen here) or waits and then wakes the paused run."""
    async with conn.transaction():
        cur = await conn.execute(q("budget_epoch_share"), {"org": org})
        row = await cur.fetchone()
        if row is None or int(row[0]) != epoch:
            return None
        statuses = await runs.finish(conn, worker_id=worker_id, finishes=[finish_])
    return statuses[(finish_.run_id, finish_.attempt)]


async def sweep(conn: AsyncConn, *, batch: int = 100) -> int:
    """The recovery pass's part: delete a batch of reservations of attempts that ended."""
    async with conn.transaction():
        cur = await conn.execute(q("reservations_sweep"), {"batch": batch})
        row = await cur.fetchone()
    return int(row[0]) if row else 0


# ---- reads -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cost:
    """The sum of charges of one group (a dimension not grouped by is None)."""

    run_id: uuid.UUID | None
    org: str | None
    play: str | None
    provider: str | None
    day: date | None
    unit: str
    amount: Decimal
    charges: int  # how many charges were summed

    def as_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))


@dataclass(frozen=True, slots=True)
class ChargeRow:
    """One recorded charge."""

    id: int
    run_id: uuid.UUID
    attempt: int
    org: str
    play: str
    scope: str
    step_key: str
    outcome: str  # completed | failed: the step's receipt it was recorded with
    unit: str
    provider: str | None
    amount: Decimal
    charged_at: datetime

    def as_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))


async def costs(
    conn: AsyncConn,
    *,
    by: Sequence[str] = ("run",),
    run_id: uuid.UUID | None = None,
    org: str | None = None,
    play: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 1000,
) -> list[Cost]:
    """The sum of charges grouped by ``by`` (any of :data:`GROUPS`; always by unit), of one
    run, org or play, charged at or after ``since`` and before ``until``."""
    unknown = [g for g in by if g not in GROUPS]
    if unknown:
        raise InvalidField(
            f"cannot group costs by {unknown[0]!r}",
            field="by",
            rule=f"any of {', '.join(GROUPS)}",
            fix="group by run, org, play, provider or day",
        )
    params = {f"by_{g}": g in by for g in GROUPS} | {
        "run_id": run_id,
        "org": org,
        "play": play,
        "since": since,
        "until": until,
        "limit": limit,
    }
    async with conn.cursor(row_factory=class_row(Cost)) as cur:
        await cur.execute(q("costs_grouped"), params)
        return await cur.fetchall()


async def charges(
    conn: AsyncConn,
    *,
    run_id: uuid.UUID | None = None,
    org: str | None = None,
    play: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
) -> list[ChargeRow]:
    """The recorded charges, newest first (``worker runs show`` lists a run's)."""
    params = {"run_id": run_id, "org": org, "play": play, "since": since, "limit": limit}
    async with conn.cursor(row_factory=class_row(ChargeRow)) as cur:
        await cur.execute(q("charges_list"), params)
        return await cur.fetchall()


def number(value: Decimal) -> int | float:
    """An amount as a JSON number (an integer when it is one)."""
    return int(value) if value == value.to_integral_value() else float(value)


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    """A row as JSON-ready values: amounts as numbers, ids and times as text."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Decimal):
            out[key] = number(value)
        elif isinstance(value, uuid.UUID | datetime | date):
            out[key] = str(value) if isinstance(value, uuid.UUID) else value.isoformat()
        else:
            out[key] = value
    return out
