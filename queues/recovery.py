"""Recovery: the maintenance pass that rescues lapsed leases and orphaned runs.

``run_once`` is one pass; a loop in ``worker/recovery.py`` (and a procrastinate periodic
task) owns the when. Each part is its own short transaction over a bounded batch, and
every pick takes its runs ``FOR UPDATE SKIP LOCKED``, so several hosts can run passes at
once and each rescue happens once (the lock order is drawn in ``sql/queries/recovery.sql``):

1. **expired leases**: a ``running`` run whose lease lapsed has its attempt closed as
   ``lease_expired`` (a failed attempt), then is retried on a new job per its lane's
   :class:`~queues.lanes.RetryPolicy`, or failed (``LEASE_EXPIRED``) once its failed and
   lapsed attempts spent the budget (a sleep's wake, a hand-back or an interruption does
   not count). A run whose cancel was pending gets a cleanup-only attempt (queued on a new
   job: a worker runs its cancel hooks and writes ``cancelled``), or is cancelled once
   the budget is spent. The attempt number is not bumped: the run leaves ``running``,
   which refuses the dead attempt's heartbeats and writes, and the next claim bumps it.
2. **orphans**: a ``queued`` run, a due sleeper or a woken waiter with no live job (lost,
   aborted, failed transport) gets a new job; a sleeper with a cancel pending is cancelled.
3. **retention**: terminal runs and finished run jobs past their lane's retention go, the
   recovery ticks' own finished jobs past the shortest lane retention, and emitted events
   and refused-write log rows past the event retention.
4. **stranded**: lanes with unfinished runs and no live worker are reported, not touched.
5. **claim deadlines**: runs never started by their ``start_by`` are failed
   (``START_DEADLINE_PASSED``), whether or not a worker serves their lane
   (:mod:`queues.options`);
6. **children of cancelled parents** that a cancel did not reach are cancelled
   (:mod:`queues.children`);
7. **permits of dead attempts** (shared rate limits) are deleted (:mod:`queues.limits`).

Before any job is spawned, the run's *original* lane row is held ``FOR SHARE`` until
commit (lock order: runs, then lanes in name order, then jobs). A lane row is never
deleted, so this is all a historic run needs to be served, on any host, in admission-only
mode too. The lane's state is left alone: a draining or reclaimed lane is served but
never reopened to admissions (only ``worker queues reopen`` does that); without a live
worker of its release its runs are reported stranded.

``adopt`` is the operator's explicit move of a lane's unfinished runs to a newer release;
recovery never does it on its own.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row

from queues import children, costs, lanes, limits, options, outcomes, transport
from queues.errors import InvalidField, did_you_mean
from queues.lanes import LaneState, RetryPolicy
from queues.queries import q

DEFAULT_BATCH = 100
# A lane is reported stranded once a run waited this long with no live worker for it:
# a lane whose worker is still starting (a deploy in progress) is not stranded yet.
DEFAULT_STRANDED_AFTER_S = 60.0


async def _shared(conn: psycopg.AsyncConnection[Any], row: _Expired) -> bool:
    """For a run at the poison bound: whether another run was there at its last deaths."""
    if not outcomes.poison_candidate(row.streak_workers):
        return False
    cur = await conn.execute(
        q("recovery_lapse_shared"),
        {
            "lane": row.lane,
            "run_id": row.run_id,
            "workers": outcomes.recent_deaths(row.streak_workers),
        },
    )
    found = await cur.fetchone()
    return bool(found and found[0])


# A streak this long (lapses in a row with nothing settled) is retried apart from the runs
# that died with it (outcomes.after_lapse).
STAGGER_FROM = 2


def _stagger(picked: list[_Expired], rng: random.Random) -> dict[uuid.UUID, int]:
    """The places, drawn at random, of runs that lapsed on the same dead worker for the
    second time in a row (or more) with nothing settled (outcomes.after_lapse retries them
    apart); the others have none."""
    together: dict[str | None, list[uuid.UUID]] = {}
    for row in picked:
        if len(row.streak_workers) >= STAGGER_FROM:
            together.setdefault(row.lease_owner, []).append(row.run_id)
    ranks: dict[uuid.UUID, int] = {}
    for run_ids in together.values():
        if len(run_ids) > 1:
            rng.shuffle(run_ids)
            ranks.update({run_id: place for place, run_id in enumerate(run_ids)})
    return ranks


# Emitted events (and the refused-write log) are kept this long, like a lane's runs.
DEFAULT_EVENT_RETENTION_S = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class _Expired:
    run_id: uuid.UUID
    attempt: int
    lane: str
    release: str
    lease_owner: str | None
    lease_expires_at: datetime
    failures: int  # the run's failed attempts (the retry budget; a lapse is not one)
    # The workers of this lapse and of the lapses right before it with nothing settled,
    # newest first (outcomes.after_lapse).
    streak_workers: list[str]
    cancel_requested: bool
    lane_state: str
    retry_max_attempts: int
    retry_base_s: float
    retry_cap_s: float
    retry_jitter: float
    retry_kind: str | None = None  # the run's own (queues.options), else the lane's
    retry_factor: float | None = None

    @property
    def policy(self) -> RetryPolicy:
        return RetryPolicy.of(self)


@dataclass(frozen=True, slots=True)
class _Orphan:
    run_id: uuid.UUID
    lane: str
    release: str
    state: str
    lane_state: str
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class Rescued:
    """A run whose lease lapsed: its next state is queued (retry), failed or cancelled."""

    run_id: uuid.UUID
    attempt: int  # the attempt that lapsed
    lane: str
    state: str
    job_id: int | None  # the retry's job; None when failed, cancelled or left to pass 2
    retry_at: datetime | None


@dataclass(frozen=True, slots=True)
class Respawned:
    """A waiting run that had no live job and got a new one."""

    run_id: uuid.UUID
    lane: str
    reason: str  # orphan | cleanup | due_sleeper | woken_waiter
    old_job_status: str  # none | missing | failed | cancelled | aborted | succeeded
    job_id: int


@dataclass(frozen=True, slots=True)
class StrandedLane:
    """Unfinished runs on a lane that no live worker serves."""

    lane: str
    release: str
    lane_state: str
    runs: int
    runnable: int  # queued or due: would run at once if a worker served the lane
    oldest_wait_s: float


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    expired: tuple[Rescued, ...] = ()
    respawned: tuple[Respawned, ...] = ()
    cancelled: tuple[uuid.UUID, ...] = ()  # sleepers whose cancellation was requested
    closed_lanes: tuple[str, ...] = ()  # draining or reclaimed lanes that got jobs (served)
    deleted_runs: int = 0
    deleted_jobs: int = 0
    deleted_events: int = 0
    stranded: tuple[StrandedLane, ...] = ()
    saturated: bool = False  # some part filled its batch: more work is waiting
    # Never started by their claim deadline (queues.options): failed START_DEADLINE_PASSED.
    unstarted_failed: tuple[uuid.UUID, ...] = ()
    # Unfinished children of cancelled parents that no cancel reached (queues.children).
    children_cancelled: tuple[uuid.UUID, ...] = ()
    holds_swept: int = 0  # permits of attempts no longer live, deleted (queues.limits)
    # Reservations of attempts that ended without settling them, deleted (queues.costs).
    reservations_swept: int = 0

    def _count(self, state: str) -> int:
        return sum(1 for r in self.expired if r.state == state)

    def counts(self) -> dict[str, int]:
        """Flat counts, for one log line per pass."""
        reasons = [r.reason for r in self.respawned]
        return {
            "lease_expired": len(self.expired),
            "retried": self._count("queued"),
            "failed": self._count("failed"),
            "cancelled": self._count("cancelled") + len(self.cancelled),
            "respawned": len(self.respawned),
            "orphans": reasons.count("orphan"),
            "cleanups": reasons.count("cleanup"),
            "due_sleepers": reasons.count("due_sleeper"),
            "woken_waiters": reasons.count("woken_waiter"),
            "closed_lanes_served": len(self.closed_lanes),
            "deleted_runs": self.deleted_runs,
            "deleted_jobs": self.deleted_jobs,
            "deleted_events": self.deleted_events,
            "stranded_lanes": len(self.stranded),
            "stranded_runs": sum(s.runs for s in self.stranded),
            "start_deadline_failed": len(self.unstarted_failed),
            "children_cancelled": len(self.children_cancelled),
            "holds_swept": self.holds_swept,
            "reservations_swept": self.reservations_swept,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": self.counts(),
            "saturated": self.saturated,
            "expired": [asdict(r) for r in self.expired],
            "respawned": [asdict(r) for r in self.respawned],
            "cancelled": [str(r) for r in self.cancelled],
            "closed_lanes": list(self.closed_lanes),
            "stranded": [asdict(s) for s in self.stranded],
            "unstarted_failed": [str(r) for r in self.unstarted_failed],
            "children_cancelled": [str(r) for r in self.children_cancelled],
        }


async def run_once(
    conn: psycopg.AsyncConnection[Any],
    *,
    now: datetime | None = None,
    batch: int = DEFAULT_BATCH,
    stranded_after_s: float = DEFAULT_STRANDED_AFTER_S,
    event_retention_s: float = DEFAULT_EVENT_RETENTION_S,
    rng: random.Random | None = None,
) -> RecoveryReport:
    """One recovery pass; ``now`` (default: the database clock) lets tests control time."""
    if batch < 1:
        raise InvalidField(
            f"batch {batch} is too small", field="batch", rule="at least 1", fix="pass 100"
        )
    expired, closed_a = await rescue_expired(conn, now=now, batch=batch, rng=rng)
    respawned, cancelled, closed_b, orphans_seen = await respawn_orphans(conn, now=now, batch=batch)
    deleted_runs, deleted_jobs, deleted_events = await apply_retention(
        conn, now=now, batch=batch, event_retention_s=event_retention_s
    )
    stranded = await find_stranded(conn, now=now, after_s=stranded_after_s)
    unstarted = await options.expire_unstarted(conn, now=now, batch=batch)
    orphans = await children.cancel_orphans(conn, batch=batch)
    swept = await limits.sweep(conn, now=now, batch=batch)
    # A rescued attempt's reservations stopped counting with it (its run moved on): deleted.
    released = await costs.sweep(conn, batch=batch)
    return RecoveryReport(
        expired=tuple(expired),
        respawned=tuple(respawned),
        cancelled=tuple(cancelled),
        closed_lanes=tuple(sorted({*closed_a, *closed_b})),
        deleted_runs=deleted_runs,
        deleted_jobs=deleted_jobs,
        deleted_events=deleted_events,
        stranded=tuple(stranded),
        saturated=max(
            len(expired),
            orphans_seen,
            deleted_runs,
            deleted_jobs,
            deleted_events,
            len(unstarted),
            swept,
            released,
        )
        >= batch,
        unstarted_failed=tuple(unstarted),
        children_cancelled=tuple(orphans),
        holds_swept=swept,
        reservations_swept=released,
    )


async def _hold_lanes(conn: psycopg.AsyncConnection[Any], names: set[str]) -> list[str]:
    """Hold the lanes a batch will spawn on FOR SHARE until commit, in name order (the lock
    order), so a drain or reclaim waits for the spawn; returns those that are closed to
    admissions (draining, reclaimed): served all the same, and never reopened here."""
    closed: list[str] = []
    for name in sorted(names):
        cur = await conn.execute(q("recovery_lane_share"), {"name": name})
        row = await cur.fetchone()
        assert row is not None  # a run's lane row is never deleted (foreign key)
        if row[1] != LaneState.PREPARED:
            closed.append(name)
    return closed


async def rescue_expired(
    conn: psycopg.AsyncConnection[Any],
    *,
    now: datetime | None = None,
    batch: int = DEFAULT_BATCH,
    rng: random.Random | None = None,
    gone_only: bool = False,
) -> tuple[list[Rescued], list[str]]:
    """Part 1: close lapsed attempts and retry, fail or cancel their runs (one batch).

    A lease has lapsed when it expired or when its owner is gone: the worker recorded a
    liveness lock that no session holds any more (migration 0024). ``gone_only`` rescues
    only the latter: what a live worker checks for between recovery passes
    (:func:`rescue_gone`)."""
    async with conn.transaction():
        async with conn.cursor(row_factory=class_row(_Expired)) as cur:
            await cur.execute(
                q("recovery_expired_pick"), {"now": now, "batch": batch, "gone_only": gone_only}
            )
            picked = await cur.fetchall()
        if not picked:
            return [], []
        ranks = _stagger(picked, rng or random.Random())
        lapses = [
            outcomes.after_lapse(
                row.policy,
                failures=row.failures,
                cancel_requested=row.cancel_requested,
                streak=row.streak_workers,
                shared=await _shared(conn, row),
                rank=ranks.get(row.run_id, 0),
                rng=rng,
            )
            for row in picked
        ]
        states = [str(lapse.state) for lapse in lapses]
        delays = [lapse.delay_s for lapse in lapses]
        closed = await _hold_lanes(
            conn,
            {row.lane for row, state in zip(picked, states, strict=True) if state == "queued"},
        )
        async with conn.cursor(row_factory=class_row(Rescued)) as cur:
            await cur.execute(
                q("recovery_expired_apply"),
                {
                    "now": now,
                    "run_ids": [row.run_id for row in picked],
                    "attempts": [row.attempt for row in picked],
                    "states": states,
                    "spawn": [state == "queued" for state in states],
                    "delays": delays,
                    "codes": [lapse.code for lapse in lapses],
                    "whys": [lapse.why for lapse in lapses],
                },
            )
            rescued = await cur.fetchall()
    return rescued, closed


async def rescue_gone(
    conn: psycopg.AsyncConnection[Any], *, now: datetime | None = None, batch: int = DEFAULT_BATCH
) -> list[Rescued]:
    """Rescue the leases of workers that are gone (their session ended: killed, crashed,
    exited), whether or not the leases have expired yet; one batch. Cheap when there is
    nothing to do: a read of the running runs, one lock probe per owner with a key."""
    rescued, _ = await rescue_expired(conn, now=now, batch=batch, gone_only=True)
    return rescued


async def respawn_orphans(
    conn: psycopg.AsyncConnection[Any], *, now: datetime | None = None, batch: int = DEFAULT_BATCH
) -> tuple[list[Respawned], list[uuid.UUID], list[str], int]:
    """Part 2: give waiting runs with no live job a new one (one batch).

    Returns (respawned, cancelled, closed lanes served, runs picked).
    """
    async with conn.transaction():
        async with conn.cursor(row_factory=class_row(_Orphan)) as cur:
            await cur.execute(q("recovery_orphans_pick"), {"now": now, "batch": batch})
            picked = await cur.fetchall()
        if not picked:
            return [], [], [], 0
        to_cancel = [
            row.run_id for row in picked if row.cancel_requested and row.state == "sleeping"
        ]
        cancelled: list[uuid.UUID] = []
        if to_cancel:
            cur2 = await conn.execute(
                q("recovery_cancel_orphans"), {"now": now, "run_ids": to_cancel}
            )
            cancelled = [row[0] for row in await cur2.fetchall()]
        live = [row for row in picked if row.run_id not in to_cancel]
        closed = await _hold_lanes(conn, {row.lane for row in live})
        respawned: list[Respawned] = []
        ids = [row.run_id for row in live]
        if ids:
            async with conn.cursor(row_factory=class_row(Respawned)) as cur:
                await cur.execute(q("recovery_respawn_apply"), {"now": now, "run_ids": ids})
                respawned = await cur.fetchall()
    return respawned, cancelled, closed, len(picked)


async def apply_retention(
    conn: psycopg.AsyncConnection[Any],
    *,
    now: datetime | None = None,
    batch: int = DEFAULT_BATCH,
    event_retention_s: float = DEFAULT_EVENT_RETENTION_S,
) -> tuple[int, int, int]:
    """Part 3: delete one batch each of expired terminal runs, finished run jobs, and
    emitted events (with refused-write log rows) past the event retention."""
    async with conn.transaction():
        cur = await conn.execute(q("recovery_retention_runs"), {"now": now, "batch": batch})
        runs_deleted = len(await cur.fetchall())
    async with conn.transaction():
        cur = await conn.execute(
            q("recovery_retention_jobs"),
            {"now": now, "batch": batch, "maintenance": transport.MAINTENANCE_QUEUE},
        )
        jobs_deleted = len(await cur.fetchall())
    async with conn.transaction():
        cur = await conn.execute(
            q("recovery_retention_events"),
            {"now": now, "batch": batch, "retention_s": event_retention_s},
        )
        row = await cur.fetchone()
    assert row is not None
    return runs_deleted, jobs_deleted, int(row[0])


async def find_stranded(
    conn: psycopg.AsyncConnection[Any],
    *,
    now: datetime | None = None,
    after_s: float = DEFAULT_STRANDED_AFTER_S,
    limit: int = 100,
) -> list[StrandedLane]:
    """Part 4 (read only): lanes with unfinished runs that no live worker serves."""
    async with conn.cursor(row_factory=class_row(StrandedLane)) as cur:
        await cur.execute(q("recovery_stranded"), {"now": now, "after_s": after_s, "batch": limit})
        return await cur.fetchall()


async def adopt(conn: psycopg.AsyncConnection[Any], *, from_release: str, to_release: str) -> int:
    """Move every unfinished run of ``from_release``'s lane to ``to_release``'s lane.

    One transaction: the runs' lane and release change, their waiting (todo) jobs are
    re-spawned on the new lane at the same scheduled time and the old ones cancelled; a
    running run keeps its attempt and will retry on the new lane if its lease lapses;
    orphans are left to the recovery pass, which now spawns them on the new lane. The
    target lane is prepared when it does not exist yet (lazy preparation, as a local
    submit does); a draining or reclaimed target is refused. Returns the runs moved.
    """
    from_lane = lanes.lane_name(lanes.validate_release(from_release, field="FROM_RELEASE"))
    to_lane = lanes.lane_name(lanes.validate_release(to_release, field="TO_RELEASE"))
    if from_lane == to_lane:
        raise InvalidField(
            f"cannot adopt lane {from_lane!r} into itself",
            field="TO_RELEASE",
            rule="a release other than FROM_RELEASE",
            fix="pass the newer release whose workers should run these runs",
        )
    source = await lanes.get(conn, from_lane)
    if source is None:
        known = [s.release for s in await lanes.list_lanes(conn)]
        near = did_you_mean(from_release, known)
        raise InvalidField(
            f"release {from_release!r} has no lane" + (f"; did you mean {near!r}?" if near else ""),
            field="FROM_RELEASE",
            rule="a release listed by `worker queues list`",
            fix="copy the release from `worker queues list`",
        )
    target = await lanes.get(conn, to_lane)
    if target is None:
        async with conn.transaction():
            target = await lanes.prepare(conn, to_release, own=False)
    _check_target(target.state, to_release)
    async with conn.transaction():
        cur = await conn.execute(q("recovery_adopt_lock"), {"from_lane": from_lane})
        run_ids = [row[0] for row in await cur.fetchall()]
        cur = await conn.execute(q("recovery_lane_share"), {"name": to_lane})
        row = await cur.fetchone()
        assert row is not None  # the lane row is never deleted
        _check_target(row[1], to_release)
        if not run_ids:
            return 0
        cur = await conn.execute(
            q("recovery_adopt_move"),
            {
                "run_ids": run_ids,
                "from_lane": from_lane,
                "to_lane": to_lane,
                "to_release": to_release,
            },
        )
        moved = await cur.fetchone()
    assert moved is not None
    return int(moved[0])


def _check_target(state: str, release: str) -> None:
    if state != LaneState.PREPARED:
        raise lanes.closed(release, state)
