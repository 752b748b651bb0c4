-- One NOTIFY wakes one claimer: an admission wakes a worker that is waiting for work, not
-- every worker of the lane.
--
-- Every spawn NOTIFYed its lane's channel, and every worker listening on the lane woke and
-- claimed: with N idle workers, one admitted run cost N claims, N - 1 of them finding
-- nothing (each a statement with its executor start-up, its take's probes and its commit).
--
-- Now the claims keep a line of the workers waiting for work (wq_workers.waiting_since):
-- a claim that took fewer jobs than it asked for leaves its worker waiting (taking none,
-- it keeps its place; taking some, it goes to the back), one that took all it asked for
-- (its slots are full, or it may take more at once) takes it out. Only a change is
-- written. A spawn then wakes, per lane, as many waiting workers as it gave the lane jobs,
-- the longest waiting first, each on a channel of its own (wq_wake_channel of its
-- liveness key), and only live ones: a worker holds its liveness lock on its LISTEN
-- session (migration 0024), so a shared probe of the key that succeeds means that session
-- ended and nobody would hear. A lane with no live waiting worker is broadcast on its
-- channel as before.
--
-- No wake-up is lost: a claim that found nothing and a spawn that committed after the
-- claim's snapshot either see each other (the spawn sees the worker waiting and wakes
-- it: the notification comes after its commit, and the woken claim sees its job) or the
-- spawn did not see the worker waiting and broadcasts, which the worker hears (it listens
-- on its lanes' channels as well). A woken worker whose slots have filled meanwhile
-- leaves the line and passes the wake on (wq_transport_wake for its lanes, itself
-- excepted); a stopping worker leaves the line and passes on what it still gets. The claim loop's poll stays as the last resort.
--
-- tests/db/test_wake_one.py: the line, who is woken, the gone worker skipped, the
-- broadcast, the race; tests/integration/test_wake_one_runtime.py: idle worker processes.
ALTER TABLE wq_workers ADD COLUMN waiting_since timestamptz;

CREATE INDEX wq_workers_waiting_idx ON wq_workers (waiting_since)
    WHERE waiting_since IS NOT NULL;

-- The channel a worker LISTENs on for wakes meant for it alone.
CREATE FUNCTION wq_wake_channel(p_liveness_key bigint) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 'wq_wake#' || p_liveness_key
$$;

-- Wake claimers for new jobs: one waiting live worker per element of p_lanes (a lane
-- repeated k times wakes up to k), the longest waiting first, never p_except (a worker
-- passing its wake on); a lane with none is broadcast on its channel. Returns the number
-- of workers woken on their own channels.
CREATE FUNCTION wq_transport_wake(p_lanes text[], p_except text DEFAULT NULL) RETURNS integer
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    v_lane record;
    v_key bigint;
    v_woken integer;
    v_total integer := 0;
    c_probes CONSTANT integer := 16;  -- waiting workers probed per lane and statement
BEGIN
    FOR v_lane IN SELECT l.name, count(*)::integer AS jobs
                    FROM unnest(p_lanes) AS l (name)
                   WHERE l.name IS NOT NULL
                   GROUP BY l.name
                   ORDER BY l.name LOOP
        v_woken := 0;
        FOR v_key IN SELECT w.liveness_key
                       FROM wq_workers w
                      WHERE w.waiting_since IS NOT NULL
                        AND w.liveness_key IS NOT NULL
                        AND v_lane.name = ANY (w.lanes)
                        AND w.id IS DISTINCT FROM p_except
                      ORDER BY w.waiting_since
                      LIMIT c_probes LOOP
            -- The worker holds this lock on its LISTEN session: taken here, it is gone.
            CONTINUE WHEN pg_try_advisory_xact_lock_shared(v_key);
            PERFORM pg_notify(wq_wake_channel(v_key), v_lane.name);
            v_woken := v_woken + 1;
            EXIT WHEN v_woken >= v_lane.jobs;
        END LOOP;
        IF v_woken = 0 THEN
            PERFORM pg_notify('procrastinate_queue_v1#' || v_lane.name,
                              '{"type": "job_inserted"}');
        END IF;
        v_total := v_total + v_woken;
    END LOOP;
    RETURN v_total;
END;
$$;

CREATE OR REPLACE FUNCTION wq_transport_spawn(p_job_ids bigint[], p_lanes text[],
                                              p_run_ids uuid[],
                                              p_scheduled_at timestamptz[] DEFAULT NULL,
                                              p_priorities integer[] DEFAULT NULL)
    RETURNS integer
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
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
    -- procrastinate's insert trigger skips these jobs: the waiting claimers are woken here.
    PERFORM wq_transport_wake(p_lanes);
    RETURN v_spawned;
END;
$$;

CREATE OR REPLACE FUNCTION wq_transport_release(p_job_ids bigint[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_lanes text[];
BEGIN
    WITH released AS (
        UPDATE procrastinate_jobs j
           SET status = 'todo', worker_id = NULL
         WHERE j.id = ANY (p_job_ids) AND j.status = 'doing' AND NOT j.abort_requested
        RETURNING j.queue_name
    )
    SELECT array_agg(r.queue_name) INTO v_lanes FROM released r;
    IF v_lanes IS NOT NULL THEN
        PERFORM wq_transport_wake(v_lanes);
    END IF;
    RETURN coalesce(cardinality(v_lanes), 0);
END;
$$;
