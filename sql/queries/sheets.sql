-- Sheets: page admission under a write version, and fenced row completion.
--
-- Lock order (every statement here, so admissions and completions never deadlock):
--   1. wq_write_intents (run_id, sheet)   stable-intent admission only, taken first
--   2. wq_sheet_rows, ascending row_key   the page's rows (INSERT ... ORDER BY / FOR UPDATE)
--   3. wq_runs (id)                       the progress counters, last, in the same statement
-- The intent insert also takes FOR KEY SHARE on wq_runs through its foreign key; that mode
-- does not conflict with the counter update (FOR NO KEY UPDATE), so it adds no edge.
-- Every statement is bounded by one page (the caller caps a page at 5,000 rows).

-- name: sheet_version_mint :one
-- Mint a fresh write version for a legacy admission; no row when the run is not the org's.
SELECT nextval('wq_write_version_seq') AS write_version
FROM wq_runs
WHERE id = %(run_id)s AND org = %(org)s;

-- name: sheet_intent_claim :one
-- Read the run's write intent on a sheet or insert one if absent; NULL version = lost race.
-- A racing loser's ON CONFLICT DO NOTHING waits for the winner's commit, but this
-- statement's snapshot predates it: the caller must re-read in a new statement
-- (sheet_intent_read), never use its own losing candidate.
WITH run AS (
    SELECT id, org FROM wq_runs WHERE id = %(run_id)s AND org = %(org)s
), existing AS (
    SELECT write_version FROM wq_write_intents
    WHERE run_id = %(run_id)s AND sheet = %(sheet)s
), inserted AS (
    INSERT INTO wq_write_intents (run_id, org, sheet, write_version)
    SELECT run.id, run.org, %(sheet)s, nextval('wq_write_version_seq')
    FROM run
    WHERE NOT EXISTS (SELECT 1 FROM existing)
    ON CONFLICT (run_id, sheet) DO NOTHING
    RETURNING write_version
)
SELECT
    EXISTS (SELECT 1 FROM run) AS run_found,
    (SELECT write_version FROM inserted) AS inserted_version,
    (SELECT write_version FROM existing) AS existing_version;

-- name: sheet_intent_read :one
-- Re-read the winning write intent after a lost insert-if-absent race (a new snapshot).
SELECT write_version
FROM wq_write_intents
WHERE run_id = %(run_id)s AND sheet = %(sheet)s AND org = %(org)s;

-- name: sheet_admit_rows :many
-- Insert a page's new rows and re-admit its pending rows of older versions; count them.
-- Returns only the rows this statement wrote (inserted or re-admitted). Rows it left
-- alone (same version, newer version, terminal) are still locked by the ON CONFLICT
-- clause, so the caller classifies them with sheet_rows_state in a new statement.
-- xmax = 0 marks a tuple this statement inserted (an ON CONFLICT update leaves it set).
-- `prior` (the statement snapshot) only tells the counter whether a re-admitted row came
-- from another run: a same-run re-stamp (a legacy wake) must not count a row twice.
WITH page AS (
    SELECT p.row_key, p.input
    FROM unnest(%(keys)s::text[], %(inputs)b::jsonb[]) AS p (row_key, input)
), prior AS (
    SELECT r.row_key, r.run_id
    FROM wq_sheet_rows r
    WHERE r.org = %(org)s AND r.sheet = %(sheet)s AND r.row_key = ANY (%(keys)s::text[])
), written AS (
    INSERT INTO wq_sheet_rows AS r (org, sheet, row_key, run_id, write_version, input)
    SELECT %(org)s, %(sheet)s, page.row_key, %(run_id)s, %(write_version)s, page.input
    FROM page
    ORDER BY page.row_key
    ON CONFLICT (org, sheet, row_key) DO UPDATE
        SET run_id = excluded.run_id,
            write_version = excluded.write_version,
            input = excluded.input,
            admitted_at = now()
        WHERE r.status = 'pending'
          AND (r.write_version IS NULL OR r.write_version < excluded.write_version)
    RETURNING r.row_key, (r.xmax = 0) AS inserted
), counted AS (
    UPDATE wq_runs
    SET rows_admitted = rows_admitted + (
        SELECT count(*)
        FROM written w LEFT JOIN prior p USING (row_key)
        WHERE w.inserted OR p.run_id IS DISTINCT FROM %(run_id)s
    )
    WHERE id = %(run_id)s AND EXISTS (SELECT 1 FROM written)
)
SELECT row_key, inserted FROM written;

-- name: sheet_rows_state :many
-- The latest state of rows this transaction already holds locks on (an admission's leftovers).
SELECT row_key, status::text AS status, write_version
FROM wq_sheet_rows
WHERE org = %(org)s AND sheet = %(sheet)s AND row_key = ANY (%(keys)s::text[]);

-- name: sheet_complete_rows :many
-- Write a page of terminal outputs where the row still carries the writer's fence; report all.
-- The fence: a versioned writer needs the row's write_version; an unversioned writer
-- (write_version NULL) needs the row to belong to its run. Either way the row must be
-- pending. `locked` takes the row locks in key order and, under READ COMMITTED, yields
-- each row's latest committed version, so the classification of rows left unwritten
-- cannot race with a concurrent admission. Rows absent from `locked` do not exist.
WITH page AS (
    SELECT c.row_key, c.status, c.output
    FROM unnest(%(keys)s::text[], %(statuses)s::wq_row_status[], %(outputs)b::jsonb[])
        AS c (row_key, status, output)
), locked AS (
    SELECT r.row_key, r.run_id, r.write_version, r.status, r.output
    FROM wq_sheet_rows r
    WHERE r.org = %(org)s AND r.sheet = %(sheet)s AND r.row_key = ANY (%(keys)s::text[])
    ORDER BY r.row_key
    FOR UPDATE
), written AS (
    UPDATE wq_sheet_rows r
    SET status = page.status, output = page.output, finished_at = now()
    FROM page JOIN locked USING (row_key)
    WHERE r.org = %(org)s AND r.sheet = %(sheet)s AND r.row_key = page.row_key
      AND r.status = 'pending'
      AND CASE WHEN %(write_version)s::bigint IS NULL THEN r.run_id = %(run_id)s
               ELSE r.write_version = %(write_version)s::bigint END
    RETURNING r.row_key
), counted AS (
    UPDATE wq_runs
    SET rows_done = rows_done + (SELECT count(*) FROM written)
    WHERE id = %(run_id)s AND EXISTS (SELECT 1 FROM written)
)
SELECT
    page.row_key,
    (w.row_key IS NOT NULL) AS written,
    (l.row_key IS NOT NULL) AS found,
    l.run_id,
    l.write_version,
    l.status::text AS status,
    (l.status = page.status AND l.output IS NOT DISTINCT FROM page.output) AS same_result
FROM page
LEFT JOIN written w USING (row_key)
LEFT JOIN locked l USING (row_key);

-- name: sheet_progress :one
-- A run's row counters for progress display.
SELECT rows_admitted, rows_done FROM wq_runs WHERE id = %(run_id)s;
