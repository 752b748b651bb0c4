-- A finished run job forgets its procrastinate worker, so a worker row goes without
-- reading or rewriting the jobs it ran.
--
-- A worker takes a run's job with its procrastinate worker id (wq_transport_take), and
-- procrastinate_jobs.worker_id refers to procrastinate_workers with ON DELETE SET NULL.
-- A worker row is deleted when its worker is gone: procrastinate prunes the rows of
-- workers silent past its stall timeout at every start of its own worker (each of ours
-- runs one for the recovery tick), so after every deploy. The key's action then ran
-- `UPDATE procrastinate_jobs SET worker_id = NULL WHERE worker_id = $1`, which no index
-- served (procrastinate's index on worker_id holds 'doing' jobs only): a read of every
-- job in the history per pruned worker (two per drain at 1,000,000 finished runs in
-- bench.history, 2.0M rows read), and a rewrite of every job that worker ever ran and
-- retention kept: a week of one worker's runs, in one statement, at a deploy.
--
-- Now the statements that end a run's job (wq_transport_settle, wq_transport_stop) clear
-- its worker_id in the same update, as procrastinate's own retry and our hand-back
-- (wq_transport_release) already do: a finished job's worker is in wq_attempts, which
-- keeps every attempt's worker. And an index holds the jobs that name a worker (those
-- running, and procrastinate's own jobs), which is what the key's action reads. Jobs that
-- finished before this migration keep their worker until its row goes, once, as before.
--
-- tests/db/test_transport_seam.py: a finished job names no worker; deleting a worker that
-- ran many jobs reads and changes only the jobs it still runs.

CREATE INDEX wq_jobs_worker_idx ON procrastinate_jobs (worker_id) WHERE worker_id IS NOT NULL;

CREATE OR REPLACE FUNCTION wq_transport_settle(p_job_ids bigint[], p_succeeded boolean[])
RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    WITH settled AS (
        UPDATE procrastinate_jobs j
           SET status = CASE WHEN s.succeeded THEN 'succeeded'
                             ELSE 'failed' END::procrastinate_job_status,
               attempts = j.attempts + 1,
               worker_id = NULL
          FROM unnest(p_job_ids, p_succeeded) AS s (id, succeeded)
         WHERE j.id = s.id AND j.status = 'doing'
        RETURNING 1
    )
    SELECT count(*)::integer FROM settled
$$;

CREATE OR REPLACE FUNCTION wq_transport_stop(p_job_ids bigint[]) RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    WITH stopped AS (
        UPDATE procrastinate_jobs j
           SET status = CASE WHEN j.status = 'todo' THEN 'cancelled'
                             ELSE 'aborted' END::procrastinate_job_status,
               worker_id = NULL
         WHERE j.id = ANY (p_job_ids) AND j.status IN ('todo', 'doing')
        RETURNING 1
    )
    SELECT count(*)::integer FROM stopped
$$;
