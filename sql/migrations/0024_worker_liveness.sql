-- A worker whose process ended has its leases rescued within seconds, not when they lapse.
--
-- A lease lapses lease_ttl_s after its last renewal (30 s by default), and the recovery
-- pass that rescues it runs once a minute: a SIGKILLed worker's runs, and above all the
-- runs it had claimed ahead into its local queue (worker.runtime, `prefetch`), waited up
-- to a minute and a half before another worker could take them.
--
-- A worker now holds a session advisory lock, its liveness lock, on its LISTEN session for
-- as long as it runs, and records the lock's key in its wq_workers row once it holds it.
-- Postgres releases a session's locks when the session ends, whatever ended it: the
-- process exited, was killed, or its host closed the connection. So a recorded key whose
-- lock nobody holds names a worker that is gone. A paused process (SIGSTOP, a long GC, a
-- swapped-out host) keeps its session and its lock: only its lease can tell, as before.
--
-- wq_worker_gone(owner, at) asks with pg_try_advisory_xact_lock_shared: it fails while the
-- worker's session holds the lock (exclusive), and succeeds once nobody does; the shared
-- lock it then takes is released with the asking transaction. A worker with no key
-- recorded (it has no LISTEN session: polling behind a transaction-mode pooler) is never
-- called gone: its leases lapse as before.
--
-- A session can also end while its process lives: the database restarted, a session-mode
-- pooler restarted, the network dropped. Such a worker reconnects, takes its lock again
-- and beats; rescuing its runs meanwhile would be fenced (its writes refused) but would
-- waste their work and spend a retry. So gone also asks for a silent worker (no
-- heartbeat for 10 s; it beats every 2 s at most) whose last beat came after the server
-- started: after a database restart every worker's last beat predates it until the
-- worker is back, and one that never comes back is left to its lease. A killed worker's
-- runs are rescued about 10 s after its last beat, by the next peer check (every worker
-- makes one per heartbeat period) or recovery pass.
--
-- wq_lease_lapsed(owner, expires_at, at) is the one rule recovery's pick and its fenced
-- apply share: a running run's lease has ended when it expired or its owner is gone.
ALTER TABLE wq_workers ADD COLUMN liveness_key bigint;

CREATE FUNCTION wq_worker_gone(p_owner text, p_at timestamptz) RETURNS boolean
LANGUAGE sql
VOLATILE
AS $$
    SELECT coalesce((SELECT pg_try_advisory_xact_lock_shared(w.liveness_key)
                       FROM wq_workers w
                      WHERE w.id = p_owner
                        AND w.liveness_key IS NOT NULL
                        AND w.heartbeat_at < p_at - interval '10 seconds'
                        AND w.heartbeat_at > pg_postmaster_start_time()),
                    false)
$$;

CREATE FUNCTION wq_lease_lapsed(p_owner text, p_expires_at timestamptz, p_at timestamptz)
RETURNS boolean
LANGUAGE sql
VOLATILE
AS $$
    SELECT p_expires_at < p_at OR wq_worker_gone(p_owner, p_at)
$$;
