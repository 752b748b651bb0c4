-- name: lane_prepare :one
-- Create a lane's registry row if it has none; idempotent, registry rows only (no DDL).
-- Never changes the state of an existing lane: a draining or reclaimed lane stays closed
-- to admissions until an operator reopens it (lane_reopen). The lane records the schema
-- of the code that prepared it (the schema window, migration 0034); with bump, its own
-- release's newer code raises it (a release name reused across schemas, such as dev).
INSERT INTO wq_lanes AS l (name, release, state, schema_version)
VALUES (%(name)s, %(release)s, 'prepared', %(schema_version)s)
ON CONFLICT (name) DO UPDATE SET schema_version = excluded.schema_version, updated_at = now()
 WHERE %(bump)s AND coalesce(l.schema_version, 0) < excluded.schema_version
RETURNING name, release, state::text, concurrency, lease_ttl_s, heartbeat_s,
          retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, max_interruptions,
          retention_s, prepared_at, updated_at, run_timeout_s, org_concurrency;

-- name: lane_reopen :one
-- An operator's explicit reopening of a draining or reclaimed lane to admissions.
UPDATE wq_lanes
   SET state = 'prepared', prepared_at = now(), updated_at = now()
 WHERE name = %(name)s
RETURNING name, release, state::text, concurrency, lease_ttl_s, heartbeat_s,
          retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, max_interruptions,
          retention_s, prepared_at, updated_at, run_timeout_s, org_concurrency;

-- name: lane_get :one
-- One lane's registry row and policies.
SELECT name, release, state::text, concurrency, lease_ttl_s, heartbeat_s,
       retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, max_interruptions,
       retention_s, prepared_at, updated_at, run_timeout_s, org_concurrency
  FROM wq_lanes
 WHERE name = %(name)s;

-- name: lane_list :many
-- Every lane with its counts of unfinished runs, live workers and stale workers. A worker
-- is live while its heartbeat is fresh: within three of the lane's heartbeat intervals
-- (it beats at least that often), never longer than the lease TTL. A stale worker stopped
-- heartbeating without stopping (killed, hung, cut off from the database) within the
-- horizon; older ones are history. Bounded by the lane count and wq_workers' size.
SELECT l.name, l.release, l.state::text,
       (SELECT count(*) FROM wq_runs r
         WHERE r.lane = l.name AND r.state IN ('queued', 'running', 'sleeping')) AS unfinished,
       count(w.id) FILTER (WHERE w.heartbeat_at > f.fresh_since) AS live_workers,
       count(w.id) FILTER (WHERE w.heartbeat_at <= f.fresh_since) AS stale_workers,
       max(w.heartbeat_at) FILTER (WHERE w.heartbeat_at <= f.fresh_since) AS stale_since,
       l.prepared_at, l.updated_at
  FROM wq_lanes l
 CROSS JOIN LATERAL (
       SELECT coalesce(%(now)s::timestamptz, now())
              - make_interval(secs => least(l.lease_ttl_s, 3 * l.heartbeat_s)) AS fresh_since
       ) f
  LEFT JOIN wq_workers w
    ON l.name = ANY (w.lanes) AND w.stopped_at IS NULL
   AND w.heartbeat_at > coalesce(%(now)s::timestamptz, now())
                        - make_interval(secs => %(stale_horizon_s)s::float8)
 GROUP BY l.name, l.release, l.state, l.prepared_at, l.updated_at, f.fresh_since
 ORDER BY l.prepared_at DESC, l.name;

-- name: lane_set_policy :one
-- Change a lane's policies; NULL keeps the current value.
UPDATE wq_lanes
   SET concurrency = coalesce(%(concurrency)s, concurrency),
       lease_ttl_s = coalesce(%(lease_ttl_s)s, lease_ttl_s),
       heartbeat_s = coalesce(%(heartbeat_s)s, heartbeat_s),
       retry_max_attempts = coalesce(%(retry_max_attempts)s, retry_max_attempts),
       retry_base_s = coalesce(%(retry_base_s)s, retry_base_s),
       retry_cap_s = coalesce(%(retry_cap_s)s, retry_cap_s),
       retry_jitter = coalesce(%(retry_jitter)s, retry_jitter),
       max_interruptions = coalesce(%(max_interruptions)s, max_interruptions),
       retention_s = coalesce(%(retention_s)s, retention_s),
       run_timeout_s = coalesce(%(run_timeout_s)s, run_timeout_s),
       org_concurrency = coalesce(%(org_concurrency)s, org_concurrency),
       updated_at = now()
 WHERE name = %(name)s
RETURNING name, release, state::text, concurrency, lease_ttl_s, heartbeat_s,
          retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, max_interruptions,
          retention_s, prepared_at, updated_at, run_timeout_s, org_concurrency;

-- name: lane_lock_for_reclaim :one
-- Take the lane row exclusively so no admission (which holds it FOR SHARE) can slip in.
SELECT name, state::text
  FROM wq_lanes
 WHERE name = %(name)s
   FOR UPDATE;

-- name: lane_unfinished :one
-- Unfinished runs of a lane; run as its own statement after the lock, so that its snapshot
-- sees every admission that committed while the lock was awaited.
SELECT count(*) FROM wq_runs WHERE lane = %(name)s AND state IN ('queued', 'running', 'sleeping');

-- name: lane_set_state :exec
-- Move a lane to another state (drain, reclaim).
UPDATE wq_lanes SET state = %(state)s::wq_lane_state, updated_at = now() WHERE name = %(name)s;

-- name: lane_contract_blockers :many
-- The lanes a contract step that raises the floor to %(below)s waits for: a lane prepared
-- by an older release that still holds unfinished runs (unless reclaimed: an operator
-- retired it), or any lane that live workers of an older release serve (a fresh heartbeat,
-- as lane_list counts them, and not stopped). Read through to_jsonb, so a database from
-- before migration 0034 (no schema_version yet) counts every lane and worker as older.
-- Bounded by the lane count and wq_workers' size.
SELECT name AS lane, release, schema_version, unfinished, live_workers
  FROM (SELECT l.name, l.release,
               (to_jsonb(l) ->> 'schema_version')::integer AS schema_version,
               CASE WHEN l.state <> 'reclaimed'
                     AND coalesce((to_jsonb(l) ->> 'schema_version')::integer, 0) < %(below)s
                    THEN (SELECT count(*) FROM wq_runs r
                           WHERE r.lane = l.name
                             AND r.state IN ('queued', 'running', 'sleeping'))
                    ELSE 0 END AS unfinished,
               (SELECT count(*) FROM wq_workers w
                 WHERE l.name = ANY (w.lanes) AND w.stopped_at IS NULL
                   AND w.heartbeat_at > now() - make_interval(
                           secs => least(l.lease_ttl_s, 3 * l.heartbeat_s))
                   AND coalesce((to_jsonb(w) ->> 'schema_version')::integer, 0) < %(below)s
               ) AS live_workers
          FROM wq_lanes l) b
 WHERE unfinished > 0 OR live_workers > 0
 ORDER BY name;

-- name: lane_retire_below_floor :exec
-- In a contract step's transaction: reclaim every open lane prepared below the new floor
-- (its workers may no longer start, so it must admit nothing), each audited as a reclaim.
-- Read through to_jsonb like lane_contract_blockers. Bounded by the lane count.
WITH retired AS (
    UPDATE wq_lanes l
       SET state = 'reclaimed', updated_at = now()
     WHERE l.state <> 'reclaimed'
       AND coalesce((to_jsonb(l) ->> 'schema_version')::integer, 0) < %(below)s
    RETURNING l.name
)
INSERT INTO wq_operator_actions (actor, action, lane, data)
SELECT %(actor)s, 'reclaim', retired.name,
       jsonb_build_object('reason', 'below the schema floor', 'migration', %(migration)s::text,
                          'floor', %(below)s::integer)
  FROM retired;
