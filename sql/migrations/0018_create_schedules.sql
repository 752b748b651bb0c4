-- Periodic plays: schedules declared by an app (@registry.play(..., cron=...), upserted by
-- each worker at start) or added by an operator (`worker schedules add`). Every worker
-- whose release has the play looks for due schedules about once a second; the first to
-- lock a due row (FOR UPDATE SKIP LOCKED) admits its tick on its own lane, with the
-- idempotency key `schedule:<name>:<tick>`, and moves next_at on, in one transaction: one
-- run per tick however many workers and releases look. Ticks missed while nothing ran
-- are admitted once, as the latest missed tick (queues/schedules.py).

CREATE TABLE wq_schedules (
    name                text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    play                text NOT NULL,
    params              jsonb NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(params) = 'object'),
    org                 text NOT NULL DEFAULT 'default',
    cron                text,               -- a cron expression (5 fields, or 6 with seconds)
    every_s             double precision CHECK (every_s >= 1),  -- or a fixed interval
    source              text NOT NULL CHECK (source IN ('app', 'cli')),
    enabled             boolean NOT NULL DEFAULT true,
    next_at             timestamptz NOT NULL,   -- the next tick to admit
    last_tick           timestamptz,
    last_run_id         uuid,
    last_release        text,
    missed_ticks        bigint NOT NULL DEFAULT 0,  -- ticks coalesced into a later one
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    updated_by          text,
    CONSTRAINT wq_schedules_one_timing CHECK ((cron IS NULL) <> (every_s IS NULL))
);
CREATE INDEX wq_schedules_due_idx ON wq_schedules (next_at) WHERE enabled;
