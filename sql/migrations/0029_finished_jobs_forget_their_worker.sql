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
-- A database still at procrastinate 3.0 (no worker_id yet) takes this migration before
-- procrastinate's deltas add the column (migration 0013 says more): the function bodies are
-- not checked here, and the index is made by wq_transport_fit, which queues.migrations
-- calls again after every procrastinate migration it applies (migration 0026), once the
-- column exists. A new database gets it below.
--
-- tests/db/test_transport_seam.py: a finished job names no worker; deleting a worker that
-- ran many jobs reads and changes only the jobs it still runs.
-- tests/integration/test_procrastinate_chain.py: a database brought forward from
-- procrastinate 3.0 ends with the schema of a new one, this index included.
SET LOCAL check_function_bodies = off;

CREATE OR REPLACE FUNCTION wq_transport_fit() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    DROP TRIGGER IF EXISTS procrastinate_jobs_notify_queue_job_inserted_v1
        ON procrastinate_jobs;
    CREATE TRIGGER procrastinate_jobs_notify_queue_job_inserted_v1
        AFTER INSERT ON procrastinate_jobs
        FOR EACH ROW WHEN (new.status = 'todo'::procrastinate_job_status
                           AND new.task_name <> 'wq.run')
        EXECUTE FUNCTION procrastinate_notify_queue_job_inserted_v1();

    DROP TRIGGER IF EXISTS procrastinate_trigger_status_events_insert_v1 ON procrastinate_jobs;
    CREATE TRIGGER procrastinate_trigger_status_events_insert_v1
        AFTER INSERT ON procrastinate_jobs
        FOR EACH ROW WHEN (new.status = 'todo'::procrastinate_job_status
                           AND new.task_name <> 'wq.run')
        EXECUTE FUNCTION procrastinate_trigger_function_status_events_insert_v1();

    DROP TRIGGER IF EXISTS procrastinate_trigger_status_events_update_v1 ON procrastinate_jobs;
    CREATE TRIGGER procrastinate_trigger_status_events_update_v1
        AFTER UPDATE OF status ON procrastinate_jobs
        FOR EACH ROW WHEN (new.task_name <> 'wq.run'
                           OR new.status IN ('succeeded', 'failed', 'cancelled', 'aborted'))
        EXECUTE FUNCTION procrastinate_trigger_function_status_events_update_v1();

    -- The jobs that name a worker, for the key's action when a worker row is deleted.
    IF to_regclass('wq_jobs_worker_idx') IS NULL
       AND EXISTS (SELECT FROM pg_attribute
                    WHERE attrelid = 'procrastinate_jobs'::regclass
                      AND attname = 'worker_id' AND NOT attisdropped) THEN
        CREATE INDEX wq_jobs_worker_idx ON procrastinate_jobs (worker_id)
         WHERE worker_id IS NOT NULL;
    END IF;
END;
$$;

SELECT wq_transport_fit();

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
