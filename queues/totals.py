"""Monotonic totals of what the queue did, for Prometheus counters.

Read from the tables, not counted in a process, so every worker, recovery process or
dashboard exposes the same cluster-wide numbers and none is lost on a restart: runs
admitted, attempts by outcome (lease rescues are ``lease_expired``, interruptions
``interrupted``), rows completed, and writes the fence refused by kind. Retention deletes
rows, so each total adds what retention removed (``wq_metric_tallies``, kept by triggers in
the deleting statement): a total never goes down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

import psycopg

from queues.queries import q


@dataclass(frozen=True, slots=True)
class Totals:
    runs_admitted: int = 0
    rows_completed: int = 0
    attempts: dict[str, int] = field(default_factory=dict)  # by outcome
    refusals: dict[str, int] = field(default_factory=dict)  # refused writes by kind
    refused_rows: dict[str, int] = field(default_factory=dict)  # rows they carried, by kind
    live_workers: int = 0
    # Charges recorded, by (org, play, provider or '', unit) (queues.costs)
    charged: dict[tuple[str, str, str, str], Decimal] = field(default_factory=dict)

    @property
    def lease_rescues(self) -> int:
        return self.attempts.get("lease_expired", 0)

    @property
    def interruptions(self) -> int:
        return self.attempts.get("interrupted", 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "runs_admitted": self.runs_admitted,
            "rows_completed": self.rows_completed,
            "attempts": dict(self.attempts),
            "lease_rescues": self.lease_rescues,
            "interruptions": self.interruptions,
            "refused_writes": dict(self.refusals),
            "refused_rows": dict(self.refused_rows),
            "live_workers": self.live_workers,
            "charged": [
                {"org": o, "play": p, "provider": pr or None, "unit": u, "amount": float(a)}
                for (o, p, pr, u), a in sorted(self.charged.items())
            ],
        }


async def read(conn: psycopg.AsyncConnection[Any], *, now: datetime | None = None) -> Totals:
    """Every total in three read-only statements."""
    cur = await conn.execute(q("metrics_totals"))
    by_metric: dict[str, dict[str, int]] = {}
    for metric, label, value in await cur.fetchall():
        by_metric.setdefault(str(metric), {})[str(label)] = int(value)
    cur = await conn.execute(q("metrics_live_workers"), {"now": now})
    row = await cur.fetchone()
    cur = await conn.execute(q("metrics_charged"))
    charged = {(str(o), str(p), str(pr), str(u)): a for o, p, pr, u, a in await cur.fetchall()}
    return Totals(
        runs_admitted=by_metric.get("runs_admitted", {}).get("", 0),
        rows_completed=by_metric.get("rows_completed", {}).get("", 0),
        attempts=by_metric.get("attempts", {}),
        refusals=by_metric.get("refusals", {}),
        refused_rows=by_metric.get("refused_rows", {}),
        live_workers=int(row[0]) if row else 0,
        charged=charged,
    )
