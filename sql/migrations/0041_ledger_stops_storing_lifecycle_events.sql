-- kind: contract
-- The ledger's contract step (docs/design.md, section 11b): an event a state row stands
-- for is no longer stored in wq_events, and the copies stored by the expand release go.
--
-- Waits for older lanes (section 4b): the previous release reads a run's lifecycle from
-- wq_events alone, so none of its workers may be running and none of its lanes may hold
-- unfinished runs when this applies.
--
-- This release's statements still send every lifecycle event (the previous release's
-- readers need them until this step applies). Those of the hot statements go through
-- wq_ledger_lifecycle (migration 0038), which now stores none of them (below); for the
-- others the event trigger keeps out each one a state row holds, (run_id, seq) and kind, in the row the statement itself wrote: it does
-- what the append would have done (NOTIFY, a delivery per HTTP sink keyed by (run_id,
-- seq), the progress fold: wq_ledger_appended, the same function the stored events go
-- through) and stores nothing. An event no state row holds is stored and numbered as
-- before, after the greater of the run's counter and its last stored seq: the counter
-- numbers the events no longer stored.
--
-- tests/db/test_ledger_view.py runs the lifecycle's scenarios on both sides of this step
-- and compares the ledgers, and applies this step to what the expand release wrote;
-- tests/db/test_ledger.py leases the delivery of a run_created, which the run row stands
-- for.

-- A delivery of an event no longer stored names it by (run_id, seq) alone.
ALTER TABLE wq_outbox ALTER COLUMN event_id DROP NOT NULL;

UPDATE wq_outbox o
   SET run_id = e.run_id,
       seq = e.seq
  FROM wq_events e
 WHERE o.event_id = e.id
   AND o.run_id IS NULL;

-- The copies: the rows a state row stands for (the view shows the state row's event from
-- now on, the same kind, attempt and data). Their deliveries stay, named by (run_id, seq).
UPDATE wq_outbox o
   SET event_id = NULL
  FROM wq_events e
  JOIN wq_ledger_state s ON s.run_id = e.run_id AND s.seq = e.seq AND s.kind = e.kind
 WHERE o.event_id = e.id;

DELETE FROM wq_events e
 USING wq_ledger_state s
 WHERE s.run_id = e.run_id
   AND s.seq = e.seq
   AND s.kind = e.kind;

-- The runs whose events a statement appended without storing them are named in the
-- statement's notifications (wq_events_appended, the statement trigger, which runs after
-- every insert statement, also one that stored nothing): the row trigger keeps them in a
-- transaction-local setting, at most 200 at a time (then it notifies them itself).
CREATE OR REPLACE FUNCTION wq_events_appended() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_heard text := nullif(current_setting('wq.ledger_heard', true), '');
BEGIN
    IF v_heard IS NOT NULL THEN
        PERFORM set_config('wq.ledger_heard', '', true);
    END IF;
    PERFORM wq_ledger_appended(ARRAY(SELECT a::wq_events FROM appended a ORDER BY a.id),
                               true, string_to_array(v_heard, ','));
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION wq_events_sequence() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_last bigint;
    v_heard text;
BEGIN
    IF NEW.kind = 'run_created' THEN
        NEW.seq := 1;
    END IF;
    -- An event its state row stands for: numbered by the statement that wrote that row
    -- (its own snapshot sees the row: a volatile function's query sees what the outer
    -- statement did before this insert).
    IF NEW.seq IS NOT NULL AND EXISTS (
        SELECT 1
          FROM wq_ledger_state s
         WHERE s.run_id = NEW.run_id
           AND s.seq = NEW.seq
           AND s.kind = NEW.kind
    ) THEN
        NEW.id := NULL;
        PERFORM wq_ledger_appended(ARRAY[NEW], false);  -- its deliveries and progress
        v_heard := nullif(current_setting('wq.ledger_heard', true), '');
        IF v_heard IS NULL THEN
            v_heard := NEW.run_id::text;
        ELSIF right(v_heard, 36) <> NEW.run_id::text THEN
            v_heard := v_heard || ',' || NEW.run_id::text;
        END IF;
        IF length(v_heard) >= 200 * 37 - 1 THEN  -- 200 runs: notified now
            PERFORM pg_notify('wq_run_events', v_heard);
            v_heard := '';
        END IF;
        PERFORM set_config('wq.ledger_heard', v_heard, true);
        RETURN NULL;
    END IF;
    IF NEW.seq IS NOT NULL THEN
        -- Numbered by the statement under the run's ledger lock (wq_ledger_next_seq), or an
        -- operator retry keeping a finishing event the run row held: stored as given; the
        -- unique (run_id, seq) index refuses a number taken twice.
        RETURN NEW;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('wq_ledger:' || NEW.run_id::text, 0));
    SELECT greatest(
               (SELECT r.ledger_seq FROM wq_runs r WHERE r.id = NEW.run_id),
               (SELECT max(e.seq) FROM wq_events e WHERE e.run_id = NEW.run_id))
      INTO v_last;
    NEW.seq := coalesce(v_last, 0) + 1;
    RETURN NEW;
END;
$$;

-- The hot statements' lifecycle events (admission, the claim, the finish: migration
-- 0038) are not stored either: what their append would do, for the statement's events at
-- once.
CREATE OR REPLACE FUNCTION wq_ledger_lifecycle(p_events wq_events[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM wq_ledger_appended(p_events);
    RETURN coalesce(cardinality(p_events), 0);
END;
$$;

-- A claim's form (migration 0040): p_notify false leaves the NOTIFY and the progress fold
-- to its worker's announcement (run_announce); the deliveries to HTTP sinks stay in the
-- claim's statement (with one enabled, the fold comes along: one call does both).
CREATE OR REPLACE FUNCTION wq_ledger_lifecycle(p_events wq_events[], p_notify boolean)
    RETURNS integer
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF p_notify THEN
        PERFORM wq_ledger_appended(p_events, true);
    ELSIF EXISTS (SELECT 1 FROM wq_sinks s WHERE s.enabled AND s.kind <> 'progress') THEN
        PERFORM wq_ledger_appended(p_events, false);
    END IF;
    RETURN coalesce(cardinality(p_events), 0);
END;
$$;
