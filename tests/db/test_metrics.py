"""Metrics read from the tables: queue depth, live workers, rescues and refused writes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from queues import admission, lanes, metrics

Conn = psycopg.AsyncConnection[Any]


async def test_metrics_count_depth_rescues_refusals_and_stranded_lanes(conn: Conn) -> None:
    release = "m" + uuid.uuid4().hex[:8]
    lane = (await lanes.prepare(conn, release)).name
    ids = [
        (await admission.submit(conn, admission.Submission(play="noop", release=release))).run_id
        for _ in range(3)
    ]
    await conn.execute(
        "UPDATE wq_runs SET state = 'running', attempt = 1, lease_owner = 'w',"
        " lease_expires_at = now() + interval '1 minute' WHERE id = %s",
        (ids[0],),
    )
    await conn.execute(
        "UPDATE wq_runs SET created_at = now() - interval '90 seconds' WHERE id = %s", (ids[1],)
    )
    await conn.execute(
        "INSERT INTO wq_attempts (run_id, attempt, outcome, finished_at) VALUES"
        " (%(a)s, 1, 'lease_expired', now()), (%(a)s, 2, 'superseded', now()),"
        " (%(b)s, 1, 'superseded', now() - interval '2 hours')",
        {"a": ids[1], "b": ids[2]},
    )
    found = await metrics.collect(conn, window_s=3600)

    (ours,) = [m for m in found.lanes if m.lane == lane]
    assert (ours.queued, ours.running, ours.sleeping, ours.live_workers) == (2, 1, 0, 0)
    assert ours.due_jobs == 3  # the running run's delivery job is still todo here
    assert 89 <= ours.oldest_due_wait_s < 200
    # The refusal two hours ago is outside the window.
    assert (found.attempts.lease_rescues, found.attempts.stale_writes_refused) == (1, 1)
    # No worker serves the lane: it is stranded once its runs waited long enough.
    later = datetime.now(UTC) + timedelta(minutes=5)
    stranded = {s.lane: s.runs for s in (await metrics.collect(conn, now=later)).stranded}
    assert stranded.get(lane) == 3
    text = found.prometheus()
    assert f'wq_lane_queued{{lane="{lane}"}} 2' in text
    assert 'wq_lease_rescues_window{window_s="3600"} 1' in text
