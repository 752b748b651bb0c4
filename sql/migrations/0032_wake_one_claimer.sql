-- One NOTIFY wakes one claimer: an admission wakes a worker that is waiting for work, not
-- every worker of the lane.
--
-- Every spawn NOTIFYed its lane's channel, and every worker listening on the lane woke and
-- claimed: with N idle workers, one admitted run cost N claims, N - 1 of them finding
-- nothing (each a statement with its executor start-up, its take's probes and its commit).
--
-- Now the claims keep the set of workers waiting for work (wq_workers.waiting_since, the
-- time it joined): a claim that took fewer jobs than it asked for leaves its worker
-- waiting, one that took all it asked for (its slots are full, or it may take more at
-- once) takes it out; only a change is written, so neither a drain's full claims nor an
-- idle worker's empty ones nor a pickup (a waiting worker taking one job) write anything
-- (moving a worker to the back of a line on every pickup cost the claim 0.15 ms: paired
-- blocks, 1.62 against 1.47 ms). A spawn then wakes, per lane, as many waiting workers as
-- it gave the lane jobs, in turns (wq_wake_turn: each spawn starts one further along the
-- set, so idle workers share the runs instead of the first filling up), each on a channel
-- of its own (wq_wake_channel of its liveness key), and only live ones: a worker holds its
-- liveness lock on its LISTEN session (migration 0024), so a shared probe of the key that
-- succeeds means that session ended and nobody would hear; such a worker leaves the set.
-- A lane with no live waiting worker is broadcast on its channel as before.
--
-- No wake-up is lost: a claim that found nothing and a spawn that committed after the
-- claim's snapshot either see each other (the spawn sees the worker waiting and wakes
-- it: the notification comes after its commit, and the woken claim sees its job) or the
-- spawn did not see the worker waiting and broadcasts, which the worker hears (it listens
-- on its lanes' channels as well). A woken worker whose slots have filled meanwhile
-- leaves the set and passes the wake on (wq_transport_wake for its lanes, after it left);
-- a stopping worker leaves the set and passes on what it still gets. The claim
-- loop's poll stays as the last resort (a worker frozen with its session open is woken in
-- vain; the others' polls pick the run up).
--
-- tests/db/test_wake_one.py: the set, who is woken, turns, the gone worker skipped, the
-- broadcast, the race; tests/integration/test_wake_one_runtime.py: idle workers.
ALTER TABLE wq_workers ADD COLUMN waiting_since timestamptz;

CREATE INDEX wq_workers_waiting_idx ON wq_workers (waiting_since)
    WHERE waiting_since IS NOT NULL;

-- Whose turn it is among a lane's waiting workers (a counter, never reset).
CREATE SEQUENCE wq_wake_turn;

-- The channel a worker LISTENs on for wakes meant for it alone.
CREATE FUNCTION wq_wake_channel(p_liveness_key bigint) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 'wq_wake#' || p_liveness_key
$$;

-- Wake claimers for new jobs: one waiting live worker per element of p_lanes (a lane
-- repeated k times wakes up to k), in turns; a lane with none is broadcast on its channel. Waiting workers found gone leave the
-- set. Returns the number of workers woken on their own channels.
CREATE FUNCTION wq_transport_wake(p_lanes text[]) RETURNS integer
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    v_lane record;
    v_ids text[];
    v_keys bigint[];
    v_gone text[] := '{}';
    v_n integer;
    v_start bigint;
    v_at integer;
    v_woken integer;
    v_total integer := 0;
    c_set CONSTANT integer := 64;  -- waiting workers considered per lane and statement
BEGIN
    FOR v_lane IN SELECT l.name, count(*)::integer AS jobs
                    FROM unnest(p_lanes) AS l (name)
                   WHERE l.name IS NOT NULL
                   GROUP BY l.name
                   ORDER BY l.name LOOP
        SELECT array_agg(w.id ORDER BY w.waiting_since, w.id),
               array_agg(w.liveness_key ORDER BY w.waiting_since, w.id)
          INTO v_ids, v_keys
          FROM (SELECT w.id, w.liveness_key, w.waiting_since
                  FROM wq_workers w
                 WHERE w.waiting_since IS NOT NULL
                   AND w.liveness_key IS NOT NULL
                   AND v_lane.name = ANY (w.lanes)
                 ORDER BY w.waiting_since, w.id
                 LIMIT c_set) w;
        v_n := coalesce(cardinality(v_ids), 0);
        v_woken := 0;
        IF v_n > 0 THEN
            v_start := nextval('wq_wake_turn');
            FOR i IN 0 .. v_n - 1 LOOP
                v_at := ((v_start + i) % v_n)::integer + 1;
                -- The worker holds this lock on its LISTEN session: taken here, it is gone.
                IF pg_try_advisory_xact_lock_shared(v_keys[v_at]) THEN
                    v_gone := v_gone || v_ids[v_at];
                    CONTINUE;
                END IF;
                PERFORM pg_notify(wq_wake_channel(v_keys[v_at]), v_lane.name);
                v_woken := v_woken + 1;
                EXIT WHEN v_woken >= v_lane.jobs;
            END LOOP;
        END IF;
        IF v_woken = 0 THEN
            PERFORM pg_notify('procrastinate_queue_v1#' || v_lane.name,
                              '{"type": "job_inserted"}');
        END IF;
        v_total := v_total + v_woken;
    END LOOP;
    IF cardinality(v_gone) > 0 THEN
        -- Rare (once per worker killed while waiting): out of the set, in id order.
        UPDATE wq_workers w
           SET waiting_since = NULL
         WHERE w.id IN (SELECT g.id FROM wq_workers g
                         WHERE g.id = ANY (v_gone) AND g.waiting_since IS NOT NULL
                         ORDER BY g.id
                           FOR NO KEY UPDATE)
           AND w.waiting_since IS NOT NULL;
    END IF;
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
