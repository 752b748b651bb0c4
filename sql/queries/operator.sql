-- Operator actions: retrying a finished run, changing a lane's policy, and the audit log
-- of who did what (wq_operator_actions).
--
-- Lock order of a retry (the same as recovery's): the run row FOR UPDATE, then its lane
-- row FOR SHARE (a reclaim, which takes the lane FOR UPDATE, waits for the retry or the
-- retry waits for it: a reclaim can never miss a run a retry requeues), then the run's
-- ledger seq lock (the run_retried event). A cancel takes the run row FOR UPDATE too, so
-- a retry and a cancel of one run are settled by the order they get that lock.

-- name: run_retry_lock :one
-- Lock the run a retry is about to requeue; its state as of the lock (the latest commit).
SELECT state::text AS state, lane, attempt
  FROM wq_runs
 WHERE id = %(run_id)s
   FOR UPDATE;

-- name: lane_share_lock :one
-- Hold a lane's registry row FOR SHARE (as admission does): a reclaim waits for us.
SELECT state::text AS state
  FROM wq_lanes
 WHERE name = %(lane)s
   FOR SHARE;

-- name: run_retry :one
-- Requeue a failed or cancelled run as itself, under the lock run_retry_lock took: a new
-- job on its own lane, a new attempt sequence (the budget counts attempts after
-- retry_floor), its receipts, write intents and ledger kept. Re-checks the state, so a
-- second retry that waited for the first's lock changes nothing (no row).
--
-- A finishing event the run row stands for (a run ended without an attempt: its
-- ledger_end_* columns) is kept as a stored event first: the row has room for one, and the
-- run may end that way again. Stored already (written before the ledger's contract step,
-- migration 0041), it is not copied.
WITH prior AS (
    SELECT r.id, r.ledger_end_seq, r.ledger_end_kind, r.ledger_end_data, r.ledger_end_at
      FROM wq_runs r
     WHERE r.id = %(run_id)s
       AND r.ledger_end_seq IS NOT NULL
), retried AS (
    UPDATE wq_runs r
       SET state = 'queued',
           ledger_end_seq = NULL,
           ledger_end_kind = NULL,
           ledger_end_data = NULL,
           ledger_end_at = NULL,
           retry_floor = r.attempt,
           job_id = wq_transport_next_id(),
           available_at = NULL,
           result = NULL,
           error = NULL,
           finished_at = NULL,
           cancel_requested_at = NULL,
           cancel_reason = NULL,
           wait_event = NULL,
           wake_payload = NULL,
           updated_at = now()
     WHERE r.id = %(run_id)s
       AND r.state IN ('failed', 'cancelled')
    RETURNING r.id, r.lane, r.job_id, r.attempt
), job AS (
    -- The transport (migration 0013). One row, read by the final SELECT so that it runs.
    SELECT wq_transport_spawn(array_agg(job_id), array_agg(lane), array_agg(id)) AS spawned
      FROM retried
), ended AS (
    INSERT INTO wq_events (run_id, seq, kind, data, at)
    SELECT b.id, b.ledger_end_seq, b.ledger_end_kind, b.ledger_end_data, b.ledger_end_at
      FROM prior b
      JOIN retried USING (id)
     WHERE NOT EXISTS (SELECT 1 FROM wq_events e
                        WHERE e.run_id = b.id AND e.seq = b.ledger_end_seq)
), event AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT id, 'run_retried',
           jsonb_strip_nulls(jsonb_build_object(
               'by', %(actor)s::text,
               'reason', %(reason)s::text,
               'previous_state', %(before)s::text,
               'after_attempt', attempt,
               'job_id', job_id))
      FROM retried
), audit AS (
    INSERT INTO wq_operator_actions (actor, action, lane, run_id, data)
    SELECT %(actor)s, 'retry', lane, id,
           jsonb_strip_nulls(jsonb_build_object('previous_state', %(before)s::text,
                                                'reason', %(reason)s::text))
      FROM retried
)
SELECT id AS run_id, lane, job_id, attempt FROM retried CROSS JOIN job;

-- name: operator_action_record :exec
-- Append one operator action to the audit log (in the transaction of the action itself).
INSERT INTO wq_operator_actions (actor, action, lane, run_id, data)
VALUES (%(actor)s, %(action)s, %(lane)s, %(run_id)s, %(data)s);

-- name: operator_actions_recent :many
-- The latest operator actions, newest first, optionally of one lane (bounded by limit).
SELECT id, at, actor, action, lane, run_id, data
  FROM wq_operator_actions
 WHERE (%(lane)s::text IS NULL OR lane = %(lane)s)
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s;

-- name: lane_lock_policy :one
-- Lock a lane's registry row for a policy change; its current policy (read under the lock).
SELECT name, lease_ttl_s, heartbeat_s
  FROM wq_lanes
 WHERE name = %(name)s
   FOR UPDATE;
