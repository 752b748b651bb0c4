-- The fence on every write of an attempt, and what it needs to be checked and counted.

-- An attempt ended by a lost connection, an administrator shutdown, a failover or a
-- serialization failure: retried promptly, not charged to the retry budget (a lane's
-- max_interruptions stops an endless loop). Not used in this transaction (ADD VALUE).
ALTER TYPE wq_attempt_outcome ADD VALUE IF NOT EXISTS 'interrupted' AFTER 'suspended';

ALTER TABLE wq_lanes
    ADD COLUMN max_interruptions integer NOT NULL DEFAULT 20 CHECK (max_interruptions >= 0);

-- The attempt of the row's run that made the row's latest write (its admission, then its
-- terminal output), so a check can compare every write with the attempt history.
ALTER TABLE wq_sheet_rows ADD COLUMN attempt integer;

-- A legacy admission's write version, one per attempt and sheet: minted on the attempt's
-- first page, reused (and checked) on its later pages, so an attempt never supersedes its
-- own pages and a caller cannot pass a version it was never given.
CREATE TABLE wq_attempt_versions (
    run_id              uuid NOT NULL REFERENCES wq_runs (id) ON DELETE CASCADE,
    attempt             integer NOT NULL,
    sheet               text NOT NULL,
    write_version       bigint NOT NULL,
    PRIMARY KEY (run_id, attempt, sheet)
);

-- Every write the fence refused: what it was, by which attempt and worker. Refused writes
-- change no run state; this log is what `worker metrics` counts. No foreign key: a log
-- row outlives its run until retention.
CREATE TABLE wq_refusals (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id              uuid NOT NULL,
    attempt             integer NOT NULL,
    worker_id           text,
    kind                text NOT NULL,   -- receipt | rows | admission | emit | final | ...
    rows                integer NOT NULL DEFAULT 1,
    at                  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX wq_refusals_at_idx ON wq_refusals (at);

-- Events belong to an org: an emit wakes only its own org's waiters. The latest emit of a
-- name is kept (with its time) until the event retention removes it.
ALTER TABLE wq_emitted_events ADD COLUMN org text NOT NULL DEFAULT 'default';
ALTER TABLE wq_emitted_events DROP CONSTRAINT wq_emitted_events_pkey;
ALTER TABLE wq_emitted_events ADD PRIMARY KEY (org, name);
ALTER TABLE wq_emitted_events ALTER COLUMN org DROP DEFAULT;
CREATE INDEX wq_emitted_events_at_idx ON wq_emitted_events (emitted_at);

DROP INDEX wq_runs_wait_event_idx;
CREATE INDEX wq_runs_wait_event_idx ON wq_runs (org, wait_event) WHERE state = 'sleeping';
