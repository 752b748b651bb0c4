-- Per-run options: a run may carry its own retry policy, maximum of attempts, run timeout,
-- claim deadline and metadata; its lane's policy stays the default (NULL: the lane's). The
-- claim reads each with coalesce(run, lane), and so does the recovery pass for a lapsed
-- lease, so one rule (queues.outcomes) decides with the values that apply to the run.
--
--   retry_max_attempts     failed attempts allowed (the lane's retry_max_attempts)
--   retry_kind             none | fixed | exponential (lanes: exponential)
--   retry_base_s           the first retry's delay (fixed: every retry's)
--   retry_factor           exponential growth per failure (lanes: 2)
--   retry_cap_s            the longest delay
--   retry_jitter           +- this fraction of each delay
--   timeout_s              the run's timeout, counted from its first start across every
--                          attempt, sleep and wait: past it the run is stopped and failed
--                          (RUN_TIMED_OUT), never retried (the lane's run_timeout_s)
--   start_by               the claim deadline: a run not started by then is failed
--                          (START_DEADLINE_PASSED), never run late
--   meta                   a small JSON object stored with the run (tracing, routing)
--
-- The constraint is NOT VALID: the existing rows carry none of these columns, so there is
-- nothing to check and the upgrade does not scan wq_runs under its exclusive lock; every
-- new row is checked.
ALTER TABLE wq_runs
    ADD COLUMN retry_max_attempts integer,
    ADD COLUMN retry_kind text,
    ADD COLUMN retry_base_s double precision,
    ADD COLUMN retry_factor double precision,
    ADD COLUMN retry_cap_s double precision,
    ADD COLUMN retry_jitter double precision,
    ADD COLUMN timeout_s double precision,
    ADD COLUMN start_by timestamptz,
    ADD COLUMN meta jsonb;

ALTER TABLE wq_runs ADD CONSTRAINT wq_runs_options_check CHECK (
        (retry_max_attempts IS NULL OR retry_max_attempts BETWEEN 1 AND 1000)
    AND (retry_kind IS NULL OR retry_kind IN ('none', 'fixed', 'exponential'))
    AND (retry_base_s IS NULL OR retry_base_s BETWEEN 0 AND 86400)
    AND (retry_factor IS NULL OR retry_factor BETWEEN 1 AND 100)
    AND (retry_cap_s IS NULL OR retry_cap_s BETWEEN 0 AND 604800)
    AND (retry_jitter IS NULL OR retry_jitter BETWEEN 0 AND 1)
    AND (timeout_s IS NULL OR timeout_s BETWEEN 0.001 AND 31536000)
    AND (meta IS NULL OR jsonb_typeof(meta) = 'object')
) NOT VALID;

-- A never-started run past its claim deadline is failed by the recovery pass even when no
-- worker claims it (the claim fails such a run too, without running it).
CREATE INDEX wq_runs_start_by_idx ON wq_runs (start_by)
    WHERE state = 'queued' AND start_by IS NOT NULL AND started_at IS NULL;

-- The lane's defaults for the new options: a run timeout (0: none) and a per-org cap on the
-- lane's running runs (0: none; the claim interleaves orgs either way, see migration 0016).
ALTER TABLE wq_lanes
    ADD COLUMN run_timeout_s double precision NOT NULL DEFAULT 0
        CHECK (run_timeout_s >= 0),
    ADD COLUMN org_concurrency integer NOT NULL DEFAULT 0
        CHECK (org_concurrency >= 0);

-- Admission with options: wq_submit, then the run's options, in one SECURITY DEFINER call
-- (the admission role may EXECUTE it, sql/queries/roles.sql). A submit without options
-- calls wq_submit itself and pays nothing for them. Options belong to the run a call
-- creates: an idempotent retry (created false) answers with the earlier run and changes
-- none of its options. An option this function does not know is refused (WQ008), never
-- ignored: a newer client's option reaching an older database fails loudly.
CREATE FUNCTION wq_submit_with_options(
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
    p_input_digest text,
    p_options jsonb
) RETURNS TABLE (run_id uuid, created boolean, lane text, job_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_admitted record;
    v_unknown text;
    v_retry jsonb := coalesce(p_options -> 'retry', '{}'::jsonb);
BEGIN
    SELECT k INTO v_unknown
      FROM jsonb_object_keys(coalesce(p_options, '{}'::jsonb)) AS k
     WHERE k NOT IN ('max_attempts', 'retry', 'timeout_s', 'start_by', 'meta')
     UNION ALL
    SELECT 'retry.' || k
      FROM jsonb_object_keys(v_retry) AS k
     WHERE k NOT IN ('kind', 'base_s', 'factor', 'cap_s', 'jitter')
     LIMIT 1;
    IF v_unknown IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'WQ008',
            MESSAGE = format('run option %L is not known to this database: nothing was '
                             'written', v_unknown),
            DETAIL = json_build_object('field', v_unknown,
                                       'rule', 'max_attempts, retry (kind, base_s, factor, '
                                               'cap_s, jitter), timeout_s, start_by, meta')::text,
            HINT = 'run `worker migrate` with the release that sends this option, or drop it';
    END IF;

    SELECT s.run_id, s.created, s.lane, s.job_id INTO v_admitted
      FROM wq_submit(p_id, p_org, p_play, p_params, p_release, p_lane, p_key, p_priority,
                     p_authority, p_input_pages, p_input_rows, p_input_digest) AS s;
    IF v_admitted.created THEN
        UPDATE wq_runs r
           SET retry_max_attempts = (p_options ->> 'max_attempts')::integer,
               retry_kind = v_retry ->> 'kind',
               retry_base_s = (v_retry ->> 'base_s')::double precision,
               retry_factor = (v_retry ->> 'factor')::double precision,
               retry_cap_s = (v_retry ->> 'cap_s')::double precision,
               retry_jitter = (v_retry ->> 'jitter')::double precision,
               timeout_s = (p_options ->> 'timeout_s')::double precision,
               start_by = (p_options ->> 'start_by')::timestamptz,
               meta = p_options -> 'meta'
         WHERE r.id = v_admitted.run_id;
    END IF;
    RETURN QUERY SELECT v_admitted.run_id, v_admitted.created, v_admitted.lane::text,
                        v_admitted.job_id;
END;
$$;

REVOKE ALL ON FUNCTION wq_submit_with_options(uuid, text, text, jsonb, text, text, text,
                                              integer, jsonb, jsonb[], bigint, text, jsonb)
    FROM PUBLIC;
