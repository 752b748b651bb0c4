"""Metrics read from the tables: queue depth, live workers, rescues and refused writes.

Every outcome counted here is produced by the code that produces it in production (a real
claim, a real rescue by the recovery pass, a stale attempt's real refused writes), never
written by hand; time is controlled through ``now``.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from queues import metrics, outcomes, receipts, runs, totals
from queues.errors import StaleAttempt
from queues.lanes import RetryPolicy
from queues.receipts import Scope
from tests import attempts
from worker import metrics_http

Conn = psycopg.AsyncConnection[Any]


async def test_metrics_count_depth_rescues_refusals_and_stranded_lanes(conn: Conn) -> None:
    # Near the real clock: refusals are stamped with the transaction's now().
    t0 = datetime.now(UTC).replace(microsecond=0)
    release = "m" + uuid.uuid4().hex[:8]
    lane = f"r-{release}"
    # `lapsed` is claimed and its worker dies; `live` is claimed and keeps running;
    # `blip` is claimed and interrupted by the database; `waiting` is never claimed.
    lapsed = await attempts.start(conn, release=release, now=t0)
    live = await attempts.start(conn, release=release, now=t0 + timedelta(seconds=20))
    blip = await attempts.start(conn, release=release, now=t0)
    interrupted = outcomes.interrupted(
        blip.run_id,
        1,
        {"type": "AdminShutdown"},
        RetryPolicy(),
        now=t0,
        failure=1,
        interruption=1,
        max_interruptions=20,
    )
    statuses = await runs.finish(conn, worker_id="w1", finishes=[interrupted])
    assert statuses[(blip.run_id, 1)] is outcomes.FinishStatus.APPLIED
    waiting = await attempts.admit(conn, release=release)

    await attempts.rescue(conn, lapsed)  # at t0 + 31 s
    # The dead attempt wakes up: a step claim and its final write are both refused.
    with pytest.raises(StaleAttempt):
        await receipts.claim(
            conn,
            receipts.StepRef(
                org=attempts.ORG,
                play=attempts.PLAY,
                scope=Scope.of_run(lapsed.run_id),
                step_key="paid",
                fence=lapsed.fence,
            ),
            lease_s=30,
        )
    late = [outcomes.succeeded(lapsed.run_id, 1, {"late": True})]
    assert (await runs.finish(conn, worker_id="w1", finishes=late))[
        (lapsed.run_id, 1)
    ] is outcomes.FinishStatus.REFUSED

    at = t0 + timedelta(seconds=40)
    found = await metrics.collect(conn, window_s=3600, now=at)

    (ours,) = [m for m in found.lanes if m.lane == lane]
    # queued: the rescued run (retry pending), the interrupted one, and `waiting`.
    assert (ours.queued, ours.running, ours.sleeping, ours.live_workers) == (3, 1, 0, 0)
    assert ours.due_jobs >= 1  # `waiting`'s job; the retries are scheduled in the future
    a = found.attempts
    assert (a.lease_rescues, a.stale_writes_refused, a.interrupted_attempts) == (1, 2, 1)
    assert a.succeeded_attempts == 0 and a.failed_attempts == 0
    assert {(r.kind, r.writes, r.rows) for r in found.refusals} == {
        ("receipt", 1, 1),
        ("final", 1, 1),
    }
    # Outside the window nothing is counted.
    later = await metrics.collect(conn, window_s=1, now=at + timedelta(hours=2))
    assert later.attempts.lease_rescues == 0 and later.refusals == []
    # No worker serves the lane: it is stranded once its runs waited long enough.
    stranded = {s.lane: s.runs for s in later.stranded}
    assert stranded.get(lane) == 4
    # `worker metrics --format prometheus` prints what /metrics serves from the database.
    text = metrics_http.exposition(await totals.read(conn), found)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {(s.labels["lane"], s.value) for s in families["wq_queue_depth"].samples} >= {(lane, 3)}
    assert families["wq_lease_rescues"].type == "counter"
    assert "# HELP wq_queue_depth " in text
    assert live.fence.attempt == 1 and waiting is not None
