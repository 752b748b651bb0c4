-- Recovery: lapsed leases, orphaned runs, retention, stranded lanes, adoption.
--
-- Lock order, in every statement here (and the Python that strings them together):
--   1. wq_runs rows, FOR UPDATE SKIP LOCKED (adopt: FOR UPDATE, ordered by id);
--   2. the wq_lanes rows the batch will spawn on, one at a time in name order, FOR SHARE
--      (a lane row is never deleted, so serving a historic run on a drained or reclaimed
--      lane needs only that lock, and never reopens the lane to admissions);
--   3. the runs' old jobs, through the transport (wq_transport_*, migration 0013; new jobs
--      are fresh inserts).
-- The other lockers fit around it: admission holds a lane FOR SHARE and only inserts; a
-- reclaim holds a lane FOR UPDATE and then only locks todo jobs, which recovery never
-- holds (its old jobs are 'doing' or dead, and adopt cancels todo jobs SKIP LOCKED);
-- a claim locks todo jobs SKIP LOCKED and then runs; a finish locks runs, then jobs.
--
-- SKIP LOCKED is what makes a pass safe to run from several hosts at once: a run another
-- pass (or a heartbeat, a claim, a late finish) holds is skipped and looked at next pass.
-- Every pick is bounded by LIMIT %(batch)s so each transaction stays short; every apply
-- re-checks its condition in a fresh snapshot with the row locks held, so a run that
-- changed between the pick and the apply is left alone (each rescue happens once).

-- name: recovery_expired_pick :many
-- Lock a batch of running runs whose lease ended (it expired, or its owner is gone:
-- migration 0024), with their lane's retry policy. %(gone_only)s: only those whose owner is
-- gone (a worker's check of its peers between recovery passes).
-- `failures` counts the run's failed attempts (the retry budget): a lapse is not one, it
-- is an interruption (the worker died or hung), and a sleep's wake or a hand-back is an
-- attempt but not a failure. The streak is this lapse and the lapses right before
-- it in which nothing settled (no receipt completed, no row done by the attempt):
-- `streak_workers` are their workers, newest first, the evidence of a run that keeps
-- killing the workers it lands on (queues.outcomes.after_lapse). At most the last ten
-- attempts are looked at.
SELECT r.id AS run_id, r.attempt, r.lane, r.release, r.lease_owner, r.lease_expires_at,
       (SELECT count(*) FROM wq_attempts a
         WHERE a.run_id = r.id AND a.attempt < r.attempt AND a.attempt > r.retry_floor
           AND a.outcome = 'failed')::int AS failures,
       streak.workers AS streak_workers,
       r.cancel_requested_at IS NOT NULL AS cancel_requested, l.state::text AS lane_state,
       -- The run's own retry options over its lane's (migration 0015), as the claim reads.
       coalesce(r.retry_max_attempts, l.retry_max_attempts) AS retry_max_attempts,
       coalesce(r.retry_base_s, l.retry_base_s) AS retry_base_s,
       coalesce(r.retry_cap_s, l.retry_cap_s) AS retry_cap_s,
       coalesce(r.retry_jitter, l.retry_jitter) AS retry_jitter,
       r.retry_kind, r.retry_factor
  FROM wq_runs r
  JOIN wq_lanes l ON l.name = r.lane
 CROSS JOIN LATERAL (
     SELECT coalesce(array_agg(t.worker_id ORDER BY t.attempt DESC), '{}') AS workers
       FROM (SELECT q.attempt, q.worker_id,
                    bool_and(q.quiet) OVER (ORDER BY q.attempt DESC) AS streak
               FROM (SELECT a.attempt, coalesce(a.worker_id, '?') AS worker_id,
                            (a.attempt = r.attempt OR a.outcome = 'lease_expired')
                            AND NOT EXISTS (
                                SELECT 1 FROM wq_receipts x
                                 WHERE x.owner_run = r.id AND x.owner_attempt = a.attempt
                                   AND x.status = 'completed')
                            AND NOT EXISTS (
                                SELECT 1 FROM wq_sheet_rows w
                                 WHERE w.run_id = r.id AND w.status = 'done'
                                   AND w.attempt = a.attempt) AS quiet
                       FROM wq_attempts a
                      WHERE a.run_id = r.id AND a.attempt <= r.attempt
                        AND a.attempt > r.retry_floor
                      ORDER BY a.attempt DESC
                      LIMIT 10) q) t
      WHERE t.streak
 ) streak
 WHERE r.state = 'running'
   AND CASE WHEN %(gone_only)s::boolean
            -- One probe per owner of a running run, not one per run.
            THEN r.lease_owner IN (SELECT o.owner
                                     FROM (SELECT DISTINCT x.lease_owner AS owner
                                             FROM wq_runs x
                                            WHERE x.state = 'running') o
                                    WHERE wq_worker_gone(o.owner,
                                                         coalesce(%(now)s::timestamptz, now())))
            ELSE wq_lease_lapsed(r.lease_owner, r.lease_expires_at,
                                 coalesce(%(now)s::timestamptz, now())) END
 ORDER BY r.lease_expires_at
 LIMIT %(batch)s
   FOR UPDATE OF r SKIP LOCKED;

-- name: recovery_lapse_shared :one
-- Whether another unfinished run of the lane lost attempts on every one of `workers` too
-- (lapsed, or still leased to a dead one): it was there at each of those deaths, and may
-- as well be what caused them, so the run is not blamed (queues.outcomes.after_lapse).
-- Asked only of a run at the poison bound; a run that lapsed on every one of them has at
-- least as many attempts, which keeps the look to the lane's retried runs.
SELECT EXISTS (
    SELECT 1
      FROM wq_runs s
     WHERE s.lane = %(lane)s AND s.state IN ('queued', 'running', 'sleeping')
       AND s.id <> %(run_id)s AND s.attempt >= cardinality(%(workers)s::text[])
       AND (SELECT count(DISTINCT a.worker_id) FROM wq_attempts a
             WHERE a.run_id = s.id AND a.worker_id = ANY(%(workers)s::text[])
               AND a.outcome IN ('lease_expired', 'running'))
           = cardinality(%(workers)s::text[])
) AS shared;

-- name: recovery_expired_apply :many
-- Close lapsed attempts as lease_expired; retry (new job), fail or cancel their runs. The
-- fence is the pick's rule (wq_lease_lapsed), checked again under the row lock.
-- The attempt number is not bumped: the run leaves 'running' and drops its lease, which
-- already refuses the dead attempt's heartbeats and writes; the next claim bumps it.
WITH input AS (
    SELECT *
      FROM unnest(%(run_ids)s::uuid[], %(attempts)s::int[], %(states)s::text[],
                  %(spawn)s::boolean[], %(delays)s::float8[], %(codes)s::text[],
                  %(whys)s::text[])
           AS i(run_id, attempt, state, spawn, delay_s, code, why)
), fenced AS (
    SELECT r.id, r.lane, r.job_id AS old_job_id, r.lease_owner, r.lease_expires_at,
           i.attempt, i.state, i.spawn, i.code, i.why,
           CASE WHEN i.state = 'queued'
                THEN coalesce(%(now)s::timestamptz, now()) + make_interval(secs => i.delay_s)
           END AS retry_at,
           CASE WHEN i.spawn THEN wq_transport_next_id() END AS new_job_id
      FROM wq_runs r
      JOIN input i ON i.run_id = r.id
     WHERE r.attempt = i.attempt
       AND r.state = 'running'
       AND wq_lease_lapsed(r.lease_owner, r.lease_expires_at,
                           coalesce(%(now)s::timestamptz, now()))
       FOR UPDATE OF r
), runs AS (
    UPDATE wq_runs r
       SET state = f.state::wq_run_state,
           lease_owner = NULL,
           lease_expires_at = NULL,
           job_id = f.new_job_id,
           available_at = f.retry_at,
           wait_event = NULL,
           wake_payload = NULL,
           error = jsonb_strip_nulls(jsonb_build_object(
               'code', f.code,
               'message', 'the lease of attempt ' || f.attempt || ' lapsed (worker '
                          || coalesce(f.lease_owner, '?') || ' died or hung)'
                          || coalesce(': ' || f.why, ''),
               'attempt', f.attempt,
               'lease_owner', f.lease_owner)),
           finished_at = CASE WHEN f.state IN ('failed', 'cancelled')
                              THEN coalesce(%(now)s::timestamptz, now()) END,
           -- The lease_expired event takes the run's next seq (docs/design.md, 11b): under
           -- the row lock `fenced` holds, the function takes the run's ledger lock and
           -- reads the last seq after it.
           ledger_seq = wq_ledger_next_seq(r.id, r.ledger_seq),
           updated_at = now()
      FROM fenced f
     WHERE r.id = f.id
    RETURNING r.id, r.ledger_seq
), expired AS (
    -- The event as the attempt row holds it.
    SELECT f.id, f.attempt, n.ledger_seq AS seq,
           jsonb_strip_nulls(jsonb_build_object(
               'lease_owner', f.lease_owner, 'next_state', f.state, 'retry_at', f.retry_at,
               'job_id', f.new_job_id)) AS data
      FROM fenced f
      JOIN runs n ON n.id = f.id
), jobs AS (
    -- The transport: fail the lapsed attempts' jobs, spawn the retries. One row, read by the
    -- final SELECT so that it runs.
    SELECT wq_transport_settle(array_agg(f.old_job_id), array_agg(false)) AS settled,
           wq_transport_spawn(array_agg(f.new_job_id) FILTER (WHERE f.spawn),
                              array_agg(f.lane) FILTER (WHERE f.spawn),
                              array_agg(f.id) FILTER (WHERE f.spawn),
                              array_agg(f.retry_at) FILTER (WHERE f.spawn)) AS spawned
      FROM fenced f
), attempts AS (
    UPDATE wq_attempts a
       SET outcome = 'lease_expired',
           error = jsonb_build_object('code', 'LEASE_EXPIRED', 'lease_owner', f.lease_owner,
                                      'lease_expires_at', f.lease_expires_at),
           finished_at = coalesce(%(now)s::timestamptz, now()),
           end_seq = x.seq, end_kind = 'lease_expired', end_data = x.data
      FROM fenced f
      JOIN expired x ON x.id = f.id
     WHERE a.run_id = f.id AND a.attempt = f.attempt AND a.outcome = 'running'
    RETURNING a.run_id, a.attempt, a.end_seq, a.end_kind, a.end_data
), events AS (
    -- Read from the attempt rows written, so the event trigger finds them (migration 0041).
    INSERT INTO wq_events (run_id, attempt, kind, data, seq)
    SELECT w.run_id, w.attempt, w.end_kind, w.end_data, w.end_seq
      FROM attempts w
)
SELECT f.id AS run_id, f.attempt, f.lane, f.state, f.new_job_id AS job_id, f.retry_at
  FROM fenced f
 CROSS JOIN jobs;

-- name: recovery_orphans_pick :many
-- Lock a batch of waiting runs with no waiting job: queued (a queued run with a cancel
-- pending waits for its cleanup attempt), due sleepers, woken waiters (their org emitted
-- the event since the run was admitted). A waiting job is one in 'todo'; a missing,
-- failed, cancelled or aborted job leaves the run an orphan, and so does a delivered one
-- ('doing': its claimer died between its claim and its drop, migration 0022). The job is
-- probed by its key, one per run looked at (wq_transport_job_waiting): as a join,
-- statistics analyzed while the lane was empty made it a read of every live job per
-- queued run (migration 0021).
SELECT r.id AS run_id, r.lane, r.release, r.state::text AS state, l.state::text AS lane_state,
       r.cancel_requested_at IS NOT NULL AS cancel_requested
  FROM wq_runs r
  JOIN wq_lanes l ON l.name = r.lane
 WHERE (r.state = 'queued'
        OR (r.state = 'sleeping'
            AND (r.available_at <= coalesce(%(now)s::timestamptz, now())
                 OR EXISTS (SELECT 1 FROM wq_emitted_events e
                             WHERE e.org = r.org AND e.name = r.wait_event
                               AND e.emitted_at >= r.created_at))))
   AND NOT wq_transport_job_waiting(r.job_id)
 ORDER BY r.updated_at
 LIMIT %(batch)s
   FOR UPDATE OF r SKIP LOCKED;

-- name: recovery_respawn_apply :many
-- Give locked orphans a new job on their lane (the same spawn as run_submit).
WITH fenced AS (
    SELECT r.id, r.lane, r.job_id AS old_job_id,
           (SELECT j.status FROM wq_transport_jobs() j WHERE j.id = r.job_id)
               AS old_job_status,
           e.name IS NOT NULL AS woken, e.payload,
           CASE WHEN r.state = 'queued' AND r.cancel_requested_at IS NOT NULL THEN 'cleanup'
                WHEN r.state = 'queued' THEN 'orphan'
                WHEN e.name IS NOT NULL THEN 'woken_waiter'
                ELSE 'due_sleeper' END AS reason,
           CASE WHEN e.name IS NULL AND r.available_at > coalesce(%(now)s::timestamptz, now())
                THEN r.available_at END AS scheduled_at,
           wq_transport_next_id() AS new_job_id
      FROM wq_runs r
      LEFT JOIN wq_emitted_events e
             ON r.state = 'sleeping' AND e.org = r.org AND e.name = r.wait_event
            AND e.emitted_at >= r.created_at
     WHERE r.id = ANY (%(run_ids)s::uuid[])
       AND (r.cancel_requested_at IS NULL OR r.state = 'queued')
       AND (r.state = 'queued'
            OR (r.state = 'sleeping'
                AND (r.available_at <= coalesce(%(now)s::timestamptz, now())
                     OR e.name IS NOT NULL)))
       AND NOT wq_transport_job_waiting(r.job_id)
       FOR UPDATE OF r
), runs AS (
    UPDATE wq_runs r
       SET job_id = f.new_job_id,
           available_at = CASE WHEN f.woken THEN NULL ELSE r.available_at END,
           wake_payload = CASE WHEN f.woken THEN f.payload ELSE r.wake_payload END,
           updated_at = now()
      FROM fenced f
     WHERE r.id = f.id
), jobs AS (
    -- One row, read by the final SELECT so that the spawn runs.
    SELECT wq_transport_spawn(array_agg(f.new_job_id), array_agg(f.lane), array_agg(f.id),
                              array_agg(f.scheduled_at)) AS spawned
      FROM fenced f
), events AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT f.id, 'respawned',
           jsonb_strip_nulls(jsonb_build_object(
               'reason', f.reason, 'lane', f.lane, 'job_id', f.new_job_id,
               'old_job_id', f.old_job_id,
               'old_job_status', CASE WHEN f.old_job_id IS NULL THEN NULL
                                      ELSE coalesce(f.old_job_status, 'missing') END))
      FROM fenced f
)
SELECT f.id AS run_id, f.lane, f.reason,
       CASE WHEN f.old_job_id IS NULL THEN 'none'
            ELSE coalesce(f.old_job_status, 'missing') END AS old_job_status,
       f.new_job_id AS job_id
  FROM fenced f
 CROSS JOIN jobs;

-- name: recovery_cancel_orphans :many
-- Finish locked sleepers whose cancellation was requested (a claim would only drop them).
-- The run row stands for their run_cancelled, under the seq it takes (docs/design.md, 11b).
WITH done AS (
    UPDATE wq_runs r
       SET state = 'cancelled',
           job_id = NULL,
           finished_at = coalesce(%(now)s::timestamptz, now()),
           updated_at = now(),
           (ledger_seq, ledger_end_seq) =
               (SELECT n, n FROM wq_ledger_next_seq(r.id, r.ledger_seq) AS n),
           ledger_end_kind = 'run_cancelled',
           ledger_end_data = jsonb_strip_nulls(jsonb_build_object('reason', r.cancel_reason)),
           ledger_end_at = now()
     WHERE r.id = ANY (%(run_ids)s::uuid[])
       AND r.state = 'sleeping'
       AND r.cancel_requested_at IS NOT NULL
       AND NOT wq_transport_job_waiting(r.job_id)
    RETURNING r.id, r.ledger_end_seq, r.ledger_end_data
), events AS (
    INSERT INTO wq_events (run_id, kind, data, seq)
    SELECT id, 'run_cancelled', ledger_end_data, ledger_end_seq
      FROM done
)
SELECT id AS run_id FROM done;

-- name: recovery_lane_share :one
-- Hold one lane FOR SHARE until commit (as admission does), so a reclaim waits for us.
SELECT name, state::text FROM wq_lanes WHERE name = %(name)s FOR SHARE;

-- name: recovery_retention_runs :many
-- Delete a batch of terminal runs past their lane's retention (cascades to their rows),
-- with the receipts of their own run scope (named scopes outlive runs on purpose).
-- The walk of wq_runs_finished_idx stops at the latest cutoff of any lane: without that
-- bound a pass read every finished run kept (1.3 s a pass with 1,000,000 of them,
-- bench.history) to find none expired.
WITH doomed AS (
    SELECT r.id, r.org, r.play
      FROM wq_runs r
      JOIN wq_lanes l ON l.name = r.lane
     WHERE r.finished_at IS NOT NULL
       AND r.state IN ('succeeded', 'failed', 'cancelled')
       AND r.finished_at < (SELECT coalesce(%(now)s::timestamptz, now())
                                   - make_interval(secs => min(k.retention_s))
                              FROM wq_lanes k)
       AND r.finished_at < coalesce(%(now)s::timestamptz, now())
                           - make_interval(secs => l.retention_s)
     ORDER BY r.finished_at
     LIMIT %(batch)s
       FOR UPDATE OF r SKIP LOCKED
), receipts AS (
    DELETE FROM wq_receipts rc
     USING doomed d
     WHERE rc.org = d.org AND rc.play = d.play AND rc.scope = 'run:' || d.id
)
DELETE FROM wq_runs r
 USING doomed d
 WHERE r.id = d.id
RETURNING r.id, r.lane;

-- name: recovery_retention_jobs :many
-- Delete a batch of finished run jobs whose last status change is past the lane's retention
-- (wq_transport_prune says how a job's age is read), and of the recovery ticks' own jobs on
-- the maintenance queue past the shortest retention of any lane. A dead job a live run
-- still points at may go too: the orphan pass treats a missing job like a dead one.
WITH cutoffs AS (
    SELECT l.name, coalesce(%(now)s::timestamptz, now())
                   - make_interval(secs => l.retention_s) AS cutoff
      FROM wq_lanes l
)
SELECT p.id
  FROM (SELECT array_agg(k.name) AS lanes, array_agg(k.cutoff) AS cutoffs
          FROM (SELECT name, cutoff FROM cutoffs
                 UNION ALL
                SELECT %(maintenance)s, max(cutoff) FROM cutoffs) k
         WHERE k.cutoff IS NOT NULL) c
 CROSS JOIN wq_transport_prune(c.lanes, c.cutoffs, %(batch)s) AS p (id);

-- name: recovery_retention_events :one
-- Delete a batch of emitted events, and of refused-write log rows, past the event retention.
WITH events AS (
    DELETE FROM wq_emitted_events e
     USING (SELECT org, name FROM wq_emitted_events
             WHERE emitted_at < coalesce(%(now)s::timestamptz, now())
                                - make_interval(secs => %(retention_s)s::float8)
             ORDER BY emitted_at
             LIMIT %(batch)s
               FOR UPDATE SKIP LOCKED) d
     WHERE e.org = d.org AND e.name = d.name
    RETURNING 1
), refusals AS (
    DELETE FROM wq_refusals f
     USING (SELECT id FROM wq_refusals
             WHERE at < coalesce(%(now)s::timestamptz, now())
                        - make_interval(secs => %(retention_s)s::float8)
             ORDER BY at
             LIMIT %(batch)s) d
     WHERE f.id = d.id
    RETURNING 1
)
SELECT (SELECT count(*) FROM events) AS events, (SELECT count(*) FROM refusals) AS refusals;

-- name: recovery_stranded :many
-- Lanes whose unfinished runs no live worker serves (read only; reported, never fixed).
-- A worker is live when it has not stopped and beat within its lane's lease TTL.
SELECT r.lane, l.release, l.state::text AS lane_state, count(*) AS runs,
       count(*) FILTER (
           WHERE r.state = 'queued'
              OR (r.state = 'sleeping'
                  AND r.available_at <= coalesce(%(now)s::timestamptz, now()))) AS runnable,
       coalesce(greatest(0, extract(epoch FROM
           coalesce(%(now)s::timestamptz, now())
           - min(coalesce(r.available_at, r.updated_at)) FILTER (
                 WHERE coalesce(r.available_at, r.updated_at)
                       <= coalesce(%(now)s::timestamptz, now())))), 0)::float8
           AS oldest_wait_s
  FROM wq_runs r
  JOIN wq_lanes l ON l.name = r.lane
 WHERE r.state IN ('queued', 'running', 'sleeping')
   AND NOT EXISTS (
       SELECT 1 FROM wq_workers w
        WHERE r.lane = ANY (w.lanes)
          AND w.stopped_at IS NULL
          AND w.heartbeat_at > coalesce(%(now)s::timestamptz, now())
                               - make_interval(secs => l.lease_ttl_s))
 GROUP BY r.lane, l.release, l.state
HAVING min(coalesce(r.available_at, r.updated_at))
       <= coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(after_s)s::float8)
 ORDER BY oldest_wait_s DESC, r.lane
 LIMIT %(batch)s;

-- name: recovery_adopt_lock :many
-- Lock every unfinished run of the lane being adopted, in id order (waits, never skips).
-- Unbounded on purpose: an operator's adopt moves the whole lane in one transaction.
SELECT id
  FROM wq_runs
 WHERE lane = %(from_lane)s AND state IN ('queued', 'running', 'sleeping')
 ORDER BY id
   FOR UPDATE;

-- name: recovery_adopt_move :one
-- Move locked runs to the new lane; re-spawn their waiting jobs there, cancel the old ones.
-- An old todo job a claim holds right now is skipped, not waited for: that claim will find
-- the run pointing at the new job and drop the delivery.
WITH moving AS (
    SELECT r.id, r.job_id AS old_job_id, j.scheduled_at,
           CASE WHEN j.waiting THEN wq_transport_next_id() END AS new_job_id
      FROM wq_runs r
      LEFT JOIN wq_transport_jobs() j ON j.id = r.job_id
     WHERE r.id = ANY (%(run_ids)s::uuid[])
       AND r.lane = %(from_lane)s
       AND r.state IN ('queued', 'running', 'sleeping')
), old_jobs AS (
    -- One row, read by the final SELECT so that it runs (as new_jobs).
    SELECT wq_transport_withdraw(array_agg(m.old_job_id) FILTER (WHERE m.new_job_id IS NOT NULL))
               AS withdrawn
      FROM moving m
), runs AS (
    UPDATE wq_runs r
       SET lane = %(to_lane)s,
           release = %(to_release)s,
           job_id = coalesce(m.new_job_id, r.job_id),
           updated_at = now()
      FROM moving m
     WHERE r.id = m.id
    RETURNING r.id
), new_jobs AS (
    SELECT wq_transport_spawn(array_agg(m.new_job_id), array_agg(%(to_lane)s::text),
                              array_agg(m.id), array_agg(m.scheduled_at)) AS spawned
      FROM moving m
     WHERE m.new_job_id IS NOT NULL
), events AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT m.id, 'adopted',
           jsonb_strip_nulls(jsonb_build_object('from_lane', %(from_lane)s::text,
                                                'to_lane', %(to_lane)s::text,
                                                'job_id', m.new_job_id))
      FROM moving m
)
SELECT (SELECT count(*) FROM runs) AS moved,
       (SELECT spawned FROM new_jobs) AS jobs_spawned,
       (SELECT withdrawn FROM old_jobs) AS jobs_cancelled;
