-- Sheets: row namespaces that runs admit and complete, fenced by write versions.

CREATE SEQUENCE wq_write_version_seq;

CREATE TYPE wq_row_status AS ENUM (
    'pending',    -- admitted under write_version, not finished
    'done',       -- terminal: output written
    'failed'      -- terminal: the row failed for good
);

CREATE TABLE wq_sheet_rows (
    org                 text NOT NULL,
    sheet               text NOT NULL,
    row_key             text NOT NULL,
    run_id              uuid,            -- the run whose admission owns the row now
    write_version       bigint,          -- the fencing token of that admission
    status              wq_row_status NOT NULL DEFAULT 'pending',
    input               jsonb NOT NULL DEFAULT '{}',
    output              jsonb,
    admitted_at         timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz,
    PRIMARY KEY (org, sheet, row_key)
);
CREATE INDEX wq_sheet_rows_run_idx ON wq_sheet_rows (run_id, status);

-- The durable first write version of one run on one sheet (stable across wakes).
CREATE TABLE wq_write_intents (
    run_id              uuid NOT NULL REFERENCES wq_runs (id) ON DELETE CASCADE,
    org                 text NOT NULL,
    sheet               text NOT NULL,
    write_version       bigint NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, sheet)
);
