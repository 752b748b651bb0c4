-- name: metrics_lanes :many
-- Per lane: runs by state (and the sleeping ones paused on a budget, queues.costs), due waiting jobs, live workers, oldest due wait (read only).
-- Bounded by the unfinished-runs partial index and the lane's todo-jobs index.
SELECT l.name AS lane,
       l.state::text AS lane_state,
       count(r.id) FILTER (WHERE r.state = 'queued') AS queued,
       count(r.id) FILTER (WHERE r.state = 'running') AS running,
       count(r.id) FILTER (WHERE r.state = 'sleeping') AS sleeping,
       count(r.id) FILTER (WHERE wq_wait_reason(r.state, r.wait_event)
                                 = 'BUDGET_EXHAUSTED') AS budget_paused,
       (SELECT count(*) FROM wq_transport_jobs() j
         WHERE j.lane = l.name AND j.waiting
           AND (j.scheduled_at IS NULL
                OR j.scheduled_at <= coalesce(%(now)s::timestamptz, now()))) AS due_jobs,
       (SELECT count(*) FROM wq_workers w
         WHERE l.name = ANY (w.lanes) AND w.stopped_at IS NULL
           AND w.heartbeat_at > coalesce(%(now)s::timestamptz, now())
                                - make_interval(secs => l.lease_ttl_s)) AS live_workers,
       coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now())
                        - min(coalesce(r.available_at, r.created_at))
                          FILTER (WHERE r.state = 'queued'
                                    AND coalesce(r.available_at, r.created_at)
                                        <= coalesce(%(now)s::timestamptz, now()))), 0)::float
           AS oldest_due_wait_s
  FROM wq_lanes l
  LEFT JOIN wq_runs r
    ON r.lane = l.name AND r.state IN ('queued', 'running', 'sleeping')
 GROUP BY l.name, l.state, l.lease_ttl_s
 ORDER BY l.name;

-- name: metrics_attempts :one
-- Attempt outcomes that finished within the window, and the writes the fence refused.
SELECT count(*) FILTER (WHERE outcome = 'lease_expired') AS lease_rescues,
       (SELECT count(*) FROM wq_refusals
         WHERE at > coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(window_s)s))
           AS stale_writes_refused,
       count(*) FILTER (WHERE outcome = 'failed') AS failed_attempts,
       count(*) FILTER (WHERE outcome = 'succeeded') AS succeeded_attempts,
       count(*) FILTER (WHERE outcome = 'handed_back') AS handed_back,
       count(*) FILTER (WHERE outcome = 'interrupted') AS interrupted_attempts
  FROM wq_attempts
 WHERE finished_at > coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(window_s)s);

-- name: metrics_refusals :many
-- Writes the fence refused within the window, per kind (receipt, admission, rows, emit,
-- final): statements, and the rows or keys they carried.
SELECT kind, count(*) AS writes, coalesce(sum(rows), 0)::bigint AS rows
  FROM wq_refusals
 WHERE at > coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(window_s)s)
 GROUP BY kind
 ORDER BY kind;
