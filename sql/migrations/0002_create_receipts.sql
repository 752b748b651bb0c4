-- Work receipts: the recorded result of a durable step, keyed by a scoped key.
-- A claimed receipt is an execution lock (owner run + attempt, lease); a completed one is
-- never executed again within its scope.

CREATE TYPE wq_receipt_status AS ENUM (
    'claimed',    -- an attempt is executing the step; owner and lease are set
    'completed',  -- the result is recorded; later attempts replay it
    'failed',     -- the step raised; a later attempt may claim it again
    'skipped'     -- the play decided not to execute it; replays as skipped
);

CREATE TABLE wq_receipts (
    org                 text NOT NULL,
    play                text NOT NULL,
    scope               text NOT NULL,   -- 'run:<id>' by default, or a wider scope name
    step_key            text NOT NULL,   -- the step name with its ordinal suffix (name#2)
    status              wq_receipt_status NOT NULL,
    owner_run           uuid,
    owner_attempt       integer,
    lease_expires_at    timestamptz,
    result              jsonb,
    error               jsonb,
    created_at          timestamptz NOT NULL DEFAULT now(),
    completed_at        timestamptz,
    PRIMARY KEY (org, play, scope, step_key)
);
CREATE INDEX wq_receipts_owner_idx ON wq_receipts (owner_run);
