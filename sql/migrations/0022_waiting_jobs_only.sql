-- A run waits for a job only while that job waits to be claimed (todo).
--
-- A claim takes jobs (todo -> doing) and, in the same statement, starts an attempt on each
-- job's run; a job it cannot use is dropped: acknowledged, or sent back to its lane when
-- its run was admitted after the statement's snapshot (queues.runs.claim). A worker claims
-- on its own autocommit connection in one statement, so the claim is one round trip and
-- one lazy commit; the drop, which is rare, follows as a statement of its own. Between
-- the two, and for good if the worker dies there, a run can be queued (or sleeping) while
-- the job it waits for is 'doing' with nobody to settle it.
--
-- Recovery treats such a run as an orphan and gives it a new job: it now asks whether the
-- run's job is waiting (wq_transport_job_waiting), no longer whether it is live (waiting
-- or delivered). No committed state otherwise pairs a waiting run with a
-- delivered job (every claim, finish, rescue and respawn moves the run and its job
-- together), and a respawn there is harmless even when the drop does come: the run then
-- points at its new job, and the old one, whether acknowledged or sent back, is dropped
-- as a duplicate when it is next claimed.
SET LOCAL check_function_bodies = off;

-- Whether a job waits to be claimed (todo): false for a delivered, missing, finished,
-- cancelled or aborted job, a job of another task, and a NULL id. One probe of
-- procrastinate_jobs' primary key per call (migration 0021).
DROP FUNCTION wq_transport_job_live(bigint);

CREATE FUNCTION wq_transport_job_waiting(p_job_id bigint) RETURNS boolean
LANGUAGE sql
STABLE
AS $$
    SELECT coalesce((SELECT j.status::text = 'todo'
                       FROM procrastinate_jobs j
                      WHERE j.id = p_job_id AND j.task_name = 'wq.run'), false)
$$;
