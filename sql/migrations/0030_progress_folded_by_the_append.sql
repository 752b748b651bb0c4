-- The progress projection is folded by the statement that appends the events, not
-- delivered through the outbox.
--
-- Until now every event got one outbox row per enabled sink, the built-in progress sink
-- included, and a loop of the projector picked the progress rows, folded their events into
-- wq_progress and marked them delivered. Per trivial run that is three outbox rows written
-- twice (insert, then the delivered mark), with their index entries, and a polling
-- statement a second per worker, to keep a table that lives in the same database: a tenth
-- to a fifth of a trivial run's server CPU in a drain (bench/README.md, "The progress
-- projection folded"), a connection per worker, and a progress bar that trailed by a poll.
--
-- Now wq_events_outbox (the AFTER INSERT statement trigger that already ran in the
-- appending transaction) writes outbox rows for the other sinks only, and, while the
-- progress sink is enabled, folds the statement's events into wq_progress itself
-- (wq_progress_fold: the same fold as the projector's, columns that only move forward).
-- The projection is exact at every commit: it commits with the events or not at all.
--
-- A run's first event, run_created (seq 1, from its admission), is not folded: what it
-- says (queued, no rows) is what a run without a projection row is, and admission is the
-- one write on a submitter's path, so it writes no progress row (nor any outbox row while
-- no HTTP sink is enabled). The row appears with the run's next event; a first row whose
-- events set no state takes run_created's (queued, seq 1).
--
-- Lock order: every append but a run's first (run_created, from the statement that makes
-- the run) takes the run's ledger lock (wq_events_sequence) before its progress row, and
-- holds it to commit, so two transactions never wait on each other for a progress row:
-- the second waits for the ledger lock first. A statement folds its runs in run id order.
--
-- The trigger runs with the privileges of whoever appends: wq_worker has DML on
-- wq_progress (sql/queries/roles.sql), admission appends inside SECURITY DEFINER wq_submit.
--
-- Progress-sink rows still pending from before are folded here and marked delivered;
-- delivered ones stay until retention deletes their run, as before.
--
-- tests/db/test_ledger.py: the projection commits with the append (and rolls back with
-- it), converges whatever the statements' order, skips a disabled progress sink; no
-- progress row is written to the outbox.
CREATE FUNCTION wq_progress_fold(p_runs uuid[], p_seqs bigint[], p_attempts integer[],
                                 p_kinds text[], p_data jsonb[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    WITH folded AS (
        SELECT e.run_id, e.seq, e.attempt,
               CASE WHEN e.kind = 'rows_admitted'
                         AND jsonb_typeof(e.data -> 'rows_admitted') = 'number'
                    THEN (e.data ->> 'rows_admitted')::numeric::bigint END AS rows_admitted,
               CASE WHEN e.kind = 'rows_completed'
                         AND jsonb_typeof(e.data -> 'rows_done') = 'number'
                    THEN (e.data ->> 'rows_done')::numeric::bigint END AS rows_done,
               CASE e.kind
                    WHEN 'run_created' THEN 'queued'
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
          FROM unnest(p_runs, p_seqs, p_attempts, p_kinds, p_data)
               AS e (run_id, seq, attempt, kind, data)
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
END;
$$;

CREATE OR REPLACE FUNCTION wq_events_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_progress boolean;
    v_http boolean;
BEGIN
    -- One read of the sinks (a handful of rows): a statement with nothing to deliver
    -- (no HTTP sink enabled, the usual case) runs no insert at all.
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
    END IF;
    IF v_progress THEN
        PERFORM wq_progress_fold(array_agg(a.run_id), array_agg(a.seq), array_agg(a.attempt),
                                 array_agg(a.kind), array_agg(a.data))
           FROM appended a
          WHERE a.kind <> 'run_created'
         HAVING count(*) > 0;  -- an admission's statement: no call at all
    END IF;
    RETURN NULL;
END;
$$;

SELECT wq_progress_fold(array_agg(e.run_id), array_agg(e.seq), array_agg(e.attempt),
                        array_agg(e.kind), array_agg(e.data))
  FROM wq_outbox o
  JOIN wq_sinks s ON s.name = o.sink
  JOIN wq_events e ON e.id = o.event_id
 WHERE s.kind = 'progress'
   AND o.status = 'pending';

UPDATE wq_outbox o
   SET status = 'delivered',
       delivered_at = now(),
       lease_owner = NULL,
       lease_expires_at = NULL,
       attempts = o.attempts + 1
  FROM wq_sinks s
 WHERE s.name = o.sink
   AND s.kind = 'progress'
   AND o.status = 'pending';
