-- Sheets: page admission under a write version, and fenced row completion.
--
-- Every statement that writes is fenced by the writer's attempt, in the statement itself:
-- the run is `running`, at this attempt, under this worker's lease, and of this org. A
-- write version separates runs of a sheet; only the attempt fence separates attempts of
-- one run (a stable intent gives every attempt the same version). A refused statement
-- writes nothing but a wq_refusals row.
--
-- Lock order (every statement here, so admissions and completions never deadlock):
--   1. wq_runs (id)                       the fence, FOR NO KEY UPDATE, taken first: the
--                                         statement updates the run's counters anyway. A
--                                         rescue skips a run whose row is locked (SKIP
--                                         LOCKED) and rescues it at its next pass; a claim
--                                         waits. Either way the write commits before the
--                                         attempt is closed, or it re-reads the row after
--                                         the close and is refused: never applied after it
--   2. wq_write_intents (run_id, sheet)   stable-intent admission only (legacy admission:
--      wq_attempt_versions (run, attempt, sheet))
--   3. wq_sheet_rows, ascending row_key   the page's rows (INSERT ... ORDER BY / FOR UPDATE)
--   4. the run's ledger seq lock          its rows_admitted / rows_completed event (a
--                                         transaction advisory lock, sql/migrations/0010)
-- Every statement is bounded by one page (the caller caps a page at 5,000 rows).

-- name: sheet_version_mint :one
-- The legacy write version of this attempt on a sheet: minted on its first page, the same
-- one after; fenced. A version the caller carries (write_version: saved from an earlier
-- page or attempt) is reused as it is when it is one of the run's on the sheet (`owned`),
-- and becomes the attempt's when its first page brings it; a foreign one mints nothing.
-- The run row lock (the fence) serializes an attempt's pages, so the insert-if-absent
-- cannot race another of its own. `owned` probes the run's few rows by primary key.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR NO KEY UPDATE  -- lock 1, the fence
), fence AS (
    SELECT id FROM run
     WHERE org = %(org)s AND attempt = %(attempt)s AND state = 'running'
       AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'admission', %(count)s FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), existing AS (
    SELECT write_version FROM wq_attempt_versions
     WHERE run_id = %(run_id)s AND attempt = %(attempt)s AND sheet = %(sheet)s
), owned AS (
    SELECT 1 FROM wq_attempt_versions
     WHERE run_id = %(run_id)s AND sheet = %(sheet)s
       AND write_version = %(write_version)s::bigint
    UNION ALL
    SELECT 1 FROM wq_write_intents
     WHERE run_id = %(run_id)s AND sheet = %(sheet)s
       AND write_version = %(write_version)s::bigint
), minted AS (
    INSERT INTO wq_attempt_versions (run_id, attempt, sheet, write_version)
    SELECT fence.id, %(attempt)s, %(sheet)s,
           coalesce(%(write_version)s::bigint, nextval('wq_write_version_seq'))
      FROM fence
     WHERE NOT EXISTS (SELECT 1 FROM existing)
       AND (%(write_version)s::bigint IS NULL OR EXISTS (SELECT 1 FROM owned))
    RETURNING write_version
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state,
       (SELECT org FROM run) AS run_org,
       coalesce((SELECT write_version FROM minted),
                (SELECT write_version FROM existing)) AS write_version,
       EXISTS (SELECT 1 FROM owned) AS owned;

-- name: sheet_intent_claim :one
-- Read the run's write intent on a sheet or insert one if absent; fenced. The first intent
-- is the caller's version when it carries one of the run's (legacy) versions on the sheet
-- (`owned`), else a fresh one; a foreign version inserts nothing. A NULL version with the
-- fence held means a lost race (or that foreign version): a racing loser's ON CONFLICT DO
-- NOTHING waits for the winner's commit, but this statement's snapshot predates it, so the
-- caller must re-read in a new statement (sheet_intent_read), never use its own losing
-- candidate.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR NO KEY UPDATE  -- lock 1, the fence
), fence AS (
    SELECT id FROM run
     WHERE org = %(org)s AND attempt = %(attempt)s AND state = 'running'
       AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'admission', %(count)s FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), existing AS (
    SELECT write_version FROM wq_write_intents
     WHERE run_id = %(run_id)s AND sheet = %(sheet)s
), owned AS (
    SELECT 1 FROM wq_attempt_versions
     WHERE run_id = %(run_id)s AND sheet = %(sheet)s
       AND write_version = %(write_version)s::bigint
), inserted AS (
    INSERT INTO wq_write_intents (run_id, org, sheet, write_version)
    SELECT fence.id, %(org)s, %(sheet)s,
           coalesce(%(write_version)s::bigint, nextval('wq_write_version_seq'))
      FROM fence
     WHERE NOT EXISTS (SELECT 1 FROM existing)
       AND (%(write_version)s::bigint IS NULL OR EXISTS (SELECT 1 FROM owned))
    ON CONFLICT (run_id, sheet) DO NOTHING
    RETURNING write_version
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state,
       (SELECT org FROM run) AS run_org,
       (SELECT write_version FROM inserted) AS inserted_version,
       (SELECT write_version FROM existing) AS existing_version,
       EXISTS (SELECT 1 FROM owned) AS owned;

-- name: sheet_intent_read :one
-- Re-read the winning write intent after a lost insert-if-absent race (a new snapshot).
SELECT write_version
FROM wq_write_intents
WHERE run_id = %(run_id)s AND sheet = %(sheet)s AND org = %(org)s;

-- name: sheet_admit_rows :many
-- Insert a page's new rows and re-admit its pending rows of older versions (unless the
-- page asks for no rerun admission, readmit_pending false); count them; fenced. Returns
-- only the rows this statement wrote (inserted or re-admitted). Rows it left alone (same
-- version, newer version, terminal) are still locked by the ON CONFLICT clause, so the
-- caller classifies them with sheet_rows_state in a new statement.
-- xmax = 0 marks a tuple this statement inserted (an ON CONFLICT update leaves it set).
-- `prior` (the statement snapshot) only tells the counter whether a re-admitted row came
-- from another run: a same-run re-stamp (a new attempt's legacy version) must not count a
-- row twice.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR NO KEY UPDATE  -- lock 1, the fence
), fence AS (
    SELECT id FROM run
     WHERE org = %(org)s AND attempt = %(attempt)s AND state = 'running'
       AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'admission', %(count)s FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), page AS (
    SELECT p.row_key, p.input
    FROM unnest(%(keys)s::text[], %(inputs)b::jsonb[]) AS p (row_key, input)
), prior AS (
    SELECT r.row_key, r.run_id
    FROM unnest(%(keys)s::text[]) AS k (row_key)
    CROSS JOIN LATERAL (
        SELECT row_key, run_id FROM wq_sheet_rows
        WHERE org = %(org)s AND sheet = %(sheet)s AND row_key = k.row_key
        OFFSET 0
    ) AS r
), written AS (
    INSERT INTO wq_sheet_rows AS r
        (org, sheet, row_key, run_id, write_version, input, attempt)
    SELECT %(org)s, %(sheet)s, page.row_key, fence.id, %(write_version)s, page.input,
           %(attempt)s
    FROM page CROSS JOIN fence
    ORDER BY page.row_key
    ON CONFLICT (org, sheet, row_key) DO UPDATE
        SET run_id = excluded.run_id,
            write_version = excluded.write_version,
            input = excluded.input,
            attempt = excluded.attempt,
            admitted_at = now()
        WHERE r.status = 'pending'
          AND (r.write_version IS NULL OR r.write_version < excluded.write_version)
          AND %(readmit_pending)s::boolean
    RETURNING r.row_key, (r.xmax = 0) AS inserted
), counted AS (
    UPDATE wq_runs
    SET rows_admitted = rows_admitted + (
        SELECT count(*)
        FROM written w LEFT JOIN prior p USING (row_key)
        WHERE w.inserted OR p.run_id IS DISTINCT FROM %(run_id)s
    )
    WHERE id = %(run_id)s AND EXISTS (SELECT 1 FROM written)
    RETURNING rows_admitted
), event AS (
    -- The ledger's rows_admitted, in this transaction, only when the fence held and rows
    -- were written (then `counted` updated the run): the page's counts and the run's
    -- total after it (what the progress projection keeps).
    INSERT INTO wq_events (run_id, attempt, kind, data)
    SELECT %(run_id)s::uuid, %(attempt)s::int, 'rows_admitted',
           jsonb_build_object(
               'sheet', %(sheet)s::text,
               'write_version', %(write_version)s::bigint,
               'rows', %(count)s::int,
               'admitted', (SELECT count(*) FROM written WHERE inserted),
               'readmitted', (SELECT count(*) FROM written WHERE NOT inserted),
               'rows_admitted', c.rows_admitted)
      FROM counted c
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced, w.row_key, w.inserted
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN written w ON true;

-- name: sheet_rows_state :many
-- The latest state of rows this transaction already holds locks on (an admission's leftovers).
SELECT r.row_key, r.status::text AS status, r.write_version
FROM unnest(%(keys)s::text[]) AS k (row_key)
CROSS JOIN LATERAL (
    SELECT row_key, status, write_version FROM wq_sheet_rows
    WHERE org = %(org)s AND sheet = %(sheet)s AND row_key = k.row_key
    OFFSET 0
) AS r;

-- name: sheet_complete_rows :many
-- Write a page of terminal outputs where the writer's attempt and the row's write version
-- still hold; report every row. The attempt fence comes first (lock 1): a stale attempt
-- writes nothing (every row comes back unwritten with fenced = false) but its refusal.
-- The row fence: the row belongs to the writer's run, and a versioned writer also needs
-- the row's write_version (versions are a sequence: another run's version is easy to name,
-- so the version alone is no fence). Either way the row must be pending. `locked` takes
-- the row locks in key order and, under READ COMMITTED, yields each row's latest
-- committed version, so the classification of rows left unwritten cannot race with a
-- concurrent admission. Rows absent from `locked` do not exist.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR NO KEY UPDATE  -- lock 1, the fence
), fence AS (
    SELECT id FROM run
     WHERE org = %(org)s AND attempt = %(attempt)s AND state = 'running'
       AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'rows', %(count)s FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), page AS (
    SELECT c.row_key, c.status, c.output
    FROM unnest(%(keys)s::text[], %(statuses)s::wq_row_status[], %(outputs)b::jsonb[])
        AS c (row_key, status, output)
), locked AS (
    SELECT r.row_key, r.run_id, r.write_version, r.status, r.output
    FROM unnest(%(keys)s::text[]) AS k (row_key)
    CROSS JOIN LATERAL (
        SELECT row_key, run_id, write_version, status, output FROM wq_sheet_rows
        WHERE org = %(org)s AND sheet = %(sheet)s AND row_key = k.row_key
        OFFSET 0
    ) AS r
    WHERE EXISTS (SELECT 1 FROM fence)
    ORDER BY r.row_key
    FOR UPDATE OF r
), written AS (
    -- Row by row through the primary key, whatever the statistics say of the sheet: every
    -- row of `locked` exists and this statement holds its lock, so each insert becomes the
    -- update, judged on the row's latest version. (An UPDATE joined to the page was planned
    -- as a read of the whole sheet, or of all the run's pending rows, for a sheet the
    -- statistics had not seen grow.)
    INSERT INTO wq_sheet_rows AS r (org, sheet, row_key, status, output)
    SELECT %(org)s, %(sheet)s, page.row_key, page.status, page.output
    FROM page JOIN locked USING (row_key)
    ORDER BY page.row_key
    ON CONFLICT (org, sheet, row_key) DO UPDATE
        SET status = excluded.status, output = excluded.output, finished_at = now(),
            attempt = %(attempt)s
        WHERE r.status = 'pending'
          AND r.run_id = %(run_id)s  -- only the writer's own rows, whatever version it sends
          AND (%(write_version)s::bigint IS NULL OR r.write_version = %(write_version)s::bigint)
    RETURNING r.row_key
), counted AS (
    UPDATE wq_runs
    SET rows_done = rows_done + (SELECT count(*) FROM written)
    WHERE id = %(run_id)s AND EXISTS (SELECT 1 FROM written)
    RETURNING rows_done
), outcome AS (
    -- Each row's outcome for the ledger: committed (written now), replayed (already
    -- finished by this version with the same result) or the stale reason. The same rules
    -- as queues.sheets._stale_reason, which reports them to the writer; a test holds the
    -- two together (tests/db/test_ledger.py).
    SELECT page.row_key, page.status,
           CASE
               WHEN w.row_key IS NOT NULL THEN 'committed'
               WHEN l.row_key IS NULL THEN 'older_write_version'
               WHEN %(write_version)s::bigint IS NULL THEN
                   CASE WHEN l.status <> 'pending' THEN 'already_terminal'
                        WHEN l.run_id IS DISTINCT FROM %(run_id)s::uuid
                            THEN 'newer_write_version'
                        ELSE 'unreported' END
               WHEN l.write_version IS NULL OR l.write_version < %(write_version)s::bigint
                   THEN 'older_write_version'
               WHEN l.write_version > %(write_version)s::bigint THEN 'newer_write_version'
               -- Its version, another run's row: nothing this writer admitted.
               WHEN l.run_id IS DISTINCT FROM %(run_id)s::uuid THEN 'older_write_version'
               WHEN l.status <> 'pending' THEN
                   CASE WHEN l.status = page.status AND l.output IS NOT DISTINCT FROM page.output
                        THEN 'replayed' ELSE 'already_terminal' END
               ELSE 'unreported'
           END AS outcome
    FROM page
    LEFT JOIN written w USING (row_key)
    LEFT JOIN locked l USING (row_key)
), event AS (
    -- The ledger's rows_completed, in this transaction, only when the fence held and rows
    -- were written (then `counted` updated the run): counts per outcome (committed counts
    -- replays too, as the writer's result does), the rows written as failed, and the run's
    -- total of finished rows after it (what the progress projection keeps).
    INSERT INTO wq_events (run_id, attempt, kind, data)
    SELECT %(run_id)s::uuid, %(attempt)s::int, 'rows_completed',
           jsonb_build_object(
               'sheet', %(sheet)s::text,
               'write_version', %(write_version)s::bigint,
               'rows', %(count)s::int,
               'committed', (SELECT count(*) FROM outcome
                              WHERE outcome IN ('committed', 'replayed')),
               'replayed', (SELECT count(*) FROM outcome WHERE outcome = 'replayed'),
               'failed', (SELECT count(*) FROM outcome
                           WHERE outcome = 'committed' AND status = 'failed'),
               'stale', (SELECT coalesce(jsonb_object_agg(outcome, n), '{}'::jsonb)
                           FROM (SELECT outcome, count(*) AS n FROM outcome
                                  WHERE outcome NOT IN ('committed', 'replayed')
                                  GROUP BY outcome) AS per_reason),
               'rows_done', c.rows_done)
      FROM counted c
)
SELECT
    page.row_key,
    EXISTS (SELECT 1 FROM fence) AS fenced,
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
