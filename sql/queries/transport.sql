-- The transport's own statements, issued by queues/transport.py: calls of the
-- wq_transport_* functions (sql/migrations/0013), which alone touch procrastinate's tables.

-- name: transport_register_worker :one
-- Register a worker with the transport; the jobs it takes carry the id this returns.
SELECT wq_transport_register_worker() AS worker_id;

-- name: transport_pass_on :one
-- Pass on a wake meant for this worker alone that it has no room for: out of the set of
-- waiting workers, and a waiting live worker per lane woken instead, itself excepted, else
-- the lane's broadcast (wq_transport_wake, migration 0032). Its own row is written before
-- the function reads the set, but the function's snapshot would still show it waiting:
-- hence the exception.
WITH stopped_waiting AS (
    UPDATE wq_workers SET waiting_since = NULL
     WHERE id = %(worker)s AND waiting_since IS NOT NULL
)
SELECT wq_transport_wake(%(lanes)s::text[], %(worker)s) AS woken;
