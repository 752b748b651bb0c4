"""Lanes: the release queues runs are spawned on, their registry and policies.

A lane is named from its release (``r-<release>``) and its name reaches SQL only as a
parameter. Preparing writes registry rows only, never DDL; it is idempotent and safe to
race. Reclaim retires a drained lane and takes the lane row ``FOR UPDATE``, which waits for
every in-flight admission (each holds the row ``FOR SHARE`` until it commits): so a reclaim
can never slip between an admission's lane check and its job insert.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues.errors import InvalidField, LaneBusy, LaneNotPrepared
from queues.queries import q

LANE_PREFIX = "r-"
# procrastinate's LISTEN channel is "procrastinate_queue_v1#<lane>" and a channel name is
# at most 63 bytes: 23 + 2 (prefix) + 38 = 63.
RELEASE_MAX = 38
_RELEASE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class LaneState(StrEnum):
    PREPARED = "prepared"  # accepts admissions; its workers consume it
    DRAINING = "draining"  # accepts no new runs; its workers finish what it has
    RECLAIMED = "reclaimed"  # retired; admission fails, recovery may re-prepare


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
    retention_s: float
    prepared_at: datetime
    updated_at: datetime

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy.of(self)


@dataclass(frozen=True, slots=True)
class LaneSummary:
    name: str
    release: str
    state: str
    unfinished: int
    live_workers: int
    prepared_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with a cap and jitter: base * 2^(attempt-1), capped, +-jitter."""

    max_attempts: int = 5
    base_s: float = 2.0
    cap_s: float = 300.0
    jitter: float = 0.1

    def delay(self, attempt: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait before the attempt after ``attempt`` (1-based) failed."""
        raw = min(self.cap_s, self.base_s * 2.0 ** max(0, attempt - 1))
        if self.jitter <= 0 or raw <= 0:
            return raw
        spread = raw * self.jitter
        return max(0.0, raw + (rng or random).uniform(-spread, spread))

    def exhausted(self, attempt: int) -> bool:
        return attempt >= self.max_attempts

    @classmethod
    def of(cls, row: Any) -> RetryPolicy:
        """The policy held in a row's ``retry_*`` columns (a lane, or a row joined to one)."""
        return cls(
            max_attempts=row.retry_max_attempts or 1,
            base_s=row.retry_base_s or 0.0,
            cap_s=row.retry_cap_s or 0.0,
            jitter=row.retry_jitter or 0.0,
        )


def validate_release(release: str, *, field: str = "release") -> str:
    if not isinstance(release, str) or not release:
        raise InvalidField(
            "the release is empty",
            field=field,
            rule="a short identifier: letters, digits, '.', '_' or '-'",
            fix="pass --release (e.g. a short git sha or v42) or set WORKER_RELEASE",
        )
    if len(release) > RELEASE_MAX or not _RELEASE.match(release):
        shown = release if len(release) <= 60 else release[:57] + "..."
        raise InvalidField(
            f"invalid release name {shown!r}",
            field=field,
            rule=(
                f"1 to {RELEASE_MAX} characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            ),
            fix="use a short git sha (12 characters) or a version like v42",
        )
    return release


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


async def prepare(conn: psycopg.AsyncConnection[Any], release: str) -> Lane:
    """Create the lane of ``release`` or re-prepare a reclaimed one; idempotent (registry
    rows only). A draining lane stays draining: a restarting worker must not re-open it."""
    name = lane_name(release)
    async with conn.cursor(row_factory=class_row(Lane)) as cur:
        await cur.execute(q("lane_prepare"), {"name": name, "release": release})
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


async def list_lanes(conn: psycopg.AsyncConnection[Any]) -> list[LaneSummary]:
    async with conn.cursor(row_factory=class_row(LaneSummary)) as cur:
        await cur.execute(q("lane_list"))
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
    retention_s: float | None = None,
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
        "retention_s": retention_s,
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


def not_prepared(release: str, *, state: str | None = None) -> LaneNotPrepared:
    name = LANE_PREFIX + release
    what = "does not exist" if state is None else f"is {state}"
    return LaneNotPrepared(
        f"lane {name!r} of release {release!r} {what}: nothing was written",
        fix=(
            f"start a worker of that release (`worker start --release {release}`), which "
            f"prepares its lane, or run `worker queues prepare {release}`; then retry"
        ),
    )


@dataclass(frozen=True, slots=True)
class ReclaimReport:
    lane: str
    unfinished: int
    jobs_cancelled: int
    was: str


async def reclaim(
    conn: psycopg.AsyncConnection[Any], release: str, *, force: bool = False
) -> ReclaimReport:
    """Retire a lane. Refuses while it has unfinished runs unless ``force``.

    Lock order: the lane row FOR UPDATE (waits for admissions holding it FOR SHARE), then
    the lane's todo jobs. A forced reclaim cancels the lane's waiting jobs, so no job is
    ever left on a reclaimed lane; its runs stay unfinished for recovery to re-prepare.
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
        cur = await conn.execute(q("lane_cancel_waiting_jobs"), {"lane": name})
        cancelled = len(await cur.fetchall())
    return ReclaimReport(lane=name, unfinished=int(unfinished), jobs_cancelled=cancelled, was=state)


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
