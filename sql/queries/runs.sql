-- name: run_submit :one
-- Admission in one statement: wq_submit (sql/migrations/0009) checks the lane under FOR
-- SHARE, inserts the launch row, its job and its input pages (the run row stands for its
-- run_created event, migration 0041), or answers an idempotent retry with the earlier run;
-- it raises WQ001/WQ002/WQ003/WQ007.
SELECT run_id, created, lane, job_id
  FROM wq_submit(%(id)s, %(org)s, %(play)s, %(params)s::jsonb, %(release)s, %(lane)s, %(key)s,
                 %(priority)s, %(authority)s, %(pages)b::jsonb[], %(count)s, %(digest)s);

-- name: run_submit_many :many
-- Batch admission in one statement: wq_submit_many (sql/migrations/0014) admits N runs,
-- each idempotent, in the batch's order, or refuses the whole batch (WQ001/2/3/7).
SELECT run_id, created, lane, job_id
  FROM wq_submit_many(%(ids)b::uuid[], %(orgs)b::text[], %(plays)b::text[],
                      %(params)b::jsonb[], %(releases)b::text[], %(lanes)b::text[],
                      %(keys)b::text[], %(priorities)b::int[], %(authorities)b::jsonb[]);

-- name: run_claim_batch :many
-- Take up to N due jobs of the lanes and start a new attempt on each of their runs.
-- A delivery whose run is terminal, leased, sleeping with a cancel pending, or not pointing
-- at this job is returned as dropped (claimed = false), and so is one whose run was
-- admitted after this statement's snapshot (the transport takes jobs in a later one), or
-- whose play this release does not have, or that was not started by its claim deadline:
-- job_drop settles those (back to the lane; failed at once; acknowledged). A queued run
-- with a cancel pending is claimed as a cleanup-only attempt (its lease lapsed before its
-- cleanup hooks ran).
WITH taken AS (
    -- The transport's ordered, SKIP LOCKED walk of each lane's due jobs; a run id that is
    -- not a UUID comes back NULL (dropped). Read to the end below, by the final SELECT.
    SELECT t.job_id AS id, t.run_id
      FROM wq_transport_take(%(lanes)s::text[], %(limit)s, %(procrastinate_worker)s,
                             %(now)s::timestamptz) AS t
), claimed AS (
    UPDATE wq_runs r
       SET state = 'running',
           attempt = r.attempt + 1,
           lease_owner = %(worker)s,
           lease_expires_at = coalesce(%(now)s::timestamptz, now())
                              + make_interval(secs => l.lease_ttl_s),
           started_at = coalesce(r.started_at, coalesce(%(now)s::timestamptz, now())),
           available_at = NULL,
           -- The attempt's start event takes the run's next seq here (docs/design.md, 11b):
           -- the function locks the row, then the run's ledger lock, and reads the last
           -- seq after both (a run not numbered yet starts after its last event).
           ledger_seq = wq_ledger_next_seq(r.id, r.ledger_seq),
           updated_at = now()
      FROM taken, wq_lanes l
     -- The taken jobs' runs by key (the array), whatever the size of the history: joined
     -- only, the generic plan read all of wq_runs per claim while it held a few thousand
     -- runs (tests/db/test_claim_plans.py).
     WHERE r.id = ANY (ARRAY(SELECT taken.run_id FROM taken))
       AND r.id = taken.run_id
       AND l.name = r.lane
       AND r.job_id = taken.id
       -- The state as text, here and in job_drop: no index matches it, so the runs are
       -- found by key, one probe per taken job. Compared as an enum, a plan made while
       -- the statistics said few runs were queued read every queued run per claim (the
       -- backlog) through wq_runs_lane_unfinished_idx.
       AND (r.state::text = 'queued'
            OR (r.state::text = 'sleeping' AND r.cancel_requested_at IS NULL))
       AND r.play = ANY (%(plays)s::text[])
       -- Never started by its claim deadline: failed below (`unknown`), not run late.
       AND (r.start_by IS NULL OR r.started_at IS NOT NULL
            OR r.start_by >= coalesce(%(now)s::timestamptz, now()))
    RETURNING r.id, r.attempt, r.ledger_seq, r.org, r.play, r.params, r.lane, r.release,
              r.job_id, r.lease_expires_at, r.wake_payload, r.created_at, r.authority,
              r.cancel_requested_at IS NOT NULL AS cleanup,
              l.lease_ttl_s, l.heartbeat_s,
              -- The run's own options over its lane's policy (migration 0015).
              coalesce(r.retry_max_attempts, l.retry_max_attempts) AS retry_max_attempts,
              coalesce(r.retry_base_s, l.retry_base_s) AS retry_base_s,
              coalesce(r.retry_cap_s, l.retry_cap_s) AS retry_cap_s,
              coalesce(r.retry_jitter, l.retry_jitter) AS retry_jitter,
              r.retry_kind, r.retry_factor,
              r.started_at + make_interval(secs => coalesce(r.timeout_s,
                                                            nullif(l.run_timeout_s, 0)))
                  AS timeout_at,
              r.meta,
              l.max_interruptions,
              l.org_concurrency > 0 AS org_capped,
              -- Failed attempts so far: sleeps, hand-backs, interruptions and lapsed
              -- leases (a dead worker's, queues.outcomes.after_lapse) do not spend the
              -- retry budget; interruptions have a budget of their own. Only this
              -- attempt sequence counts: an operator's retry set retry_floor. A first
              -- attempt of the sequence (r.attempt is the new number) has none to count,
              -- and reads nothing: most claims are first attempts, and a plan cached
              -- while wq_attempts was small reads all of it per count.
              CASE WHEN r.attempt - 1 > r.retry_floor THEN
                  (SELECT count(*) FROM wq_attempts a
                    WHERE a.run_id = r.id AND a.attempt > r.retry_floor
                      AND a.outcome = 'failed')::int
              ELSE 0 END AS failures,
              CASE WHEN r.attempt - 1 > r.retry_floor THEN
                  (SELECT count(*) FROM wq_attempts a
                    WHERE a.run_id = r.id AND a.attempt > r.retry_floor
                      AND a.outcome = 'interrupted')::int
              ELSE 0 END AS interruptions,
              -- Whether the attempt before this one was cut short (interrupted, or its
              -- worker lost): the steps it was in the middle of may run again here (a
              -- duplicate suspect, counted by worker.instruments). One key probe.
              CASE WHEN r.attempt - 1 > r.retry_floor THEN
                  EXISTS (SELECT 1 FROM wq_attempts a
                           WHERE a.run_id = r.id AND a.attempt = r.attempt - 1
                             AND a.outcome IN ('interrupted', 'lease_expired'))
              ELSE false END AS resumed
), attempt AS (
    INSERT INTO wq_attempts (run_id, attempt, worker_id, start_seq, cleanup)
    SELECT id, attempt, %(worker)s, ledger_seq, cleanup FROM claimed
    RETURNING run_id, attempt, start_seq, cleanup
), event AS (
    -- The attempt row stands for its start event (wq_ledger), read from the row written;
    -- wq_ledger_lifecycle stores it until the ledger's contract step (migration 0041),
    -- then only delivers and folds it: not notified here (false, migration 0040), the
    -- worker announces the runs it started (runs.announce). One row, read by the final
    -- SELECT so that it runs.
    SELECT wq_ledger_lifecycle(array_agg(wq_ledger_event(
               run_id, start_seq, attempt,
               CASE WHEN cleanup THEN 'cleanup_started' ELSE 'attempt_started' END,
               jsonb_build_object('worker', %(worker)s::text))), false) AS noted
      FROM attempt
), waiting AS (
    -- The set of workers waiting for work (migration 0032: a spawn wakes them in turns):
    -- taking fewer jobs than asked for, the worker waits; taking all, it does not. Only a
    -- change is written: a drain's full claims, an idle worker's empty ones and a waiting
    -- worker's pickup write nothing.
    UPDATE wq_workers w
       SET waiting_since = CASE WHEN n.taken < %(limit)s THEN now() END
      FROM (SELECT count(*) AS taken FROM taken) n
     WHERE w.id = %(worker)s
       AND (w.waiting_since IS NULL) = (n.taken < %(limit)s)
), lazy AS (
    -- The claim's commit need not wait for its WAL flush (queues.runs.claim says why its
    -- loss is harmless); %(lazy)s: this statement is its own transaction (autocommit), so
    -- the transaction-local setting reaches no other write.
    SELECT set_config('synchronous_commit', 'off', true) AS setting
     WHERE %(lazy)s::boolean
)
SELECT true AS claimed, c.id AS run_id, c.attempt, c.org, c.play, c.params, c.lane,
       c.release, c.job_id, c.lease_expires_at, c.wake_payload, c.created_at, c.authority,
       c.cleanup,
       c.lease_ttl_s, c.heartbeat_s, c.retry_max_attempts, c.retry_base_s, c.retry_cap_s,
       c.retry_jitter, c.max_interruptions, c.failures, c.interruptions,
       c.retry_kind, c.retry_factor, c.timeout_at, c.meta, c.org_capped, c.resumed
  FROM claimed c
  LEFT JOIN lazy ON true
 CROSS JOIN event
UNION ALL
SELECT false, t.run_id, NULL, NULL, NULL, NULL, NULL, NULL, t.id, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL
  FROM taken t
 WHERE NOT EXISTS (SELECT 1 FROM claimed c WHERE c.job_id = t.id);

-- name: run_announce :exec
-- Announce the attempts a claim started, which its statement neither notifies nor folds
-- (migrations 0040, 0041): NOTIFY `wq_run_events` for these runs (wq_ledger_appended: run
-- ids, 200 per notification) and fold each one's current attempt start into the progress
-- sink, as the ledger shows it (wq_ledger_state: the attempt row stands for it). The fold
-- only moves forward, so a start folded after the run's later events changes nothing.
-- With an HTTP sink enabled the claim delivered and folded the start itself, and nothing
-- is folded here (no delivery is written twice).
-- Lock order, every folder's: the runs, then their progress rows, each in run id order.
-- The run rows FOR KEY SHARE come first: the fold's insert checks its foreign key with that
-- lock only at the statement's end, after writing the progress rows, so a finish holding
-- one of the runs and folding into its progress row would wait for this statement while
-- this one waited for the finish (tests/integration/test_notify_once.py).
WITH announced AS MATERIALIZED (
    SELECT r.id, r.attempt
      FROM wq_runs r
     WHERE r.id = ANY (%(runs)s::uuid[])
     ORDER BY r.id
       FOR KEY SHARE OF r
)
SELECT wq_ledger_appended(
           coalesce(array_agg(wq_ledger_event(e.run_id, e.seq, e.attempt, e.kind, e.data)
                              ORDER BY e.run_id), ARRAY[]::wq_events[]),
           true, %(runs)s::text[])
  FROM announced r
  JOIN wq_ledger_state e
    ON e.run_id = r.id AND e.attempt = r.attempt
   AND e.kind IN ('attempt_started', 'cleanup_started')
 WHERE e.run_id = ANY (%(runs)s::uuid[])  -- the view's branches read by key
   AND NOT EXISTS (SELECT 1 FROM wq_sinks s WHERE s.enabled AND s.kind <> 'progress');

-- name: job_drop :exec
-- Settle deliveries a claim dropped, in a statement of their own (rare: the claim itself
-- carries no statement for them). A run that waits for exactly this job but whose play
-- this release does not have can never run on this lane, and one never started by its
-- claim deadline must not run late: it fails at once (is cancelled, when that was asked)
-- instead of burning attempts, and its job is acknowledged. One that waits for this job
-- otherwise goes back to its lane: the claim could not see that run yet (see
-- run_claim_batch), this statement can. Every other one is acknowledged (duplicate, late,
-- or for a finished run).
WITH delivery AS (
    SELECT t.id, t.run_id
      FROM unnest(%(job_ids)s::bigint[], %(run_ids)s::uuid[]) AS t (id, run_id)
), unknown AS (
    UPDATE wq_runs r
       SET state = CASE WHEN r.cancel_requested_at IS NULL THEN 'failed'
                        ELSE 'cancelled' END::wq_run_state,
           error = CASE WHEN r.play = ANY (%(plays)s::text[])
                        THEN jsonb_build_object(
                            'code', 'START_DEADLINE_PASSED',
                            'message', 'the run was not started by its claim deadline '
                                       || r.start_by)
                        ELSE jsonb_build_object(
                            'code', 'PLAY_UNKNOWN',
                            'message', 'play ' || r.play || ' is not registered in release '
                                       || r.release) END,
           job_id = NULL,
           finished_at = now(),
           updated_at = now(),
           -- The run row stands for its run_failed or run_cancelled (docs/design.md, 11b).
           (ledger_seq, ledger_end_seq) =
               (SELECT n, n FROM wq_ledger_next_seq(r.id, r.ledger_seq) AS n),
           ledger_end_kind = CASE WHEN r.cancel_requested_at IS NULL THEN 'run_failed'
                                  ELSE 'run_cancelled' END,
           ledger_end_data = jsonb_build_object(
               'code', CASE WHEN r.play = ANY (%(plays)s::text[])
                            THEN 'START_DEADLINE_PASSED' ELSE 'PLAY_UNKNOWN' END,
               'play', r.play),
           ledger_end_at = now()
      FROM delivery d
     WHERE r.id = ANY (ARRAY(SELECT d.run_id FROM delivery d))  -- by key (run_claim_batch)
       AND r.id = d.run_id
       AND r.job_id = d.id
       AND (r.state::text = 'queued'
            OR (r.state::text = 'sleeping' AND r.cancel_requested_at IS NULL))
       AND (NOT (r.play = ANY (%(plays)s::text[]))
            OR (r.started_at IS NULL
                AND r.start_by < coalesce(%(now)s::timestamptz, now())))
    RETURNING r.id, d.id AS job_id, r.ledger_end_seq, r.ledger_end_kind, r.ledger_end_data
), unknown_event AS (
    INSERT INTO wq_events (run_id, kind, data, seq)
    SELECT id, ledger_end_kind, ledger_end_data, ledger_end_seq
      FROM unknown
), settled AS (
    -- This statement's snapshot does not show the failures above: those jobs are
    -- acknowledged, never sent back.
    SELECT d.id,
           NOT EXISTS (SELECT 1 FROM unknown u WHERE u.job_id = d.id)
           AND EXISTS (SELECT 1 FROM wq_runs r
                        WHERE r.id = d.run_id AND r.job_id = d.id
                          AND (r.state = 'queued'
                               OR (r.state = 'sleeping' AND r.cancel_requested_at IS NULL)))
               AS waiting
      FROM delivery d
)
SELECT wq_transport_release(array_agg(s.id) FILTER (WHERE s.waiting)) AS released,
       wq_transport_settle(array_agg(s.id) FILTER (WHERE NOT s.waiting),
                           array_agg(true) FILTER (WHERE NOT s.waiting)) AS acknowledged
  FROM settled s;

-- name: run_heartbeat :many
-- Renew the leases of this worker's live attempts; a run missing from the answer lost its
-- lease (rescued, superseded or cancelled) and its attempt must stop.
-- Lock order: the runs in id order (`locked`), as run_finish_batch takes them. An UPDATE
-- joined to an unnest locks in whatever order its join yields, and the heartbeat renews
-- the very runs the finish loop is finishing: unordered, the two deadlocked ("deadlock
-- detected ... while locking tuple ... in relation wq_runs"). The fence stays in the
-- UPDATE, checked on the row version the lock yields.
WITH locked AS (
    SELECT r.id
      FROM wq_runs r
     WHERE r.id = ANY (%(run_ids)s::uuid[])
     ORDER BY r.id
       FOR NO KEY UPDATE OF r
)
UPDATE wq_runs r
   SET lease_expires_at = coalesce(%(now)s::timestamptz, now())
                          + make_interval(secs => l.lease_ttl_s)
  FROM wq_lanes l,
       unnest(%(run_ids)s::uuid[], %(attempts)s::int[]) AS i(run_id, attempt)
 WHERE r.id = i.run_id
   AND r.attempt = i.attempt
   AND r.state = 'running'
   AND r.lease_owner = %(worker)s
   AND l.name = r.lane
   AND r.id IN (SELECT id FROM locked)
RETURNING r.id AS run_id, r.attempt, r.lease_expires_at, r.cancel_requested_at IS NOT NULL AS cancel;

-- name: run_cancel_requested :many
-- Which of this worker's live attempts have a durable cancel request on their run (written
-- by run_cancel, which only the worker role and the owner can run). A control message only
-- names a run to look at: anyone who can connect can NOTIFY, so this read is what a worker
-- acts on. Reads only; the runs by their primary key.
SELECT r.id AS run_id, r.attempt
  FROM wq_runs r
  JOIN unnest(%(run_ids)s::uuid[], %(attempts)s::int[]) AS i(run_id, attempt)
    ON r.id = i.run_id AND r.attempt = i.attempt
 WHERE r.state = 'running'
   AND r.lease_owner = %(worker)s
   AND r.cancel_requested_at IS NOT NULL;

-- name: run_finish_batch :many
-- Write the outcome of finished attempts, fenced: only where the run still carries the
-- attempt number, is running and holds this worker's lease (checked under the run's row
-- lock, in this statement). Cancel is final: while a cancel is pending only a `cancelled`
-- outcome is applied; any other comes back `cancel_pending` and changes nothing (the
-- worker then runs the cleanup hooks and writes `cancelled`). A write applied before whose
-- reply was lost comes back `replayed`. Any other unfenced write is `refused`: logged in
-- wq_refusals and (if it is the writer's own, still open) its attempt row marked
-- superseded, nothing else written.
-- Also finishes the delivering job, and spawns the next job (retry, hand-back, wake).
WITH input AS (
    SELECT *
      FROM unnest(%(run_ids)s::uuid[], %(attempts)s::int[], %(states)s::text[],
                  %(outcomes)s::text[], %(results)s::jsonb[], %(errors)s::jsonb[],
                  %(spawn)s::boolean[], %(spawn_at)s::timestamptz[], %(wait_events)s::text[],
                  %(kinds)s::text[])
           AS i(run_id, attempt, state, outcome, result, error, spawn, spawn_at, wait_event,
                kind)
), fenced AS (
    SELECT r.id, r.job_id AS old_job_id, r.lane, i.attempt, i.state, i.outcome, i.result,
           i.error, i.spawn, i.spawn_at, i.wait_event, i.kind,
           (r.cancel_requested_at IS NOT NULL AND i.outcome <> 'cancelled') AS cancel_pending
      FROM wq_runs r
      JOIN input i ON i.run_id = r.id
     WHERE r.attempt = i.attempt
       AND r.state = 'running'
       AND r.lease_owner = %(worker)s
     ORDER BY r.id
       FOR UPDATE OF r
), applying AS (
    SELECT f.*, CASE WHEN f.spawn THEN wq_transport_next_id() END AS new_job_id
      FROM fenced f
     WHERE NOT f.cancel_pending
), runs AS (
    UPDATE wq_runs r
       SET state = f.state::wq_run_state,
           result = coalesce(f.result, r.result),
           error = CASE WHEN f.state = 'succeeded' THEN NULL ELSE coalesce(f.error, r.error) END,
           lease_owner = NULL,
           lease_expires_at = NULL,
           job_id = f.new_job_id,
           available_at = f.spawn_at,
           wait_event = f.wait_event,
           wake_payload = NULL,
           finished_at = CASE WHEN f.state IN ('succeeded', 'failed', 'cancelled')
                              THEN now() END,
           -- The outcome's event takes the run's next seq (docs/design.md, 11b): under the
           -- row lock `fenced` holds, the function takes the run's ledger lock and reads
           -- the last seq after it.
           ledger_seq = wq_ledger_next_seq(r.id, r.ledger_seq),
           updated_at = now()
      FROM applying f
     WHERE r.id = f.id
    RETURNING r.id, r.ledger_seq
), outcome AS (
    -- The outcome's event as the attempt row holds it.
    SELECT f.id, f.attempt, f.kind, n.ledger_seq AS seq,
           -- The event names the error; its traceback stays on the attempt and the run.
           jsonb_strip_nulls(jsonb_build_object('error', f.error - 'traceback',
                                                'spawn_at', f.spawn_at,
                                                'wait_event', f.wait_event)) AS data
      FROM applying f
      JOIN runs n ON n.id = f.id
), jobs AS (
    -- The transport: finish the delivering jobs and spawn the next ones (retry, hand-back,
    -- wake), one call each for the batch. One row, read by the final SELECT so that it runs.
    SELECT wq_transport_settle(array_agg(f.old_job_id), array_agg(f.outcome = 'succeeded'))
               AS settled,
           CASE WHEN bool_or(f.spawn)
                THEN wq_transport_spawn(array_agg(f.new_job_id) FILTER (WHERE f.spawn),
                                        array_agg(f.lane) FILTER (WHERE f.spawn),
                                        array_agg(f.id) FILTER (WHERE f.spawn),
                                        array_agg(f.spawn_at) FILTER (WHERE f.spawn))
           END AS spawned
      FROM applying f
), attempts AS (
    UPDATE wq_attempts a
       SET outcome = f.outcome::wq_attempt_outcome, error = f.error, finished_at = now(),
           end_seq = o.seq, end_kind = o.kind, end_data = o.data
      FROM applying f
      JOIN outcome o ON o.id = f.id
     WHERE a.run_id = f.id AND a.attempt = f.attempt
    RETURNING a.run_id, a.attempt, a.end_seq, a.end_kind, a.end_data
), events AS (
    -- The outcomes' events, read from the attempt rows written (see the claim's `event`).
    -- One row, read by the final SELECT so that it runs.
    SELECT wq_ledger_lifecycle(array_agg(wq_ledger_event(
               w.run_id, w.end_seq, w.attempt, w.end_kind, w.end_data))) AS noted
      FROM attempts w
), refused AS (
    -- Both checks are scalar subqueries, read per input row and the second only for a row
    -- the fence did not take (rare): as anti joins, a plan cached while wq_attempts was
    -- small read all of it on every finish.
    SELECT i.run_id, i.attempt
      FROM input i
     WHERE CASE WHEN (SELECT EXISTS (SELECT 1 FROM fenced f
                                      WHERE f.id = i.run_id AND f.attempt = i.attempt))
                THEN false
                -- An earlier copy of this very write (its reply lost) left its outcome on
                -- the attempt.
                ELSE (SELECT NOT EXISTS (
                          SELECT 1 FROM wq_attempts a
                           WHERE a.run_id = i.run_id AND a.attempt = i.attempt
                             AND a.outcome::text = i.outcome AND a.finished_at IS NOT NULL))
           END
), refusal_log AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind)
    SELECT run_id, attempt, %(worker)s, 'final' FROM refused
), superseded AS (
    -- Only the writer's own attempt: a refused write sent by another worker for the live
    -- attempt's number must not close the live attempt.
    UPDATE wq_attempts a
       SET outcome = 'superseded', finished_at = now()
      FROM refused x
     WHERE a.run_id = x.run_id AND a.attempt = x.attempt AND a.outcome = 'running'
       AND a.worker_id = %(worker)s
       AND EXISTS (SELECT 1 FROM refused)  -- a one-time check: no refusal, nothing read
)
SELECT i.run_id, i.attempt,
       CASE WHEN f.id IS NOT NULL AND f.cancel_pending THEN 'cancel_pending'
            WHEN f.id IS NOT NULL THEN 'applied'
            WHEN x.run_id IS NOT NULL THEN 'refused'
            ELSE 'replayed' END AS status
  FROM input i
 CROSS JOIN jobs
 CROSS JOIN events
  LEFT JOIN fenced f ON f.id = i.run_id AND f.attempt = i.attempt
  LEFT JOIN refused x ON x.run_id = i.run_id AND x.attempt = i.attempt;

-- name: run_cancel :one
-- Cancel a run in one statement. A queued run with no request pending, or a sleeping run,
-- is cancelled at once with its waiting job; a running attempt gets a durable request and
-- a NOTIFY, runs its cleanup hooks and writes `cancelled` itself (a queued run with a
-- request pending is waiting for such a cleanup attempt). `force` cancels at once in every
-- unfinished state, skipping cleanup: the live attempt's writes are refused from then on.
-- A repeated cancel is harmless (it re-notifies a running attempt); a finished run stays.
WITH target AS (
    SELECT id, state, job_id, attempt, cancel_requested_at, ledger_seq
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR UPDATE
), decided AS (
    SELECT t.*,
           jsonb_strip_nulls(jsonb_build_object(
               'reason', %(reason)s::text,
               'forced', CASE WHEN %(force)s::boolean THEN true END,
               'by', %(actor)s::text)) AS event_data,
           t.state IN ('queued', 'sleeping', 'running')
           AND (t.state = 'sleeping'
                OR (t.state = 'queued' AND t.cancel_requested_at IS NULL)
                OR %(force)s::boolean) AS now_,
           t.state IN ('queued', 'sleeping', 'running') AND t.cancel_requested_at IS NULL
               AS first_request
      FROM target t
), numbered AS (
    -- The event's seq, only when there is an event (docs/design.md, 11b): under the row
    -- lock `target` holds, the function takes the run's ledger lock and reads the last seq
    -- after it. A finished run, or a repeated request of a running one, takes nothing.
    SELECT d.*, wq_ledger_next_seq(d.id, d.ledger_seq) AS next_seq
      FROM decided d
     WHERE d.now_ OR d.first_request
), req AS (
    UPDATE wq_runs r
       SET cancel_requested_at = coalesce(r.cancel_requested_at, now()),
           cancel_reason = coalesce(r.cancel_reason, %(reason)s),
           state = CASE WHEN d.now_ THEN 'cancelled'::wq_run_state ELSE r.state END,
           lease_owner = CASE WHEN d.now_ THEN NULL ELSE r.lease_owner END,
           lease_expires_at = CASE WHEN d.now_ THEN NULL ELSE r.lease_expires_at END,
           finished_at = CASE WHEN d.now_ THEN now() ELSE r.finished_at END,
           job_id = CASE WHEN d.now_ THEN NULL ELSE r.job_id END,
           wait_event = CASE WHEN d.now_ THEN NULL ELSE r.wait_event END,
           ledger_seq = d.next_seq,
           -- Cancelled now: the run row stands for its run_cancelled (no attempt writes it).
           ledger_end_seq = CASE WHEN d.now_ THEN d.next_seq ELSE r.ledger_end_seq END,
           ledger_end_kind = CASE WHEN d.now_ THEN 'run_cancelled' ELSE r.ledger_end_kind END,
           ledger_end_data = CASE WHEN d.now_ THEN d.event_data ELSE r.ledger_end_data END,
           ledger_end_at = CASE WHEN d.now_ THEN now() ELSE r.ledger_end_at END,
           updated_at = now()
      FROM numbered d
     WHERE r.id = d.id
    RETURNING r.id, r.state, r.ledger_seq, d.event_data
), job AS (
    -- The run's job: a waiting one is cancelled; a forced cancel aborts a delivery in flight.
    -- One row, read by the final SELECT so that it runs.
    SELECT wq_transport_stop(array_agg(d.job_id)) AS stopped
      FROM decided d
     WHERE d.now_
), attempt AS (
    UPDATE wq_attempts a
       SET outcome = 'cancelled', finished_at = now(),
           error = jsonb_build_object('code', 'CANCELLED_BY_FORCE')
      FROM decided d
     WHERE d.now_ AND d.state = 'running' AND a.run_id = d.id AND a.attempt = d.attempt
       AND a.outcome = 'running'
), event AS (
    INSERT INTO wq_events (run_id, kind, data, seq)
    SELECT req.id,
           CASE WHEN req.state = 'cancelled' THEN 'run_cancelled' ELSE 'cancel_requested' END,
           req.event_data, req.ledger_seq
      FROM req
), notify AS (
    -- Also for a repeated request: a worker that missed the first NOTIFY hears this one.
    SELECT wq_transport_notify_cancel(d.id)
      FROM decided d
     WHERE d.state = 'running' AND NOT d.now_
)
SELECT (SELECT state::text FROM target) AS before,
       (SELECT state::text FROM req) AS after,
       (SELECT stopped FROM job) AS jobs_cancelled,
       (SELECT count(*) FROM notify) AS notified;

-- name: run_get :one
-- One run as the CLI and the API show it.
SELECT id, org, play, params, release, lane, idempotency_key, state::text, attempt,
       lease_owner, lease_expires_at, job_id, available_at, wait_event, result, error,
       cancel_requested_at, cancel_reason, input_rows, rows_admitted, rows_done, created_at,
       started_at, finished_at,
       wq_wait_reason(state, wait_event) AS wait_reason
  FROM wq_runs
 WHERE id = %(run_id)s;

-- name: run_list :many
-- Recent runs, newest first, optionally of one state or lane.
SELECT id, org, play, params, release, lane, idempotency_key, state::text, attempt,
       lease_owner, lease_expires_at, job_id, available_at, wait_event, result, error,
       cancel_requested_at, cancel_reason, input_rows, rows_admitted, rows_done, created_at,
       started_at, finished_at,
       wq_wait_reason(state, wait_event) AS wait_reason
  FROM wq_runs
 WHERE (%(state)s::text IS NULL OR state::text = %(state)s)
   AND (%(lane)s::text IS NULL OR lane = %(lane)s)
 ORDER BY created_at DESC
 LIMIT %(limit)s;

-- name: run_events :many
-- The ledger of a run after a given seq, in seq order (commit order: a follower that reads
-- after the last seq it saw never misses an event). Read from the view over wq_events and
-- the state rows (docs/design.md, 11b).
SELECT id, run_id, seq, attempt, kind, data, idempotency_key, at
  FROM wq_ledger
 WHERE run_id = %(run_id)s AND seq > %(after)s
 ORDER BY seq;

-- name: run_attempts :many
-- Every attempt of a run.
SELECT run_id, attempt, worker_id, outcome::text, error, started_at, finished_at
  FROM wq_attempts
 WHERE run_id = %(run_id)s
 ORDER BY attempt;

-- name: worker_register :exec
-- Register (or re-register) a worker process, with its code's schema (migration 0034:
-- refused below the schema floor).
INSERT INTO wq_workers (id, lanes, release, host, pid, procrastinate_id, schema_version)
VALUES (%(id)s, %(lanes)s, %(release)s, %(host)s, %(pid)s, %(procrastinate_id)s,
        %(schema_version)s)
ON CONFLICT (id) DO UPDATE
   SET lanes = excluded.lanes, heartbeat_at = now(), stopped_at = NULL, waiting_since = NULL,
       schema_version = excluded.schema_version;

-- name: worker_heartbeat :exec
-- Mark a worker alive (also its registration with the transport).
WITH w AS (
    UPDATE wq_workers SET heartbeat_at = now() WHERE id = %(id)s RETURNING procrastinate_id
)
SELECT wq_transport_beat(w.procrastinate_id) FROM w;

-- name: worker_hold_liveness :exec
-- Take the worker's liveness lock on this session; it waits while a recovery pass holds
-- the key's shared probe. Idempotent: a reconnected session takes the lock again.
SELECT pg_advisory_lock(hashtextextended('wq_worker:' || %(id)s, 0));

-- name: worker_record_liveness :one
-- Record the key of the lock this session holds (after worker_hold_liveness): a recorded
-- key whose lock nobody holds names a worker that is gone (migration 0024).
-- Returns the channel of wakes meant for this worker alone (migration 0032).
WITH lock AS (
    SELECT hashtextextended('wq_worker:' || %(id)s, 0) AS key
), recorded AS (
    UPDATE wq_workers w SET liveness_key = lock.key FROM lock WHERE w.id = %(id)s
)
SELECT wq_wake_channel(lock.key) FROM lock;

-- name: worker_stop :exec
-- Mark a worker stopped.
UPDATE wq_workers SET stopped_at = now(), waiting_since = NULL WHERE id = %(id)s;

-- name: worker_stop_waiting :exec
-- Out of the set of waiting workers, so spawns wake others (migration 0032): a stopping
-- worker, or one passing on a wake it has no room for.
UPDATE wq_workers SET waiting_since = NULL WHERE id = %(id)s AND waiting_since IS NOT NULL;

-- name: event_lock :exec
-- Serialize emits and waits on one (org, event name), transaction-scoped: no lost wake-up.
SELECT pg_advisory_xact_lock(hashtextextended('wq_event:' || %(org)s || ':' || %(name)s, 0));

-- name: event_emit :one
-- Record an emit of an org's event (the latest emit of a name is kept, with its time) and
-- wake that org's runs waiting for it. From a play (run_id given) the emit is fenced by its
-- attempt like every other write: refused and logged when the attempt is stale.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org
      FROM wq_runs
     WHERE id = %(run_id)s::uuid
       FOR SHARE  -- the fence: a rescue or a newer claim waits for this emit, or refuses it
), allowed AS (
    SELECT %(run_id)s::uuid IS NULL
           OR EXISTS (SELECT 1 FROM run
                       WHERE attempt = %(attempt)s AND state = 'running'
                         AND lease_owner = %(owner)s AND org = %(org)s) AS ok
), emitted AS (
    INSERT INTO wq_emitted_events (org, name, payload, emitted_at)
    SELECT %(org)s, %(name)s, %(payload)s, clock_timestamp()
      FROM allowed WHERE allowed.ok
    ON CONFLICT (org, name) DO UPDATE
       SET payload = excluded.payload, emitted_at = excluded.emitted_at
    RETURNING org, name, payload
), waiting AS (
    SELECT r.id, r.lane, wq_transport_next_id() AS job_id
      FROM wq_runs r, emitted e
     WHERE r.state = 'sleeping' AND r.org = e.org AND r.wait_event = e.name
       AND r.cancel_requested_at IS NULL
       AND r.wake_payload IS NULL  -- already woken, its wake-up job pending: once is enough
     ORDER BY r.id
       FOR UPDATE OF r
), woken AS (
    UPDATE wq_runs r
       SET job_id = w.job_id, available_at = NULL, wake_payload = e.payload, updated_at = now()
      FROM waiting w, emitted e
     WHERE r.id = w.id
    RETURNING r.id
), jobs AS (
    -- One row, read by the final SELECT so that the spawn runs.
    SELECT wq_transport_spawn(array_agg(w.job_id), array_agg(w.lane), array_agg(w.id))
               AS spawned
      FROM waiting w
), events AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT w.id, 'event_received', jsonb_build_object('event', %(name)s::text) FROM waiting w
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind)
    SELECT %(run_id)s::uuid, %(attempt)s, %(owner)s, 'emit'
      FROM allowed WHERE NOT allowed.ok
)
SELECT (SELECT ok FROM allowed) AS fenced,
       (SELECT count(*) FROM woken) AS woken,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state
  FROM jobs;

-- name: event_get :one
-- The latest emit of an org's event at or after a time (a run's admission), if any.
SELECT payload, emitted_at
  FROM wq_emitted_events
 WHERE org = %(org)s AND name = %(name)s AND emitted_at >= %(since)s;

-- name: run_input_page :one
-- One page of a run's input rows (NULL past the last page).
SELECT rows FROM wq_run_inputs WHERE run_id = %(run_id)s AND page = %(page)s;
