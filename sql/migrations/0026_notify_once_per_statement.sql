-- Notifications once per statement, and procrastinate's job history only where it is read.
--
-- 1. A ledger append NOTIFYs `wq_run_events` once per statement, not once per event. The
--    listeners (`worker observe`, `worker result --wait`, `worker events --follow`, the
--    projector) only ask whether a run of theirs moved: the payload is the statement's
--    distinct run ids, comma-separated, in chunks of 200 (a payload is at most 8,000
--    bytes). A batched finish of 50 runs used to queue 100-150 notifications, each read by
--    every listening session; now it queues one.
-- 2. A run's job (task 'wq.run') is spawned only by wq_transport_spawn, which now NOTIFYs
--    each of the statement's lanes once on procrastinate's lane channel; so does
--    wq_transport_release for the deliveries it hands back (once per job before).
--    procrastinate's per-row insert trigger, which sent two notifications per job (its
--    lane's channel and the any-queue channel, each payload naming the job), skips them.
--    A worker only wakes on the channel and reads no payload (queues.transport.listen);
--    identical notifications of one transaction are folded into one by Postgres.
-- 3. procrastinate_events keeps, for a run's job, only the event of its terminal status.
--    The run's history is its ledger (wq_events); procrastinate's deferred/started/retry
--    rows for the same job duplicated it, three rows per run that nothing reads. The one
--    reader of procrastinate_events for these jobs, wq_transport_prune, reads the latest
--    event's time of a finished job: the terminal event, which is still written. Jobs of
--    any other task (procrastinate's own periodic recovery task) keep their full history.
--
-- tests/integration/test_notify_once.py counts the notifications and rows;
-- tests/integration/test_procrastinate_chain.py checks that a database brought forward from
-- procrastinate 3.0 ends with the same triggers as a new one.
--
-- wq_transport_release is a SQL function naming procrastinate's worker_id, which a database
-- still at procrastinate 3.0 takes only from procrastinate's deltas, after this file
-- (migration 0013 says more): its body is not checked here.
SET LOCAL check_function_bodies = off;

CREATE OR REPLACE FUNCTION wq_notify_run_events() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_ids text[] := ARRAY(SELECT DISTINCT a.run_id::text FROM appended a);
BEGIN
    FOR i IN 1 .. cardinality(v_ids) BY 200 LOOP
        PERFORM pg_notify('wq_run_events', array_to_string(v_ids[i:i + 199], ','));
    END LOOP;
    RETURN NULL;
END;
$$;

DROP TRIGGER wq_events_notify ON wq_events;
DROP FUNCTION wq_notify_run_event();
CREATE TRIGGER wq_events_notify AFTER INSERT ON wq_events
    REFERENCING NEW TABLE AS appended
    FOR EACH STATEMENT EXECUTE FUNCTION wq_notify_run_events();

CREATE OR REPLACE FUNCTION wq_transport_spawn(
    p_job_ids bigint[],
    p_lanes text[],
    p_run_ids uuid[],
    p_scheduled_at timestamptz[] DEFAULT NULL,
    p_priorities integer[] DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_spawned integer;
BEGIN
    WITH spawned AS (
        INSERT INTO procrastinate_jobs (id, queue_name, task_name, priority, args, scheduled_at)
        SELECT s.id, s.lane, 'wq.run', coalesce(s.priority, 0),
               jsonb_strip_nulls(jsonb_build_object(
                   'run_id', s.run_id,
                   'org', (SELECT r.org FROM wq_runs r WHERE r.id = s.run_id))),
               s.scheduled_at
          FROM unnest(p_job_ids, p_lanes, p_run_ids, p_scheduled_at, p_priorities)
               AS s (id, lane, run_id, scheduled_at, priority)
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_spawned FROM spawned;
    -- procrastinate's insert trigger skips these jobs (above): one wake per lane.
    PERFORM pg_notify('procrastinate_queue_v1#' || l.lane, '{"type": "job_inserted"}')
       FROM (SELECT DISTINCT lane FROM unnest(p_lanes) AS lane) l;
    RETURN v_spawned;
END;
$$;

CREATE OR REPLACE FUNCTION wq_transport_release(p_job_ids bigint[]) RETURNS integer
LANGUAGE sql
AS $$
    WITH released AS (
        UPDATE procrastinate_jobs j
           SET status = 'todo', worker_id = NULL
         WHERE j.id = ANY (p_job_ids) AND j.status = 'doing' AND NOT j.abort_requested
        RETURNING j.id, j.queue_name
    ), woken AS (
        -- One payload per lane: Postgres folds a transaction's identical notifications.
        SELECT pg_notify('procrastinate_queue_v1#' || r.queue_name, '{"type": "job_inserted"}')
          FROM released r
    )
    SELECT count(*)::integer FROM woken
$$;

-- procrastinate's three row triggers, re-created under their own names with a WHEN clause
-- that leaves out the jobs of runs. A function, because a procrastinate delta migration
-- may re-create one of them (03.04.00 re-creates the status trigger): queues.migrations
-- calls it again after every procrastinate migration it applies to a database that has
-- this one, so an upgraded database ends with the triggers of a new one.
CREATE FUNCTION wq_transport_fit() RETURNS void LANGUAGE plpgsql AS $$
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
END;
$$;

SELECT wq_transport_fit();
