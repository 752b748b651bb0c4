-- The transport's own statements, issued by queues/transport.py: calls of the
-- wq_transport_* functions (sql/migrations/0013), which alone touch procrastinate's tables.

-- name: transport_register_worker :one
-- Register a worker with the transport; the jobs it takes carry the id this returns.
SELECT wq_transport_register_worker() AS worker_id;

-- name: transport_wake :one
-- Wake claimers for jobs of these lanes: a waiting live worker per element, else the
-- lane's broadcast (wq_transport_wake, migration 0032).
SELECT wq_transport_wake(%(lanes)s::text[]) AS woken;
