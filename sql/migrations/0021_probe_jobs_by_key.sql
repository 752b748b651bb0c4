-- The recovery pass reads one job per waiting run it looks at, whatever the table
-- statistics say.
--
-- Statistics of a queue table are stale by nature (migration 0016 says so for the take).
-- When autovacuum analyzes procrastinate_jobs while a lane is empty, every job is
-- 'succeeded' at that moment: the planner then believes no job is 'todo' or 'doing', and
-- every partial index on those statuses (procrastinate's procrastinate_jobs_id_lock_idx_v1
-- on (id, lock) WHERE status IN ('todo', 'doing'), our todo indexes) holds no tuple and
-- costs nothing to read in full.
--
-- recovery_orphans_pick looked for waiting runs with no live job as
--   `NOT EXISTS (SELECT 1 FROM wq_transport_jobs() j WHERE j.id = r.job_id AND j.live)`.
-- With the live jobs believed absent, the planner made it a nested-loop anti join whose
-- inner side is a full read of procrastinate_jobs_id_lock_idx_v1 (the join key only a
-- filter): for every queued run, a walk of the live jobs up to its own. Admitting N
-- runs after such an ANALYZE made each pass read about N^2/2 jobs: 4.5M rows of
-- procrastinate_jobs for 3,000 runs; 10-14 s of one core per pass, every minute on every
-- worker, at 10,000 runs (tests/db/test_recovery_plans.py, before this migration: 18K rows
-- for the pass over its 3,000 runs, 295K for the two apply statements of a 100-run batch). recovery_respawn_apply
-- and recovery_cancel_orphans had the same anti join over their batch (batch x live
-- jobs). They now ask wq_transport_job_live(job_id) per run: a probe of
-- procrastinate_jobs' primary key. It is a SQL function that is never inlined (its body
-- is a scalar subquery), planned per calling statement, so no plan outlives the table
-- size it was made for; its only restriction is the key (the status is compared as
-- text, which no partial index's predicate matches), so its plan is the key probe, or a
-- read of a table of a few pages. A pass now reads one job per waiting run it looks
-- at, and no more.
SET LOCAL check_function_bodies = off;

-- Whether a job is live (waiting or delivered: todo, doing): false for a missing job, a
-- job of another task, a finished, cancelled or aborted one, and a NULL id. One probe of
-- procrastinate_jobs' primary key per call.
CREATE FUNCTION wq_transport_job_live(p_job_id bigint) RETURNS boolean
LANGUAGE sql
STABLE
AS $$
    SELECT coalesce((SELECT j.status::text IN ('todo', 'doing')
                       FROM procrastinate_jobs j
                      WHERE j.id = p_job_id AND j.task_name = 'wq.run'), false)
$$;
