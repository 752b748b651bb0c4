"""What the dashboard reads: runs with filters, one run in full, lanes, throughput.

Pure, read-only functions over a connection (the dashboard gives them the reader role's);
every read is bounded. The page rendering lives in :mod:`worker.dashboard`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues import costs, ledger, metrics, operator, recovery, runs, totals
from queues.lanes import Lane
from queues.queries import q
from queues.receipts import Scope

RUNS_LIMIT = 100
EVENTS_LIMIT = 500
STEPS_LIMIT = 25
STRANDED_LIMIT = 50


@dataclass(frozen=True, slots=True)
class RunRow:
    id: uuid.UUID
    org: str
    play: str
    release: str
    lane: str
    idempotency_key: str | None
    state: str
    attempt: int
    input_rows: int
    rows_admitted: int
    rows_done: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error_type: str | None
    error_message: str | None

    @property
    def rows_total(self) -> int:
        return max(self.input_rows, self.rows_admitted)


@dataclass(frozen=True, slots=True)
class RunFilter:
    state: str | None = None
    play: str | None = None
    release: str | None = None
    org: str | None = None
    since: datetime | None = None
    search: str | None = None  # a run id or an idempotency key
    limit: int = RUNS_LIMIT


async def list_runs(conn: psycopg.AsyncConnection[Any], f: RunFilter) -> list[RunRow]:
    search_id: uuid.UUID | None = None
    search_key: str | None = None
    if f.search:
        text = f.search.strip()
        try:
            search_id = uuid.UUID(text)
        except ValueError:
            search_id = None
        search_key = text
    async with conn.cursor(row_factory=class_row(RunRow)) as cur:
        await cur.execute(
            q("dashboard_runs"),
            {
                "state": f.state,
                "play": f.play,
                "release": f.release,
                "org": f.org,
                "since": f.since,
                "search_id": search_id,
                "search_key": search_key,
                "limit": f.limit,
            },
        )
        return await cur.fetchall()


@dataclass(frozen=True, slots=True)
class SheetProgress:
    sheet: str | None
    admitted: int
    readmitted: int
    committed: int
    replayed: int
    failed: int
    stale: dict[str, int]


@dataclass(frozen=True, slots=True)
class Step:
    step_key: str
    status: str
    owner_attempt: int | None
    created_at: datetime
    completed_at: datetime | None
    error: Any


@dataclass(frozen=True, slots=True)
class AttemptView:
    attempt: runs.Attempt

    @property
    def duration_s(self) -> float | None:
        a = self.attempt
        return (a.finished_at - a.started_at).total_seconds() if a.finished_at else None

    @property
    def traceback(self) -> str | None:
        error = self.attempt.error
        value = error.get("traceback") if isinstance(error, dict) else None
        return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class RunDetail:
    run: runs.Run
    attempts: list[AttemptView]
    events: list[runs.Event]
    events_total: int
    progress: tuple[int, int]  # (rows done, rows in all), from the progress projection
    projection: ledger.Progress | None
    sheets: list[SheetProgress]
    steps: list[Step]
    step_counts: dict[str, int]
    spent: list[costs.Cost]  # the run's charges per provider and unit

    @property
    def traceback(self) -> str | None:
        """The run's error traceback, else the latest failed attempt's."""
        error = self.run.error
        value = error.get("traceback") if isinstance(error, dict) else None
        if isinstance(value, str):
            return value
        for view in reversed(self.attempts):
            if view.traceback:
                return view.traceback
        return None


async def run_detail(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> RunDetail:
    """One run in full (raises RunNotFound for an unknown id)."""
    run = await runs.get(conn, run_id)
    tries = await runs.attempts(conn, run_id)
    async with conn.cursor(row_factory=class_row(runs.Event)) as cur:
        await cur.execute(q("dashboard_events_tail"), {"run_id": run_id, "limit": EVENTS_LIMIT})
        events = await cur.fetchall()
    async with conn.cursor(row_factory=class_row(SheetProgress)) as cur:
        await cur.execute(q("dashboard_sheet_progress"), {"run_id": run_id})
        sheets = await cur.fetchall()
    scope = {"org": run.org, "play": run.play, "scope": str(Scope.of_run(run_id))}
    async with conn.cursor(row_factory=class_row(Step)) as cur:
        await cur.execute(q("dashboard_steps"), scope | {"limit": STEPS_LIMIT})
        steps = await cur.fetchall()
    cur2 = await conn.execute(q("dashboard_step_counts"), scope)
    counts = {str(status): int(n) for status, n in await cur2.fetchall()}
    return RunDetail(
        run=run,
        attempts=[AttemptView(a) for a in tries],
        events=events,
        events_total=events[-1].seq if events else 0,
        progress=await ledger.progress_counts(conn, run),
        projection=await ledger.progress(conn, run_id),
        sheets=sheets,
        steps=steps,
        step_counts=counts,
        spent=await costs.costs(conn, by=("provider",), run_id=run_id),
    )


@dataclass(frozen=True, slots=True)
class StrandedRun:
    id: uuid.UUID
    lane: str
    play: str
    state: str
    created_at: datetime
    available_at: datetime | None


@dataclass(frozen=True, slots=True)
class LanesView:
    lanes: list[Lane]
    numbers: dict[str, metrics.LaneMetrics]
    stranded: list[recovery.StrandedLane]
    stranded_runs: list[StrandedRun]
    actions: list[operator.Action]


async def lanes_view(conn: psycopg.AsyncConnection[Any]) -> LanesView:
    async with conn.cursor(row_factory=class_row(Lane)) as cur:
        await cur.execute(q("dashboard_lanes"))
        found = await cur.fetchall()
    measured = await metrics.collect(conn)
    stranded_runs: list[StrandedRun] = []
    if measured.stranded:
        async with conn.cursor(row_factory=class_row(StrandedRun)) as cur:
            await cur.execute(
                q("dashboard_stranded_runs"),
                {"lanes": [s.lane for s in measured.stranded], "limit": STRANDED_LIMIT},
            )
            stranded_runs = await cur.fetchall()
    return LanesView(
        lanes=found,
        numbers={m.lane: m for m in measured.lanes},
        stranded=measured.stranded,
        stranded_runs=stranded_runs,
        actions=await operator.recent_actions(conn, limit=20),
    )


@dataclass(frozen=True, slots=True)
class Minute:
    minute: datetime
    succeeded: int
    failed: int
    finished: int


@dataclass(frozen=True, slots=True)
class StatsView:
    metrics: metrics.Metrics
    totals: totals.Totals
    minutes: list[Minute] = field(default_factory=list)  # one per minute, oldest first


async def stats_view(
    conn: psycopg.AsyncConnection[Any], *, minutes: int = 60, now: datetime | None = None
) -> StatsView:
    """The numbers of ``worker metrics`` (over the last hour), the totals behind
    ``/metrics``, and per-minute throughput and failures over the last ``minutes``."""
    measured = await metrics.collect(conn, window_s=minutes * 60.0, now=now)
    found = await totals.read(conn, now=now)
    async with conn.cursor(row_factory=class_row(Minute)) as cur:
        await cur.execute(q("dashboard_throughput"), {"minutes": minutes, "now": now})
        rows = {m.minute: m for m in await cur.fetchall()}
    cur2 = await conn.execute(q("dashboard_now_minute"), {"now": now})
    row = await cur2.fetchone()
    assert row is not None
    last: datetime = row[0]
    series = []
    for back in range(minutes - 1, -1, -1):
        at = last - timedelta(minutes=back)
        series.append(rows.get(at, Minute(at, 0, 0, 0)))
    return StatsView(metrics=measured, totals=found, minutes=series)


async def releases(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    cur = await conn.execute(q("dashboard_releases"))
    return [str(r[0]) for r in await cur.fetchall()]


# ---- costs --------------------------------------------------------------------------------

COSTS_DAYS = 30
COSTS_SERIES = 6  # the orgs or providers charted apart; the rest are summed as "other"


@dataclass(frozen=True, slots=True)
class Series:
    """Spend per UTC day of one org or provider (or "other"), in one unit."""

    name: str
    total: Decimal
    by_day: dict[date, Decimal]


@dataclass(frozen=True, slots=True)
class CostsView:
    unit: str | None  # the unit charted (None: nothing charged yet)
    units: list[str]  # every unit charged in the window
    days: list[date]  # the window's UTC days, oldest first
    by_org: list[Series]
    by_provider: list[Series]
    totals: list[costs.Cost]  # per org and unit over the window
    budgets: list[costs.Budget]


async def costs_view(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str | None = None,
    unit: str | None = None,
    days: int = COSTS_DAYS,
    now: datetime | None = None,
) -> CostsView:
    """Spend per day over the last ``days`` UTC days, per org and per provider, in one unit
    (the asked one, else the one with the most spent), with the budgets and their use."""
    today = (now or datetime.now(UTC)).astimezone(UTC).date()
    first = today - timedelta(days=days - 1)
    since = datetime.combine(first, time(), tzinfo=UTC)
    window = [first + timedelta(days=i) for i in range(days)]
    per_org = await costs.costs(conn, by=("day", "org"), org=org, since=since, limit=100000)
    per_provider = await costs.costs(
        conn, by=("day", "provider"), org=org, since=since, limit=100000
    )
    spent: dict[str, Decimal] = {}
    for c in per_org:
        spent[c.unit] = spent.get(c.unit, Decimal(0)) + c.amount
    units = sorted(spent, key=lambda u: (-spent[u], u))
    chosen = unit if unit in spent else (units[0] if units else None)
    # Each org's totals over the window, summed from its days (no second read).
    summed: dict[tuple[str | None, str], tuple[Decimal, int]] = {}
    for c in per_org:
        amount, charges = summed.get((c.org, c.unit), (Decimal(0), 0))
        summed[(c.org, c.unit)] = (amount + c.amount, charges + c.charges)
    totals_ = [
        costs.Cost(None, o, None, None, None, u, amount, n)
        for (o, u), (amount, n) in sorted(summed.items(), key=lambda kv: (kv[0][0] or "", kv[0][1]))
    ]
    return CostsView(
        unit=chosen,
        units=units,
        days=window,
        by_org=_series([(c.org or "", c) for c in per_org if c.unit == chosen]),
        by_provider=_series(
            [(c.provider or "(none)", c) for c in per_provider if c.unit == chosen]
        ),
        totals=totals_,
        budgets=await costs.list_budgets(conn, org=org, now=now),
    )


def _series(rows: list[tuple[str, costs.Cost]]) -> list[Series]:
    """The biggest :data:`COSTS_SERIES` names apart, biggest first, the rest as "other"."""
    by_name: dict[str, dict[date, Decimal]] = {}
    for name, c in rows:
        assert c.day is not None
        days = by_name.setdefault(name, {})
        days[c.day] = days.get(c.day, Decimal(0)) + c.amount
    ranked = sorted(by_name.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    found = [Series(name, sum(d.values(), Decimal(0)), d) for name, d in ranked[:COSTS_SERIES]]
    rest: dict[date, Decimal] = {}
    for _, d in ranked[COSTS_SERIES:]:
        for day, value in d.items():
            rest[day] = rest.get(day, Decimal(0)) + value
    if rest:
        found.append(Series("other", sum(rest.values(), Decimal(0)), rest))
    return found
