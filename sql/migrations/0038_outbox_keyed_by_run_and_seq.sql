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
-- A run's deliveries go with it: retention deletes runs, and their events with them
-- (wq_events_gone drops the deliveries naming those events); wq_runs_gone drops those
-- that name an event by (run_id, seq) alone.
--
-- tests/db/test_ledger.py, tests/db/test_outbox_channel.py, tests/integration/test_projector.py.

ALTER TABLE wq_outbox
    ADD COLUMN run_id uuid,
    ADD COLUMN seq bigint;

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
         ORDER BY a.run_id, a.seq, s.name
        ON CONFLICT DO NOTHING;  -- an event already delivered to that sink
        -- The projectors: deliveries are due (their channel, migration 0033).
        PERFORM pg_notify('wq_outbox', '');
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
