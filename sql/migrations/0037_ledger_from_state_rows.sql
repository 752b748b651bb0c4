-- kind: expand
-- The ledger as a view over state rows plus events (docs/design.md, section 11b), the
-- expand half: the columns by which a run row and its attempt rows stand for their
-- lifecycle events, the per-run counter that numbers them, and the view readers read.
-- Writers of this release still append every lifecycle event to wq_events too, so the
-- previous release, which reads wq_events only, sees everything; the view shows a
-- synthesized event only where no wq_events row holds its (run_id, seq).

-- The run's counter (the last seq taken; NULL: admitted before this migration and not
-- numbered since), its admission lane (an adoption moves `lane`; run_created names the
-- first), and a finishing event written without an attempt.
ALTER TABLE wq_runs
    ADD COLUMN ledger_seq bigint,
    ADD COLUMN created_lane text,
    ADD COLUMN ledger_end_seq bigint,
    ADD COLUMN ledger_end_kind text,
    ADD COLUMN ledger_end_data jsonb,
    ADD COLUMN ledger_end_at timestamptz;

-- An attempt's start event (cleanup_started when `cleanup`) and its outcome's event.
ALTER TABLE wq_attempts
    ADD COLUMN start_seq bigint,
    ADD COLUMN cleanup boolean,
    ADD COLUMN end_seq bigint,
    ADD COLUMN end_kind text,
    ADD COLUMN end_data jsonb;

-- Numbering. Every seq of a run is taken under its ledger lock (a transaction advisory
-- lock on 'wq_ledger:' || run_id, held to commit), after the last seq in wq_events, so a
-- run's order is gapless and commit order. An event without a seq (every append of the
-- previous release; this release's appends that do not update the run row) is numbered
-- here. An event that comes with its seq took it from wq_ledger_next_seq (below) in the
-- statement that updated the run row, under the same lock, which that transaction still
-- holds: here it is the next one. The check stays for a seq taken any other way (a
-- statement that took it without the lock would let an older release's append, which
-- numbers without the counter, take that number first): the statement then fails as a
-- serialization failure, to be retried with a fresh snapshot. The trigger never writes the
-- run row: an older statement that updates the run row in one CTE and appends in one run
-- before it would then fail ("tuple to be updated was already modified by an operation
-- triggered by the current command").
CREATE OR REPLACE FUNCTION wq_events_sequence() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_last bigint;
BEGIN
    IF NEW.kind = 'run_created' THEN
        NEW.seq := 1;
        RETURN NEW;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('wq_ledger:' || NEW.run_id::text, 0));
    SELECT coalesce(max(e.seq), 0) INTO v_last
      FROM wq_events e
     WHERE e.run_id = NEW.run_id;
    IF NEW.seq IS NULL THEN
        NEW.seq := v_last + 1;
    ELSIF NEW.seq <> v_last + 1 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'serialization_failure',
            MESSAGE = format('event %s of run %s came with seq %s, but the run''s next '
                             'seq is %s (the number was not taken under the run''s ledger '
                             'lock, and another append took it)', NEW.kind, NEW.run_id,
                             NEW.seq, v_last + 1),
            HINT = 'retry the statement: it takes the number again';
    END IF;
    RETURN NEW;
END;
$$;

-- The next seq of a run, for a statement that updates the run row and writes the event
-- with its number (the claim, the finish batch, recovery's lapse rescue, the cancel): called
-- in that UPDATE's SET, `ledger_seq = wq_ledger_next_seq(r.id, r.ledger_seq)`.
--
-- Lock order, the same for every appender of a run's events: (1) the run row, (2) the
-- run's ledger lock. The function takes both in that order. The row lock is a no-op for a
-- statement that locked the row already (the finish batch, the rescue and the cancel hold
-- it FOR UPDATE); the claim's UPDATE evaluates its SET before it locks the row, so here
-- the row comes first for it too. Every other appender holds the row before its insert
-- takes the ledger lock in wq_events_sequence: ledger_append, ledger_append_delivered,
-- receipt_finish and child_spawn (the parent) FOR SHARE; the sheet statements FOR NO KEY
-- UPDATE; event_emit, the operator's retry, recovery's respawn, cancel of orphans and
-- adoption, job_drop and options_expire_unstarted FOR UPDATE or by their UPDATE of the
-- row; admission and a child's spawn insert the row, and run_created takes no lock.
--
-- Then the number: the greater of the counter and the last seq in wq_events, plus one. A
-- volatile function's query takes a fresh snapshot (READ COMMITTED), so it sees every
-- append committed before the lock was granted; an append still open holds the lock, and
-- this waits for its commit. Held to commit, the lock keeps any other appender of the run
-- from taking a number before this one commits: the insert that follows is always the
-- next seq, and wq_events_sequence's check never fires for it. The counter is read from
-- the locked row too, so a caller's stale copy cannot move the number back; when the row
-- changed since the caller's snapshot, the UPDATE re-evaluates its SET on the new version
-- anyway (and calls this again, which then waits for nothing).
CREATE FUNCTION wq_ledger_next_seq(p_run uuid, p_counter bigint) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_counter bigint;
    v_last bigint;
BEGIN
    SELECT r.ledger_seq INTO v_counter
      FROM wq_runs r
     WHERE r.id = p_run
       FOR NO KEY UPDATE;  -- lock 1, the run row
    PERFORM pg_advisory_xact_lock(hashtextextended('wq_ledger:' || p_run::text, 0));  -- lock 2
    SELECT max(e.seq) INTO v_last FROM wq_events e WHERE e.run_id = p_run;
    RETURN coalesce(greatest(p_counter, v_counter, v_last), 0) + 1;
END;
$$;

-- Admission starts the counter (run_created is seq 1) and records the admission lane.
-- The same arguments and meaning: the previous release calls these too.
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

-- The events the state rows stand for, where the row carries its seq.
CREATE VIEW wq_ledger_state AS
SELECT NULL::bigint AS id, r.id AS run_id, 1::bigint AS seq, NULL::integer AS attempt,
       'run_created'::text AS kind,
       jsonb_build_object('play', r.play, 'lane', r.created_lane, 'org', r.org)
           || CASE WHEN r.parent_id IS NULL THEN '{}'::jsonb
                   ELSE jsonb_build_object('parent', r.parent_id::text) END AS data,
       NULL::text AS idempotency_key, r.created_at AS at
  FROM wq_runs r
 WHERE r.created_lane IS NOT NULL
UNION ALL
SELECT NULL::bigint, r.id, r.ledger_end_seq, NULL::integer, r.ledger_end_kind,
       r.ledger_end_data, NULL::text, r.ledger_end_at
  FROM wq_runs r
 WHERE r.ledger_end_seq IS NOT NULL
UNION ALL
SELECT NULL::bigint, a.run_id, a.start_seq, a.attempt,
       CASE WHEN a.cleanup THEN 'cleanup_started' ELSE 'attempt_started' END,
       jsonb_build_object('worker', a.worker_id), NULL::text, a.started_at
  FROM wq_attempts a
 WHERE a.start_seq IS NOT NULL
UNION ALL
SELECT NULL::bigint, a.run_id, a.end_seq, a.attempt, a.end_kind, a.end_data, NULL::text,
       a.finished_at
  FROM wq_attempts a
 WHERE a.end_seq IS NOT NULL;

-- The ledger readers read: every wq_events row, and each synthesized event no wq_events
-- row holds (run_id, seq) of. `id` is NULL for a synthesized event; (run_id, seq)
-- identifies an event wherever it is held.
CREATE VIEW wq_ledger AS
SELECT e.id, e.run_id, e.seq, e.attempt, e.kind, e.data, e.idempotency_key, e.at
  FROM wq_events e
UNION ALL
SELECT s.id, s.run_id, s.seq, s.attempt, s.kind, s.data, s.idempotency_key, s.at
  FROM wq_ledger_state s
 WHERE NOT EXISTS (SELECT 1 FROM wq_events e WHERE e.run_id = s.run_id AND e.seq = s.seq);
