"""Real attempts for tests: a real admission and claim, a real rescue, a real second claim.

No test moves the fence by hand (``UPDATE wq_runs SET attempt = attempt + 1``): a stale
attempt is made the way production makes one. The recovery pass closes the attempt whose
lease lapsed (state ``queued``, attempt number kept, a retry job) and a second worker
claims the run (attempt + 1). Time is controlled through ``now``: every call takes it, so
a test in one rolled-back transaction (where ``now()`` never moves) can still let a lease
lapse.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from queues import admission, lanes, recovery, runs
from queues.fence import Fence

Conn = psycopg.AsyncConnection[Any]
T0 = datetime(2030, 1, 1, tzinfo=UTC)
RELEASE = "fence"
PLAY = "play"
ORG = "org"


@dataclass(frozen=True, slots=True)
class Attempt:
    """A claimed attempt: its fence, and the claim row (policies, times)."""

    fence: Fence
    claimed: runs.Claimed
    now: datetime  # the time it was claimed at

    @property
    def run_id(self) -> Any:
        return self.fence.run_id

    @property
    def lapses_at(self) -> datetime:
        assert self.claimed.lease_expires_at is not None
        return self.claimed.lease_expires_at


async def admit(
    conn: Conn,
    *,
    play: str = PLAY,
    org: str = ORG,
    release: str = RELEASE,
    params: dict[str, Any] | None = None,
    inputs: list[tuple[str, Any]] | None = None,
) -> Any:
    """A real admission (the lane is prepared first); returns the run id."""
    await lanes.prepare(conn, release)
    admitted = await admission.submit(
        conn,
        admission.Submission(play=play, params=params or {}, release=release, org=org),
        inputs=inputs,
    )
    return admitted.run_id


async def claim(
    conn: Conn,
    *,
    worker: str = "w1",
    release: str = RELEASE,
    plays: tuple[str, ...] = (PLAY,),
    now: datetime = T0,
    run_id: Any = None,
) -> Attempt:
    """A real claim of the lane's next due run (``run_id``: check it is that run)."""
    got = await runs.claim(
        conn,
        lanes=[lanes.lane_name(release)],
        worker_id=worker,
        limit=1,
        plays=list(plays),
        now=now,
    )
    taken = [c for c in got if c.claimed]
    assert len(taken) == 1, f"expected one claim, got {got!r}"
    c = taken[0]
    if run_id is not None:
        assert c.run_id == run_id, f"claimed {c.run_id}, expected {run_id}"
    return Attempt(c.fence(worker), c, now)


async def start(conn: Conn, *, worker: str = "w1", now: datetime = T0, **admit_kw: Any) -> Attempt:
    """Admit a run and claim it: attempt 1 of a fresh run, leased by ``worker``."""
    run_id = await admit(conn, **admit_kw)
    return await claim(
        conn,
        worker=worker,
        release=admit_kw.get("release", RELEASE),
        plays=(admit_kw.get("play", PLAY),),
        now=now,
        run_id=run_id,
    )


async def rescue(conn: Conn, attempt: Attempt) -> recovery.RecoveryReport:
    """The real recovery pass, just after the attempt's lease lapsed: it closes the attempt
    as ``lease_expired`` and queues the run on a new job (or fails or cancels it)."""
    report = await recovery.run_once(conn, now=attempt.lapses_at + timedelta(seconds=1))
    assert any(r.run_id == attempt.run_id for r in report.expired), report
    return report


async def supersede(conn: Conn, attempt: Attempt, *, worker: str = "w2") -> Attempt:
    """Make ``attempt`` stale the way production does: rescue it, then a second worker
    claims the run (attempt + 1). Returns the new, live attempt."""
    await rescue(conn, attempt)
    later = attempt.lapses_at + timedelta(minutes=10)  # past any retry backoff
    return await claim(
        conn,
        worker=worker,
        release=attempt.claimed.release or RELEASE,
        plays=(attempt.claimed.play or PLAY,),
        now=later,
        run_id=attempt.run_id,
    )


async def run_row(conn: Conn, run_id: Any) -> dict[str, Any]:
    cur = await conn.execute(
        "SELECT state::text, attempt, lease_owner, cancel_requested_at IS NOT NULL"
        " FROM wq_runs WHERE id = %s",
        (run_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    return {"state": row[0], "attempt": row[1], "lease_owner": row[2], "cancel": row[3]}


async def refusals(conn: Conn, run_id: Any) -> list[tuple[int, str, int]]:
    """The refused writes logged for a run: (attempt, kind, rows)."""
    cur = await conn.execute(
        "SELECT attempt, kind, rows FROM wq_refusals WHERE run_id = %s ORDER BY id", (run_id,)
    )
    return [(int(a), str(k), int(n)) for a, k, n in await cur.fetchall()]
