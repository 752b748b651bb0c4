"""Per-run options: what a submission (or a play's child run) may set for its own run.

A run may carry its own maximum of attempts, retry policy (``none``, ``fixed`` or
``exponential`` with base, factor, cap and jitter), run timeout, claim deadline and
metadata; whatever it leaves unset is its lane's policy. The rules of each value are the
field rules (:mod:`queues.fields`), so the CLI, the Python API and a play's ``ctx.spawn``
refuse the same things with the same messages.

Stored as columns of the run (``sql/migrations/0015_add_run_options.sql``), read by the
claim with ``coalesce(run, lane)``:

- **max attempts / retry**: the outcome policy (:mod:`queues.outcomes`) uses them for the
  run's failures and lapsed leases exactly as it uses a lane's;
- **run timeout**: counted from the run's first start, over every attempt, sleep and wait;
  past it the running attempt is stopped (its cleanup hooks run) and the run is
  ``failed`` with ``RUN_TIMED_OUT``, never retried. A sleep or a wait past it wakes the run
  at its deadline to fail it. A lane may have a default (``--run-timeout``);
- **start by** (the claim deadline): a run not started by then is ``failed`` with
  ``START_DEADLINE_PASSED`` by the claim that finds it late (its play never runs) or by the
  recovery pass when no worker claims it; only the first start counts (a retry is not
  late);
- **meta**: a small JSON object kept with the run (``worker runs show``, ``ctx.meta``);
- **budget**: the run's own budget (:mod:`queues.costs`), a limit in a unit over a period
  (``budget=50``: 50 credits, no period), written with the run by the same statement.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues import costs, fields
from queues.queries import q

TIMED_OUT = "RUN_TIMED_OUT"  # the error code of a run stopped at its timeout
START_DEADLINE_PASSED = "START_DEADLINE_PASSED"  # a run not started by its claim deadline


@dataclass(frozen=True, slots=True)
class RunOptions:
    """A run's own options, checked (None: the lane's)."""

    max_attempts: int | None = None
    retry: fields.Retry | None = None
    timeout_s: float | None = None
    start_by: datetime | None = None
    meta: dict[str, Any] | None = None
    budget: costs.RunBudget | None = None

    @classmethod
    def checked(
        cls,
        *,
        max_attempts: object = None,
        retry: object = None,
        timeout: object = None,
        start_by: object = None,
        meta: object = None,
        budget: object = None,
        now: datetime | None = None,
        names: Mapping[str, str] | None = None,
    ) -> RunOptions:
        """The options from raw values, each by its field rule; ``names`` renames the fields
        in refusals (the CLI's flags)."""
        name = {
            "max_attempts": "max_attempts",
            "retry": "retry",
            "timeout": "timeout",
            "start_by": "start_by",
            "meta": "meta",
            "budget": "budget",
        } | dict(names or {})
        return cls(
            max_attempts=None
            if max_attempts is None
            else fields.max_attempts(max_attempts, field=name["max_attempts"]),
            retry=None if retry is None else fields.retry(retry, field=name["retry"]),
            timeout_s=None
            if timeout is None
            else fields.run_timeout(timeout, field=name["timeout"]),
            start_by=None
            if start_by is None
            else fields.start_by(start_by, field=name["start_by"], now=now),
            meta=None if meta is None else fields.meta(meta, field=name["meta"]),
            budget=None
            if budget is None
            else costs.RunBudget.checked(budget, field=name["budget"]),
        )

    @property
    def empty(self) -> bool:
        return self == RunOptions()

    def as_json(self) -> dict[str, Any]:
        """The options document ``wq_submit_with_options`` takes (only what is set)."""
        doc: dict[str, Any] = {}
        if self.max_attempts is not None:
            doc["max_attempts"] = self.max_attempts
        if self.retry is not None:
            doc["retry"] = self.retry.as_json()
        if self.timeout_s is not None:
            doc["timeout_s"] = self.timeout_s
        if self.start_by is not None:
            doc["start_by"] = self.start_by.isoformat()
        if self.meta is not None:
            doc["meta"] = self.meta
        if self.budget is not None:
            doc["budget"] = self.budget.as_json()
        return doc

    def columns(self) -> dict[str, Any]:
        """The run's option columns, for a statement that inserts the run itself (a child)."""
        retry = self.retry
        return {
            "max_attempts": self.max_attempts,
            "retry_kind": retry.kind if retry else None,
            "retry_base_s": retry.base_s if retry else None,
            "retry_factor": retry.factor if retry else None,
            "retry_cap_s": retry.cap_s if retry else None,
            "retry_jitter": retry.jitter if retry else None,
            "timeout_s": self.timeout_s,
            "start_by": self.start_by,
        }


@dataclass(frozen=True, slots=True)
class Shown:
    """A run's own options as ``worker runs show`` prints them (None: its lane's)."""

    max_attempts: int | None
    retry_kind: str | None
    retry_base_s: float | None
    retry_factor: float | None
    retry_cap_s: float | None
    retry_jitter: float | None
    timeout_s: float | None
    start_by: datetime | None
    meta: dict[str, Any] | None
    parent_id: uuid.UUID | None
    children: int

    @property
    def retry(self) -> fields.Retry | None:
        if self.retry_kind is None:
            return None
        return fields.Retry(
            kind=self.retry_kind,
            base_s=self.retry_base_s or 0.0,
            factor=self.retry_factor or 1.0,
            cap_s=self.retry_cap_s or 0.0,
            jitter=self.retry_jitter or 0.0,
        )

    def as_dict(self) -> dict[str, Any]:
        retry = self.retry
        return {
            "max_attempts": self.max_attempts,
            "retry": str(retry) if retry else None,
            "timeout_s": self.timeout_s,
            "start_by": self.start_by,
            "meta": self.meta,
            "parent_id": str(self.parent_id) if self.parent_id else None,
            "children": self.children,
        }


async def shown(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> Shown | None:
    """A run's own options, metadata, parent and number of children (None: no such run)."""
    async with conn.cursor(row_factory=class_row(Shown)) as cur:
        await cur.execute(q("run_options_get"), {"run_id": run_id})
        return await cur.fetchone()


async def expire_unstarted(
    conn: psycopg.AsyncConnection[Any], *, now: datetime | None = None, batch: int = 100
) -> list[uuid.UUID]:
    """The recovery pass's part for claim deadlines: fail a batch of runs never started by
    their ``start_by`` (``START_DEADLINE_PASSED``), whether or not a worker serves them."""
    async with conn.transaction():
        cur = await conn.execute(q("options_expire_unstarted"), {"now": now, "batch": batch})
        return [row[0] for row in await cur.fetchall()]
