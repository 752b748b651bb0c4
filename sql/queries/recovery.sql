-- Recovery: lapsed leases, orphaned runs, retention, stranded lanes, adoption.
--
-- Lock order, in every statement here (and the Python that strings them together):
--   1. wq_runs rows, FOR UPDATE SKIP LOCKED (adopt: FOR UPDATE, ordered by id);
--   2. the wq_lanes rows the batch will spawn on, one at a time in name order: FOR SHARE,
--      or the exclusive row lock of lanes.prepare for a lane that must be re-prepared;
--   3. procrastinate_jobs rows (the runs' old jobs; new jobs are fresh inserts).
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
-- Lock a batch of running runs whose lease lapsed, with their lane's retry policy.
-- `failures` counts this lapse and the run's earlier failed or lapsed attempts: only those
-- spend the retry budget (a sleep's wake or a hand-back is an attempt but not a failure).
SELECT r.id AS run_id, r.attempt, r.lane, r.release, r.lease_owner, r.lease_expires_at,
       1 + (SELECT count(*) FROM wq_attempts a
             WHERE a.run_id = r.id AND a.attempt < r.attempt
               AND a.outcome IN ('failed', 'lease_expired'))::int AS failures,
       r.cancel_requested_at IS NOT NULL AS cancel_requested, l.state::text AS lane_state,
       l.retry_max_attempts, l.retry_base_s, l.retry_cap_s, l.retry_jitter
  FROM wq_runs r
  JOIN wq_lanes l ON l.name = r.lane
 WHERE r.state = 'running'
   AND r.lease_expires_at < coalesce(%(now)s::timestamptz, now())
 ORDER BY r.lease_expires_at
 LIMIT %(batch)s
   FOR UPDATE OF r SKIP LOCKED;

-- name: recovery_expired_apply :many
-- Close lapsed attempts as lease_expired; retry (new job), fail or cancel their runs.
-- The attempt number is not bumped: the run leaves 'running' and drops its lease, which
-- already refuses the dead attempt's heartbeats and writes; the next claim bumps it.
WITH input AS (
    SELECT *
      FROM unnest(%(run_ids)s::uuid[], %(attempts)s::int[], %(states)s::text[],
                  %(spawn)s::boolean[], %(delays)s::float8[])
           AS i(run_id, attempt, state, spawn, delay_s)
), fenced AS (
    SELECT r.id, r.lane, r.job_id AS old_job_id, r.lease_owner, r.lease_expires_at,
           i.attempt, i.state, i.spawn,
           CASE WHEN i.state = 'queued'
                THEN coalesce(%(now)s::timestamptz, now()) + make_interval(secs => i.delay_s)
           END AS retry_at,
           CASE WHEN i.spawn THEN nextval('procrastinate_jobs_id_seq') END AS new_job_id
      FROM wq_runs r
      JOIN input i ON i.run_id = r.id
     WHERE r.attempt = i.attempt
       AND r.state = 'running'
       AND r.lease_expires_at < coalesce(%(now)s::timestamptz, now())
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
           error = jsonb_build_object(
               'code', 'LEASE_EXPIRED',
               'message', 'the lease of attempt ' || f.attempt || ' lapsed (worker '
                          || coalesce(f.lease_owner, '?') || ' died or hung)',
               'attempt', f.attempt,
               'lease_owner', f.lease_owner),
           finished_at = CASE WHEN f.state IN ('failed', 'cancelled')
                              THEN coalesce(%(now)s::timestamptz, now()) END,
           updated_at = now()
      FROM fenced f
     WHERE r.id = f.id
    RETURNING r.id
), old_jobs AS (
    UPDATE procrastinate_jobs j
       SET status = 'failed', attempts = j.attempts + 1
      FROM fenced f
     WHERE j.id = f.old_job_id AND j.status = 'doing'
), new_jobs AS (
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, args, scheduled_at)
    SELECT f.new_job_id, f.lane, 'wq.run', jsonb_build_object('run_id', f.id), f.retry_at
      FROM fenced f
     WHERE f.spawn
), attempts AS (
    UPDATE wq_attempts a
       SET outcome = 'lease_expired',
           error = jsonb_build_object('code', 'LEASE_EXPIRED', 'lease_owner', f.lease_owner,
                                      'lease_expires_at', f.lease_expires_at),
           finished_at = coalesce(%(now)s::timestamptz, now())
      FROM fenced f
     WHERE a.run_id = f.id AND a.attempt = f.attempt AND a.outcome = 'running'
), events AS (
    INSERT INTO wq_events (run_id, attempt, kind, data)
    SELECT f.id, f.attempt, 'lease_expired',
           jsonb_strip_nulls(jsonb_build_object(
               'lease_owner', f.lease_owner, 'next_state', f.state, 'retry_at', f.retry_at,
               'job_id', f.new_job_id))
      FROM fenced f
)
SELECT f.id AS run_id, f.attempt, f.lane, f.state, f.new_job_id AS job_id, f.retry_at
  FROM fenced f;

-- name: recovery_orphans_pick :many
-- Lock a batch of waiting runs with no live job: queued, due sleepers, woken waiters.
-- A live job is one in 'todo' or 'doing'; a missing, failed, cancelled or aborted job
-- (lost, or cancelled by a lane reclaim) leaves the run an orphan.
SELECT r.id AS run_id, r.lane, r.release, r.state::text AS state, l.state::text AS lane_state,
       r.cancel_requested_at IS NOT NULL AS cancel_requested
  FROM wq_runs r
  JOIN wq_lanes l ON l.name = r.lane
 WHERE (r.state = 'queued'
        OR (r.state = 'sleeping'
            AND (r.available_at <= coalesce(%(now)s::timestamptz, now())
                 OR EXISTS (SELECT 1 FROM wq_emitted_events e WHERE e.name = r.wait_event))))
   AND NOT EXISTS (SELECT 1 FROM procrastinate_jobs j
                    WHERE j.id = r.job_id AND j.status IN ('todo', 'doing'))
 ORDER BY r.updated_at
 LIMIT %(batch)s
   FOR UPDATE OF r SKIP LOCKED;

-- name: recovery_respawn_apply :many
-- Give locked orphans a new job on their lane (the same direct insert as run_submit).
WITH fenced AS (
    SELECT r.id, r.lane, r.job_id AS old_job_id,
           (SELECT j.status::text FROM procrastinate_jobs j WHERE j.id = r.job_id)
               AS old_job_status,
           e.name IS NOT NULL AS woken, e.payload,
           CASE WHEN r.state = 'queued' THEN 'orphan'
                WHEN e.name IS NOT NULL THEN 'woken_waiter'
                ELSE 'due_sleeper' END AS reason,
           CASE WHEN e.name IS NULL AND r.available_at > coalesce(%(now)s::timestamptz, now())
                THEN r.available_at END AS scheduled_at,
           nextval('procrastinate_jobs_id_seq') AS new_job_id
      FROM wq_runs r
      LEFT JOIN wq_emitted_events e ON r.state = 'sleeping' AND e.name = r.wait_event
     WHERE r.id = ANY (%(run_ids)s::uuid[])
       AND r.cancel_requested_at IS NULL
       AND (r.state = 'queued'
            OR (r.state = 'sleeping'
                AND (r.available_at <= coalesce(%(now)s::timestamptz, now())
                     OR e.name IS NOT NULL)))
       AND NOT EXISTS (SELECT 1 FROM procrastinate_jobs j
                        WHERE j.id = r.job_id AND j.status IN ('todo', 'doing'))
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
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, args, scheduled_at)
    SELECT f.new_job_id, f.lane, 'wq.run', jsonb_build_object('run_id', f.id), f.scheduled_at
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
  FROM fenced f;

-- name: recovery_cancel_orphans :many
-- Finish locked orphans whose cancellation was requested (a claim would only drop them).
WITH done AS (
    UPDATE wq_runs r
       SET state = 'cancelled',
           job_id = NULL,
           finished_at = coalesce(%(now)s::timestamptz, now()),
           updated_at = now()
     WHERE r.id = ANY (%(run_ids)s::uuid[])
       AND r.state IN ('queued', 'sleeping')
       AND r.cancel_requested_at IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM procrastinate_jobs j
                        WHERE j.id = r.job_id AND j.status IN ('todo', 'doing'))
    RETURNING r.id, r.cancel_reason
), events AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT id, 'run_cancelled', jsonb_strip_nulls(jsonb_build_object('reason', cancel_reason))
      FROM done
)
SELECT id AS run_id FROM done;

-- name: recovery_lane_share :one
-- Hold one lane FOR SHARE until commit (as admission does), so a reclaim waits for us.
SELECT name, state::text FROM wq_lanes WHERE name = %(name)s FOR SHARE;

-- name: recovery_retention_runs :many
-- Delete a batch of terminal runs past their lane's retention (cascades to their rows),
-- with the receipts of their own run scope (named scopes outlive runs on purpose).
WITH doomed AS (
    SELECT r.id, r.org, r.play
      FROM wq_runs r
      JOIN wq_lanes l ON l.name = r.lane
     WHERE r.finished_at IS NOT NULL
       AND r.state IN ('succeeded', 'failed', 'cancelled')
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
-- Delete a batch of finished run jobs whose last status change is past the lane's retention.
-- procrastinate_jobs has no timestamp of its own: the age is that of its latest event, as
-- in procrastinate's own delete_old_jobs. A job with no event is never deleted here. A
-- dead job a live run still points at may go too: the orphan pass treats a missing job
-- like a dead one.
WITH doomed AS (
    SELECT j.id
      FROM procrastinate_jobs j
      JOIN wq_lanes l ON l.name = j.queue_name
     WHERE j.task_name = 'wq.run'
       AND j.status IN ('succeeded', 'failed', 'cancelled', 'aborted')
       AND (SELECT max(e.at) FROM procrastinate_events e WHERE e.job_id = j.id)
           < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => l.retention_s)
     ORDER BY j.id
     LIMIT %(batch)s
       FOR UPDATE OF j SKIP LOCKED
)
DELETE FROM procrastinate_jobs j
 USING doomed d
 WHERE j.id = d.id
RETURNING j.id;

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
           CASE WHEN j.status = 'todo' THEN nextval('procrastinate_jobs_id_seq') END
               AS new_job_id
      FROM wq_runs r
      LEFT JOIN procrastinate_jobs j ON j.id = r.job_id
     WHERE r.id = ANY (%(run_ids)s::uuid[])
       AND r.lane = %(from_lane)s
       AND r.state IN ('queued', 'running', 'sleeping')
), old_jobs AS (
    UPDATE procrastinate_jobs j
       SET status = 'cancelled'
     WHERE j.id IN (SELECT o.id
                      FROM procrastinate_jobs o
                      JOIN moving m ON m.old_job_id = o.id
                     WHERE m.new_job_id IS NOT NULL AND o.status = 'todo'
                       FOR UPDATE OF o SKIP LOCKED)
    RETURNING j.id
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
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, args, scheduled_at)
    SELECT m.new_job_id, %(to_lane)s, 'wq.run', jsonb_build_object('run_id', m.id),
           m.scheduled_at
      FROM moving m
     WHERE m.new_job_id IS NOT NULL
    RETURNING id
), events AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT m.id, 'adopted',
           jsonb_strip_nulls(jsonb_build_object('from_lane', %(from_lane)s::text,
                                                'to_lane', %(to_lane)s::text,
                                                'job_id', m.new_job_id))
      FROM moving m
)
SELECT (SELECT count(*) FROM runs) AS moved,
       (SELECT count(*) FROM new_jobs) AS jobs_spawned,
       (SELECT count(*) FROM old_jobs) AS jobs_cancelled;
