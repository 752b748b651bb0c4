"""Lanes: the release queues runs are spawned on, their registry and policies.

A lane is named from its release (``r-<release>``) and its name reaches SQL only as a
parameter. Preparing writes registry rows only, never DDL; it is idempotent and safe to
race, and it never changes an existing lane's state.

States mean what they say. Admitting and serving are separate: a ``draining`` or
``reclaimed`` lane admits nothing, whoever asks, and only an operator's explicit
:func:`reopen` opens it again (never lazy preparation, never a worker's start, never
recovery). Workers of the release still serve the runs a closed lane holds, and recovery
still spawns their retries and wakes there. Drain and reclaim take the lane row
``FOR UPDATE``, which waits for every in-flight admission (each holds the row ``FOR
SHARE`` until it commits): so neither can slip between an admission's lane check and its
job insert.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues import fields, migrations
from queues.errors import (
    InvalidField,
    LaneBusy,
    LaneDraining,
    LaneError,
    LaneNotPrepared,
    LaneReclaimed,
    translate,
)
from queues.queries import q

LANE_PREFIX = "r-"
# The lane is part of its NOTIFY channel's name, so a lane name fits transport.LANE_MAX:
# 2 (prefix) + 38 = 40 (tests/db/test_transport_seam.py checks it).
RELEASE_MAX = fields.MAX_RELEASE
# A worker that stopped heartbeating (without stopping) is reported stale this long; an
# older one is history (a supervisor restarts a killed worker under a new id).
STALE_HORIZON_S = 3600.0


class LaneState(StrEnum):
    PREPARED = "prepared"  # accepts admissions; its workers consume it
    DRAINING = "draining"  # accepts no new runs; its workers finish what it has
    RECLAIMED = "reclaimed"  # retired; admission fails; historic runs are still served


@dataclass(frozen=True, slots=True)
class Lane:
    name: str
    release: str
    state: str
    concurrency: int
    lease_ttl_s: float
    heartbeat_s: float
    retry_max_attempts: int
    retry_base_s: float
    retry_cap_s: float
    retry_jitter: float
    max_interruptions: int
    retention_s: float
    prepared_at: datetime
    updated_at: datetime
    run_timeout_s: float = 0.0  # runs' default timeout (0: none); a run's own overrides it
    org_concurrency: int = 0  # running runs per org on the lane (0: no cap)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy.of(self)


@dataclass(frozen=True, slots=True)
class LaneSummary:
    name: str
    release: str
    state: str
    unfinished: int
    live_workers: int  # heartbeat within 3 of the lane's heartbeat intervals (<= lease TTL)
    stale_workers: int  # stopped heartbeating without stopping, within STALE_HORIZON_S
    stale_since: datetime | None  # the latest heartbeat of a stale worker
    prepared_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Backoff with a cap and jitter, and a maximum of failed attempts. A lane's policy is
    exponential with factor 2: base * 2^(attempt-1), capped, +-jitter. A run may carry its
    own (:class:`~queues.fields.Retry`): ``fixed`` (base every time), another factor, or
    ``none`` (the first failure is final)."""

    max_attempts: int = 5
    base_s: float = 2.0
    cap_s: float = 300.0
    jitter: float = 0.1
    kind: str = "exponential"  # none | fixed | exponential
    factor: float = 2.0

    def delay(self, attempt: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait before the attempt after ``attempt`` (1-based) failed."""
        if self.kind == "fixed":
            raw = self.base_s
        else:
            raw = min(self.cap_s, self.base_s * self.factor ** max(0, attempt - 1))
        if self.jitter <= 0 or raw <= 0:
            return raw
        spread = raw * self.jitter
        return max(0.0, raw + (rng or random).uniform(-spread, spread))

    def exhausted(self, attempt: int) -> bool:
        return self.kind == "none" or attempt >= self.max_attempts

    @classmethod
    def of(cls, row: Any) -> RetryPolicy:
        """The policy held in a row's ``retry_*`` columns (a lane, or a row joined to one:
        a claim reads a run's own values over its lane's, ``retry_kind`` and
        ``retry_factor`` are a run's only)."""
        return cls(
            max_attempts=row.retry_max_attempts or 1,
            base_s=row.retry_base_s or 0.0,
            cap_s=row.retry_cap_s or 0.0,
            jitter=row.retry_jitter or 0.0,
            kind=getattr(row, "retry_kind", None) or "exponential",
            factor=getattr(row, "retry_factor", None) or 2.0,
        )


def validate_release(release: object, *, field: str = "release") -> fields.Release:
    """The release as a checked :class:`~queues.fields.Release` (free when it is one)."""
    return fields.Release(release, field=field)


def lane_name(release: str) -> str:
    """The lane (procrastinate queue) of a release."""
    return LANE_PREFIX + validate_release(release)


def release_of(lane: str) -> str:
    if not lane.startswith(LANE_PREFIX):
        raise InvalidField(
            f"{lane!r} is not a lane name",
            field="lane",
            rule=f"lanes are named {LANE_PREFIX}<release>",
            fix="pass the release instead",
        )
    return validate_release(lane[len(LANE_PREFIX) :], field="lane")


async def prepare(conn: psycopg.AsyncConnection[Any], release: str, *, own: bool = True) -> Lane:
    """Create the lane of ``release`` if it has none; idempotent (registry rows only).

    An existing lane keeps its state: a draining or reclaimed lane stays closed to
    admissions (a restarting worker still serves it). Only :func:`reopen` opens it.

    The lane records this code's schema (the schema window): ``own`` says this code is the
    release's own (its worker, its app's admission), whose newer schema it raises;
    otherwise (an adopted lane, an adoption's target) an existing lane keeps its schema.
    Below the database's floor, preparing is refused (``SchemaWindowClosed``, raised by the
    database).
    """
    name = lane_name(release)
    params = {
        "name": name,
        "release": release,
        "schema_version": migrations.code_schema().version,
        "bump": own,
    }
    async with conn.cursor(row_factory=class_row(Lane)) as cur:
        try:
            await cur.execute(q("lane_prepare"), params)
        except psycopg.Error as exc:
            mapped = translate(exc)
            if mapped is None:
                raise
            raise mapped from exc
        lane = await cur.fetchone()
        if lane is None:  # already prepared: the upsert's WHERE left it untouched
            await cur.execute(q("lane_get"), {"name": name})
            lane = await cur.fetchone()
    assert lane is not None
    return lane


async def get(conn: psycopg.AsyncConnection[Any], name: str) -> Lane | None:
    async with conn.cursor(row_factory=class_row(Lane)) as cur:
        await cur.execute(q("lane_get"), {"name": name})
        return await cur.fetchone()


async def list_lanes(
    conn: psycopg.AsyncConnection[Any], *, now: datetime | None = None
) -> list[LaneSummary]:
    """Every lane, with its live workers (a fresh heartbeat) and its stale ones."""
    async with conn.cursor(row_factory=class_row(LaneSummary)) as cur:
        await cur.execute(q("lane_list"), {"now": now, "stale_horizon_s": STALE_HORIZON_S})
        return await cur.fetchall()


async def set_policy(
    conn: psycopg.AsyncConnection[Any],
    release: str,
    *,
    concurrency: int | None = None,
    lease_ttl_s: float | None = None,
    heartbeat_s: float | None = None,
    retry_max_attempts: int | None = None,
    retry_base_s: float | None = None,
    retry_cap_s: float | None = None,
    retry_jitter: float | None = None,
    max_interruptions: int | None = None,
    retention_s: float | None = None,
    run_timeout_s: float | None = None,
    org_concurrency: int | None = None,
) -> Lane:
    name = lane_name(release)
    params = {
        "name": name,
        "concurrency": concurrency,
        "lease_ttl_s": lease_ttl_s,
        "heartbeat_s": heartbeat_s,
        "retry_max_attempts": retry_max_attempts,
        "retry_base_s": retry_base_s,
        "retry_cap_s": retry_cap_s,
        "retry_jitter": retry_jitter,
        "max_interruptions": max_interruptions,
        "retention_s": retention_s,
        "run_timeout_s": run_timeout_s,
        "org_concurrency": org_concurrency,
    }
    try:
        async with conn.transaction(), conn.cursor(row_factory=class_row(Lane)) as cur:
            await cur.execute(q("lane_set_policy"), params)
            lane = await cur.fetchone()
    except psycopg.errors.CheckViolation as exc:
        raise InvalidField(
            f"lane policy refused: {exc.diag.constraint_name or exc}",
            field="policy",
            rule="positive concurrency and TTL; heartbeat below the lease TTL; jitter in 0..1",
            fix="pass values that satisfy the rule",
        ) from exc
    if lane is None:
        raise not_prepared(release)
    return lane


def not_prepared(release: str) -> LaneNotPrepared:
    name = LANE_PREFIX + release
    return LaneNotPrepared(
        f"lane {name!r} of release {release!r} does not exist: nothing was written",
        fix=(
            f"start a worker of that release (`worker start --release {release}`), which "
            f"prepares its lane, or run `worker queues prepare {release}`; then retry"
        ),
    )


def closed(release: str, state: str) -> LaneError:
    """The refusal of an admission (or an adoption) to a lane that exists but is closed."""
    name = LANE_PREFIX + release
    reopen_fix = (
        "submit with the current release; if this release must take new runs again, an "
        f"operator reopens its lane with `worker queues reopen {release}`"
    )
    if state == LaneState.DRAINING:
        return LaneDraining(
            f"lane {name!r} of release {release!r} is draining (it takes no new runs while "
            "its workers finish the ones it has): nothing was written",
            fix=reopen_fix,
        )
    if state == LaneState.RECLAIMED:
        return LaneReclaimed(
            f"lane {name!r} of release {release!r} was reclaimed: nothing was written",
            fix=reopen_fix,
        )
    return not_prepared(release)


async def reopen(conn: psycopg.AsyncConnection[Any], release: str) -> Lane:
    """An operator's explicit reopening of a draining or reclaimed lane to admissions."""
    name = lane_name(release)
    async with conn.transaction():
        cur = await conn.execute(q("lane_lock_for_reclaim"), {"name": name})
        if await cur.fetchone() is None:
            raise not_prepared(release)
        async with conn.cursor(row_factory=class_row(Lane)) as lanes_cur:
            await lanes_cur.execute(q("lane_reopen"), {"name": name})
            lane = await lanes_cur.fetchone()
    assert lane is not None
    return lane


@dataclass(frozen=True, slots=True)
class ReclaimReport:
    lane: str
    unfinished: int  # runs left on the lane (only with force): historic, still served
    was: str


async def reclaim(
    conn: psycopg.AsyncConnection[Any], release: str, *, force: bool = False
) -> ReclaimReport:
    """Retire a lane: it admits nothing until an operator reopens it. Refuses while it
    has unfinished runs unless ``force``.

    The lane row is taken FOR UPDATE (waits for admissions holding it FOR SHARE). With
    ``force``, the runs left on the lane stay where they are: a worker of the release
    still serves them (their retries and wakes are spawned on the lane as before), and
    without one the recovery pass reports them stranded until an operator adopts them.
    """
    name = lane_name(release)
    async with conn.transaction():
        cur = await conn.execute(q("lane_lock_for_reclaim"), {"name": name})
        row = await cur.fetchone()
        if row is None:
            raise not_prepared(release)
        _, state = row
        cur = await conn.execute(q("lane_unfinished"), {"name": name})
        counted = await cur.fetchone()
        unfinished = int(counted[0]) if counted else 0
        if unfinished and not force:
            raise LaneBusy(
                f"lane {name!r} has {unfinished} unfinished run(s); reclaim refused",
                fix=(
                    "wait for them to finish (`worker queues list`), move them with "
                    "`worker queues adopt`, or pass --force"
                ),
            )
        await conn.execute(q("lane_set_state"), {"name": name, "state": "reclaimed"})
    return ReclaimReport(lane=name, unfinished=int(unfinished), was=state)


async def drain(conn: psycopg.AsyncConnection[Any], release: str) -> Lane:
    """Stop admissions to a lane while its workers finish what it has."""
    name = lane_name(release)
    async with conn.transaction():
        cur = await conn.execute(q("lane_lock_for_reclaim"), {"name": name})
        if await cur.fetchone() is None:
            raise not_prepared(release)
        await conn.execute(q("lane_set_state"), {"name": name, "state": "draining"})
    lane = await get(conn, name)
    assert lane is not None
    return lane
