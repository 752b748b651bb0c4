-- Per-run options (sql/migrations/0015): admission with options, what `runs show` prints,
-- and the recovery pass's part that fails runs never started by their claim deadline.

-- name: run_submit_options :one
-- Admission of a run with options of its own: wq_submit_with_options (migration 0015) is
-- wq_submit, then the run's options in the same call; WQ008 for an option it does not know.
SELECT run_id, created, lane, job_id
  FROM wq_submit_with_options(%(id)s, %(org)s, %(play)s, %(params)s::jsonb, %(release)s,
                              %(lane)s, %(key)s, %(priority)s, %(authority)s,
                              %(pages)b::jsonb[], %(count)s, %(digest)s, %(options)s::jsonb);

-- name: run_options_get :one
-- A run's own options (NULL: its lane's), its metadata, its parent and how many children.
SELECT r.retry_max_attempts AS max_attempts, r.retry_kind, r.retry_base_s, r.retry_factor,
       r.retry_cap_s, r.retry_jitter, r.timeout_s, r.start_by, r.meta, r.parent_id,
       (SELECT count(*) FROM wq_runs c WHERE c.parent_id = r.id)::integer AS children
  FROM wq_runs r
 WHERE r.id = %(run_id)s;

-- name: options_expire_unstarted :many
-- Fail a batch of runs never started whose claim deadline passed (no worker claimed them in
-- time): START_DEADLINE_PASSED, `run_failed` in the ledger (the run row stands for it, under
-- the seq it takes: docs/design.md, 11b), their waiting job withdrawn.
-- Runs are taken FOR UPDATE SKIP LOCKED (safe from several hosts); a job a claim holds
-- right now is not waited for (withdraw skips it): that claim finds the run failed and
-- drops the delivery. Bounded by the batch, through wq_runs_start_by_idx.
WITH late AS (
    SELECT r.id, r.job_id, r.start_by
      FROM wq_runs r
     WHERE r.state = 'queued' AND r.start_by IS NOT NULL AND r.started_at IS NULL
       AND r.start_by < coalesce(%(now)s::timestamptz, now())
     ORDER BY r.start_by
     LIMIT %(batch)s
       FOR UPDATE OF r SKIP LOCKED
), failed AS (
    UPDATE wq_runs r
       SET state = 'failed',
           error = jsonb_build_object(
               'code', 'START_DEADLINE_PASSED',
               'message', 'the run was not started by its claim deadline ' || l.start_by),
           job_id = NULL,
           finished_at = coalesce(%(now)s::timestamptz, now()),
           updated_at = now(),
           (ledger_seq, ledger_end_seq) =
               (SELECT n, n FROM wq_ledger_next_seq(r.id, r.ledger_seq) AS n),
           ledger_end_kind = 'run_failed',
           ledger_end_data = jsonb_build_object('code', 'START_DEADLINE_PASSED',
                                                'start_by', l.start_by),
           ledger_end_at = now()
      FROM late l
     WHERE r.id = l.id
    RETURNING r.id, r.ledger_end_seq, r.ledger_end_data
), jobs AS (
    -- One row, read by the final SELECT so that it runs.
    SELECT wq_transport_withdraw(array_agg(l.job_id)) AS withdrawn FROM late l
), events AS (
    INSERT INTO wq_events (run_id, kind, data, seq)
    SELECT f.id, 'run_failed', f.ledger_end_data, f.ledger_end_seq
      FROM failed f
)
SELECT f.id AS run_id
  FROM failed f
 CROSS JOIN jobs;
