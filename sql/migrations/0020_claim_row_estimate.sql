-- The claim's plan no longer grows with the history of runs.
--
-- run_claim_batch joins the jobs wq_transport_take hands out to wq_runs. A set-returning
-- function is estimated at 1,000 rows unless it says otherwise, so the planner joined
-- those "1,000" jobs to wq_runs by hashing the whole table: every claim read every run
-- ever admitted (a 10-run claim over 3,000 runs of history: 7.5 ms, 6.3 of them in the
-- two sequential scans of wq_runs). A claim takes at most the worker's free slots
-- (CLAIM_BATCH_MAX, 64, in worker/runtime.py), usually a handful: with the estimate at
-- that size the planner probes wq_runs' key per job (1.8 ms for the same claim), and the
-- cost of a claim stays flat however many finished runs are kept.
ALTER FUNCTION wq_transport_take(text[], integer, bigint, timestamptz) ROWS 16;
ALTER FUNCTION wq_transport_take_fair(text[], integer, bigint, timestamptz) ROWS 16;
