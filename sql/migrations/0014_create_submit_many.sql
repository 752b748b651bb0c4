-- Batch admission: N runs in one statement, each idempotent, for the admission role too.
--
-- wq_submit_many is wq_submit for a batch (no input rows: a run with rows is admitted by
-- wq_submit). SECURITY DEFINER, owned by the migration owner, search_path pinned, and the
-- admission role may EXECUTE it (sql/queries/roles.sql), as it may wq_submit.
--
-- Lock order: every lane of the batch FOR SHARE, in name order (a drain or reclaim takes
-- its lane FOR UPDATE and waits for us); then the idempotency index entries, in the
-- batch's order. Atomic: one refusal writes nothing. A submission on a lane that does not
-- admit is refused (WQ001/WQ002/WQ007, as wq_submit raises them) unless its key already
-- admitted a run: that is a retry and answers with the run. A key that admitted another
-- request (another play or params) is WQ003 for the whole batch. The same key twice in one
-- batch admits one run: the first creates it, the second answers with it (created false).
--
-- Cost: one INSERT of the runs, one transport spawn of their jobs, one INSERT of their
-- run_created events, whatever the batch size; the existing runs of retried keys are read
-- in a statement of their own (a new snapshot: ON CONFLICT waited for a concurrent
-- admitter's commit, which the insert's snapshot cannot see).
CREATE FUNCTION wq_submit_many(
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
BEGIN
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

REVOKE ALL ON FUNCTION wq_submit_many(uuid[], text[], text[], jsonb[], text[], text[], text[],
                                      integer[], jsonb[]) FROM PUBLIC;
