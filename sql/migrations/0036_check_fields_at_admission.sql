-- kind: expand
-- The database is the last line of admission: wq_submit, wq_submit_many and
-- wq_submit_with_options enforce the field rules of queues/fields.py themselves, whoever
-- calls them. Before this, the rules stopped at the Python API: the admission role could
-- call a submit function directly with params or authority that are not a JSON object
-- (every worker that claimed the run died on it, and recovery handed it to the next), a
-- name holding terminal escapes, a 100,000-character org, 30 MB of params, or a lane that
-- is not its release's.
--
-- A refusal is a custom SQLSTATE of class WQ (queues/errors.py maps each to the error the
-- Python API raises for the same value, so a direct call, the API and the CLI answer with
-- the same code), with DETAIL = {"field", "rule"} as JSON and HINT = the fix:
--   WQ010 a field breaks its rule (FIELD_INVALID), WQ011 a value over its size
--   (PAYLOAD_TOO_LARGE). Nothing is written.
--
-- One source of the limits: wq_field_rules() holds the numbers and patterns the checks
-- read, and tests/integration/test_field_rules_everywhere.py holds it equal to
-- queues.admission.database_rules() (made of queues/fields.py's constants). The checks are
-- SQL functions the planner inlines and folds (the rules become constants): per submit a
-- few comparisons, length() and regular expressions on short names, jsonb_typeof and the
-- stored size of params and authority, a jsonpath walk of each for integers too long to
-- read back (and one for nesting, only when a value is large enough to nest past the
-- limit); no table is read. Measured: 3 to 7 microseconds a submission.
--
-- JSON sizes: the API measures compact JSON text; the database measures the jsonb it
-- stores (pg_column_size, no serialization), which takes up to 6 times the bytes for the
-- same value (queues.fields.STORED_FACTOR). Its ceilings are 6 times the API's limits, so
-- whatever the API accepts fits, and a value the API refuses for its size is refused here
-- from 6 times that size on. A compressed value (read from a table rather than sent) is
-- measured by its text instead.
--
-- Control signals: a cancel is the run's durable request (wq_runs.cancel_requested_at),
-- which only a role with UPDATE on wq_runs can write (the worker role, the owner); a
-- worker acts on it, never on a notification alone (anyone who can connect can NOTIFY
-- any channel). The function that wakes the run's worker is the worker role's from now on.

-- ---- the rules --------------------------------------------------------------------------

CREATE FUNCTION wq_field_rules() RETURNS jsonb
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT jsonb_build_object(
        'lane_prefix', 'r-',
        'max_release', 38,
        'release_name', '^[A-Za-z0-9][A-Za-z0-9._-]*$',
        'max_play', 100,
        'play_name', '^[a-z][a-z0-9_.-]*$',  -- its length is the text rule's (max_play)
        'max_org', 100,
        'max_idempotency_key', 200,
        -- Unicode 14.0's control (Cc) and format (Cf) characters, except U+200D
        -- (queues.fields.CONTROL_RANGES)
        'control', '[\u0001-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f'
                   '\u0890-\u0891\u08e2\u180e\u200b-\u200c\u200e-\u200f\u202a-\u202e'
                   '\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd'
                   '\U00013430-\U00013438\U0001bca0-\U0001bca3\U0001d173-\U0001d17a'
                   '\U000e0001\U000e0020-\U000e007f]',
        'priority_min', -1000000,
        'priority_max', 1000000,
        'max_json_depth', 64,
        'max_json_integer_digits', 4300,
        'max_params_stored_bytes', 6 * 262144,
        'max_authority_stored_bytes', 6 * 65536,
        'max_meta_stored_bytes', 6 * 8192,
        'capabilities', jsonb_build_array('sheet.write', 'receipt.write', 'event.emit',
                                          'run.read', 'limit.acquire', 'run.spawn'),
        'max_batch', 10000,
        'max_attempts', 1000,
        'min_run_timeout_s', 0.001,
        'max_run_timeout_s', 31536000.0,
        'retry_kinds', jsonb_build_array('none', 'fixed', 'exponential'),
        'retry_bounds', jsonb_build_object('base_s', jsonb_build_array(0.0, 86400.0),
                                           'factor', jsonb_build_array(1.0, 100.0),
                                           'cap_s', jsonb_build_array(0.0, 604800.0),
                                           'jitter', jsonb_build_array(0.0, 1.0)))
$$;

-- One rule as text; inlined and folded to a constant in every check that reads it.
CREATE FUNCTION wq_field_rule(p_name text) RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT wq_field_rules() ->> p_name
$$;

-- ---- the checks: each answers NULL, or {sqlstate, field, rule, message, fix} ------------

-- A value as a refusal quotes it: cut to 60 characters, control characters shown as '?'.
CREATE FUNCTION wq_shown(p_value text) RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT quote_literal(regexp_replace(left(p_value, 60), wq_field_rule('control'), '?', 'g'))
$$;

-- queues.fields.text: a non-empty, printable string of at most p_max characters.
CREATE FUNCTION wq_text_problem(p_value text, p_field text, p_what text, p_max integer,
                                p_fix text)
RETURNS text[]
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_value IS NULL OR p_value = '' THEN
            ARRAY['WQ010', p_field,
                  format('a non-empty string of at most %s characters', p_max),
                  format('%s is %s', p_what,
                         CASE WHEN p_value IS NULL THEN 'null' ELSE 'empty' END),
                  coalesce(p_fix, 'pass a ' || p_what)]
        WHEN length(p_value) > p_max THEN
            ARRAY['WQ010', p_field, format('at most %s characters', p_max),
                  format('%s is %s characters long', p_what, length(p_value)),
                  coalesce(p_fix, 'shorten the ' || p_what)]
        WHEN p_value ~ wq_field_rule('control') THEN
            ARRAY['WQ010', p_field,
                  'printable text: no control characters, no NUL, valid Unicode',
                  format('%s contains a control character (U+%s) at %s', p_what,
                         upper(lpad(to_hex(ascii(substring(p_value
                                                           FROM wq_field_rule('control')))),
                                    4, '0')),
                         strpos(p_value, substring(p_value FROM wq_field_rule('control'))) - 1),
                  coalesce(p_fix, 'remove it from the ' || p_what)]
    END
$$;

-- queues.fields.encode for a JSON object: an object, within its size, nested at most 64
-- levels deep, and no integer longer than a worker can read back. (The paths and numbers
-- are made of immutable parts only, so the planner folds them to constants.)
CREATE FUNCTION wq_json_problem(p_value jsonb, p_field text, p_max_stored integer)
RETURNS text[]
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_value IS NULL OR jsonb_typeof(p_value) <> 'object' THEN
            ARRAY['WQ010', p_field, 'a JSON object',
                  format('%s must be a JSON object, got %s', p_field,
                         coalesce(jsonb_typeof(p_value), 'null')),
                  'wrap the value in an object']
        WHEN pg_column_size(p_value) > p_max_stored
             OR (pg_column_compression(p_value) IS NOT NULL
                 AND octet_length(p_value::text) > p_max_stored) THEN
            ARRAY['WQ011', p_field, format('at most %s bytes of jsonb', p_max_stored),
                  format('%s is %s bytes of jsonb; the limit is %s', p_field,
                         greatest(pg_column_size(p_value), octet_length(p_value::text)),
                         p_max_stored),
                  'pass large inputs as sheet rows (--input) instead']
        -- A container nested past the limit sits in one more container per level, each of
        -- 8 bytes at least (its header and its entry in its parent): a value stored in fewer
        -- bytes is not walked.
        WHEN (pg_column_size(p_value) >= 8 * wq_field_rule('max_json_depth')::integer
              OR pg_column_compression(p_value) IS NOT NULL)
             AND jsonb_path_exists(
                 p_value,
                 ('strict $.**{' || wq_field_rule('max_json_depth')
                  || '} ? (@.type() == "object" || @.type() == "array")')::jsonpath) THEN
            ARRAY['WQ010', p_field,
                  format('JSON nested at most %s levels deep', wq_field_rule('max_json_depth')),
                  format('%s nests deeper than %s levels', p_field,
                         wq_field_rule('max_json_depth')),
                  'flatten the value']
        WHEN jsonb_path_exists(
                 p_value,
                 'strict $.** ? (@.type() == "number" && (@ >= $big || @ <= -$big))',
                 ('{"big": 1' || repeat('0', wq_field_rule('max_json_integer_digits')::integer)
                  || '}')::jsonb) THEN
            ARRAY['WQ010', p_field,
                  format('numbers of at most %s digits before the point',
                         wq_field_rule('max_json_integer_digits')),
                  format('%s holds a number of more than %s digits', p_field,
                         wq_field_rule('max_json_integer_digits')),
                  'send such a number as a string']
    END
$$;

-- Every field of one submission (queues.admission.validate, then its params and authority),
-- in that order; the first problem, or NULL.
CREATE FUNCTION wq_submit_problem(p_id uuid, p_org text, p_play text, p_params jsonb,
                                  p_release text, p_lane text, p_key text,
                                  p_priority integer, p_authority jsonb)
RETURNS text[]
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT coalesce(
        CASE WHEN p_id IS NULL THEN
            ARRAY['WQ010', 'id', 'a run id (a uuid)', 'the run id is null',
                  'pass a new uuid']
        END,
        CASE
            WHEN p_release IS NULL OR p_release = '' THEN
                ARRAY['WQ010', 'release', 'a short identifier: letters, digits, ''.'', ''_'' or ''-''',
                      'the release is ' || CASE WHEN p_release IS NULL THEN 'null' ELSE 'empty' END,
                      'pass --release (e.g. a short git sha or v42) or set WORKER_RELEASE']
            WHEN length(p_release) > wq_field_rule('max_release')::integer
                 OR p_release !~ wq_field_rule('release_name') THEN
                ARRAY['WQ010', 'release',
                      format('1 to %s characters of letters, digits, ''.'', ''_'' or ''-'', '
                             'starting with a letter or digit', wq_field_rule('max_release')),
                      'invalid release name ' || wq_shown(p_release),
                      'use a short git sha (12 characters) or a version like v42']
        END,
        CASE WHEN p_lane IS DISTINCT FROM wq_field_rule('lane_prefix') || p_release THEN
            ARRAY['WQ010', 'lane', 'the lane of its release: r-<release>',
                  format('lane %s is not the lane of release %s', wq_shown(p_lane),
                         wq_shown(p_release)),
                  'pass the lane r-<release>, or let admission name it (queues.admission)']
        END,
        wq_text_problem(p_play, 'play', 'play name', wq_field_rule('max_play')::integer,
                        NULL),
        CASE WHEN p_play !~ wq_field_rule('play_name') THEN
            ARRAY['WQ010', 'play',
                  format('lower-case letters, digits, ''.'', ''_'' or ''-'', starting with a '
                         'letter, up to %s characters', wq_field_rule('max_play')),
                  'invalid play name ' || wq_shown(p_play),
                  'use the name the play was registered with']
        END,
        wq_text_problem(p_org, 'org', 'org', wq_field_rule('max_org')::integer,
                        'pass a short identifier'),
        CASE WHEN p_key IS NOT NULL THEN
            wq_text_problem(p_key, 'idempotency_key', 'idempotency key',
                            wq_field_rule('max_idempotency_key')::integer,
                            'use a delivery id or a request id')
        END,
        CASE WHEN p_priority IS NULL
                  OR p_priority < wq_field_rule('priority_min')::integer
                  OR p_priority > wq_field_rule('priority_max')::integer THEN
            ARRAY['WQ010', 'priority',
                  format('a whole number from %s to %s', wq_field_rule('priority_min'),
                         wq_field_rule('priority_max')),
                  'priority is ' || coalesce(p_priority::text, 'null'),
                  'pass e.g. priority 10']
        END,
        wq_json_problem(p_params, 'params', wq_field_rule('max_params_stored_bytes')::integer),
        wq_json_problem(p_authority, 'authority',
                        wq_field_rule('max_authority_stored_bytes')::integer),
        -- The authority is what the run's attempt tokens are minted from: it names this
        -- run, and grants no capability admission does not.
        CASE
            WHEN (p_authority ? 'run' AND p_authority -> 'run' IS DISTINCT FROM to_jsonb(p_id::text))
                 OR (p_authority ? 'org' AND p_authority -> 'org' IS DISTINCT FROM to_jsonb(p_org))
                 OR (p_authority ? 'play' AND p_authority -> 'play' IS DISTINCT FROM to_jsonb(p_play))
                 OR (p_authority ? 'release'
                     AND p_authority -> 'release' IS DISTINCT FROM to_jsonb(p_release)) THEN
                ARRAY['WQ010', 'authority',
                      'names the run it is stored with: its run id, org, play and release',
                      'the authority names another run, org, play or release than its run''s',
                      'let admission make the authority (queues.admission)']
            WHEN p_authority ? 'capabilities'
                 AND NOT (jsonb_typeof(p_authority -> 'capabilities') = 'array'
                          AND (p_authority -> 'capabilities')
                              <@ (wq_field_rules() -> 'capabilities')) THEN
                ARRAY['WQ010', 'authority',
                      'capabilities: a list of those admission grants, of '
                      || (wq_field_rules() -> 'capabilities')::text,
                      'the authority grants capabilities admission does not',
                      'let admission make the authority (queues.admission)']
        END)
$$;

-- A run's own options (queues.options.RunOptions, as its as_json sends them); not on the
-- path of a submit without options.
CREATE FUNCTION wq_options_problem(p_options jsonb) RETURNS text[]
LANGUAGE plpgsql
STABLE
SET search_path = public, pg_temp
AS $$
DECLARE
    v_value jsonb;
    v_retry jsonb;
    v_bound record;
    v_number numeric;
    v_retry_rule text := 'none, fixed:DURATION or exponential:base=DURATION,factor=N,'
                         'cap=DURATION,jitter=F (each part optional; base 0 to 1d, factor 1 '
                         'to 100, cap up to 7d, jitter 0 to 1)';
BEGIN
    IF p_options IS NULL THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(p_options) <> 'object' THEN
        RETURN ARRAY['WQ010', 'options', 'a JSON object of run options',
                     format('the options are a JSON %s', jsonb_typeof(p_options)),
                     'send an object (queues.options.RunOptions.as_json)'];
    END IF;

    v_value := p_options -> 'max_attempts';
    v_number := CASE WHEN jsonb_typeof(v_value) = 'number' THEN v_value::numeric END;
    IF v_value IS NOT NULL AND (
           v_number IS NULL
           OR v_number <> trunc(v_number)
           OR v_number NOT BETWEEN 1 AND wq_field_rule('max_attempts')::numeric) THEN
        RETURN ARRAY['WQ010', 'max_attempts',
                     format('a whole number from 1 to %s', wq_field_rule('max_attempts')),
                     'max attempts is ' || left(v_value::text, 60),
                     'pass e.g. max_attempts 3'];
    END IF;

    v_retry := p_options -> 'retry';
    IF v_retry IS NOT NULL THEN
        IF jsonb_typeof(v_retry) <> 'object' THEN
            RETURN ARRAY['WQ010', 'retry', v_retry_rule,
                         format('retry is a JSON %s', jsonb_typeof(v_retry)),
                         'pass e.g. retry fixed:30s'];
        END IF;
        IF v_retry ? 'kind' AND NOT (wq_field_rules() -> 'retry_kinds') @> jsonb_build_array(v_retry -> 'kind') THEN
            RETURN ARRAY['WQ010', 'retry', v_retry_rule,
                         'retry kind is ' || left((v_retry -> 'kind')::text, 60),
                         'pass e.g. retry exponential:base=2s,factor=2,cap=5m'];
        END IF;
        FOR v_bound IN
            SELECT b.key, (b.value ->> 0)::numeric AS low, (b.value ->> 1)::numeric AS high
              FROM jsonb_each(wq_field_rules() -> 'retry_bounds') AS b
        LOOP
            v_value := v_retry -> v_bound.key;
            CONTINUE WHEN v_value IS NULL;
            v_number := CASE WHEN jsonb_typeof(v_value) = 'number' THEN v_value::numeric END;
            IF v_number IS NULL OR v_number NOT BETWEEN v_bound.low AND v_bound.high THEN
                RETURN ARRAY['WQ010', 'retry', v_retry_rule,
                             format('retry %s is %s', v_bound.key, left(v_value::text, 60)),
                             format('pass a %s from %s to %s', v_bound.key, v_bound.low,
                                    v_bound.high)];
            END IF;
        END LOOP;
        IF (v_retry -> 'cap_s')::numeric < (v_retry -> 'base_s')::numeric THEN
            RETURN ARRAY['WQ010', 'retry', 'cap at least base',
                         format('retry cap (%s s) is below its base (%s s)',
                                v_retry -> 'cap_s', v_retry -> 'base_s'),
                         'raise cap or lower base'];
        END IF;
    END IF;

    v_value := p_options -> 'timeout_s';
    IF v_value IS NOT NULL THEN
        v_number := CASE WHEN jsonb_typeof(v_value) = 'number' THEN v_value::numeric END;
        IF v_number IS NULL
           OR v_number NOT BETWEEN wq_field_rule('min_run_timeout_s')::numeric
                               AND wq_field_rule('max_run_timeout_s')::numeric THEN
            RETURN ARRAY['WQ010', 'timeout',
                         format('a duration from %s to %s seconds',
                                wq_field_rule('min_run_timeout_s'),
                                wq_field_rule('max_run_timeout_s')),
                         'the timeout is ' || left(v_value::text, 60),
                         'pass e.g. timeout 1h'];
        END IF;
    END IF;

    v_value := p_options -> 'start_by';
    IF v_value IS NOT NULL AND jsonb_typeof(v_value) <> 'string' THEN
        RETURN ARRAY['WQ010', 'start_by',
                     'a time with its offset (2030-01-01T09:00:00+00:00)',
                     'start_by is ' || left(v_value::text, 60),
                     'pass e.g. start_by 10m'];
    END IF;

    IF p_options ? 'meta' THEN
        RETURN wq_json_problem(p_options -> 'meta', 'meta',
                               wq_field_rule('max_meta_stored_bytes')::integer);
    END IF;
    RETURN NULL;
END
$$;

-- Raise a problem as its SQLSTATE: the message, DETAIL = {"field", "rule"}, HINT = the fix.
CREATE FUNCTION wq_refuse(p_problem text[]) RETURNS void
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = p_problem[1],
        MESSAGE = p_problem[4] || ': nothing was written',
        DETAIL = json_build_object('field', p_problem[2], 'rule', p_problem[3])::text,
        HINT = p_problem[5];
END
$$;

REVOKE ALL ON FUNCTION wq_shown(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION wq_text_problem(text, text, text, integer, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION wq_json_problem(jsonb, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION wq_submit_problem(uuid, text, text, jsonb, text, text, text, integer,
                                         jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION wq_options_problem(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION wq_refuse(text[]) FROM PUBLIC;

-- ---- the submit functions: as before, each field checked first ---------------------------

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
    v_problem text[];
BEGIN
    v_problem := wq_submit_problem(p_id, p_org, p_play, p_params, p_release, p_lane, p_key,
                                   p_priority, p_authority);
    IF v_problem IS NOT NULL THEN
        PERFORM wq_refuse(v_problem);
    END IF;

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

-- The batch checks every submission before anything else, in one pass over its arrays
-- (arrays of different lengths leave a submission with a null field: refused as such).
CREATE OR REPLACE FUNCTION wq_submit_many(
    p_ids uuid[],
    p_orgs text[],
    p_plays text[],
    p_params jsonb[],
    p_releases text[],
    p_lanes text[],
    p_keys text[],
    p_priorities integer[],
    p_authorities jsonb[]
) RETURNS TABLE (run_id uuid, created boolean, lane text, job_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_closed record;
    v_existing record;
    v_fix text;
    v_ids uuid[];
    v_jobs bigint[];
    v_spawned integer;
    v_bad bigint;
    v_problem text[];
BEGIN
    IF cardinality(p_ids) > wq_field_rule('max_batch')::integer THEN
        PERFORM wq_refuse(ARRAY['WQ010', 'runs',
                                format('at most %s submissions per batch',
                                       wq_field_rule('max_batch')),
                                format('%s submissions in one batch', cardinality(p_ids)),
                                'split the batch']);
    END IF;
    -- The first submission with a problem (each checked once), then its problem.
    SELECT min(s.ord) INTO v_bad
      FROM unnest(p_ids, p_orgs, p_plays, p_params, p_releases, p_lanes, p_keys,
                  p_priorities, p_authorities) WITH ORDINALITY
           AS s (id, org, play, params, release, lane, key, priority, authority, ord)
     WHERE wq_submit_problem(s.id, s.org, s.play, s.params, s.release, s.lane, s.key,
                             s.priority, s.authority) IS NOT NULL;
    IF v_bad IS NOT NULL THEN
        SELECT wq_submit_problem(s.id, s.org, s.play, s.params, s.release, s.lane, s.key,
                                 s.priority, s.authority) INTO v_problem
          FROM unnest(p_ids, p_orgs, p_plays, p_params, p_releases, p_lanes, p_keys,
                      p_priorities, p_authorities) WITH ORDINALITY
               AS s (id, org, play, params, release, lane, key, priority, authority, ord)
         WHERE s.ord = v_bad;
        v_problem[4] := format('submission %s of the batch: %s', v_bad, v_problem[4]);
        PERFORM wq_refuse(v_problem);
    END IF;

    PERFORM 1 FROM wq_lanes l WHERE l.name = ANY (p_lanes) ORDER BY l.name FOR SHARE;

    SELECT s.lane, s.release, l.state INTO v_closed
      FROM unnest(p_lanes, p_releases, p_orgs, p_keys) WITH ORDINALITY
           AS s (lane, release, org, key, ord)
      LEFT JOIN wq_lanes l ON l.name = s.lane
     WHERE l.state IS DISTINCT FROM 'prepared'
       AND NOT EXISTS (SELECT 1 FROM wq_runs r
                        WHERE r.org = s.org AND r.idempotency_key = s.key)
     ORDER BY s.ord
     LIMIT 1;
    IF FOUND THEN
        v_fix := 'submit with the current release; if this release must take new runs '
                 'again, an operator reopens its lane with `worker queues reopen '
                 || v_closed.release || '`';
        IF v_closed.state IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'WQ001',
                MESSAGE = format('lane %L of release %L does not exist: nothing was written',
                                 v_closed.lane, v_closed.release),
                DETAIL = json_build_object('field', 'release',
                                           'rule', 'a release whose worker prepared its lane')::text,
                HINT = format('start a worker of that release (`worker start --release %s`), '
                              'which prepares its lane, or run `worker queues prepare %s`; '
                              'then retry', v_closed.release, v_closed.release);
        ELSIF v_closed.state = 'draining' THEN
            RAISE EXCEPTION USING
                ERRCODE = 'WQ007',
                MESSAGE = format('lane %L of release %L is draining (it takes no new runs '
                                 'while its workers finish the ones it has): nothing was '
                                 'written', v_closed.lane, v_closed.release),
                DETAIL = json_build_object('field', 'release',
                                           'rule', 'a release whose lane admits runs')::text,
                HINT = v_fix;
        ELSE
            RAISE EXCEPTION USING
                ERRCODE = 'WQ002',
                MESSAGE = format('lane %L of release %L was reclaimed: nothing was written',
                                 v_closed.lane, v_closed.release),
                DETAIL = json_build_object('field', 'release',
                                           'rule', 'a release whose lane admits runs')::text,
                HINT = v_fix;
        END IF;
    END IF;

    WITH input AS (
        SELECT s.*, wq_transport_next_id() AS job
          FROM unnest(p_ids, p_orgs, p_plays, p_params, p_releases, p_lanes, p_keys,
                      p_priorities, p_authorities) WITH ORDINALITY
               AS s (id, org, play, params, release, lane, key, priority, authority, ord)
    ), inserted AS (
        INSERT INTO wq_runs (id, org, play, params, release, lane, idempotency_key, job_id,
                             authority, input_rows)
        SELECT i.id, i.org, i.play, i.params, i.release, i.lane, i.key, i.job, i.authority, 0
          FROM input i
          JOIN wq_lanes l ON l.name = i.lane AND l.state = 'prepared'
         ORDER BY i.ord
        ON CONFLICT (org, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id, job_id
    ), made AS (
        SELECT i.id, i.job, i.lane, i.priority, i.play, i.org
          FROM inserted n
          JOIN input i ON i.id = n.id
    ), events AS (
        INSERT INTO wq_events (run_id, kind, data)
        SELECT m.id, 'run_created', jsonb_build_object('play', m.play, 'lane', m.lane, 'org', m.org)
          FROM made m
    )
    SELECT array_agg(m.id), array_agg(m.job),
           (SELECT wq_transport_spawn(array_agg(x.job), array_agg(x.lane), array_agg(x.id),
                                      NULL, array_agg(x.priority))
              FROM made x)
      INTO v_ids, v_jobs, v_spawned
      FROM made m;

    -- The submissions that created nothing: retries of a key (or its second use in this
    -- batch). A new statement: it sees the runs those keys admitted.
    FOR v_existing IN
        SELECT r.id, r.play AS e_play, r.params AS e_params, r.input_digest AS e_digest,
               s.org, s.play, s.params, s.key
          FROM unnest(p_ids, p_orgs, p_plays, p_params, p_keys) AS s (id, org, play, params, key)
          JOIN wq_runs r ON r.org = s.org AND r.idempotency_key = s.key
         WHERE r.id <> s.id
    LOOP
        PERFORM wq_submit_same_request(
            v_existing.id, v_existing.e_play, v_existing.e_params, v_existing.e_digest,
            v_existing.org, v_existing.play, v_existing.params, v_existing.key, NULL);
    END LOOP;

    RETURN QUERY
    SELECT coalesce(made.id, r.id), made.id IS NOT NULL,
           CASE WHEN made.id IS NOT NULL THEN s.lane ELSE r.lane END::text, made.job
      FROM unnest(p_ids, p_orgs, p_keys, p_lanes) WITH ORDINALITY AS s (id, org, key, lane, ord)
      LEFT JOIN unnest(v_ids, v_jobs) AS made (id, job) ON made.id = s.id
      LEFT JOIN LATERAL (SELECT w.id, w.lane FROM wq_runs w
                          WHERE made.id IS NULL AND w.org = s.org
                            AND w.idempotency_key = s.key) r ON true
     ORDER BY s.ord;
END;
$$;

-- The run's options are checked (their types and bounds) before its fields (wq_submit).
CREATE OR REPLACE FUNCTION wq_submit_with_options(
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
    v_retry jsonb;
    v_problem text[];
BEGIN
    v_problem := wq_options_problem(p_options);
    IF v_problem IS NOT NULL THEN
        PERFORM wq_refuse(v_problem);
    END IF;
    v_retry := coalesce(p_options -> 'retry', '{}'::jsonb);

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

-- ---- control signals --------------------------------------------------------------------

-- The wake of a cancel's worker (the run_cancel statement calls it after writing the
-- durable request): the worker role's and the owner's, no longer anyone's.
REVOKE ALL ON FUNCTION wq_transport_notify_cancel(uuid) FROM PUBLIC;
DO $$
BEGIN
    -- sql/queries/roles.sql grants it on every migrate; granted here too when the role
    -- exists, so no cancel between this commit and that grant is refused.
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'wq_worker') THEN
        GRANT EXECUTE ON FUNCTION wq_transport_notify_cancel(uuid) TO wq_worker;
    END IF;
END
$$;
