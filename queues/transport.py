"""The transport seam: every use of procrastinate, the job transport, in one place.

A run's job is a procrastinate job on the run's lane (a procrastinate queue) with task
:data:`TASK_NAME`. Admission and every statement that re-spawns a run insert it, the spawn
wakes a worker waiting for work on its own channel (or, with none waiting, NOTIFYs the
lane's channel, :func:`lane_channel`: migration 0032), the claim statement takes jobs in
batches and starts their runs' attempts, and the statement that writes a run's outcome
finishes its job. procrastinate's own worker serves one periodic task, the recovery tick
(:data:`RECOVERY_TASK` on :data:`MAINTENANCE_QUEUE`).

Only this module and the ``wq_transport_*`` SQL functions
(``sql/migrations/0013_create_transport_seam.sql``) know procrastinate's tables, job
statuses, task and channel names: statements in ``sql/queries`` call the functions, code
calls this module (``queues.migrations`` alone installs procrastinate's schema).
``tests/db/test_transport_seam.py`` fails when anything else names them.

=================================  ==================================================
SQL function                       does
=================================  ==================================================
``wq_transport_jobs()``            our runs' jobs: id, lane, status (text, for
                                   reports), scheduled_at, waiting, live; inlined
``wq_transport_job_waiting(id)``  whether one job waits to be claimed (todo): a
                                   probe of its key per call, never a join
                                   (migrations 0021, 0022)
``wq_transport_next_id()``         a job id, taken before the job is spawned
``wq_transport_spawn(...)``        spawn jobs (the only insert of a job)
``wq_transport_take(...)``         take due jobs of lanes for a worker (the claim)
``wq_transport_settle(...)``       finish delivered jobs, succeeded or failed
``wq_transport_release(...)``      send delivered jobs back to their lanes
``wq_transport_wake(lanes)``       wake claimers: a waiting live worker per lane
                                   element, else the lane's broadcast
``wq_transport_stop(...)``         a cancel: cancel waiting, abort delivered jobs
``wq_transport_withdraw(...)``     cancel waiting jobs no claimer holds (adopt)
``wq_transport_prune(...)``        delete finished jobs past their lane's retention
``wq_transport_register_worker``,  procrastinate's worker row of a worker
``wq_transport_beat(...)``
``wq_transport_notify_cancel``     NOTIFY :data:`CONTROL_CHANNEL`: wake the worker of a
                                   run whose cancel was requested (the worker role's)
=================================  ==================================================

The writers take arrays: a batch statement calls each once, never per row. The migration
says why the claim may take a job whose run it cannot see yet, and what becomes of it.

A control message is a wake, never an order: any role that can connect can NOTIFY any
channel. The request itself is the run's row (``wq_runs.cancel_requested_at``, written by
``run_cancel``), which a worker reads before it stops anything (migration 0036).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from queues.queries import q

TASK_NAME = "wq.run"  # the task of a run's job (its args: {"run_id": ...})
CONTROL_CHANNEL = "wq_control"  # our NOTIFY channel: {"cancel": run_id}, a run to look at
MAINTENANCE_QUEUE = "wq-maintenance"  # procrastinate's own worker serves this queue
RECOVERY_TASK = "wq.recovery"  # the periodic recovery pass, one job per tick
RECOVERY_PERIODIC_ID = "wq-recovery"

# procrastinate NOTIFYs a queue's jobs on this channel plus the queue name; a channel name
# is at most 63 bytes (NAMEDATALEN - 1), which bounds a lane name.
_LANE_CHANNEL_PREFIX = "procrastinate_queue_v1#"
CHANNEL_MAX_BYTES = 63
LANE_MAX = CHANNEL_MAX_BYTES - len(_LANE_CHANNEL_PREFIX)


def lane_channel(lane: str) -> str:
    """The channel procrastinate NOTIFYs when a job is spawned on ``lane``."""
    return _LANE_CHANNEL_PREFIX + lane


async def listen(conn: psycopg.AsyncConnection[Any], lanes: Sequence[str]) -> None:
    """LISTEN for jobs spawned on ``lanes`` and for control messages (autocommit ``conn``)."""
    for lane in lanes:
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(lane_channel(lane))))
    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CONTROL_CHANNEL)))


async def listen_wake(conn: psycopg.AsyncConnection[Any], channel: str) -> None:
    """LISTEN for wakes meant for this worker alone (``channel``: its
    :func:`queues.runs.hold_liveness`), on the session that holds its liveness lock."""
    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


async def wake(conn: psycopg.AsyncConnection[Any], lanes: Sequence[str]) -> int:
    """Wake a claimer for each of ``lanes``: a waiting live worker, else the lane's
    broadcast (a worker passing on a wake it has no room for, once it left the set of
    waiting workers). Returns how many were woken on their own channels."""
    cur = await conn.execute(q("transport_wake"), {"lanes": list(lanes)})
    row = await cur.fetchone()
    return int(row[0]) if row is not None else 0


def cancel_request(payload: str) -> uuid.UUID | None:
    """The run a control message names (``wq_transport_notify_cancel``), if any: a run to
    look at, whose durable request decides (anyone may send such a message)."""
    try:
        message = json.loads(payload)
        return uuid.UUID(str(message.get("cancel")))
    except (ValueError, TypeError, AttributeError):
        return None


async def register_worker(conn: psycopg.AsyncConnection[Any]) -> int:
    """Register a worker with procrastinate; the jobs it takes carry the id returned."""
    cur = await conn.execute(q("transport_register_worker"))
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])
