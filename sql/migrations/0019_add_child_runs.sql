-- Child runs: a play admits a child run with `ctx.spawn(...)` (fenced by its attempt, in
-- the transaction that records the spawn's step receipt) and waits for it durably with
-- `ctx.wait_for_run(child)`: the parent sleeps on the event `wq.run:<child id>` of its org,
-- which the child's end emits (the trigger below), so the parent leaves the worker while
-- the child runs and an end racing the wait is never lost (the wait and this emit take the
-- same event lock, as `worker emit` does: queues/runs.py suspend_for_event).
--
-- No foreign key to the parent: a child may outlive its parent's retention, and a delete
-- of old runs must not have to visit their children.
ALTER TABLE wq_runs ADD COLUMN parent_id uuid;
CREATE INDEX wq_runs_parent_idx ON wq_runs (parent_id) WHERE parent_id IS NOT NULL;
-- The unfinished children: what a parent's cancel reaches, and what the recovery pass
-- looks through for children of a cancelled parent (a few, whatever the history).
CREATE INDEX wq_runs_children_unfinished_idx ON wq_runs (parent_id)
    WHERE parent_id IS NOT NULL AND state IN ('queued', 'running', 'sleeping');

-- The end of a child run (its state becomes terminal, in whatever statement: a finish, a
-- rescue, a cancel, a refused claim) emits its org's event `wq.run:<id>` with the state,
-- and wakes the runs of that org sleeping on it, exactly as event_emit does
-- (sql/queries/runs.sql): a new job each, `event_received` in their ledgers.
--
-- Lock order: the child's row (held by the statement that ended it), then the event's
-- transaction lock, then the waiting parents' rows in id order. A parent suspending on
-- the event takes the event lock and then its own row: it never holds a child's row, and
-- nothing that holds a parent's row ends a child in the same transaction (a cancel reaches
-- a parent's children in transactions of their own, queues/children.py).
CREATE FUNCTION wq_child_run_ended() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    v_name text := 'wq.run:' || NEW.id::text;
    v_payload jsonb := jsonb_build_object('run_id', NEW.id, 'state', NEW.state);
    v_woken integer;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('wq_event:' || NEW.org || ':' || v_name, 0));
    INSERT INTO wq_emitted_events (org, name, payload, emitted_at)
    VALUES (NEW.org, v_name, v_payload, clock_timestamp())
    ON CONFLICT (org, name) DO UPDATE
       SET payload = excluded.payload, emitted_at = excluded.emitted_at;
    WITH waiting AS (
        SELECT r.id, r.lane, wq_transport_next_id() AS job_id
          FROM wq_runs r
         WHERE r.state = 'sleeping' AND r.org = NEW.org AND r.wait_event = v_name
           AND r.cancel_requested_at IS NULL
           AND r.wake_payload IS NULL  -- already woken, its wake-up job pending
         ORDER BY r.id
           FOR UPDATE OF r
    ), woken AS (
        UPDATE wq_runs r
           SET job_id = w.job_id, available_at = NULL, wake_payload = v_payload,
               updated_at = now()
          FROM waiting w
         WHERE r.id = w.id
        RETURNING r.id
    ), events AS (
        INSERT INTO wq_events (run_id, kind, data)
        SELECT w.id, 'event_received', jsonb_build_object('event', v_name) FROM waiting w
    )
    SELECT wq_transport_spawn(array_agg(w.job_id), array_agg(w.lane), array_agg(w.id))
      INTO v_woken
      FROM waiting w;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_child_run_ended AFTER UPDATE OF state ON wq_runs
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL
          AND NEW.state IN ('succeeded', 'failed', 'cancelled')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION wq_child_run_ended();
