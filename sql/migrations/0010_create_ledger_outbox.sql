-- The run ledger (wq_events) gets a stored per-run sequence and an idempotency key; its
-- events are projected to consumers through a leased outbox: sinks (the built-in progress
-- sink and HTTP endpoints), one outbox row per (event, enabled sink), filled by a trigger
-- in the appending transaction, and the progress projection that `worker observe` reads.

-- ---- the ledger: seq and idempotency key --------------------------------------------------

-- A per-run sequence, stored. row_number() over the id would renumber: an id is drawn
-- before its statement holds anything, so two appenders of one run can commit in the
-- other order (a receipt's step_failed only holds the run FOR SHARE; queues.ledger.append
-- holds nothing stronger), and an event committed late would shift the seq of one already
-- read, delivered and keyed with it. Here seq is assigned under a per-run transaction lock
-- (below), so it is gapless, never reused, and in commit order: a reader that follows a run
-- by seq never misses an event.
ALTER TABLE wq_events ADD COLUMN seq bigint;
ALTER TABLE wq_events ADD COLUMN idempotency_key text;

UPDATE wq_events e
   SET seq = n.seq
  FROM (SELECT id, row_number() OVER (PARTITION BY run_id ORDER BY id) AS seq
          FROM wq_events) n
 WHERE e.id = n.id;

ALTER TABLE wq_events ALTER COLUMN seq SET NOT NULL;
CREATE UNIQUE INDEX wq_events_run_seq_idx ON wq_events (run_id, seq);
-- The same key appended twice for a run stores one event (ON CONFLICT DO NOTHING).
CREATE UNIQUE INDEX wq_events_idempotency_idx ON wq_events (run_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Lock order: every statement that appends holds its run's row first (FOR UPDATE, FOR NO
-- KEY UPDATE or FOR SHARE, see sql/queries/*.sql; queues.ledger.append takes FOR SHARE),
-- then this transaction-scoped advisory lock of the run, then reads the run's last seq.
-- Statements that append for several runs already hold all their run rows exclusively, so
-- no two of them wait on each other's advisory locks. A new run (admission) is invisible
-- to everyone else until it commits. Under READ COMMITTED each query of this function
-- takes a fresh snapshot after the lock, so it sees the previous holder's commit; in a
-- REPEATABLE READ transaction a concurrent appender's seq is not visible and the unique
-- index refuses the duplicate (a loud error, never a reused seq).
CREATE FUNCTION wq_events_sequence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('wq_ledger:' || NEW.run_id::text, 0));
    SELECT coalesce(max(e.seq), 0) + 1 INTO NEW.seq
      FROM wq_events e
     WHERE e.run_id = NEW.run_id;
    RETURN NEW;
END;
$$;

CREATE TRIGGER wq_events_sequence BEFORE INSERT ON wq_events
    FOR EACH ROW EXECUTE FUNCTION wq_events_sequence();

-- ---- sinks and the outbox ------------------------------------------------------------------

CREATE TYPE wq_sink_kind AS ENUM (
    'progress',   -- built in: upserts wq_progress in the database
    'http'        -- POSTs each event as JSON to url, with an Idempotency-Key header
);

CREATE TABLE wq_sinks (
    name                text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9_.-]{0,62}$'),
    kind                wq_sink_kind NOT NULL,
    url                 text,
    enabled             boolean NOT NULL DEFAULT true,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wq_sinks_url_iff_http CHECK ((kind = 'http') = (url IS NOT NULL))
);

-- The built-in progress sink always exists; `worker sinks` refuses to change it.
INSERT INTO wq_sinks (name, kind) VALUES ('progress', 'progress');

CREATE TYPE wq_delivery_status AS ENUM (
    'pending',    -- not delivered yet: due at next_attempt_at, or leased until then
    'delivered'   -- the sink accepted it (HTTP 2xx, or the progress upsert committed)
);

-- One row per (event, sink) that was enabled when the event was appended. A lease
-- (lease_owner, lease_expires_at) makes one projector the deliverer until it expires;
-- while leased, next_attempt_at equals lease_expires_at, so one index finds due rows.
-- Delivered rows stay until their run is deleted (retention): event -> outbox cascade.
CREATE TABLE wq_outbox (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id            bigint NOT NULL REFERENCES wq_events (id) ON DELETE CASCADE,
    sink                text NOT NULL REFERENCES wq_sinks (name) ON DELETE CASCADE,
    status              wq_delivery_status NOT NULL DEFAULT 'pending',
    attempts            integer NOT NULL DEFAULT 0,   -- leases taken (delivery attempts)
    lease_owner         text,
    lease_expires_at    timestamptz,
    next_attempt_at     timestamptz NOT NULL DEFAULT now(),
    last_error          text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    delivered_at        timestamptz,
    CONSTRAINT wq_outbox_event_sink_key UNIQUE (event_id, sink)
);
CREATE INDEX wq_outbox_due_idx ON wq_outbox (sink, next_attempt_at, id)
    WHERE status = 'pending';

-- Filled in the appending transaction, whoever appends (SECURITY DEFINER admission too).
CREATE FUNCTION wq_events_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wq_outbox (event_id, sink)
    SELECT a.id, s.name
      FROM appended a
     CROSS JOIN wq_sinks s
     WHERE s.enabled
     ORDER BY a.id, s.name;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_events_outbox AFTER INSERT ON wq_events
    REFERENCING NEW TABLE AS appended
    FOR EACH STATEMENT EXECUTE FUNCTION wq_events_outbox();

-- ---- the progress projection ---------------------------------------------------------------

-- What the progress sink makes of a run's ledger. Every column only moves forward
-- (greatest of what it had and what a delivery brings; the state only from a later state
-- event), so deliveries in any order, and replayed ones, converge on the same row.
CREATE TABLE wq_progress (
    run_id              uuid PRIMARY KEY REFERENCES wq_runs (id) ON DELETE CASCADE,
    state               wq_run_state,
    state_seq           bigint NOT NULL DEFAULT 0,    -- the seq of the event that set state
    attempt             integer,
    rows_admitted       bigint NOT NULL DEFAULT 0,
    rows_done           bigint NOT NULL DEFAULT 0,
    last_event_seq      bigint NOT NULL DEFAULT 0,
    updated_at          timestamptz NOT NULL DEFAULT now()
);
