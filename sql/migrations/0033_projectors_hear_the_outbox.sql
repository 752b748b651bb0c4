-- The projectors hear the outbox, not the whole ledger.
--
-- A projector (the loop that delivers the outbox to HTTP sinks) LISTENed on wq_run_events,
-- which every append NOTIFYs, and ran a pass (a lease statement on the outbox) for each
-- notification it got. `worker recover --every` runs one next to the recovery passes (the
-- Procfile's `recovery` process), so during a drain it leased the outbox about once per
-- claim or finish statement, finding nothing where no HTTP sink is enabled (the usual
-- case): 172-202 passes in a drain of 5,000 runs at concurrency 10, against 4-6 now
-- (its poll). The same drain with such a projector in the worker's process, four
-- alternating rounds on one scratch server: 2,134 runs/s before, 2,452 after (most of
-- it the projector's Python, which a recoverer on a host of its own does not share).
--
-- Now a statement that wrote outbox rows (an HTTP sink is enabled) also NOTIFYs
-- wq_outbox, once, and the projectors LISTEN there (worker.projector). Their poll still
-- covers a lost notification and a retry coming due. The ledger's listeners (`worker
-- observe`, `worker result --wait`, `worker events --follow`) hear wq_run_events as
-- before.
--
-- tests/db/test_outbox_channel.py: only a statement that wrote outbox rows notifies it;
-- tests/integration/test_projector.py: a projector that polls once an hour runs no pass for
-- appends without an HTTP sink, and delivers at once when one is enabled.
CREATE OR REPLACE FUNCTION wq_events_appended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_ids text[];
    v_folded boolean;  -- an event besides run_created: the progress fold has work
    v_progress boolean;
    v_http boolean;
BEGIN
    SELECT array_agg(DISTINCT a.run_id::text), bool_or(a.kind <> 'run_created')
      INTO v_ids, v_folded
      FROM appended a;
    IF v_ids IS NULL THEN
        RETURN NULL;  -- nothing appended: nothing to hear, nothing to deliver
    END IF;
    -- The listeners (`worker observe`, `worker result --wait`, `worker events --follow`):
    -- one NOTIFY per 200 runs of the statement, not one per event.
    FOR i IN 1 .. cardinality(v_ids) BY 200 LOOP
        PERFORM pg_notify('wq_run_events', array_to_string(v_ids[i:i + 199], ','));
    END LOOP;
    -- The sinks, read once (a handful of rows): a statement with nothing to deliver (no
    -- HTTP sink enabled, the usual case) runs no insert at all.
    SELECT coalesce(bool_or(s.kind = 'progress'), false),
           coalesce(bool_or(s.kind <> 'progress'), false)
      INTO v_progress, v_http
      FROM wq_sinks s
     WHERE s.enabled;
    IF v_http THEN
        INSERT INTO wq_outbox (event_id, sink)
        SELECT a.id, s.name
          FROM appended a
         CROSS JOIN wq_sinks s
         WHERE s.enabled
           AND s.kind <> 'progress'
         ORDER BY a.id, s.name;
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
              FROM appended e
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
    RETURN NULL;
END;
$$;
