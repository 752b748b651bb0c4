-- Per-org fairness on a lane: the claim interleaves orgs, and a lane may cap each org's
-- running runs (wq_lanes.org_concurrency, migration 0015). One org's backlog of 100,000
-- runs no longer delays every other org of the lane.
--
-- A run's job carries its org (args.org, looked up by the spawn from the run), so a lane's
-- waiting jobs can be walked per org: wq_jobs_lane_org_todo_idx. A job spawned before this
-- migration carries none; the waiting ones are given theirs here, and a job without an org
-- counts as the org '' (a group of its own).
--
-- The order (wq_transport_take):
--   * a lane whose waiting jobs all belong to one org and that has no cap is taken exactly
--     as before: an ordered walk of (lane, priority, id), locking as it goes. Telling that
--     case apart costs a read of the lane's cap and two probes of the org index (the
--     highest org, and any below it);
--   * otherwise the orgs with waiting jobs are listed (up to 32 per lane: the org of the
--     lane's oldest waiting job, the orgs after it in order, then from the first, so no org
--     is left out for good), each org's due jobs are walked without locks, at most the
--     claim's limit each and never more than the org's room under the cap, and ranked by
--     priority, then by the org's running runs plus the job's place in its org's queue
--     (the org with the fewest runs in flight goes first: interleaving, least loaded
--     first), then by id; the best are locked in that order (SKIP LOCKED, re-checked under
--     the lock) up to the limit.
--   * a capped lane's claims take turns (a transaction advisory lock per lane, in lane
--     name order, taken before anything else), so the cap holds exactly across workers:
--     each claim counts the runs running after the previous claim committed.
--
-- Cost. The spawn and the take's one-org path are PL/pgSQL planned once per session (the
-- SQL functions of 0013 were planned on every call): a one-org claim and an admission cost
-- what they did (bench.throughput). Their statements reach the jobs and runs through
-- lateral references, variables and key probes, so the one plan is right for any lane and
-- any size of the tables. The fair path (wq_transport_take_fair) is planned for each call,
-- for the lane and orgs at hand.
SET LOCAL check_function_bodies = off;

CREATE INDEX wq_jobs_lane_org_todo_idx
    ON procrastinate_jobs (queue_name, (coalesce(args ->> 'org', '')) COLLATE "C",
                           priority DESC, id)
    WHERE status = 'todo';

UPDATE procrastinate_jobs j
   SET args = j.args || jsonb_build_object('org', r.org)
  FROM wq_runs r
 WHERE j.status = 'todo'
   AND j.task_name = 'wq.run'
   AND j.args ->> 'run_id' = r.id::text
   AND NOT j.args ? 'org';

-- The spawn as in 0013, with the run's org in the job (a run id with no run: no org),
-- read by one probe of wq_runs' key per job. PL/pgSQL planned once per session (the SQL
-- function of 0013 was planned on every call, and a plan that names wq_runs costs more to
-- make than to run). The probe is a correlated subquery on the key, so the cached plan
-- probes the index whatever the table's size when it was made (a join's cached plan,
-- made while wq_runs was small, read the whole table for every later spawn).
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
    RETURN v_spawned;
END;
$$;

-- The take, with the fair order above. Same signature and answer as in 0013.
CREATE OR REPLACE FUNCTION wq_transport_take(
    p_lanes text[],
    p_limit integer,
    p_worker bigint,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (job_id bigint, run_id uuid)
LANGUAGE plpgsql
VOLATILE
-- Planned once per session: every statement here reaches a lane's jobs through a lateral
-- reference or a variable, so a plan for one lane is the plan for any (the SQL function of
-- 0013 was planned, the same way, on every call). Sorts are disabled, so the two probes
-- below can only be the walks of wq_jobs_lane_org_todo_idx they are written as, whatever
-- the statistics when the session planned them (wq_transport_take_fair says why).
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
AS $$
#variable_conflict use_column
DECLARE
    v_fair boolean := false;
    v_hi text;
    v_lane text;
BEGIN
    -- Per lane: a cap, or another org with waiting jobs below the highest one (the end of
    -- the lane's part of the org index; on a one-org lane the range below it is empty, so
    -- neither probe walks over the jobs its claims took and vacuum has not cleared yet).
    FOREACH v_lane IN ARRAY p_lanes LOOP
        IF (SELECT l.org_concurrency FROM wq_lanes l WHERE l.name = v_lane) > 0 THEN
            v_fair := true;
            EXIT;
        END IF;
        v_hi := (SELECT coalesce(j.args ->> 'org', '') COLLATE "C"
                   FROM procrastinate_jobs j
                  WHERE j.status = 'todo' AND j.queue_name = v_lane
                  ORDER BY coalesce(j.args ->> 'org', '') COLLATE "C" DESC
                  LIMIT 1);
        IF v_hi IS NOT NULL
           AND (SELECT coalesce(j.args ->> 'org', '') COLLATE "C"
                  FROM procrastinate_jobs j
                 WHERE j.status = 'todo' AND j.queue_name = v_lane
                   AND coalesce(j.args ->> 'org', '') COLLATE "C" < v_hi
                 ORDER BY coalesce(j.args ->> 'org', '') COLLATE "C" DESC
                 LIMIT 1) IS NOT NULL THEN
            v_fair := true;
            EXIT;
        END IF;
    END LOOP;

    IF NOT v_fair THEN
        -- One org per lane, no cap: per lane, an ordered walk of wq_jobs_lane_todo_idx
        -- (lane, priority, id) that stops after p_limit rows whatever the table statistics
        -- or other lanes' backlog; then the best p_limit over the lanes. The walk orders by
        -- the lane too: with sorts off, only that index yields the order (procrastinate's
        -- (priority, id) index would walk every lane's jobs, and a plan made with stale
        -- statistics chose it). The taken jobs are updated
        -- by key probes: joined to them, the plan made once per session hashed the whole
        -- jobs table, history included, on every claim (tests/db/test_claim_plans.py).
        RETURN QUERY
        WITH picked AS (
            SELECT j.id
              FROM unnest(p_lanes) AS lane (name)
             CROSS JOIN LATERAL (
                    SELECT j.id, j.priority
                      FROM procrastinate_jobs j
                     WHERE j.status = 'todo'
                       -- The lane as a range: an equality would make the lane a constant
                       -- of the order, which procrastinate's index could then serve.
                       AND j.queue_name >= lane.name AND j.queue_name <= lane.name
                       AND j.task_name = 'wq.run'
                       AND (j.scheduled_at IS NULL
                            OR j.scheduled_at <= coalesce(p_now, now()))
                     ORDER BY j.queue_name, j.priority DESC, j.id
                     LIMIT p_limit
                       FOR UPDATE OF j SKIP LOCKED
                   ) j
             ORDER BY j.priority DESC, j.id
             LIMIT p_limit
        )
        UPDATE procrastinate_jobs j
           SET status = 'doing', worker_id = p_worker
         WHERE j.id = ANY (ARRAY(SELECT picked.id FROM picked))
        RETURNING j.id,
                  CASE WHEN j.args ->> 'run_id'
                            ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                       THEN (j.args ->> 'run_id')::uuid END;
        RETURN;
    END IF;

    RETURN QUERY SELECT f.job_id, f.run_id
                   FROM wq_transport_take_fair(p_lanes, p_limit, p_worker, p_now) AS f;
END;
$$;

-- The fair order of wq_transport_take, for lanes with a cap or several orgs waiting. Its
-- statements are planned for each call: a plan made once for any lane and org (as the
-- one-org path's) walked a large org's taken jobs on every claim and tripled a small
-- org's waits behind it (tests/integration/test_fairness_runtime.py).
--
-- Every statement here has one plan whatever the table statistics say, and its cost is
-- bounded by the orgs and the claim's limit, never by the backlog. Statistics of a queue
-- table are stale by nature: analyzed while a lane was drained (every job 'succeeded'),
-- they say no job is 'todo', so every partial index on status = 'todo' looks empty and
-- free to read in full. The take's first version trusted them and, in that state, joined
-- the ranked candidates back to procrastinate_jobs as a nested loop over every waiting
-- job of the lane, re-ranking (and re-walking each org, through the wrong index) for each
-- of them: O(backlog^2), 20 to 30 s per claim at 10,000 waiting jobs, until autovacuum
-- analyzed the table again (tests/db/test_fairness.py). So the planner is left no choice
-- that estimates could make wrong (the SET clauses below: sorts, sequential scans, hash
-- and merge joins and materializing are disabled, so the plans are index walks and
-- nested loops over key probes):
--   * each read of the backlog is a walk of one index's range that stops at its LIMIT
--     and that no other path can answer without a sort: the probes order by the org (the
--     org index's key after the lane), a lane's head by (lane, priority, id) and an org's
--     walk by (org, priority, id) with the org as a range (an equality would make that
--     order the one of procrastinate_jobs_priority_idx_v1, a walk of every lane's
--     backlog);
--   * the candidates (at most the limit per org) are ranked in memory, and locked by key
--     in rank order: a walk of the ranked ids (WITH ORDINALITY: no sort, it stops at the
--     limit) probing the primary key. There the job's status is compared as text, which
--     no partial index's predicate matches: an estimate cannot turn the probes into a
--     read of a 'todo' index either.
CREATE FUNCTION wq_transport_take_fair(
    p_lanes text[],
    p_limit integer,
    p_worker bigint,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (job_id bigint, run_id uuid)
LANGUAGE plpgsql
VOLATILE
SET plan_cache_mode = force_custom_plan
SET enable_sort = off
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
AS $$
#variable_conflict use_column
DECLARE
    v_lane text;
    v_head text;
    v_org text;
    v_lanes text[] := '{}';
    v_orgs text[] := '{}';
    v_seen integer;
    v_ranked bigint[];
    c_orgs CONSTANT integer := 32;  -- orgs considered per lane and claim
BEGIN
    -- Capped lanes take turns, in lane name order (before any other lock of this claim).
    PERFORM pg_advisory_xact_lock(hashtextextended('wq_lane_claim:' || l.name, 0))
       FROM wq_lanes l
      WHERE l.name = ANY (p_lanes) AND l.org_concurrency > 0
      ORDER BY l.name;

    -- The orgs with waiting jobs, per lane: the oldest waiting job's org, the orgs after it,
    -- then from the first; one probe of the org index each.
    FOR v_lane IN SELECT DISTINCT u.name FROM unnest(p_lanes) AS u (name) ORDER BY 1 LOOP
        SELECT coalesce(j.args ->> 'org', '') COLLATE "C" INTO v_head
          FROM procrastinate_jobs j
         WHERE j.status = 'todo'
           AND j.queue_name >= v_lane AND j.queue_name <= v_lane  -- keeps the lane in the order
         ORDER BY j.queue_name, j.priority DESC, j.id
         LIMIT 1;
        CONTINUE WHEN v_head IS NULL;
        v_org := v_head;
        v_seen := 0;
        WHILE v_org IS NOT NULL AND v_seen < c_orgs LOOP
            v_lanes := v_lanes || v_lane;
            v_orgs := v_orgs || v_org;
            v_seen := v_seen + 1;
            v_org := (SELECT coalesce(j.args ->> 'org', '') COLLATE "C"
                        FROM procrastinate_jobs j
                       WHERE j.status = 'todo' AND j.queue_name = v_lane
                         AND coalesce(j.args ->> 'org', '') COLLATE "C" > v_org
                       ORDER BY coalesce(j.args ->> 'org', '') COLLATE "C"
                       LIMIT 1);
        END LOOP;
        v_org := (SELECT coalesce(j.args ->> 'org', '') COLLATE "C"
                    FROM procrastinate_jobs j
                   WHERE j.status = 'todo' AND j.queue_name = v_lane
                   ORDER BY coalesce(j.args ->> 'org', '') COLLATE "C"
                   LIMIT 1);
        WHILE v_org IS NOT NULL AND v_org < v_head COLLATE "C" AND v_seen < c_orgs LOOP
            v_lanes := v_lanes || v_lane;
            v_orgs := v_orgs || v_org;
            v_seen := v_seen + 1;
            v_org := (SELECT coalesce(j.args ->> 'org', '') COLLATE "C"
                        FROM procrastinate_jobs j
                       WHERE j.status = 'todo' AND j.queue_name = v_lane
                         AND coalesce(j.args ->> 'org', '') COLLATE "C" > v_org
                       ORDER BY coalesce(j.args ->> 'org', '') COLLATE "C"
                       LIMIT 1);
        END LOOP;
    END LOOP;

    -- Each org's due jobs (at most the claim's limit, never more than the org's room under
    -- the cap), ranked by priority, then the org's running runs plus the job's place in its
    -- org's queue, then id: the ids in the order they are to be taken.
    v_ranked := ARRAY(
        WITH orgs AS (
            SELECT o.lane, o.org, nullif(l.org_concurrency, 0) AS cap
              FROM unnest(v_lanes, v_orgs) AS o (lane, org)
              LEFT JOIN wq_lanes l ON l.name = o.lane
        ), busy AS MATERIALIZED (
            -- Running runs per org of these lanes (each lane's running runs: few), counted
            -- once (materialized: not again for each org of the nested loop below).
            SELECT r.lane, r.org, count(*)::integer AS running
              FROM wq_runs r
             WHERE r.lane = ANY (p_lanes) AND r.state = 'running'
             GROUP BY 1, 2
        ), due AS (
            SELECT o.lane, o.org, coalesce(b.running, 0) AS running, c.id, c.priority
              FROM orgs o
              LEFT JOIN busy b ON b.lane = o.lane AND b.org = o.org
             CROSS JOIN LATERAL (
                    SELECT j.id, j.priority
                      FROM procrastinate_jobs j
                     WHERE j.status = 'todo'
                       AND j.queue_name = o.lane
                       -- The org as a range, so that it stays in the order below.
                       AND coalesce(j.args ->> 'org', '') COLLATE "C" >= o.org
                       AND coalesce(j.args ->> 'org', '') COLLATE "C" <= o.org
                       AND j.task_name = 'wq.run'
                       AND (j.scheduled_at IS NULL
                            OR j.scheduled_at <= coalesce(p_now, now()))
                     ORDER BY coalesce(j.args ->> 'org', '') COLLATE "C", j.priority DESC, j.id
                     LIMIT greatest(0, least(p_limit, o.cap - coalesce(b.running, 0), p_limit))
                   ) c
        ), ranked AS (
            SELECT d.id, d.priority,
                   d.running + row_number() OVER (PARTITION BY d.lane, d.org
                                                  ORDER BY d.priority DESC, d.id) AS turn
              FROM due d
        )
        SELECT k.id FROM ranked k ORDER BY k.priority DESC, k.turn, k.id
    );

    -- The best of them still waiting, locked in that order (SKIP LOCKED, the status
    -- re-checked under the lock), up to the limit.
    RETURN QUERY
    WITH picked AS (
        SELECT j.id
          FROM unnest(v_ranked) WITH ORDINALITY AS k (id, n)
          JOIN procrastinate_jobs j ON j.id = k.id
         WHERE j.status::text = 'todo'  -- as text: no partial index's predicate (above)
         ORDER BY k.n
         LIMIT p_limit
           FOR UPDATE OF j SKIP LOCKED
    )
    UPDATE procrastinate_jobs j
       SET status = 'doing', worker_id = p_worker
      FROM picked
     WHERE j.id = picked.id
    RETURNING j.id,
              CASE WHEN j.args ->> 'run_id'
                        ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                   THEN (j.args ->> 'run_id')::uuid END;
END;
$$;
