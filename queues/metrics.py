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


@dataclass(frozen=True, slots=True)
class Metrics:
    window_s: float
    lanes: list[LaneMetrics]
    attempts: AttemptMetrics
    stranded: list[recovery.StrandedLane]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def prometheus(self) -> str:
        """The Prometheus text exposition format."""
        lines = []
        gauges = ("queued", "running", "sleeping", "due_jobs", "live_workers")
        for name in gauges:
            lines.append(f"# TYPE wq_lane_{name} gauge")
            lines.extend(
                f'wq_lane_{name}{{lane="{m.lane}"}} {getattr(m, name)}' for m in self.lanes
            )
        lines.append("# TYPE wq_lane_oldest_due_wait_seconds gauge")
        lines.extend(
            f'wq_lane_oldest_due_wait_seconds{{lane="{m.lane}"}} {m.oldest_due_wait_s:.3f}'
            for m in self.lanes
        )
        for name, value in asdict(self.attempts).items():
            lines.append(f"# TYPE wq_{name}_window gauge")
            lines.append(f'wq_{name}_window{{window_s="{self.window_s:g}"}} {value}')
        lines.append("# TYPE wq_stranded_runs gauge")
        lines.extend(f'wq_stranded_runs{{lane="{s.lane}"}} {s.runs}' for s in self.stranded)
        return "\n".join(lines) + "\n"


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
    stranded = await recovery.find_stranded(conn, now=now)
    return Metrics(window_s=window_s, lanes=lanes, attempts=attempts, stranded=stranded)
