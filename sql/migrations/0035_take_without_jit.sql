-- kind: expand
-- The take is never JIT-compiled, on any Postgres.
--
-- The take functions turn plan nodes off for their statements (enable_sort and others,
-- migrations 0016 and 0025) so that one plan shape serves every lane. Up to Postgres 17 a
-- node that is turned off but still needed (the final sort of the best jobs over the
-- lanes, the fair take's ranking and the distinct lanes) is not forbidden: its cost gets
-- 10^10 added (disable_cost), and the statement's estimate with it. JIT compilation is
-- decided on that estimate alone: above jit_above_cost (100,000), jit_inline_above_cost
-- and jit_optimize_above_cost (500,000), on by default wherever the server was built with
-- LLVM (Debian's and the PGDG packages are). So on Postgres 15 every take compiled its
-- statement with inlining and optimization, 140-330 ms of LLVM per claim for a statement
-- that runs in 0.2 ms (three compilations, 365 ms, per fair take): a drain of 1,000 runs
-- at concurrency 10 went at 226 runs/s where Postgres 18 (which counts turned-off nodes
-- instead of adding to their cost) went at 3,248, and a pickup took 108 ms at p50 against
-- 1.7. The plans are otherwise the same on both. Nothing in these functions gains from
-- JIT (a handful of rows per statement), so it is off for them, whatever the server's
-- setting; tests/db/test_hot_path_plans.py holds every hot-path statement to it.
ALTER FUNCTION wq_transport_take(text[], integer, bigint, timestamptz)
    SET jit = off;
ALTER FUNCTION wq_transport_take_fair(text[], integer, bigint, timestamptz)
    SET jit = off;

-- The job prune of the recovery pass (recovery_retention_jobs) walks the terminal events
-- oldest first and checks each one's job by its key, on every major.
--
-- Migration 0028 made it walk wq_job_events_terminal_idx up to the latest cutoff, joined
-- to the jobs. Postgres 15 planned that join (the function's statement is planned once,
-- for any limit) as a hash of every finished job of the lanes, each with its newest event
-- looked up, materialized and compared with every event walked: with 3,000 finished jobs
-- all due, a batch of 100 read 3,104 jobs, 3,204 events and compared 297,000 pairs
-- (tests/db/test_recovery_plans.py), where 18 read the batch. The job is now checked by a
-- scalar subquery per event, which no major turns into a join: one probe of the job's key
-- (and of its newest event) per event walked, locked there (SKIP LOCKED, as before; a job
-- two events name is locked once), and the walk stops after p_limit jobs. The pass reads
-- a batch, so JIT is off for it too.
CREATE OR REPLACE FUNCTION wq_transport_prune(
    p_lanes text[],
    p_cutoffs timestamptz[],
    p_limit integer
) RETURNS SETOF bigint
LANGUAGE sql
VOLATILE
SET jit = off
AS $$
    WITH doomed AS (
        SELECT e.job_id AS id
          FROM procrastinate_events e
         WHERE e.type IN ('succeeded', 'failed', 'cancelled', 'aborted')
           AND e.at < (SELECT max(c) FROM unnest(p_cutoffs) AS c)
           AND (SELECT true
                  FROM procrastinate_jobs j
                  JOIN unnest(p_lanes, p_cutoffs) AS l (name, cutoff) ON l.name = j.queue_name
                 WHERE j.id = e.job_id
                   AND j.task_name IN ('wq.run', 'wq.recovery')
                   AND j.status IN ('succeeded', 'failed', 'cancelled', 'aborted')
                   AND (SELECT max(x.at) FROM procrastinate_events x WHERE x.job_id = j.id)
                       < l.cutoff
                   AND NOT EXISTS (SELECT FROM procrastinate_periodic_defers d
                                    WHERE d.job_id = j.id)
                 LIMIT 1
                   FOR UPDATE OF j SKIP LOCKED)
         ORDER BY e.at, e.job_id
         LIMIT p_limit
    )
    DELETE FROM procrastinate_jobs j
     WHERE j.id = ANY (ARRAY(SELECT d.id FROM doomed d))
    RETURNING j.id
$$;
