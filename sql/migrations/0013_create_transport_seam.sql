-- The transport seam: every use of procrastinate's tables, statuses and names by our SQL.
--
-- procrastinate is the transport. A run's job is a row of procrastinate_jobs on the run's
-- lane (a procrastinate queue) with task `wq.run` and args {"run_id": ...}; procrastinate's
-- insert trigger NOTIFYs the lane's channel. Statements in sql/queries reach procrastinate
-- only through the wq_transport_* functions below, and Python only through
-- queues/transport.py (the names: task, channels, the maintenance queue). A procrastinate
-- upgrade that changes its tables is one new migration replacing these functions.
--
-- The bodies are strings, bound when called: no dependency is recorded on procrastinate's
-- tables, so its own delta migrations may alter them (a view would block an ALTER COLUMN),
-- and they are not checked here either (check_function_bodies off, as pg_dump does): a
-- database still at an older procrastinate schema (3.0 has no worker_id, no workers table)
-- takes this migration before procrastinate's deltas bring the tables forward.
-- tests/db/test_transport_seam.py runs each function and checks that nothing else names
-- procrastinate.
--
-- Cost. The reader, wq_transport_jobs(), is a STABLE one-SELECT SQL function: the planner
-- inlines it, so a caller's plan is the plan of the table named in place. wq_transport_next_id
-- inlines to nextval. The writers take arrays and are called once per statement, never per
-- row. A writer called from a SELECT in WITH runs only when that SELECT is read (Postgres
-- runs a SELECT in WITH only as far as it is read): every caller reads it in its final
-- SELECT (a scalar subquery, or a one-row WITH query in its FROM).
--
-- Snapshots. A VOLATILE function's statements take a fresh snapshot, later than the calling
-- statement's. Every writer here but one touches only jobs its caller already knows (by
-- id), or inserts. The exception is wq_transport_take, called by the claim statement: it
-- may take a job admitted after the claim statement's snapshot, whose run that statement
-- cannot see (a job and its run commit together). The claim drops such a delivery like any
-- other it cannot serve, and the drop (job_drop, a statement of its own, so a later
-- snapshot) sends a delivery whose run waits for exactly that job back to its lane
-- (wq_transport_release) instead of acknowledging it. That costs a rare second delivery;
-- taking jobs in a statement of its own before every claim would cost a round trip each.

SET LOCAL check_function_bodies = off;

-- Our runs' jobs as the rest of the schema sees them: procrastinate's status only as text
-- for reports, and as the two facts our statements test.
CREATE FUNCTION wq_transport_jobs()
RETURNS TABLE (
    id bigint,
    lane text,
    status text,                -- procrastinate's status, for reports only
    scheduled_at timestamptz,   -- not due before (NULL: due now)
    waiting boolean,            -- waits for a claim (todo)
    live boolean                -- waiting or delivered (todo, doing): the run has a live job
)
LANGUAGE sql
STABLE
AS $$
    SELECT j.id, j.queue_name::text, j.status::text, j.scheduled_at,
           j.status = 'todo', j.status IN ('todo', 'doing')
      FROM procrastinate_jobs j
     WHERE j.task_name = 'wq.run'
$$;

-- A new job id, taken before the job exists, so a run can point at its job in the same
-- statement that spawns it.
CREATE FUNCTION wq_transport_next_id() RETURNS bigint
LANGUAGE sql
VOLATILE
AS $$
    SELECT nextval('procrastinate_jobs_id_seq')
$$;

-- Spawn one job per element: job i runs run_ids[i] on lanes[i], not before scheduled_at[i]
-- (NULL: now), at priorities[i] (NULL: 0). The only insert into procrastinate_jobs.
-- Returns how many were spawned.
CREATE FUNCTION wq_transport_spawn(
    p_job_ids bigint[],
    p_lanes text[],
    p_run_ids uuid[],
    p_scheduled_at timestamptz[] DEFAULT NULL,
    p_priorities integer[] DEFAULT NULL
) RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    WITH spawned AS (
        INSERT INTO procrastinate_jobs (id, queue_name, task_name, priority, args, scheduled_at)
        SELECT s.id, s.lane, 'wq.run', coalesce(s.priority, 0),
               jsonb_build_object('run_id', s.run_id), s.scheduled_at
          FROM unnest(p_job_ids, p_lanes, p_run_ids, p_scheduled_at, p_priorities)
               AS s (id, lane, run_id, scheduled_at, priority)
        RETURNING 1
    )
    SELECT count(*)::integer FROM spawned
$$;

-- Take up to p_limit due jobs of the lanes for a procrastinate worker, whose runs the
-- calling statement claims (see Snapshots above). SKIP LOCKED keeps claimers off each
-- other's jobs. Per lane, an ordered walk of wq_jobs_lane_todo_idx
-- (lane, priority, id) that stops after p_limit rows whatever the table statistics or
-- other lanes' backlog; then the best p_limit over the lanes. A run id that is not a UUID
-- comes back NULL (the caller drops that delivery).
CREATE FUNCTION wq_transport_take(
    p_lanes text[],
    p_limit integer,
    p_worker bigint,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (job_id bigint, run_id uuid)
LANGUAGE sql
VOLATILE
AS $$
    WITH picked AS (
        SELECT j.id
          FROM unnest(p_lanes) AS lane (name)
         CROSS JOIN LATERAL (
                SELECT j.id, j.priority
                  FROM procrastinate_jobs j
                 WHERE j.status = 'todo'
                   AND j.queue_name = lane.name
                   AND j.task_name = 'wq.run'
                   AND (j.scheduled_at IS NULL
                        OR j.scheduled_at <= coalesce(p_now, now()))
                 ORDER BY j.priority DESC, j.id
                 LIMIT p_limit
                   FOR UPDATE OF j SKIP LOCKED
               ) j
         ORDER BY j.priority DESC, j.id
         LIMIT p_limit
    )
    UPDATE procrastinate_jobs j
       SET status = 'doing', worker_id = p_worker
      FROM picked
     WHERE j.id = picked.id
    RETURNING j.id,
              CASE WHEN j.args ->> 'run_id'
                        ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                   THEN (j.args ->> 'run_id')::uuid END
$$;

-- Finish delivered jobs: job i succeeded when succeeded[i], else failed. Only a delivered
-- job (doing) is finished; a cancelled, aborted or finished one is left as it is.
CREATE FUNCTION wq_transport_settle(p_job_ids bigint[], p_succeeded boolean[])
RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    WITH settled AS (
        UPDATE procrastinate_jobs j
           SET status = CASE WHEN s.succeeded THEN 'succeeded'
                             ELSE 'failed' END::procrastinate_job_status,
               attempts = j.attempts + 1
          FROM unnest(p_job_ids, p_succeeded) AS s (id, succeeded)
         WHERE j.id = s.id AND j.status = 'doing'
        RETURNING 1
    )
    SELECT count(*)::integer FROM settled
$$;

-- Send delivered jobs back to their lanes, waiting again, and wake the lanes' workers (the
-- NOTIFY procrastinate's insert trigger sends). Returns how many were sent back.
CREATE FUNCTION wq_transport_release(p_job_ids bigint[]) RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    WITH released AS (
        UPDATE procrastinate_jobs j
           SET status = 'todo', worker_id = NULL
         WHERE j.id = ANY (p_job_ids) AND j.status = 'doing' AND NOT j.abort_requested
        RETURNING j.id, j.queue_name
    ), woken AS (
        SELECT pg_notify('procrastinate_queue_v1#' || r.queue_name,
                         json_build_object('type', 'job_inserted', 'job_id', r.id)::text)
          FROM released r
    )
    SELECT count(*)::integer FROM woken
$$;

-- Stop jobs now (a cancel): a waiting job is cancelled, a delivered one aborted. Waits for
-- a claimer that holds one. Returns how many were stopped.
CREATE FUNCTION wq_transport_stop(p_job_ids bigint[]) RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    WITH stopped AS (
        UPDATE procrastinate_jobs j
           SET status = CASE WHEN j.status = 'todo' THEN 'cancelled'
                             ELSE 'aborted' END::procrastinate_job_status
         WHERE j.id = ANY (p_job_ids) AND j.status IN ('todo', 'doing')
        RETURNING 1
    )
    SELECT count(*)::integer FROM stopped
$$;

-- Cancel the waiting jobs among these that no claimer holds right now (SKIP LOCKED: a
-- claimer that holds one will find its run pointing elsewhere and drop the delivery).
-- Returns how many were cancelled.
CREATE FUNCTION wq_transport_withdraw(p_job_ids bigint[]) RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    WITH withdrawn AS (
        UPDATE procrastinate_jobs j
           SET status = 'cancelled'
         WHERE j.id IN (SELECT o.id
                          FROM procrastinate_jobs o
                         WHERE o.id = ANY (p_job_ids) AND o.status = 'todo'
                           FOR UPDATE OF o SKIP LOCKED)
        RETURNING 1
    )
    SELECT count(*)::integer FROM withdrawn
$$;

-- Delete up to p_limit finished jobs of the lanes whose last status change is older than
-- their lane's cutoff (lanes[i] before cutoffs[i]); returns their ids. procrastinate_jobs
-- has no timestamp of its own: the age is that of its latest event, as in procrastinate's
-- own delete_old_jobs. A job with no event is never deleted here.
CREATE FUNCTION wq_transport_prune(p_lanes text[], p_cutoffs timestamptz[], p_limit integer)
RETURNS SETOF bigint
LANGUAGE sql
VOLATILE
AS $$
    WITH doomed AS (
        SELECT j.id
          FROM procrastinate_jobs j
          JOIN unnest(p_lanes, p_cutoffs) AS l (name, cutoff) ON l.name = j.queue_name
         WHERE j.task_name = 'wq.run'
           AND j.status IN ('succeeded', 'failed', 'cancelled', 'aborted')
           AND (SELECT max(e.at) FROM procrastinate_events e WHERE e.job_id = j.id) < l.cutoff
         ORDER BY j.id
         LIMIT p_limit
           FOR UPDATE OF j SKIP LOCKED
    )
    DELETE FROM procrastinate_jobs j
     USING doomed d
     WHERE j.id = d.id
    RETURNING j.id
$$;

-- Register a worker with procrastinate (its jobs carry this id); and mark it alive.
CREATE FUNCTION wq_transport_register_worker() RETURNS bigint
LANGUAGE sql
VOLATILE
AS $$
    SELECT worker_id FROM procrastinate_register_worker_v1()
$$;

CREATE FUNCTION wq_transport_beat(p_worker bigint) RETURNS void
LANGUAGE sql
VOLATILE
AS $$
    SELECT procrastinate_update_heartbeat_v1(p_worker)
$$;

-- Ask the worker running a run to cancel it: NOTIFY on our control channel, read by
-- queues/transport.py (the channel name and the message live in those two places only).
CREATE FUNCTION wq_transport_notify_cancel(p_run_id uuid) RETURNS void
LANGUAGE sql
VOLATILE
AS $$
    SELECT pg_notify('wq_control', json_build_object('cancel', p_run_id)::text)
$$;

-- Admission spawns its job through the seam. The same function as in 0009 but for the two
-- transport lines (the job id and the spawn).
CREATE OR REPLACE FUNCTION wq_submit(
    p_id uuid,
    p_org text,
    p_play text,
    p_params jsonb,
    p_release text,
    p_lane text,
    p_key text,
    p_priority integer,
    p_authority jsonb,
    p_input_pages jsonb[],
    p_input_rows bigint,
    p_input_digest text
) RETURNS TABLE (run_id uuid, created boolean, lane text, job_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_state wq_lane_state;
    v_job bigint;
    v_run uuid;
    v_existing record;
    v_fix text;
BEGIN
    SELECT l.state INTO v_state FROM wq_lanes l WHERE l.name = p_lane FOR SHARE;
    IF v_state IS DISTINCT FROM 'prepared' THEN
        -- A retried request (its response lost) answers with its run even after the lane
        -- stopped taking new ones.
        IF p_key IS NOT NULL THEN
            SELECT r.id, r.play, r.params, r.lane, r.input_digest INTO v_existing
              FROM wq_runs r WHERE r.org = p_org AND r.idempotency_key = p_key;
            IF FOUND THEN
                PERFORM wq_submit_same_request(
                    v_existing.id, v_existing.play, v_existing.params, v_existing.input_digest,
                    p_org, p_play, p_params, p_key, p_input_digest);
                RETURN QUERY SELECT v_existing.id, false, v_existing.lane::text, NULL::bigint;
                RETURN;
            END IF;
        END IF;
        v_fix := 'submit with the current release; if this release must take new runs '
                 'again, an operator reopens its lane with `worker queues reopen '
                 || p_release || '`';
        IF v_state IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'WQ001',
                MESSAGE = format('lane %L of release %L does not exist: nothing was written',
                                 p_lane, p_release),
                DETAIL = json_build_object('field', 'release',
                                           'rule', 'a release whose worker prepared its lane')::text,
                HINT = format('start a worker of that release (`worker start --release %s`), '
                              'which prepares its lane, or run `worker queues prepare %s`; '
                              'then retry', p_release, p_release);
        ELSIF v_state = 'draining' THEN
            RAISE EXCEPTION USING
                ERRCODE = 'WQ007',
                MESSAGE = format('lane %L of release %L is draining (it takes no new runs '
                                 'while its workers finish the ones it has): nothing was '
                                 'written', p_lane, p_release),
                DETAIL = json_build_object('field', 'release',
                                           'rule', 'a release whose lane admits runs')::text,
                HINT = v_fix;
        ELSE
            RAISE EXCEPTION USING
                ERRCODE = 'WQ002',
                MESSAGE = format('lane %L of release %L was reclaimed: nothing was written',
                                 p_lane, p_release),
                DETAIL = json_build_object('field', 'release',
                                           'rule', 'a release whose lane admits runs')::text,
                HINT = v_fix;
        END IF;
    END IF;

    v_job := wq_transport_next_id();
    INSERT INTO wq_runs (id, org, play, params, release, lane, idempotency_key, job_id,
                         authority, input_rows, input_digest)
    VALUES (p_id, p_org, p_play, p_params, p_release, p_lane, p_key, v_job, p_authority,
            coalesce(p_input_rows, 0), p_input_digest)
    ON CONFLICT (org, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id INTO v_run;

    IF v_run IS NULL THEN
        -- The key admitted a run before, or a concurrent submit just did (ON CONFLICT
        -- waited for its commit; this new statement sees it): the same request, or a
        -- conflict.
        SELECT r.id, r.play, r.params, r.lane, r.input_digest INTO v_existing
          FROM wq_runs r WHERE r.org = p_org AND r.idempotency_key = p_key;
        PERFORM wq_submit_same_request(
            v_existing.id, v_existing.play, v_existing.params, v_existing.input_digest,
            p_org, p_play, p_params, p_key, p_input_digest);
        RETURN QUERY SELECT v_existing.id, false, v_existing.lane::text, NULL::bigint;
        RETURN;
    END IF;

    PERFORM wq_transport_spawn(ARRAY[v_job], ARRAY[p_lane], ARRAY[v_run], NULL,
                               ARRAY[p_priority]);
    INSERT INTO wq_events (run_id, kind, data)
    VALUES (v_run, 'run_created',
            jsonb_build_object('play', p_play, 'lane', p_lane, 'org', p_org));
    IF p_input_pages IS NOT NULL AND cardinality(p_input_pages) > 0 THEN
        INSERT INTO wq_run_inputs (run_id, page, rows)
        SELECT v_run, p.ordinality - 1, p.rows
          FROM unnest(p_input_pages) WITH ORDINALITY AS p (rows, ordinality);
    END IF;
    RETURN QUERY SELECT v_run, true, p_lane, v_job;
END;
$$;
