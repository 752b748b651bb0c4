"""Periodic plays: schedules admitted once per tick, whatever the workers and releases.

A schedule names a play, its params and org, and a timing: a cron expression (UTC, 5 fields,
or 6 with the seconds first) or a fixed interval (``every``; its ticks fall on multiples of
it since the epoch, so every worker computes the same ones). An app declares one on a play
(``@registry.play("digest", cron="0 * * * *", params={...})``; each worker upserts its
app's declarations when it starts) or an operator adds one (``worker schedules add``).

Every worker whose release has the play looks for due schedules about once a second
(:func:`admit_due`, one cheap statement when nothing is due). In one transaction it locks a
due schedule (``FOR UPDATE SKIP LOCKED``: one worker at a time), admits the tick's run on
**its own lane** (pinned to the admitting worker's release) with the idempotency key
``schedule:<name>:<tick>``, and moves the schedule to its next tick. So each tick is
admitted exactly once, however many workers and releases look: the lock makes one worker
do it, the next tick recorded in the same transaction keeps the others from doing it
again, and the key would refuse a second run for the tick anyway. A worker whose lane no
longer admits (draining, reclaimed) leaves the schedule to a worker whose lane does.

**Missed ticks.** Ticks that passed while no worker ran (downtime, a deploy, every worker
busy) are admitted **once**, as the latest of them, not once each: the run's metadata says
which tick it is and how many it stands for (``missed_ticks``), and the schedule counts
them. The first tick of a new schedule is the first one after it was declared or added; a
changed timing starts again from the next tick.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues import admission, fields
from queues.errors import IdempotencyConflict, InvalidField, LaneError
from queues.queries import q

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
COUNT_MAX = 100_000  # missed ticks counted one by one (a cron over a long downtime) at most
DUE_BATCH = 20


@dataclass(frozen=True, slots=True)
class Timing:
    """When a schedule ticks: a cron expression or a fixed interval (one of them)."""

    cron: str | None = None
    every_s: float | None = None

    @classmethod
    def checked(cls, *, cron: object = None, every: object = None) -> Timing:
        if (cron is None) == (every is None):
            raise InvalidField(
                "a schedule needs exactly one of a cron expression and an interval",
                field="--cron",
                rule="--cron EXPR or --every DURATION",
                fix="pass e.g. --cron '0 * * * *' or --every 1h",
            )
        if cron is not None:
            return cls(cron=fields.cron(cron))
        return cls(every_s=fields.every(every))

    def _iter(self, start: datetime) -> Any:
        from croniter import croniter

        assert self.cron is not None
        expr = self.cron
        return croniter(expr, start, second_at_beginning=len(expr.split()) == 6)

    def latest(self, now: datetime) -> datetime:
        """The latest tick at or before ``now``."""
        if self.every_s is not None:
            steps = math.floor((now - EPOCH).total_seconds() / self.every_s)
            return EPOCH + timedelta(seconds=steps * self.every_s)
        before: datetime = self._iter(now).get_prev(datetime)
        after: datetime = self._iter(before).get_next(datetime)
        return after if after <= now else before

    def after(self, moment: datetime) -> datetime:
        """The first tick strictly after ``moment``."""
        if self.every_s is not None:
            steps = math.floor((moment - EPOCH).total_seconds() / self.every_s) + 1
            return EPOCH + timedelta(seconds=steps * self.every_s)
        found: datetime = self._iter(moment).get_next(datetime)
        return found

    def between(self, first: datetime, last: datetime) -> int:
        """How many ticks lie in ``[first, last)`` (counted up to :data:`COUNT_MAX`)."""
        if last <= first:
            return 0
        if self.every_s is not None:
            return max(0, round((last - first).total_seconds() / self.every_s))
        count = 0
        iterator = self._iter(first - timedelta(microseconds=1))
        while count < COUNT_MAX and iterator.get_next(datetime) < last:
            count += 1
        return count

    def __str__(self) -> str:
        return (
            f"cron {self.cron}"
            if self.cron
            else f"every {fields.human_duration(self.every_s or 0)}"
        )


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    play: str
    params: dict[str, Any]
    org: str
    cron: str | None
    every_s: float | None
    source: str  # app | cli
    enabled: bool
    next_at: datetime
    last_tick: datetime | None
    last_run_id: uuid.UUID | None
    last_release: str | None
    missed_ticks: int
    created_at: datetime
    updated_at: datetime
    updated_by: str | None

    @property
    def timing(self) -> Timing:
        return Timing(cron=self.cron, every_s=self.every_s)


async def _clock(conn: psycopg.AsyncConnection[Any], now: datetime | None) -> datetime:
    cur = await conn.execute(q("schedule_clock"), {"now": now})
    row = await cur.fetchone()
    assert row is not None
    moment: datetime = row[0]
    return moment


async def declare(
    conn: psycopg.AsyncConnection[Any],
    *,
    name: str,
    play: str,
    params: Mapping[str, Any],
    org: str,
    timing: Timing,
    now: datetime | None = None,
) -> bool:
    """Upsert an app's schedule (at a worker's start); False when an operator's schedule
    holds the name (it is left alone)."""
    fields.schedule_name(name, field="schedule")
    fields.play_name(play)
    fields.org(org)
    encoded = admission.encode_params(params)
    async with conn.transaction():
        moment = await _clock(conn, now)
        cur = await conn.execute(
            q("schedule_declare"),
            {
                "name": name,
                "play": play,
                "params": encoded,
                "org": org,
                "cron": timing.cron,
                "every_s": timing.every_s,
                "next_at": timing.after(moment),
            },
        )
        return await cur.fetchone() is not None


async def add(
    conn: psycopg.AsyncConnection[Any],
    name: str,
    *,
    play: str,
    params: Mapping[str, Any] | None = None,
    org: str = "default",
    timing: Timing,
    actor: str | None = None,
    now: datetime | None = None,
) -> Schedule:
    """Add (or change) an operator's schedule; its first tick is the first after now. A
    name an app declared is refused (the app's declaration would take it back)."""
    fields.schedule_name(name)
    fields.play_name(play, field="--play")
    fields.org(org, field="--org")
    encoded = admission.encode_params(params or {})
    async with conn.transaction():
        moment = await _clock(conn, now)
        async with conn.cursor(row_factory=class_row(Schedule)) as cur:
            await cur.execute(
                q("schedule_add"),
                {
                    "name": name,
                    "play": play,
                    "params": encoded,
                    "org": org,
                    "cron": timing.cron,
                    "every_s": timing.every_s,
                    "next_at": timing.after(moment),
                    "actor": actor,
                },
            )
            added = await cur.fetchone()
    if added is None:
        raise InvalidField(
            f"schedule {name!r} is declared by an app (@registry.play(..., cron=...))",
            field="NAME",
            rule="an operator's schedule takes a name no app declares",
            fix="change it in the app, or add this one under another name",
        )
    return added


async def delete(conn: psycopg.AsyncConnection[Any], name: str) -> str | None:
    """Delete a schedule; its source (app or cli), or None when there was none. An app's
    schedule comes back at its workers' next start unless the app drops it."""
    fields.schedule_name(name)
    async with conn.transaction():
        cur = await conn.execute(q("schedule_delete"), {"name": name})
        row = await cur.fetchone()
    return None if row is None else str(row[1])


async def list_schedules(conn: psycopg.AsyncConnection[Any]) -> list[Schedule]:
    async with conn.cursor(row_factory=class_row(Schedule)) as cur:
        await cur.execute(q("schedule_list"), {})
        return await cur.fetchall()


@dataclass(frozen=True, slots=True)
class Ticked:
    """A tick a worker admitted (or found admitted under its key)."""

    name: str
    tick: datetime
    run_id: uuid.UUID | None
    created: bool
    missed: int  # earlier ticks this one stands for (missed while nothing ran)
    next_at: datetime


@dataclass(frozen=True, slots=True)
class Pass:
    ticked: tuple[Ticked, ...]
    skipped: tuple[str, ...]  # due, but this worker's lane does not admit
    next_due: datetime | None  # the next tick of the plays looked at
    now: datetime


def tick_key(name: str, tick: datetime) -> str:
    """The idempotency key of a schedule's tick: one run per tick."""
    return f"schedule:{name}:{tick.astimezone(UTC).isoformat()}"


async def admit_due(
    conn: psycopg.AsyncConnection[Any],
    *,
    release: str,
    plays: Sequence[str],
    now: datetime | None = None,
    batch: int = DUE_BATCH,
) -> Pass:
    """One pass: admit the due ticks of schedules of ``plays`` on ``release``'s lane, each
    once (see the module's docstring). ``now`` (default: the database's clock) lets tests
    control time. Runs in one transaction; each admission in a savepoint of its own."""
    ticked: list[Ticked] = []
    skipped: list[str] = []
    async with conn.transaction():
        moment = await _clock(conn, now)
        cur = await conn.execute(
            q("schedule_due"), {"now": moment, "plays": list(plays), "batch": batch}
        )
        due = await cur.fetchall()
        for name, play, params, org, cron, every_s, next_at in due:
            timing = Timing(cron=cron, every_s=every_s)
            tick = max(timing.latest(moment), next_at)
            missed = timing.between(next_at, tick)
            sub = admission.Submission(
                play=play,
                params=params,
                release=release,
                org=org,
                idempotency_key=tick_key(name, tick),
                meta={"schedule": name, "tick": tick.isoformat(), "missed_ticks": missed},
            )
            try:
                admitted = await admission.submit(conn, sub)
                run_id: uuid.UUID | None = admitted.run_id
                created = admitted.created
            except LaneError:
                skipped.append(name)  # this release's lane does not admit: another will
                continue
            except IdempotencyConflict:
                run_id, created = None, False  # another release admitted it, other params
            following = timing.after(moment)
            await conn.execute(
                q("schedule_advance"),
                {
                    "name": name,
                    "next_at": following,
                    "tick": tick,
                    "run_id": run_id,
                    "release": release,
                    "missed": missed,
                },
            )
            ticked.append(Ticked(name, tick, run_id, created, missed, following))
        cur = await conn.execute(q("schedule_next_due"), {"plays": list(plays)})
        row = await cur.fetchone()
    return Pass(tuple(ticked), tuple(skipped), row[0] if row else None, moment)
