-- The dashboard's reads (queues.dashboard): read only, each bounded by a LIMIT or by one
-- run's rows. Run with the reader role.

-- name: dashboard_runs :many
-- Runs, newest first, filtered by state, play, release, org, admission time, and a search
-- by run id or idempotency key; bounded by limit.
SELECT id, org, play, release, lane, idempotency_key, state::text AS state, attempt,
       input_rows, rows_admitted, rows_done, created_at, started_at, finished_at,
       error ->> 'type' AS error_type, error ->> 'message' AS error_message
  FROM wq_runs
 WHERE (%(state)s::text IS NULL OR state::text = %(state)s)
   AND (%(play)s::text IS NULL OR play = %(play)s)
   AND (%(release)s::text IS NULL OR release = %(release)s)
   AND (%(org)s::text IS NULL OR org = %(org)s)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s)
   AND ((%(search_id)s::uuid IS NULL AND %(search_key)s::text IS NULL)
        OR id = %(search_id)s::uuid
        OR idempotency_key = %(search_key)s::text)
 ORDER BY created_at DESC
 LIMIT %(limit)s;

-- name: dashboard_events_tail :many
-- A run's latest ledger events, in seq order (the last `limit` of them).
SELECT id, run_id, seq, attempt, kind, data, idempotency_key, at
  FROM (SELECT id, run_id, seq, attempt, kind, data, idempotency_key, at
          FROM wq_ledger  -- wq_events and the state rows (docs/design.md, 11b)
         WHERE run_id = %(run_id)s
         ORDER BY seq DESC
         LIMIT %(limit)s) AS tail
 ORDER BY seq;

-- name: dashboard_sheet_progress :many
-- A run's sheet progress, folded from its ledger: per sheet, rows admitted and re-admitted,
-- rows committed (replays included), written as failed, and stale per reason.
WITH ev AS (
    SELECT kind, data
      FROM wq_events
     WHERE run_id = %(run_id)s
       AND kind IN ('rows_admitted', 'rows_completed')
), counts AS (
    SELECT data ->> 'sheet' AS sheet,
           coalesce(sum((data ->> 'admitted')::bigint)
                    FILTER (WHERE kind = 'rows_admitted'), 0)::bigint AS admitted,
           coalesce(sum((data ->> 'readmitted')::bigint)
                    FILTER (WHERE kind = 'rows_admitted'), 0)::bigint AS readmitted,
           coalesce(sum((data ->> 'committed')::bigint)
                    FILTER (WHERE kind = 'rows_completed'), 0)::bigint AS committed,
           coalesce(sum((data ->> 'replayed')::bigint)
                    FILTER (WHERE kind = 'rows_completed'), 0)::bigint AS replayed,
           coalesce(sum((data ->> 'failed')::bigint)
                    FILTER (WHERE kind = 'rows_completed'), 0)::bigint AS failed
      FROM ev
     GROUP BY data ->> 'sheet'
), per_reason AS (
    SELECT ev.data ->> 'sheet' AS sheet, s.key AS reason, sum(s.value::bigint) AS n
      FROM ev,
           jsonb_each_text(CASE WHEN jsonb_typeof(ev.data -> 'stale') = 'object'
                                THEN ev.data -> 'stale' ELSE '{}'::jsonb END) AS s
     WHERE ev.kind = 'rows_completed'
     GROUP BY 1, 2
), stale AS (
    SELECT sheet, jsonb_object_agg(reason, n) AS stale FROM per_reason GROUP BY sheet
)
SELECT c.sheet, c.admitted, c.readmitted, c.committed, c.replayed, c.failed,
       coalesce(s.stale, '{}'::jsonb) AS stale
  FROM counts c
  LEFT JOIN stale s ON s.sheet IS NOT DISTINCT FROM c.sheet
 ORDER BY c.sheet;

-- name: dashboard_steps :many
-- The latest steps (work receipts) of a run's own scope, newest first; bounded by limit.
SELECT step_key, status::text AS status, owner_attempt, created_at, completed_at, error
  FROM wq_receipts
 WHERE org = %(org)s AND play = %(play)s AND scope = %(scope)s
 ORDER BY created_at DESC, step_key
 LIMIT %(limit)s;

-- name: dashboard_step_counts :many
-- How many of a run's own steps are in each status.
SELECT status::text AS status, count(*) AS n
  FROM wq_receipts
 WHERE org = %(org)s AND play = %(play)s AND scope = %(scope)s
 GROUP BY status
 ORDER BY status;

-- name: dashboard_lanes :many
-- Every lane with its policy, newest first.
SELECT name, release, state::text AS state, concurrency, lease_ttl_s, heartbeat_s,
       retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, max_interruptions,
       retention_s, prepared_at, updated_at, run_timeout_s, org_concurrency
  FROM wq_lanes
 ORDER BY prepared_at DESC, name;

-- name: dashboard_stranded_runs :many
-- Unfinished runs waiting on the given (stranded) lanes, oldest first; bounded by limit.
SELECT id, lane, play, state::text AS state, created_at, available_at
  FROM wq_runs
 WHERE lane = ANY (%(lanes)s::text[])
   AND state IN ('queued', 'sleeping')
 ORDER BY created_at
 LIMIT %(limit)s;

-- name: dashboard_throughput :many
-- Attempts that finished in the last `minutes` minutes, per minute: succeeded, failed
-- (failed or lease expired) and all. Bounded by the window.
SELECT date_trunc('minute', finished_at) AS minute,
       count(*) FILTER (WHERE outcome = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE outcome IN ('failed', 'lease_expired')) AS failed,
       count(*) AS finished
  FROM wq_attempts
 WHERE finished_at > coalesce(%(now)s::timestamptz, now()) - make_interval(mins => %(minutes)s)
 GROUP BY 1
 ORDER BY 1;

-- name: dashboard_releases :many
-- The releases that have a lane (the runs page's release filter).
SELECT release FROM wq_lanes ORDER BY prepared_at DESC LIMIT 200;

-- name: dashboard_now_minute :one
-- The database's current minute (the charts' last bar), or that of a given time.
SELECT date_trunc('minute', coalesce(%(now)s::timestamptz, now())) AS minute;
