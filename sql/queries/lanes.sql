-- name: lane_prepare :one
-- Create or refresh a lane's registry row; idempotent, registry rows only (no DDL).
INSERT INTO wq_lanes AS l (name, release, state)
VALUES (%(name)s, %(release)s, 'prepared')
ON CONFLICT (name) DO UPDATE
   SET state = 'prepared', updated_at = now()
 WHERE l.state = 'reclaimed'
RETURNING name, release, state::text, concurrency, lease_ttl_s, heartbeat_s,
          retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, retention_s,
          prepared_at, updated_at;

-- name: lane_get :one
-- One lane's registry row and policies.
SELECT name, release, state::text, concurrency, lease_ttl_s, heartbeat_s,
       retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, retention_s,
       prepared_at, updated_at
  FROM wq_lanes
 WHERE name = %(name)s;

-- name: lane_list :many
-- Every lane with its counts of unfinished runs and live workers.
SELECT l.name, l.release, l.state::text,
       (SELECT count(*) FROM wq_runs r
         WHERE r.lane = l.name AND r.state IN ('queued', 'running', 'sleeping')) AS unfinished,
       (SELECT count(*) FROM wq_workers w
         WHERE l.name = ANY (w.lanes) AND w.stopped_at IS NULL
           AND w.heartbeat_at > now() - make_interval(secs => l.lease_ttl_s)) AS live_workers,
       l.prepared_at, l.updated_at
  FROM wq_lanes l
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
       retention_s = coalesce(%(retention_s)s, retention_s),
       updated_at = now()
 WHERE name = %(name)s
RETURNING name, release, state::text, concurrency, lease_ttl_s, heartbeat_s,
          retry_max_attempts, retry_base_s, retry_cap_s, retry_jitter, retention_s,
          prepared_at, updated_at;

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

-- name: lane_cancel_waiting_jobs :many
-- Cancel the waiting jobs of a lane being reclaimed (its runs stay for recovery).
UPDATE procrastinate_jobs
   SET status = 'cancelled'
 WHERE queue_name = %(lane)s AND status = 'todo'
RETURNING id;
