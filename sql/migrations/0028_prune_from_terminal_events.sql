-- The job prune starts from what may have expired, and recovery ticks' jobs expire too.
--
-- 1. wq_transport_prune walked every finished job in id order (procrastinate_jobs_pkey)
--    and read each one's newest procrastinate_events row for its age, looking for p_limit
--    jobs past their lane's cutoff. With nothing past it (the usual pass: retention is
--    days, the pass runs every minute) it read the whole history: 4.26 s at 1,000,000
--    finished runs, once a minute, in the recovery pass (bench.history, 2026-12-03). A job's
--    age is that of its newest event, and a finished job's newest event is at or after the
--    event of its terminal status (procrastinate's status trigger writes one at every
--    change of status; for a run's job it is the only event kept, migration 0026). So every
--    job the prune may delete has a terminal event older than the latest cutoff of any lane.
--    The prune now walks those events (a partial index on (at, job_id) for the terminal
--    types, one entry per finished job) up to that cutoff, oldest first, and checks each
--    job as before: its task, its status, its lane's own cutoff against its newest event.
--    A pass with nothing due reads nothing. Ties in time go in job id order. The delete
--    finds its batch by primary key (= ANY of the batch's ids), never by a join that the
--    planner may make a read of the whole table.
-- 2. The recovery pass is procrastinate's periodic task (worker/recovery.py): one job of
--    task 'wq.recovery' on the maintenance queue every minute, with its full history of
--    events, that nothing deleted (1,440 jobs a day). The prune takes them too when the
--    caller names their queue among the lanes (recovery_retention_jobs gives it the
--    shortest retention of any lane), except the job procrastinate's periodic table still
--    names (procrastinate_periodic_defers keeps the latest tick of each periodic task and
--    refers to its job without ON DELETE).
--
-- tests/db/test_transport_seam.py holds what is deleted; tests/db/test_recovery_plans.py
-- that a pass over a history of finished jobs, none past its cutoff, reads none of them.

CREATE INDEX wq_job_events_terminal_idx ON procrastinate_events (at, job_id)
 WHERE type IN ('succeeded', 'failed', 'cancelled', 'aborted');

CREATE OR REPLACE FUNCTION wq_transport_prune(
    p_lanes text[],
    p_cutoffs timestamptz[],
    p_limit integer
) RETURNS SETOF bigint
LANGUAGE sql
VOLATILE
AS $$
    WITH doomed AS (
        SELECT j.id
          FROM procrastinate_events e
          JOIN procrastinate_jobs j ON j.id = e.job_id
          JOIN unnest(p_lanes, p_cutoffs) AS l (name, cutoff) ON l.name = j.queue_name
         WHERE e.type IN ('succeeded', 'failed', 'cancelled', 'aborted')
           AND e.at < (SELECT max(c) FROM unnest(p_cutoffs) AS c)
           AND j.task_name IN ('wq.run', 'wq.recovery')
           AND j.status IN ('succeeded', 'failed', 'cancelled', 'aborted')
           AND (SELECT max(x.at) FROM procrastinate_events x WHERE x.job_id = j.id) < l.cutoff
           AND NOT EXISTS (SELECT FROM procrastinate_periodic_defers d WHERE d.job_id = j.id)
         ORDER BY e.at, e.job_id
         LIMIT p_limit
           FOR UPDATE OF j SKIP LOCKED
    )
    DELETE FROM procrastinate_jobs j
     WHERE j.id = ANY (ARRAY(SELECT d.id FROM doomed d))
    RETURNING j.id
$$;
