"""The design's floor: what a run's required writes cost at their plainest.

The design (docs/design.md) fixes what a run writes: admission is one statement that
checks its lane under a share lock, inserts the launch row (which stands for the
``run_created`` event: section 11b) and spawns the run's procrastinate job (section 6,
"Admission: the atomic submit"); a claim starts an attempt (the job taken, the run leased
and its ledger counter moved, the attempt row, which stands for ``attempt_started``); the
final write is fenced by the attempt and ends it, the attempt row standing for the run's
terminal event (section 7, "Execution: attempts, leases and fences"). No lifecycle event
is stored apart from its state row. This system does exactly those
writes and nothing else: one plain SQL statement each, no function, no trigger of its own,
minimal tables (a primary key and the idempotency key's index; no authority, options,
progress, outbox, fairness or rate limits), and the project's transport table (procrastinate's
``procrastinate_jobs``, as the project's migrations leave it). No play machinery: a "play"
is the claim's answer.

It is a baseline for one question only: can a target be met while the design holds? What
the floor cannot reach, no implementation of this design reaches on the same machine; what
it reaches shows how much of ours is above the design's own cost.

- submit one at a time: that statement, autocommit (one round trip, one durable commit);
- batch submit: the same for N runs from arrays;
- drain: one loop per core, each claiming a batch (``--concurrency``, or the tuned row's
  ``--tuned-prefetch``) in one statement and finishing it in another (fenced by attempt
  and lease owner; the job marked succeeded);
- pickup: a LISTEN session hears the lane's channel, a second connection claims (the claim
  answer is the start) and finishes the run after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

from bench.common import BenchError, connect, scalar, wait_until
from queues import migrations

CHANNEL = "floor_lane"  # the lane's channel: admission NOTIFYs it, the pickup LISTENs

TABLES = """
CREATE TABLE f_lanes (name text PRIMARY KEY, state text NOT NULL);
INSERT INTO f_lanes VALUES ('floor', 'prepared');
CREATE TABLE f_runs (
    id uuid PRIMARY KEY, org text NOT NULL, play text NOT NULL, params jsonb NOT NULL,
    lane text NOT NULL, idempotency_key text, job_id bigint NOT NULL,
    state text NOT NULL DEFAULT 'queued', attempt integer NOT NULL DEFAULT 0,
    lease_owner text, lease_expires_at timestamptz, result jsonb,
    created_at timestamptz NOT NULL DEFAULT now(), started_at timestamptz,
    finished_at timestamptz, ledger_seq bigint NOT NULL DEFAULT 1);
CREATE UNIQUE INDEX ON f_runs (org, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE TABLE f_attempts (
    run_id uuid NOT NULL, attempt integer NOT NULL, worker text NOT NULL,
    outcome text NOT NULL DEFAULT 'running', started_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz, start_seq bigint NOT NULL, end_seq bigint, end_kind text,
    PRIMARY KEY (run_id, attempt));
"""

# Admission (docs/design.md, section 6) for the runs of the arrays: nothing when the lane is not
# prepared; an idempotency key admits one run.
SUBMIT = """
WITH lane AS (
    SELECT 1 FROM f_lanes WHERE name = 'floor' AND state = 'prepared' FOR SHARE
), run AS (
    INSERT INTO f_runs (id, org, play, params, lane, idempotency_key, job_id)
    SELECT s.id, 'default', 'noop', s.params, 'floor', NULL, nextval('procrastinate_jobs_id_seq')
      FROM unnest(%(ids)s::uuid[], %(params)s::jsonb[]) AS s (id, params), lane
        ON CONFLICT (org, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, job_id
), job AS (
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, args)
    SELECT run.job_id, 'floor', 'wq.run', jsonb_build_object('run_id', run.id, 'org', 'default')
      FROM run
    RETURNING id
)
SELECT (SELECT count(*) FROM job), pg_notify(%(channel)s, '')
"""

# A claim (docs/design.md, section 7): the due jobs taken in order, SKIP LOCKED; each run
# leased at a new attempt (its seq from the run's counter), the attempt row written. Its
# commit need not wait for the WAL flush (as the project's claim: queues.runs.claim says
# why).
CLAIM = """
WITH picked AS (
    SELECT j.id FROM procrastinate_jobs j
     WHERE j.queue_name = 'floor' AND j.status = 'todo'
     ORDER BY j.priority DESC, j.id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), taken AS (
    UPDATE procrastinate_jobs j SET status = 'doing'
     WHERE j.id = ANY (ARRAY(SELECT picked.id FROM picked))
    RETURNING (j.args ->> 'run_id')::uuid AS run_id
), run AS (
    UPDATE f_runs r
       SET state = 'running', attempt = r.attempt + 1, lease_owner = %(worker)s,
           lease_expires_at = now() + interval '60 seconds',
           started_at = coalesce(r.started_at, now()), ledger_seq = r.ledger_seq + 1
     WHERE r.id = ANY (ARRAY(SELECT taken.run_id FROM taken)) AND r.state = 'queued'
    RETURNING r.id, r.attempt, r.params, r.ledger_seq
), attempt AS (
    INSERT INTO f_attempts (run_id, attempt, worker, start_seq)
    SELECT id, attempt, %(worker)s, ledger_seq FROM run
), lazy AS (
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT run.id, run.attempt, run.params FROM run LEFT JOIN lazy ON true
"""

# The final write, fenced in the statement: the run is running, at this attempt, under this
# owner's lease; the attempt ends (its row standing for the terminal event), the job is
# marked.
FINISH = """
WITH done AS (
    UPDATE f_runs r
       SET state = 'succeeded', result = 'null', lease_owner = NULL, lease_expires_at = NULL,
           finished_at = now(), ledger_seq = r.ledger_seq + 1
      FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS d (id, attempt)
     WHERE r.id = ANY (%(ids)s::uuid[]) AND r.id = d.id AND r.attempt = d.attempt
       AND r.state = 'running' AND r.lease_owner = %(worker)s
    RETURNING r.id, r.attempt, r.job_id, r.ledger_seq
), attempt AS (
    UPDATE f_attempts a
       SET outcome = 'succeeded', finished_at = now(), end_seq = done.ledger_seq,
           end_kind = 'run_succeeded'
      FROM done WHERE a.run_id = done.id AND a.attempt = done.attempt
), job AS (
    UPDATE procrastinate_jobs j SET status = 'succeeded'
     WHERE j.id = ANY (ARRAY(SELECT done.job_id FROM done))
)
SELECT count(*) FROM done
"""

UNFINISHED = "SELECT EXISTS (SELECT 1 FROM f_runs WHERE state IN ('queued', 'running'))"


class Floor:
    name = "floor"

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args

    async def setup(self) -> None:
        self.conn = await connect(self.url)
        await migrations.migrate(self.conn)  # the transport table, as the project has it
        await self.conn.execute(TABLES)

    async def close(self) -> None:
        await self.conn.close()

    async def _submit(self, first: int, count: int) -> None:
        ids = [uuid.uuid4() for _ in range(count)]
        params = [json.dumps({"i": i}) for i in range(first, first + count)]
        await self.conn.execute(SUBMIT, {"ids": ids, "params": params, "channel": CHANNEL})

    async def submit_one(self, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await self._submit(i, 1)
        return time.perf_counter() - t0

    async def submit_batch(self, n: int, batch: int) -> float:
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            await self._submit(start, min(batch, n - start))
        return time.perf_counter() - t0

    @staticmethod
    async def _claim(conn: Any, limit: int, worker: str) -> list[tuple[Any, ...]]:
        cur = await conn.execute(CLAIM, {"limit": limit, "worker": worker})
        rows: list[tuple[Any, ...]] = await cur.fetchall()
        return rows

    @staticmethod
    async def _finish(conn: Any, rows: list[tuple[Any, ...]], worker: str) -> int:
        ids = [r[0] for r in rows]
        attempts = [r[1] for r in rows]
        done = await scalar(conn, FINISH, {"ids": ids, "attempts": attempts, "worker": worker})
        if done != len(rows):
            raise BenchError(f"the floor's fenced finish wrote {done} of {len(rows)} runs")
        return int(done)

    async def drain(self, n: int, concurrency: int, *, analyze: bool, tuned: bool) -> float:
        await self.submit_batch(n, 1000)
        if analyze:
            await self.conn.execute("ANALYZE")
        batch = self.args.tuned_prefetch if tuned else concurrency
        first: list[float] = []

        async def loop(worker: str) -> float:
            async with await connect(self.url) as conn:
                last = time.perf_counter()
                while True:
                    rows = await self._claim(conn, batch, worker)
                    if not rows:
                        if not await scalar(conn, UNFINISHED):
                            return last
                        continue
                    first.append(time.perf_counter())
                    await self._finish(conn, rows, worker)
                    last = time.perf_counter()

        loops = os.cpu_count() or 2
        ends = await asyncio.gather(*(loop(f"floor-{k}") for k in range(loops)))
        return max(ends) - min(first)

    async def pickup(self, samples: int, spacing_s: float, concurrency: int) -> list[float]:
        started: dict[int, float] = {}
        listen = await connect(self.url)
        work = await connect(self.url)
        await listen.execute(f"LISTEN {CHANNEL}")

        async def listener() -> None:
            async for _ in listen.notifies():
                while rows := await self._claim(work, concurrency, "floor-0"):
                    now = time.perf_counter()
                    for row in rows:
                        started[row[2]["i"]] = now
                    await self._finish(work, rows, "floor-0")

        task = asyncio.create_task(listener())
        try:
            await asyncio.sleep(0.5)
            returned: dict[int, float] = {}
            for i in range(10_000_000, 10_000_000 + samples):
                await self._submit(i, 1)
                returned[i] = time.perf_counter()
                await asyncio.sleep(spacing_s)

            async def all_started() -> bool:
                if task.done():
                    task.result()  # the listener's failure, not a timeout
                return len(started) >= samples

            await wait_until(all_started, 10, "pickups")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await listen.close()
            await work.close()
        return [started[k] - t for k, t in returned.items() if k in started]
