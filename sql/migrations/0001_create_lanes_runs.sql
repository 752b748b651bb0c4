-- Lanes (release queues), workers, runs (launch rows), attempts and the run ledger.
-- Our tables carry the wq_ prefix; procrastinate_* stays procrastinate's.

CREATE TYPE wq_lane_state AS ENUM (
    'prepared',   -- accepts admissions; its workers consume it
    'draining',   -- accepts no new runs; its workers finish what it has
    'reclaimed'   -- retired after a cutover; admission fails, recovery may re-prepare
);

CREATE TYPE wq_run_state AS ENUM (
    'queued',     -- admitted, waiting for a worker (or for its retry time)
    'running',    -- leased by a live attempt
    'sleeping',   -- suspended durably (sleep or event wait); re-spawned when due/woken
    'succeeded',  -- terminal: the play returned
    'failed',     -- terminal: retries exhausted or a non-retryable error
    'cancelled'   -- terminal: cancelled by an operator
);

CREATE TYPE wq_attempt_outcome AS ENUM (
    'running',        -- still open
    'succeeded',
    'failed',         -- the play raised
    'lease_expired',  -- the lease lapsed (worker died or hung); counts against retries
    'superseded',     -- a newer attempt owns the run; this one's writes were refused
    'cancelled',      -- stopped by a cancellation request
    'handed_back',    -- graceful shutdown returned the run to the lane (not a failure)
    'suspended'       -- the play went to sleep or to wait for an event
);

CREATE TABLE wq_lanes (
    name                text PRIMARY KEY,
    release             text NOT NULL,
    state               wq_lane_state NOT NULL DEFAULT 'prepared',
    concurrency         integer NOT NULL DEFAULT 16 CHECK (concurrency > 0),
    lease_ttl_s         double precision NOT NULL DEFAULT 30 CHECK (lease_ttl_s > 0),
    heartbeat_s         double precision NOT NULL DEFAULT 5 CHECK (heartbeat_s > 0),
    retry_max_attempts  integer NOT NULL DEFAULT 5 CHECK (retry_max_attempts >= 1),
    retry_base_s        double precision NOT NULL DEFAULT 2 CHECK (retry_base_s >= 0),
    retry_cap_s         double precision NOT NULL DEFAULT 300 CHECK (retry_cap_s >= 0),
    retry_jitter        double precision NOT NULL DEFAULT 0.1 CHECK (retry_jitter BETWEEN 0 AND 1),
    retention_s         double precision NOT NULL DEFAULT 604800 CHECK (retention_s > 0),
    prepared_at         timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wq_lanes_heartbeat_below_ttl CHECK (heartbeat_s < lease_ttl_s)
);

CREATE TABLE wq_workers (
    id                  text PRIMARY KEY,
    lanes               text[] NOT NULL,
    release             text NOT NULL,
    host                text NOT NULL,
    pid                 integer NOT NULL,
    procrastinate_id    bigint,
    started_at          timestamptz NOT NULL DEFAULT now(),
    heartbeat_at        timestamptz NOT NULL DEFAULT now(),
    stopped_at          timestamptz
);

CREATE TABLE wq_runs (
    id                  uuid PRIMARY KEY,
    org                 text NOT NULL,
    play                text NOT NULL,
    params              jsonb NOT NULL DEFAULT '{}',
    release             text NOT NULL,
    lane                text NOT NULL REFERENCES wq_lanes (name),
    idempotency_key     text,
    state               wq_run_state NOT NULL DEFAULT 'queued',
    attempt             integer NOT NULL DEFAULT 0,  -- the fence: only grows
    lease_owner         text,
    lease_expires_at    timestamptz,
    job_id              bigint,                      -- the live procrastinate job, if any
    available_at        timestamptz,                 -- retry or wake time while queued/sleeping
    wait_event          text,                        -- event name while waiting for one
    wake_payload        jsonb,
    result              jsonb,
    error               jsonb,
    cancel_requested_at timestamptz,
    cancel_reason       text,
    rows_admitted       bigint NOT NULL DEFAULT 0,
    rows_done           bigint NOT NULL DEFAULT 0,
    authority           jsonb NOT NULL DEFAULT '{}',
    created_at          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz,
    finished_at         timestamptz,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wq_runs_lease_while_running CHECK (state <> 'running' OR lease_owner IS NOT NULL)
);

CREATE UNIQUE INDEX wq_runs_idempotency_idx ON wq_runs (org, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX wq_runs_lane_unfinished_idx ON wq_runs (lane, state)
    WHERE state IN ('queued', 'running', 'sleeping');
CREATE INDEX wq_runs_lease_idx ON wq_runs (lease_expires_at) WHERE state = 'running';
CREATE INDEX wq_runs_wait_event_idx ON wq_runs (wait_event) WHERE state = 'sleeping';
CREATE INDEX wq_runs_finished_idx ON wq_runs (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE wq_attempts (
    run_id              uuid NOT NULL REFERENCES wq_runs (id) ON DELETE CASCADE,
    attempt             integer NOT NULL,
    worker_id           text,
    outcome             wq_attempt_outcome NOT NULL DEFAULT 'running',
    error               jsonb,
    started_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz,
    PRIMARY KEY (run_id, attempt)
);

-- The append-only run ledger. NOTIFY wq_run_events carries {run_id, kind} for observers.
CREATE TABLE wq_events (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id              uuid NOT NULL REFERENCES wq_runs (id) ON DELETE CASCADE,
    attempt             integer,
    kind                text NOT NULL,
    data                jsonb NOT NULL DEFAULT '{}',
    at                  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX wq_events_run_idx ON wq_events (run_id, id);

CREATE FUNCTION wq_notify_run_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('wq_run_events',
        json_build_object('run_id', NEW.run_id, 'kind', NEW.kind, 'id', NEW.id)::text);
    RETURN NEW;
END;
$$;

CREATE TRIGGER wq_events_notify AFTER INSERT ON wq_events
    FOR EACH ROW EXECUTE FUNCTION wq_notify_run_event();
