-- kind: expand
-- A claim does only what its play needs before it starts (docs/design.md, section 7:
-- the pickup is the claim's round trip).
--
-- 1. Its statement no longer NOTIFYs wq_run_events, nor folds its start into the progress
--    sink. A NOTIFY makes the commit queue the notification under the cluster's one
--    notify lock and wake every session that LISTENs in the database (the worker's own
--    LISTEN session among them), on the way to the play's first line: about half a
--    millisecond of an idle worker's pickup; the fold (an upsert of the run's progress
--    row and the statements that decide it) about a fifth of one. The claim passes
--    `false` to wq_ledger_lifecycle's new second argument, and its worker announces the
--    runs it started a moment later (run_announce: the NOTIFY and the fold of each run's
--    current attempt start), unless their final writes (which notify and fold) came
--    first (worker.producer). Deliveries to HTTP sinks are not deferred: with one
--    enabled, the claim's statement writes them (and folds, as before). The one-argument
--    form stays for every other statement and the previous release. Until the ledger's
--    contract step (0041) the events are still stored, and the stored rows' trigger
--    notifies and folds them as before; from the step on, the second argument decides.
-- 2. The take probes a lane for a second org only when its walk came back full. A walk
--    that took fewer jobs than asked for took every due job nobody else holds, of every
--    org: there is no one to be fair to (and an idle worker's claim, one job, is that
--    case). A full walk with a second org waiting goes to the fair take as before, which
--    may take or leave the jobs the walk locked (locks of this transaction do not stop it;
--    the claim commits at once).

CREATE FUNCTION wq_ledger_lifecycle(p_events wq_events[], p_notify boolean) RETURNS integer
    LANGUAGE sql
    AS $$
    SELECT wq_ledger_lifecycle(p_events)
$$;

CREATE OR REPLACE FUNCTION wq_transport_take(p_lanes text[], p_limit integer, p_worker bigint,
                                             p_now timestamptz DEFAULT NULL)
    RETURNS TABLE (job_id bigint, run_id uuid)
    LANGUAGE plpgsql ROWS 16
    SET plan_cache_mode = force_generic_plan
    SET enable_sort = off
    SET enable_incremental_sort = off
    SET jit = off
    AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_hi text;
    v_lane text;
BEGIN
    -- A lane with a cap per org: the fair take, always.
    IF EXISTS (SELECT 1 FROM wq_lanes l
                WHERE l.name = ANY (p_lanes) AND l.org_concurrency > 0) THEN
        RETURN QUERY SELECT f.job_id, f.run_id
                       FROM wq_transport_take_fair(p_lanes, p_limit, p_worker, p_now) AS f;
        RETURN;
    END IF;

    -- Per lane, an ordered walk of wq_jobs_lane_todo_idx (lane, priority, id) that stops
    -- after p_limit rows whatever the table statistics or other lanes' backlog; then the
    -- best p_limit over the lanes. The walk orders by the lane too: with sorts off, only
    -- that index yields the order (procrastinate's (priority, id) index would walk every
    -- lane's jobs, and a plan made with stale statistics chose it).
    v_ids := ARRAY(
        SELECT j.id
          FROM unnest(p_lanes) AS lane (name)
         CROSS JOIN LATERAL (
                SELECT j.id, j.priority
                  FROM procrastinate_jobs j
                 WHERE j.status = 'todo'
                   -- The lane as a range: an equality would make the lane a constant of
                   -- the order, which procrastinate's index could then serve.
                   AND j.queue_name >= lane.name AND j.queue_name <= lane.name
                   AND j.task_name = 'wq.run'
                   AND (j.scheduled_at IS NULL OR j.scheduled_at <= coalesce(p_now, now()))
                 ORDER BY j.queue_name, j.priority DESC, j.id
                 LIMIT p_limit
                   FOR UPDATE OF j SKIP LOCKED
               ) j
         ORDER BY j.priority DESC, j.id
         LIMIT p_limit);

    IF cardinality(v_ids) >= p_limit THEN
        -- More may wait: another org with waiting jobs below a lane's highest one (the end
        -- of the lane's part of the org index; on a one-org lane the range below it is
        -- empty, so neither probe walks over the jobs claims took and vacuum has not
        -- cleared yet) makes the take fair.
        FOREACH v_lane IN ARRAY p_lanes LOOP
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
                RETURN QUERY SELECT f.job_id, f.run_id
                               FROM wq_transport_take_fair(p_lanes, p_limit, p_worker, p_now)
                                    AS f;
                RETURN;
            END IF;
        END LOOP;
    END IF;

    -- The walked jobs by key probes: joined to them, the plan made once per session
    -- hashed the whole jobs table, history included, on every claim
    -- (tests/db/test_claim_plans.py).
    RETURN QUERY
    UPDATE procrastinate_jobs j
       SET status = 'doing', worker_id = p_worker
     WHERE j.id = ANY (v_ids)
    RETURNING j.id,
              CASE WHEN j.args ->> 'run_id'
                        ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                   THEN (j.args ->> 'run_id')::uuid END;
END;
$$;
