"""Operational metrics, read from the tables (no counters to lose on a restart).

Queue depth and oldest due wait per lane, live workers, and over a time window the lease
rescues, stale writes refused, failures and hand-backs; stranded lanes come from the
recovery pass's own query. Rendered as JSON or Prometheus text by the CLI.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues import recovery
from queues.queries import q

DEFAULT_WINDOW_S = 3600.0


@dataclass(frozen=True, slots=True)
class LaneMetrics:
    lane: str
    lane_state: str
    queued: int
    running: int
    sleeping: int
    budget_paused: int  # sleeping runs paused with BUDGET_EXHAUSTED (queues.costs)
    due_jobs: int
    live_workers: int
    oldest_due_wait_s: float


@dataclass(frozen=True, slots=True)
class AttemptMetrics:
    lease_rescues: int
    stale_writes_refused: int
    failed_attempts: int
    succeeded_attempts: int
    handed_back: int
    interrupted_attempts: int


@dataclass(frozen=True, slots=True)
class Refusals:
    """Writes of closed or superseded attempts that the fence refused, of one kind."""

    kind: str  # receipt | admission | rows | emit | final
    writes: int
    rows: int


@dataclass(frozen=True, slots=True)
class Metrics:
    window_s: float
    lanes: list[LaneMetrics]
    attempts: AttemptMetrics
    refusals: list[Refusals]
    stranded: list[recovery.StrandedLane]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def collect(
    conn: psycopg.AsyncConnection[Any],
    *,
    window_s: float = DEFAULT_WINDOW_S,
    now: datetime | None = None,
) -> Metrics:
    """Read every metric in a few bounded, read-only statements."""
    async with conn.cursor(row_factory=class_row(LaneMetrics)) as cur:
        await cur.execute(q("metrics_lanes"), {"now": now})
        lanes = await cur.fetchall()
    async with conn.cursor(row_factory=class_row(AttemptMetrics)) as cur:
        await cur.execute(q("metrics_attempts"), {"now": now, "window_s": window_s})
        attempts = await cur.fetchone()
    assert attempts is not None
    async with conn.cursor(row_factory=class_row(Refusals)) as cur:
        await cur.execute(q("metrics_refusals"), {"now": now, "window_s": window_s})
        refusals = await cur.fetchall()
    stranded = await recovery.find_stranded(conn, now=now)
    return Metrics(
        window_s=window_s, lanes=lanes, attempts=attempts, refusals=refusals, stranded=stranded
    )
