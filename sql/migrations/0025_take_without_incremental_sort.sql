-- The take walks its lane's todo index whatever the lane's size: incremental sorts are off
-- where sorts already were.
--
-- wq_transport_take is planned once per session (force_generic_plan), for any lane: the
-- lane is a lateral reference, so the planner guesses its share of the table (the range
-- `queue_name >= lane AND queue_name <= lane`, about 0.4%). With sorts off (migration
-- 0016) it was meant to have one way to the order (queue_name, priority DESC, id): the walk
-- of wq_jobs_lane_todo_idx that stops after p_limit jobs. An incremental sort is another:
-- procrastinate's queue_name index yields the first key, and a sort of each queue's group
-- the rest. With 20,000 waiting jobs analyzed, the guess was 84 jobs and the planner took
-- it, so every claim read and sorted the lane's whole backlog (16,240 jobs for a claim of
-- 10): a drain of 20,000 runs at concurrency 10 went at 480 runs/s, where 5,000 went at
-- 1,200 (tests/db/test_claim_plans.py). The fair take gets the same setting.
ALTER FUNCTION wq_transport_take(text[], integer, bigint, timestamptz)
    SET enable_incremental_sort = off;
ALTER FUNCTION wq_transport_take_fair(text[], integer, bigint, timestamptz)
    SET enable_incremental_sort = off;
