-- Admission as one function: the only thing the admission role may do (EXECUTE on it; it
-- reads no run, params or row). SECURITY DEFINER, owned by the migration owner, with its
-- search_path pinned so no caller's objects can be substituted. One call is the whole
-- atomic submit: in autocommit mode one round trip, inside a caller's transaction part of
-- it (the run exists exactly when the caller commits).
--
-- Lock order: the lane row FOR SHARE (a drain or reclaim, FOR UPDATE, waits for us), then
-- the idempotency index entry. Nothing is written unless the lane is prepared. Errors are
-- raised here, where the truth is, as the project's SQLSTATEs (see queues/errors.py):
--   WQ001 lane does not exist, WQ002 lane reclaimed, WQ007 lane draining,
--   WQ003 idempotency key reused for another request.
-- DETAIL carries {"field", "rule"} as JSON; HINT carries the fix.

-- A digest of the input rows given at submit, so a reused idempotency key with other
-- input rows is a conflict, not a silent answer with the earlier run.
ALTER TABLE wq_runs ADD COLUMN input_digest text;

CREATE FUNCTION wq_submit(
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

    v_job := nextval('procrastinate_jobs_id_seq');
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

    INSERT INTO procrastinate_jobs (id, queue_name, task_name, priority, args)
    VALUES (v_job, p_lane, 'wq.run', p_priority, jsonb_build_object('run_id', v_run));
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

-- The conflict check of an idempotent retry: the same play, params and input rows, or
-- WQ003 naming what differs and the run the key admitted.
CREATE FUNCTION wq_submit_same_request(
    e_id uuid, e_play text, e_params jsonb, e_digest text,
    p_org text, p_play text, p_params jsonb, p_key text, p_digest text
) RETURNS void
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
DECLARE
    v_differs text;
BEGIN
    IF e_play IS DISTINCT FROM p_play THEN
        v_differs := format('play %L', e_play);
    ELSIF e_params IS DISTINCT FROM p_params THEN
        v_differs := 'other params';
    ELSIF e_digest IS DISTINCT FROM p_digest THEN
        v_differs := 'other input rows';
    ELSE
        RETURN;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'WQ003',
        MESSAGE = format('idempotency key %L of org %L already admitted run %s with %s',
                         p_key, p_org, e_id, v_differs),
        DETAIL = json_build_object('field', 'idempotency_key',
                                   'rule', 'one key admits one request (same play, params '
                                           'and input rows)')::text,
        HINT = 'use a new key for a different request';
END;
$$;

REVOKE ALL ON FUNCTION wq_submit(uuid, text, text, jsonb, text, text, text, integer, jsonb,
                                 jsonb[], bigint, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION wq_submit_same_request(uuid, text, jsonb, text, text, text, jsonb,
                                              text, text) FROM PUBLIC;
