-- kind: expand
-- The outbox names an event by (run_id, seq), the key every reader of the ledger uses
-- (docs/design.md, section 11b), so that an event a state row stands for, which the
-- contract step stops storing in wq_events, can still be delivered. This release's
-- projectors read both shapes: a delivery written before this step names its event by
-- event_id only.
--
-- What an append does besides storing its events (NOTIFY the ledger's listeners, one
-- outbox row per enabled HTTP sink, the progress fold) moves into one function,
-- wq_ledger_appended, over the events it is given: the AFTER INSERT trigger passes the
-- statement's stored events, and the contract step's event trigger passes an event it does
-- not store. Its behaviour is the previous wq_events_appended's, the deliveries carrying
-- (run_id, seq) as well.
--
-- The lifecycle events of the hot statements (admission, the claim, the finish) go through
-- one function, wq_ledger_lifecycle, given the events as the state rows the statement
-- wrote hold them (wq_ledger_event makes one). Here it stores them in wq_events, as
-- before; the contract step (0041) makes it do what their append does without storing
-- them. The switch is the database's: this release's code runs on both sides of it.
--
-- An HTTP sink may name the kinds of event it wants (wq_sinks.kinds): no delivery row is
-- written for another kind.
--
-- A run's deliveries go with it: retention deletes runs, and their events with them
-- (wq_events_gone drops the deliveries naming those events); wq_runs_gone drops those
-- that name an event by (run_id, seq) alone.
--
-- tests/db/test_ledger.py, tests/db/test_outbox_channel.py, tests/integration/test_projector.py.

ALTER TABLE wq_outbox
    ADD COLUMN run_id uuid,
    ADD COLUMN seq bigint;

-- The kinds of event an HTTP sink wants (NULL: every kind, as before): an event of another
-- kind gets no delivery row for it at all.
ALTER TABLE wq_sinks ADD COLUMN kinds text[];

CREATE UNIQUE INDEX wq_outbox_run_seq_sink_key ON wq_outbox (run_id, seq, sink);

-- p_notify: NOTIFY the ledger's listeners of these events' runs; p_heard: more runs whose
-- events the statement appended without storing them (the contract step's trigger), to
-- name in the same notifications.
CREATE FUNCTION wq_ledger_appended(p_events wq_events[], p_notify boolean DEFAULT true,
                                   p_heard text[] DEFAULT NULL) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_ids text[];
    v_folded boolean;  -- an event besides run_created: the progress fold has work
    v_progress boolean;
    v_http boolean;
    v_delivered bigint;
BEGIN
    SELECT array_agg(DISTINCT r.id)
      INTO v_ids
      FROM (SELECT a.run_id::text AS id FROM unnest(p_events) a WHERE p_notify
            UNION ALL
            SELECT h FROM unnest(p_heard) h) r;
    -- The listeners (`worker observe`, `worker result --wait`, `worker events --follow`):
    -- one NOTIFY per 200 runs of the statement, not one per event.
    FOR i IN 1 .. coalesce(cardinality(v_ids), 0) BY 200 LOOP
        PERFORM pg_notify('wq_run_events', array_to_string(v_ids[i:i + 199], ','));
    END LOOP;
    SELECT bool_or(a.kind <> 'run_created') INTO v_folded FROM unnest(p_events) a;
    IF v_folded IS NULL THEN
        RETURN;  -- nothing appended: nothing to deliver
    END IF;
    -- The sinks, read once (a handful of rows): with nothing to deliver (no HTTP sink
    -- enabled, the usual case) no insert runs at all.
    SELECT coalesce(bool_or(s.kind = 'progress'), false),
           coalesce(bool_or(s.kind <> 'progress'), false)
      INTO v_progress, v_http
      FROM wq_sinks s
     WHERE s.enabled;
    IF v_http THEN
        INSERT INTO wq_outbox (event_id, run_id, seq, sink)
        SELECT a.id, a.run_id, a.seq, s.name
          FROM unnest(p_events) a
         CROSS JOIN wq_sinks s
         WHERE s.enabled
           AND s.kind <> 'progress'
           AND (s.kinds IS NULL OR a.kind = ANY (s.kinds))
         ORDER BY a.run_id, a.seq, s.name
        ON CONFLICT DO NOTHING;  -- an event already delivered to that sink
        GET DIAGNOSTICS v_delivered = ROW_COUNT;
        IF v_delivered > 0 THEN
            -- The projectors: deliveries are due (their channel, migration 0033).
            PERFORM pg_notify('wq_outbox', '');
        END IF;
    END IF;
    IF v_progress AND v_folded THEN  -- an admission's statement folds nothing
        -- The progress fold (migration 0030): every column only moves forward, the
        -- statement's runs in run id order.
        WITH folded AS (
            SELECT e.run_id, e.seq, e.attempt,
                   CASE WHEN e.kind = 'rows_admitted'
                             AND jsonb_typeof(e.data -> 'rows_admitted') = 'number'
                        THEN (e.data ->> 'rows_admitted')::numeric::bigint END AS rows_admitted,
                   CASE WHEN e.kind = 'rows_completed'
                             AND jsonb_typeof(e.data -> 'rows_done') = 'number'
                        THEN (e.data ->> 'rows_done')::numeric::bigint END AS rows_done,
                   CASE e.kind
                        WHEN 'run_retried' THEN 'queued'
                        WHEN 'attempt_started' THEN 'running'
                        WHEN 'cleanup_started' THEN 'running'
                        WHEN 'retry_scheduled' THEN 'queued'
                        WHEN 'run_interrupted' THEN 'queued'
                        WHEN 'run_handed_back' THEN 'queued'
                        WHEN 'run_sleeping' THEN 'sleeping'
                        WHEN 'run_waiting' THEN 'sleeping'
                        WHEN 'run_succeeded' THEN 'succeeded'
                        WHEN 'run_failed' THEN 'failed'
                        WHEN 'run_cancelled' THEN 'cancelled'
                        WHEN 'lease_expired' THEN
                            CASE WHEN e.data ->> 'next_state' IN ('queued', 'failed', 'cancelled')
                                 THEN e.data ->> 'next_state' END
                   END::wq_run_state AS state
              FROM unnest(p_events) e
             WHERE e.kind <> 'run_created'
        ), per_run AS (
            SELECT run_id,
                   max(seq) AS last_event_seq,
                   max(attempt) AS attempt,
                   max(rows_admitted) AS rows_admitted,
                   max(rows_done) AS rows_done,
                   (array_agg(state ORDER BY seq DESC) FILTER (WHERE state IS NOT NULL))[1]
                       AS state,
                   max(seq) FILTER (WHERE state IS NOT NULL) AS state_seq
              FROM folded
             GROUP BY run_id
        )
        INSERT INTO wq_progress AS p
            (run_id, state, state_seq, attempt, rows_admitted, rows_done, last_event_seq,
             updated_at)
        SELECT run_id, coalesce(state, 'queued'), coalesce(state_seq, 1), attempt,
               coalesce(rows_admitted, 0), coalesce(rows_done, 0), last_event_seq,
               clock_timestamp()
          FROM per_run
         ORDER BY run_id  -- progress rows are locked in run id order
        ON CONFLICT (run_id) DO UPDATE SET
            state = CASE WHEN excluded.state_seq > p.state_seq THEN excluded.state
                         ELSE p.state END,
            state_seq = greatest(p.state_seq, excluded.state_seq),
            attempt = greatest(p.attempt, excluded.attempt),
            rows_admitted = greatest(p.rows_admitted, excluded.rows_admitted),
            rows_done = greatest(p.rows_done, excluded.rows_done),
            last_event_seq = greatest(p.last_event_seq, excluded.last_event_seq),
            updated_at = excluded.updated_at;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION wq_events_appended() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM wq_ledger_appended(ARRAY(SELECT a::wq_events FROM appended a ORDER BY a.id));
    RETURN NULL;
END;
$$;

CREATE FUNCTION wq_runs_gone() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    DELETE FROM wq_outbox o USING gone g WHERE o.run_id = g.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_runs_gone AFTER DELETE ON wq_runs
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION wq_runs_gone();

-- One event as wq_events' row type (its id and idempotency key empty, its time now).
CREATE FUNCTION wq_ledger_event(p_run uuid, p_seq bigint, p_attempt integer, p_kind text,
                                p_data jsonb) RETURNS wq_events
    LANGUAGE sql STABLE
    AS $$
    SELECT NULL::bigint, p_run, p_attempt, p_kind, coalesce(p_data, '{}'::jsonb), now(),
           p_seq, NULL::text
$$;

-- Lifecycle events a statement's state rows stand for, stored (until the contract step);
-- how many.
CREATE FUNCTION wq_ledger_lifecycle(p_events wq_events[]) RETURNS integer
    LANGUAGE sql
    AS $$
    WITH stored AS (
        INSERT INTO wq_events (run_id, attempt, kind, data, at, seq)
        SELECT e.run_id, e.attempt, e.kind, e.data, e.at, e.seq
          FROM unnest(p_events) e
         ORDER BY e.run_id, e.seq
        RETURNING 1
    )
    SELECT count(*)::integer FROM stored
$$;

-- Admission's run_created through wq_ledger_lifecycle. The same arguments and meaning:
-- the previous release calls these too.
CREATE OR REPLACE FUNCTION wq_submit(p_id uuid, p_org text, p_play text, p_params jsonb, p_release text, p_lane text, p_key text, p_priority integer, p_authority jsonb, p_input_pages jsonb[], p_input_rows bigint, p_input_digest text) RETURNS TABLE(run_id uuid, created boolean, lane text, job_id bigint)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
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
                         authority, input_rows, input_digest, ledger_seq, created_lane)
    VALUES (p_id, p_org, p_play, p_params, p_release, p_lane, p_key, v_job, p_authority,
            coalesce(p_input_rows, 0), p_input_digest, 1, p_lane)
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
    PERFORM wq_ledger_lifecycle(ARRAY[wq_ledger_event(
        v_run, 1, NULL, 'run_created',
        jsonb_build_object('play', p_play, 'lane', p_lane, 'org', p_org))]);
    IF p_input_pages IS NOT NULL AND cardinality(p_input_pages) > 0 THEN
        INSERT INTO wq_run_inputs (run_id, page, rows)
        SELECT v_run, p.ordinality - 1, p.rows
          FROM unnest(p_input_pages) WITH ORDINALITY AS p (rows, ordinality);
    END IF;
    RETURN QUERY SELECT v_run, true, p_lane, v_job;
END;
$$;

CREATE OR REPLACE FUNCTION wq_submit_many(p_ids uuid[], p_orgs text[], p_plays text[], p_params jsonb[], p_releases text[], p_lanes text[], p_keys text[], p_priorities integer[], p_authorities jsonb[]) RETURNS TABLE(run_id uuid, created boolean, lane text, job_id bigint)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    v_closed record;
    v_existing record;
    v_fix text;
    v_ids uuid[];
    v_jobs bigint[];
    v_spawned integer;
    v_noted integer;
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
                             authority, input_rows, ledger_seq, created_lane)
        SELECT i.id, i.org, i.play, i.params, i.release, i.lane, i.key, i.job, i.authority, 0,
               1, i.lane
          FROM input i
          JOIN wq_lanes l ON l.name = i.lane AND l.state = 'prepared'
         ORDER BY i.ord
        ON CONFLICT (org, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id, job_id
    ), made AS (
        SELECT i.id, i.job, i.lane, i.priority, i.play, i.org
          FROM inserted n
          JOIN input i ON i.id = n.id
    )
    SELECT array_agg(m.id), array_agg(m.job),
           (SELECT wq_transport_spawn(array_agg(x.job), array_agg(x.lane), array_agg(x.id),
                                      NULL, array_agg(x.priority))
              FROM made x),
           (SELECT wq_ledger_lifecycle(array_agg(wq_ledger_event(
                       x.id, 1, NULL, 'run_created',
                       jsonb_build_object('play', x.play, 'lane', x.lane, 'org', x.org))
                       ORDER BY x.id))
              FROM made x)
      INTO v_ids, v_jobs, v_spawned, v_noted
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
