-- name: run_submit :one
-- Admission in one statement: lane check under FOR SHARE, launch row, job, ledger event.
-- Lock order: the lane row (FOR SHARE, so a reclaim's FOR UPDATE waits for us), then the
-- idempotency index entry. Nothing is inserted unless the lane is prepared.
WITH lane AS (
    SELECT name, state FROM wq_lanes WHERE name = %(lane)s FOR SHARE
), ids AS (
    SELECT nextval('procrastinate_jobs_id_seq') AS job_id
      FROM lane WHERE lane.state = 'prepared'
), run AS (
    INSERT INTO wq_runs (id, org, play, params, release, lane, idempotency_key, job_id, authority)
    SELECT %(id)s, %(org)s, %(play)s, %(params)s, %(release)s, %(lane)s, %(key)s, ids.job_id,
           %(authority)s
      FROM ids
    ON CONFLICT (org, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, job_id, lane
), job AS (
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, priority, args)
    SELECT run.job_id, run.lane, 'wq.run', %(priority)s, jsonb_build_object('run_id', run.id)
      FROM run
    RETURNING id
), event AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT run.id, 'run_created',
           jsonb_build_object('play', %(play)s::text, 'lane', run.lane, 'org', %(org)s::text)
      FROM run
)
SELECT (SELECT state::text FROM lane) AS lane_state,
       (SELECT id FROM run) AS run_id,
       (SELECT id FROM job) AS job_id;

-- name: run_by_key :one
-- The run an idempotency key already admitted (to answer created=false or a conflict).
SELECT id, play, params, state::text, lane
  FROM wq_runs
 WHERE org = %(org)s AND idempotency_key = %(key)s;

-- name: run_claim_batch :many
-- Take up to N due jobs of the lanes and start a new attempt on each of their runs.
-- A delivery whose run is terminal, cancelled, leased or not pointing at this job is
-- returned as dropped (claimed = false). SKIP LOCKED keeps claimers off each other's rows.
WITH picked AS (
    -- Per lane, an ordered walk of wq_jobs_lane_todo_idx (lane, priority, id) that stops
    -- after N rows whatever the table statistics or other lanes' backlog; then the best N
    -- over the lanes (one lane, unless the worker adopted others).
    SELECT j.id
      FROM unnest(%(lanes)s::text[]) AS lane (name)
     CROSS JOIN LATERAL (
            SELECT j.id, j.priority
              FROM procrastinate_jobs j
             WHERE j.status = 'todo'
               AND j.queue_name = lane.name
               AND j.task_name = 'wq.run'
               AND (j.scheduled_at IS NULL
                    OR j.scheduled_at <= coalesce(%(now)s::timestamptz, now()))
             ORDER BY j.priority DESC, j.id
             LIMIT %(limit)s
               FOR UPDATE OF j SKIP LOCKED
           ) j
     ORDER BY j.priority DESC, j.id
     LIMIT %(limit)s
), taken AS (
    UPDATE procrastinate_jobs j
       SET status = 'doing', worker_id = %(procrastinate_worker)s
      FROM picked
     WHERE j.id = picked.id
    -- Parsed only for the taken rows: a run id that is not a UUID comes back NULL (dropped).
    RETURNING j.id,
              CASE WHEN j.args ->> 'run_id'
                        ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                   THEN (j.args ->> 'run_id')::uuid END AS run_id
), claimed AS (
    UPDATE wq_runs r
       SET state = 'running',
           attempt = r.attempt + 1,
           lease_owner = %(worker)s,
           lease_expires_at = coalesce(%(now)s::timestamptz, now())
                              + make_interval(secs => l.lease_ttl_s),
           started_at = coalesce(r.started_at, coalesce(%(now)s::timestamptz, now())),
           available_at = NULL,
           updated_at = now()
      FROM taken, wq_lanes l
     WHERE r.id = taken.run_id
       AND l.name = r.lane
       AND r.job_id = taken.id
       AND r.state IN ('queued', 'sleeping')
       AND r.cancel_requested_at IS NULL
       AND r.play = ANY (%(plays)s::text[])
    RETURNING r.id, r.attempt, r.org, r.play, r.params, r.lane, r.release, r.job_id,
              r.lease_expires_at, r.wake_payload, l.lease_ttl_s, l.heartbeat_s,
              l.retry_max_attempts, l.retry_base_s, l.retry_cap_s, l.retry_jitter,
              -- Failed attempts so far: sleeps and hand-backs do not spend the retry budget.
              (SELECT count(*) FROM wq_attempts a
                WHERE a.run_id = r.id AND a.outcome IN ('failed', 'lease_expired'))::int
                  AS failures
), unknown AS (
    -- A play this release does not have can never run on this lane: fail the run at once
    -- instead of burning attempts on it.
    UPDATE wq_runs r
       SET state = 'failed',
           error = jsonb_build_object(
               'code', 'PLAY_UNKNOWN',
               'message', 'play ' || r.play || ' is not registered in release ' || r.release),
           job_id = NULL,
           finished_at = now(),
           updated_at = now()
      FROM taken
     WHERE r.id = taken.run_id
       AND r.job_id = taken.id
       AND r.state IN ('queued', 'sleeping')
       AND r.cancel_requested_at IS NULL
       AND NOT (r.play = ANY (%(plays)s::text[]))
    RETURNING r.id, r.play
), unknown_event AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT id, 'run_failed', jsonb_build_object('code', 'PLAY_UNKNOWN', 'play', play)
      FROM unknown
), attempt AS (
    INSERT INTO wq_attempts (run_id, attempt, worker_id)
    SELECT id, attempt, %(worker)s FROM claimed
), event AS (
    INSERT INTO wq_events (run_id, attempt, kind, data)
    SELECT id, attempt, 'attempt_started', jsonb_build_object('worker', %(worker)s::text)
      FROM claimed
)
SELECT true AS claimed, c.id AS run_id, c.attempt, c.org, c.play, c.params, c.lane,
       c.release, c.job_id, c.lease_expires_at, c.wake_payload, c.lease_ttl_s, c.heartbeat_s,
       c.retry_max_attempts, c.retry_base_s, c.retry_cap_s, c.retry_jitter, c.failures
  FROM claimed c
UNION ALL
SELECT false, t.run_id, NULL, NULL, NULL, NULL, NULL, NULL, t.id, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL
  FROM taken t
 WHERE NOT EXISTS (SELECT 1 FROM claimed c WHERE c.job_id = t.id);

-- name: job_drop :exec
-- Acknowledge deliveries that carry no work (duplicate, late, or for a finished run).
UPDATE procrastinate_jobs
   SET status = 'succeeded', attempts = attempts + 1
 WHERE id = ANY (%(job_ids)s::bigint[]) AND status = 'doing';

-- name: run_heartbeat :many
-- Renew the leases of this worker's live attempts; a run missing from the answer lost its
-- lease (rescued, superseded or cancelled) and its attempt must stop.
UPDATE wq_runs r
   SET lease_expires_at = coalesce(%(now)s::timestamptz, now())
                          + make_interval(secs => l.lease_ttl_s)
  FROM wq_lanes l,
       unnest(%(run_ids)s::uuid[], %(attempts)s::int[]) AS i(run_id, attempt)
 WHERE r.id = i.run_id
   AND r.attempt = i.attempt
   AND r.state = 'running'
   AND r.lease_owner = %(worker)s
   AND l.name = r.lane
RETURNING r.id AS run_id, r.attempt, r.lease_expires_at, r.cancel_requested_at IS NOT NULL AS cancel;

-- name: run_finish_batch :many
-- Write the outcome of finished attempts, fenced: only where the run still carries the
-- attempt number and this worker's lease. Stale rows are simply absent from the answer.
-- Also finishes the delivering job, and spawns the next job (retry, hand-back, wake).
WITH input AS (
    SELECT *
      FROM unnest(%(run_ids)s::uuid[], %(attempts)s::int[], %(states)s::text[],
                  %(outcomes)s::text[], %(results)s::jsonb[], %(errors)s::jsonb[],
                  %(spawn)s::boolean[], %(spawn_at)s::timestamptz[], %(wait_events)s::text[],
                  %(kinds)s::text[])
           AS i(run_id, attempt, state, outcome, result, error, spawn, spawn_at, wait_event,
                kind)
), fenced AS (
    SELECT r.id, r.job_id AS old_job_id, r.lane, i.*,
           CASE WHEN i.spawn THEN nextval('procrastinate_jobs_id_seq') END AS new_job_id
      FROM wq_runs r
      JOIN input i ON i.run_id = r.id
     WHERE r.attempt = i.attempt
       AND r.state = 'running'
       AND r.lease_owner = %(worker)s
       FOR UPDATE OF r
), runs AS (
    UPDATE wq_runs r
       SET state = f.state::wq_run_state,
           result = coalesce(f.result, r.result),
           error = CASE WHEN f.state = 'succeeded' THEN NULL ELSE coalesce(f.error, r.error) END,
           lease_owner = NULL,
           lease_expires_at = NULL,
           job_id = f.new_job_id,
           available_at = f.spawn_at,
           wait_event = f.wait_event,
           wake_payload = NULL,
           finished_at = CASE WHEN f.state IN ('succeeded', 'failed', 'cancelled')
                              THEN now() END,
           updated_at = now()
      FROM fenced f
     WHERE r.id = f.id
    RETURNING r.id
), old_jobs AS (
    UPDATE procrastinate_jobs j
       SET status = CASE WHEN f.outcome = 'succeeded' THEN 'succeeded'
                         ELSE 'failed' END::procrastinate_job_status,
           attempts = j.attempts + 1
      FROM fenced f
     WHERE j.id = f.old_job_id AND j.status = 'doing'
), new_jobs AS (
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, args, scheduled_at)
    SELECT f.new_job_id, f.lane, 'wq.run', jsonb_build_object('run_id', f.id), f.spawn_at
      FROM fenced f
     WHERE f.spawn
), attempts AS (
    UPDATE wq_attempts a
       SET outcome = f.outcome::wq_attempt_outcome, error = f.error, finished_at = now()
      FROM fenced f
     WHERE a.run_id = f.id AND a.attempt = f.attempt
), events AS (
    INSERT INTO wq_events (run_id, attempt, kind, data)
    SELECT f.id, f.attempt, f.kind,
           jsonb_strip_nulls(jsonb_build_object('error', f.error, 'spawn_at', f.spawn_at,
                                                'wait_event', f.wait_event))
      FROM fenced f
)
SELECT f.id, f.attempt FROM fenced f;

-- name: run_attempt_superseded :exec
-- Record that a stale attempt's final write was refused (its attempt row only).
UPDATE wq_attempts
   SET outcome = 'superseded', finished_at = now()
 WHERE run_id = %(run_id)s AND attempt = %(attempt)s AND outcome = 'running';

-- name: run_cancel :one
-- Cancel a run in one statement: durable request, immediate stop of a queued/sleeping run
-- and its waiting job; a running attempt is told via NOTIFY and writes 'cancelled' itself.
WITH target AS (
    SELECT id, state, job_id FROM wq_runs WHERE id = %(run_id)s FOR UPDATE
), req AS (
    UPDATE wq_runs r
       SET cancel_requested_at = coalesce(r.cancel_requested_at, now()),
           cancel_reason = coalesce(r.cancel_reason, %(reason)s),
           state = CASE WHEN t.state IN ('queued', 'sleeping') THEN 'cancelled'::wq_run_state
                        ELSE r.state END,
           finished_at = CASE WHEN t.state IN ('queued', 'sleeping') THEN now()
                              ELSE r.finished_at END,
           job_id = CASE WHEN t.state IN ('queued', 'sleeping') THEN NULL ELSE r.job_id END,
           updated_at = now()
      FROM target t
     WHERE r.id = t.id AND t.state IN ('queued', 'sleeping', 'running')
       AND r.cancel_requested_at IS NULL
    RETURNING r.id, r.state
), job AS (
    UPDATE procrastinate_jobs j
       SET status = 'cancelled'
      FROM target t, req
     WHERE j.id = t.job_id AND j.status = 'todo' AND req.state = 'cancelled'
    RETURNING j.id
), event AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT req.id,
           CASE WHEN req.state = 'cancelled' THEN 'run_cancelled' ELSE 'cancel_requested' END,
           jsonb_build_object('reason', %(reason)s::text)
      FROM req
), notify AS (
    SELECT pg_notify('wq_control', json_build_object('cancel', req.id)::text) FROM req
     WHERE req.state = 'running'
)
SELECT (SELECT state::text FROM target) AS before,
       (SELECT state::text FROM req) AS after,
       (SELECT count(*) FROM job) AS jobs_cancelled,
       (SELECT count(*) FROM notify) AS notified;

-- name: run_get :one
-- One run as the CLI and the API show it.
SELECT id, org, play, params, release, lane, idempotency_key, state::text, attempt,
       lease_owner, lease_expires_at, job_id, available_at, wait_event, result, error,
       cancel_requested_at, cancel_reason, input_rows, rows_admitted, rows_done, created_at,
       started_at, finished_at
  FROM wq_runs
 WHERE id = %(run_id)s;

-- name: run_list :many
-- Recent runs, newest first, optionally of one state or lane.
SELECT id, org, play, params, release, lane, idempotency_key, state::text, attempt,
       lease_owner, lease_expires_at, job_id, available_at, wait_event, result, error,
       cancel_requested_at, cancel_reason, input_rows, rows_admitted, rows_done, created_at,
       started_at, finished_at
  FROM wq_runs
 WHERE (%(state)s::text IS NULL OR state::text = %(state)s)
   AND (%(lane)s::text IS NULL OR lane = %(lane)s)
 ORDER BY created_at DESC
 LIMIT %(limit)s;

-- name: run_events :many
-- The ledger of a run after a given event id.
SELECT id, run_id, attempt, kind, data, at
  FROM wq_events
 WHERE run_id = %(run_id)s AND id > %(after)s
 ORDER BY id;

-- name: run_attempts :many
-- Every attempt of a run.
SELECT run_id, attempt, worker_id, outcome::text, error, started_at, finished_at
  FROM wq_attempts
 WHERE run_id = %(run_id)s
 ORDER BY attempt;

-- name: worker_register :exec
-- Register (or re-register) a worker process.
INSERT INTO wq_workers (id, lanes, release, host, pid, procrastinate_id)
VALUES (%(id)s, %(lanes)s, %(release)s, %(host)s, %(pid)s, %(procrastinate_id)s)
ON CONFLICT (id) DO UPDATE
   SET lanes = excluded.lanes, heartbeat_at = now(), stopped_at = NULL;

-- name: worker_heartbeat :exec
-- Mark a worker alive (also procrastinate's worker row).
WITH w AS (
    UPDATE wq_workers SET heartbeat_at = now() WHERE id = %(id)s RETURNING procrastinate_id
)
UPDATE procrastinate_workers p SET last_heartbeat = now() FROM w WHERE p.id = w.procrastinate_id;

-- name: worker_stop :exec
-- Mark a worker stopped.
UPDATE wq_workers SET stopped_at = now() WHERE id = %(id)s;

-- name: event_lock :exec
-- Serialize emit and wait on one event name (transaction-scoped), so no wake-up is lost.
SELECT pg_advisory_xact_lock(hashtextextended('wq_event:' || %(name)s, 0));

-- name: event_emit :one
-- Record the first emit of an event (first wins) and wake the runs waiting for it.
WITH emitted AS (
    INSERT INTO wq_emitted_events (name, payload) VALUES (%(name)s, %(payload)s)
    ON CONFLICT (name) DO NOTHING
    RETURNING name, payload
), waiting AS (
    SELECT r.id, r.lane, nextval('procrastinate_jobs_id_seq') AS job_id
      FROM wq_runs r, emitted e
     WHERE r.state = 'sleeping' AND r.wait_event = e.name
       FOR UPDATE OF r
), woken AS (
    UPDATE wq_runs r
       SET job_id = w.job_id, available_at = NULL, wake_payload = e.payload, updated_at = now()
      FROM waiting w, emitted e
     WHERE r.id = w.id
    RETURNING r.id
), jobs AS (
    INSERT INTO procrastinate_jobs (id, queue_name, task_name, args)
    SELECT w.job_id, w.lane, 'wq.run', jsonb_build_object('run_id', w.id) FROM waiting w
), events AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT w.id, 'event_received', jsonb_build_object('event', %(name)s::text) FROM waiting w
)
SELECT (SELECT count(*) FROM emitted) AS first, (SELECT count(*) FROM woken) AS woken;

-- name: event_get :one
-- The recorded payload of an emitted event, if it was emitted.
SELECT payload, emitted_at FROM wq_emitted_events WHERE name = %(name)s;

-- name: run_input_insert :exec
-- Store a submit's input rows as pages (same transaction as the launch row) and count them.
WITH pages AS (
    INSERT INTO wq_run_inputs (run_id, page, rows)
    SELECT %(run_id)s, p.page, p.rows
      FROM unnest(%(pages)s::int[], %(rows)s::jsonb[]) AS p(page, rows)
)
UPDATE wq_runs SET input_rows = %(count)s WHERE id = %(run_id)s;

-- name: run_input_page :one
-- One page of a run's input rows (NULL past the last page).
SELECT rows FROM wq_run_inputs WHERE run_id = %(run_id)s AND page = %(page)s;
