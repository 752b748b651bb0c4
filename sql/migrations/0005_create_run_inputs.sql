-- Input rows given at submit (--input rows.csv|rows.jsonl), stored in pages in the same
-- transaction as the launch row; the play streams them page by page into its sheet.

CREATE TABLE wq_run_inputs (
    run_id              uuid NOT NULL REFERENCES wq_runs (id) ON DELETE CASCADE,
    page                integer NOT NULL,
    rows                jsonb NOT NULL,   -- a JSON array of [key, row] pairs
    PRIMARY KEY (run_id, page)
);
