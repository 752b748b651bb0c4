"""Rate limits shared by every worker and host, stored in Postgres.

A limit has a key (``clearbit``, ``plan:pro``), a rate (``10/s``, ``600/m``) with a burst,
and an optional concurrency cap (permits held at once); with ``per_org`` each org of the
acquiring run has a bucket of its own, so one customer's plan does not throttle another's.
Operators define them (``worker limits set KEY --rate 10/s [--burst N] [--concurrency N]
[--per-org]``); a play takes a permit per call (``async with ctx.limit("clearbit"):`` or
``ctx.step(..., limit="clearbit")``).

The rate is a GCRA bucket (one timestamp, moved on by ``1 / rate`` per grant, granted while
within ``burst`` intervals of now): with burst 1 a limit of ``10/s`` grants at most 10
permits in any one-second window, across every process; a burst of N lets N go at once
after a quiet spell (a window may then see up to rate + N - 1). A refused permit comes back
with the time until it would be granted, so a waiting play sleeps exactly that long. The
concurrency cap counts the permits of live attempts only (their run still running at that
attempt, under its lease): a permit of a dead worker stops counting when its lease lapses,
and the recovery pass deletes it.

Taking and releasing a permit are writes of an attempt, fenced like every other
(``limit_acquire``, ``limit_release`` in ``sql/queries/limits.sql``): a stale attempt's
request is refused (:class:`~queues.errors.StaleAttempt`, a ``wq_refusals`` row of kind
``limit``) and takes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues import fields
from queues.errors import InvalidField, LimitUnknown, did_you_mean
from queues.fence import Fence, refused
from queues.queries import q


@dataclass(frozen=True, slots=True)
class Limit:
    key: str
    rate_per_s: float | None
    rate: str | None  # as given: 10/s, 600/m
    burst: int
    concurrency: int | None
    per_org: bool
    created_at: datetime
    updated_at: datetime
    updated_by: str | None
    holding: int  # permits live attempts hold now (every bucket of the limit)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Permit:
    """What one request for a permit got."""

    granted: bool
    held: bool  # granted under a concurrency cap: release it (limit_release)
    busy: bool  # refused: the concurrency cap is reached (ask again later)
    wait_s: float | None  # refused by the rate: it would be granted in this many seconds
    at: datetime | None  # the database's time of the decision


def check(
    key: object,
    *,
    rate: object = None,
    burst: object = None,
    concurrency: object = None,
) -> dict[str, Any]:
    """A limit's definition from raw values (the CLI's flags), by the field rules."""
    checked_key = fields.limit_key(key)
    per_s, text = (None, None) if rate is None else fields.rate(rate)
    cap = (
        None
        if concurrency is None
        else fields.whole_number(
            concurrency, field="--concurrency", minimum=1, maximum=1_000_000, example=2
        )
    )
    if per_s is None and burst is not None:
        raise InvalidField(
            "--burst without --rate",
            field="--burst",
            rule="a burst belongs to a rate",
            fix="add --rate, or drop --burst",
        )
    if per_s is None and cap is None:
        raise InvalidField(
            f"limit {checked_key!r} has neither a rate nor a concurrency cap",
            field="--rate",
            rule="a rate (--rate 10/s), a concurrency cap (--concurrency N), or both",
            fix=f"pass e.g. worker limits set {checked_key} --rate 10/s",
        )
    bursts = (
        1
        if burst is None
        else fields.whole_number(burst, field="--burst", minimum=1, maximum=1_000_000, example=5)
    )
    return {
        "key": checked_key,
        "rate_per_s": per_s,
        "rate": text,
        "burst": bursts,
        "concurrency": cap,
    }


async def set_limit(
    conn: psycopg.AsyncConnection[Any],
    key: str,
    *,
    rate: object = None,
    burst: object = None,
    concurrency: object = None,
    per_org: bool = False,
    actor: str | None = None,
) -> Limit:
    """Define or redefine a limit (checked first; nothing is written on a refusal)."""
    values = check(key, rate=rate, burst=burst, concurrency=concurrency)
    async with conn.transaction(), conn.cursor(row_factory=class_row(Limit)) as cur:
        await cur.execute(q("limit_set"), values | {"per_org": per_org, "actor": actor})
        limit = await cur.fetchone()
    assert limit is not None
    return limit


async def list_limits(conn: psycopg.AsyncConnection[Any]) -> list[Limit]:
    async with conn.cursor(row_factory=class_row(Limit)) as cur:
        await cur.execute(q("limit_list"), {})
        return await cur.fetchall()


async def delete_limit(conn: psycopg.AsyncConnection[Any], key: str) -> bool:
    """Delete a limit with its buckets and holds; False when there was none."""
    checked = fields.limit_key(key)
    async with conn.transaction():
        cur = await conn.execute(q("limit_delete"), {"key": checked})
        return await cur.fetchone() is not None


async def acquire(
    conn: psycopg.AsyncConnection[Any],
    *,
    key: str,
    hold: str,
    fence: Fence,
    now: datetime | None = None,
) -> Permit:
    """Ask for one permit of ``key`` for the fenced attempt (``hold``: the attempt's name
    for it, to release it by). Raises :class:`StaleAttempt` when the fence refuses,
    :class:`LimitUnknown` for a key nobody defined."""
    checked = fields.limit_key(key, field="key")
    params = {"key": checked, "hold": hold, "now": now, **fence.params()}
    for _ in range(2):  # a bucket's first use makes it, then asks again
        cur = await conn.execute(q("limit_acquire"), params)
        row = await cur.fetchone()
        assert row is not None
        fenced, known, bucket, granted, busy, wait_s, held, at, run_attempt, run_state = row
        if not fenced:
            raise refused(
                fence,
                verb="take a permit of",
                subject=f"limit {checked!r}",
                run_attempt=run_attempt,
                run_state=run_state,
            )
        if not known:
            raise await unknown(conn, checked)
        if bucket:
            return Permit(
                granted=bool(granted),
                held=bool(granted and held),
                busy=bool(busy),
                wait_s=None if wait_s is None else float(wait_s),
                at=at,
            )
        await conn.execute(q("limit_bucket_ensure"), params)
    raise AssertionError(f"limit {checked!r}: its bucket did not appear")


async def unknown(conn: psycopg.AsyncConnection[Any], key: str) -> LimitUnknown:
    defined = [limit.key for limit in await list_limits(conn)]
    near = did_you_mean(key, defined)
    return LimitUnknown(
        f"no limit {key!r}" + (f"; did you mean {near!r}?" if near else ""),
        field="key",
        rule=f"a limit defined with `worker limits set` ({', '.join(defined) or 'none yet'})",
        fix=f"define it: worker limits set {key} --rate 10/s",
    )


async def release(conn: psycopg.AsyncConnection[Any], *, hold: str, fence: Fence) -> bool:
    """Release a permit the fenced attempt holds; whether there was one."""
    cur = await conn.execute(q("limit_release"), {"hold": hold, **fence.params()})
    row = await cur.fetchone()
    assert row is not None
    fenced, released, run_attempt, run_state = row
    if not fenced:
        raise refused(
            fence,
            verb="release",
            subject=f"permit {hold!r}",
            run_attempt=run_attempt,
            run_state=run_state,
        )
    return bool(released)


async def sweep(
    conn: psycopg.AsyncConnection[Any], *, now: datetime | None = None, batch: int = 100
) -> int:
    """The recovery pass's part: delete a batch of holds of attempts no longer live."""
    async with conn.transaction():
        cur = await conn.execute(q("limit_holds_sweep"), {"now": now, "batch": batch})
        row = await cur.fetchone()
    return int(row[0]) if row else 0
