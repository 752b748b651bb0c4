-- Work receipts (wq_receipts): claim, finish, batch-complete and look up durable steps.
--
-- Lock order, in every statement here (and in any other code that locks both tables):
--   1. the wq_runs row of the writing run, FOR SHARE (the fence: running, at this attempt,
--      under this worker's lease, of this org and play);
--   2. then wq_receipts rows, in primary-key order (org, play, scope, step_key).
--   3. then the run's ledger seq lock, for receipt_finish's step_failed event (a
--      transaction advisory lock, sql/migrations/0010).
--   4. then, when the write records charges, the budgets that apply to the run FOR UPDATE
--      in id order (wq_budget_charge, migration 0039: the lock order of
--      sql/queries/costs.sql), and the step's own reservation rows.
-- A lease rescue or a new claim is an UPDATE of the wq_runs row, which conflicts with FOR
-- SHARE: a claim waits for a receipt write in flight; a rescue skips the locked run (SKIP
-- LOCKED) and rescues it at its next pass; a receipt write that queues behind either
-- re-checks the fence against the new row version and is refused (and logged in
-- wq_refusals). So a stale attempt's write either commits before its attempt is closed
-- or is refused; it never lands after it. Steps of one
-- attempt take FOR SHARE together and do not block each other. A receipt row is only locked
-- once a fence row is in hand (the writes draw their rows FROM fence), so no statement
-- here holds a receipt while waiting for a run.
--
-- completed and skipped are terminal: nothing here changes such a row again, so a plain
-- snapshot read of them is final and replays take no row lock and write nothing.
--
-- Every statement is bounded: one receipt, the receipts one attempt holds, or one page of
-- at most queues.receipts.MAX_PAGE keys. That bounds the locks, the WAL and the time one
-- transaction holds the fence, so a heartbeat on the run never waits long behind a page.

-- name: receipt_claim :one
-- Claim a step for (run, attempt) or report replay/skip/busy; fenced by the run's attempt.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org, play
    FROM wq_runs
    WHERE id = %(run_id)s
    FOR SHARE  -- lock 1; a locking read yields the newest row version, even after a wait
),
fence AS (
    -- The attempt fence: running, at this attempt, under this worker's lease, in its scope.
    SELECT id FROM run
    WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
      AND org = %(org)s AND play = %(play)s
),
refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'receipt', %(count)s FROM run
    WHERE NOT EXISTS (SELECT 1 FROM fence)
),
settled AS (
    SELECT status, result, owner_run, owner_attempt, lease_expires_at
    FROM wq_receipts
    WHERE org = %(org)s AND play = %(play)s AND scope = %(scope)s AND step_key = %(step_key)s
      AND status IN ('completed', 'skipped')
),
claimed AS (
    INSERT INTO wq_receipts AS r
        (org, play, scope, step_key, status, owner_run, owner_attempt, lease_expires_at)
    SELECT %(org)s, %(play)s, %(scope)s, %(step_key)s, 'claimed', fence.id, %(attempt)s,
           coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s)
    FROM fence
    WHERE NOT EXISTS (SELECT 1 FROM settled)
    -- The conflict arm always updates, so RETURNING reports the newest row even when it is
    -- not ours to take: a conditional DO UPDATE returns nothing then, and a SELECT in this
    -- statement cannot see a row another transaction committed after our snapshot (the
    -- case where we waited on its insert or its claim). A row we may not take keeps every
    -- value. We may take: a failed step; a claim whose lease lapsed; a claim of an earlier
    -- (or this) attempt of our own run. Never a live claim of another run.
    ON CONFLICT (org, play, scope, step_key) DO UPDATE SET
        (status, owner_run, owner_attempt, lease_expires_at, error) = (
            SELECT pick.status, pick.owner_run, pick.owner_attempt, pick.lease_expires_at,
                   pick.error
            FROM (VALUES
                (true, EXCLUDED.status, EXCLUDED.owner_run, EXCLUDED.owner_attempt,
                 EXCLUDED.lease_expires_at, NULL::jsonb),
                (false, r.status, r.owner_run, r.owner_attempt, r.lease_expires_at, r.error)
            ) AS pick (take, status, owner_run, owner_attempt, lease_expires_at, error)
            WHERE pick.take = coalesce(
                r.status = 'failed'
                OR (r.status = 'claimed'
                    AND (r.lease_expires_at <= coalesce(%(now)s::timestamptz, now())
                         OR (r.owner_run = EXCLUDED.owner_run
                             AND r.owner_attempt <= EXCLUDED.owner_attempt))),
                false  -- a NULL here would match no pick and null every column
            )
        )
    RETURNING r.status, r.result, r.owner_run, r.owner_attempt, r.lease_expires_at
),
receipt AS (
    SELECT status, result, owner_run, owner_attempt, lease_expires_at FROM claimed
    UNION ALL
    SELECT status, result, owner_run, owner_attempt, lease_expires_at FROM settled
),
lazy_commit AS (
    -- One durable commit per step (the completion's): this claim's commit need not wait
    -- for its WAL flush when losing it in a crash is harmless, i.e. when it excludes
    -- nobody the run's lease does not already exclude. A claim in the run's own scope
    -- only keeps out other attempts of this run, and a newer attempt exists only after the
    -- durable run claim moved the lease (it then takes over this run's earlier claim
    -- anyway); a replay writes nothing but its share lock. A crash that loses the claim
    -- also ends its attempt (every connection dies: the attempt is interrupted, or its
    -- completion is refused as holding no receipt); the next attempt claims the step
    -- again, as it would take over a durable claim of its dead predecessor. A claim in a
    -- named scope keeps other runs out: it stays durable, as does every refusal.
    -- %(own_commit)s: the caller runs this statement as its own transaction (autocommit),
    -- so the setting (transaction-local) reaches no other write.
    SELECT set_config('synchronous_commit', 'off', true)
    WHERE %(own_commit)s::boolean
      AND EXISTS (SELECT 1 FROM fence)
      AND (%(scope)s = 'run:' || %(run_id)s::text OR EXISTS (SELECT 1 FROM settled))
)
SELECT
    EXISTS (SELECT 1 FROM fence) AS fenced,
    run.attempt AS run_attempt,
    run.state::text AS run_state,
    receipt.status::text AS status,
    receipt.result,
    receipt.owner_run,
    receipt.owner_attempt,
    receipt.lease_expires_at
FROM (VALUES (1)) AS one (x)
LEFT JOIN receipt ON true
LEFT JOIN run ON true
LEFT JOIN lazy_commit ON true

-- name: receipt_finish :one
-- Record the outcome of a step this attempt holds (completed, failed, skipped), with its
-- charges; fenced. The step's reservation is released and its charges added to its run's
-- budgets (sql/queries/costs.sql) by this statement too.
WITH checked AS (
    -- The charges by the rules of queues.costs (WQ010: nothing is written); none to check
    -- for most steps.
    SELECT CASE WHEN cardinality(%(charge_units)s::text[]) = 0 THEN true
                ELSE wq_cost_check(%(charge_units)s::text[], %(charge_amounts)s::numeric[],
                                   %(charge_providers)s::text[], 'charges') END AS ok
),
run AS (
    SELECT id, attempt, state, lease_owner, org, play
    FROM wq_runs
    WHERE id = %(run_id)s AND (SELECT ok FROM checked)
    FOR SHARE  -- lock 1; a locking read yields the newest row version, even after a wait
),
fence AS (
    -- The attempt fence: running, at this attempt, under this worker's lease, in its scope.
    SELECT id FROM run
    WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
      AND org = %(org)s AND play = %(play)s
),
refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'receipt', %(count)s FROM run
    WHERE NOT EXISTS (SELECT 1 FROM fence)
),
finished AS (
    UPDATE wq_receipts AS r
    SET status = %(status)s::wq_receipt_status,
        result = %(result)s::jsonb,
        error = %(error)s::jsonb,
        lease_expires_at = NULL,
        completed_at = CASE WHEN %(status)s::wq_receipt_status = 'failed' THEN NULL
                            ELSE coalesce(%(now)s::timestamptz, now()) END
    FROM fence
    WHERE r.org = %(org)s AND r.play = %(play)s AND r.scope = %(scope)s
      AND r.step_key = %(step_key)s
      AND r.status = 'claimed' AND r.owner_run = fence.id AND r.owner_attempt = %(attempt)s
    RETURNING r.step_key
),
step_failed AS (
    -- The ledger's step_failed, in this transaction, only when the fence held and the
    -- failure was written. Under FOR SHARE two steps of one attempt may fail at once: the
    -- ledger's seq lock (sql/migrations/0010) orders their events.
    INSERT INTO wq_events (run_id, attempt, kind, data)
    SELECT %(run_id)s::uuid, %(attempt)s::int, 'step_failed',
           jsonb_strip_nulls(jsonb_build_object(
               'step', finished.step_key,
               'scope', %(scope)s::text,
               'error', %(error)s::jsonb))
    FROM finished
    WHERE %(status)s::wq_receipt_status = 'failed'
),
charged AS (
    -- The step's charges, recorded once: only with the receipt this statement settled.
    INSERT INTO wq_charges
        (run_id, attempt, org, play, scope, step_key, outcome, unit, provider, amount,
         charged_at)
    SELECT %(run_id)s, %(attempt)s, %(org)s, %(play)s, %(scope)s, finished.step_key,
           CASE WHEN %(status)s::wq_receipt_status = 'failed' THEN 'failed'
                ELSE 'completed' END,
           c.unit, c.provider, c.amount, coalesce(%(now)s::timestamptz, now())
    FROM finished
    CROSS JOIN unnest(%(charge_units)s::text[], %(charge_providers)s::text[],
                      %(charge_amounts)s::numeric[]) AS c (unit, provider, amount)
    RETURNING unit, amount
),
released AS (
    -- The step's reservation (this attempt's), released: its charges replace it.
    DELETE FROM wq_reservations v
    USING fence
    WHERE v.run_id = fence.id AND v.scope = %(scope)s AND v.step_key = %(step_key)s
      AND v.attempt = %(attempt)s
),
counted AS (
    -- The charges added to the run's budgets, under their row locks (only with charges).
    SELECT wq_budget_charge(%(run_id)s, %(org)s, %(play)s, array_agg(unit), array_agg(amount),
                            coalesce(%(now)s::timestamptz, now())) AS spent
    FROM charged
    HAVING count(*) > 0
)
SELECT
    EXISTS (SELECT 1 FROM finished) AS written,
    coalesce((SELECT spent FROM counted), false) AS budget_spent,
    -- Whether the fence held: an unwritten finish under it, of a receipt this attempt
    -- already settled the same way, is a repeat of its own write whose answer was lost.
    EXISTS (SELECT 1 FROM fence) AS fenced,
    run.attempt AS run_attempt,
    run.state::text AS run_state,
    cur.status::text AS status,
    cur.owner_run,
    cur.owner_attempt,
    cur.result
FROM (VALUES (1)) AS one (x)
LEFT JOIN run ON true
LEFT JOIN wq_receipts AS cur
    ON cur.org = %(org)s AND cur.play = %(play)s AND cur.scope = %(scope)s
   AND cur.step_key = %(step_key)s

-- name: receipt_complete_many :one
-- Claim-and-complete a page of step keys in one statement, keeping settled ones, with the
-- charges of the keys it completes; fenced. The page's reservations are released and its
-- charges added to its run's budgets (sql/queries/costs.sql) by this statement too.
WITH checked AS (
    -- The charges by the rules of queues.costs (WQ010: nothing is written); none to check
    -- for most pages.
    SELECT CASE WHEN cardinality(%(charge_units)s::text[]) = 0 THEN true
                ELSE wq_cost_check(%(charge_units)s::text[], %(charge_amounts)s::numeric[],
                                   %(charge_providers)s::text[], 'charges') END AS ok
),
run AS (
    SELECT id, attempt, state, lease_owner, org, play
    FROM wq_runs
    WHERE id = %(run_id)s AND (SELECT ok FROM checked)
    FOR SHARE  -- lock 1; a locking read yields the newest row version, even after a wait
),
fence AS (
    -- The attempt fence: running, at this attempt, under this worker's lease, in its scope.
    SELECT id FROM run
    WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
      AND org = %(org)s AND play = %(play)s
),
refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'receipt', %(count)s FROM run
    WHERE NOT EXISTS (SELECT 1 FROM fence)
),
page AS (
    SELECT k.step_key, k.result::jsonb AS result
    FROM unnest(%(keys)s::text[], %(results)b::text[]) AS k (step_key, result)
),
settled AS (
    SELECT r.step_key
    FROM unnest(%(keys)s::text[]) AS k (step_key)
    CROSS JOIN LATERAL (
        SELECT step_key FROM wq_receipts
        WHERE org = %(org)s AND play = %(play)s AND scope = %(scope)s
          AND step_key = k.step_key AND status IN ('completed', 'skipped')
        OFFSET 0
    ) AS r
),
written AS (
    INSERT INTO wq_receipts AS r
        (org, play, scope, step_key, status, owner_run, owner_attempt, result, completed_at)
    SELECT %(org)s, %(play)s, %(scope)s, page.step_key, 'completed', fence.id, %(attempt)s,
           page.result, coalesce(%(now)s::timestamptz, now())
    FROM fence
    CROSS JOIN page
    WHERE page.step_key NOT IN (SELECT step_key FROM settled)
    ORDER BY page.step_key  -- receipts are locked in key order: overlapping pages never deadlock
    -- Same rule as receipt_claim: always update so RETURNING is exact; a row we may not take
    -- (a live claim of another run, or one settled after our snapshot) keeps every value.
    ON CONFLICT (org, play, scope, step_key) DO UPDATE SET
        (status, owner_run, owner_attempt, lease_expires_at, result, error, completed_at) = (
            SELECT pick.status, pick.owner_run, pick.owner_attempt, pick.lease_expires_at,
                   pick.result, pick.error, pick.completed_at
            FROM (VALUES
                (true, EXCLUDED.status, EXCLUDED.owner_run, EXCLUDED.owner_attempt,
                 NULL::timestamptz, EXCLUDED.result, NULL::jsonb, EXCLUDED.completed_at),
                (false, r.status, r.owner_run, r.owner_attempt, r.lease_expires_at, r.result,
                 r.error, r.completed_at)
            ) AS pick (take, status, owner_run, owner_attempt, lease_expires_at, result, error,
                       completed_at)
            WHERE pick.take = coalesce(
                r.status = 'failed'
                OR (r.status = 'claimed'
                    AND (r.lease_expires_at <= coalesce(%(now)s::timestamptz, now())
                         OR (r.owner_run = EXCLUDED.owner_run
                             AND r.owner_attempt <= EXCLUDED.owner_attempt))),
                false  -- a NULL here would match no pick and null every column
            )
        )
    RETURNING r.step_key, r.status,
              (r.status = 'completed' AND r.owner_run = %(run_id)s
               AND r.owner_attempt = %(attempt)s) AS mine
),
charged AS (
    -- The charges of the keys this statement completed, recorded once: only with them.
    INSERT INTO wq_charges
        (run_id, attempt, org, play, scope, step_key, outcome, unit, provider, amount,
         charged_at)
    SELECT %(run_id)s, %(attempt)s, %(org)s, %(play)s, %(scope)s, c.step_key, 'completed',
           c.unit, c.provider, c.amount, coalesce(%(now)s::timestamptz, now())
    FROM unnest(%(charge_keys)s::text[], %(charge_units)s::text[],
                %(charge_providers)s::text[], %(charge_amounts)s::numeric[])
         AS c (step_key, unit, provider, amount)
    JOIN written w ON w.step_key = c.step_key AND w.mine
    RETURNING unit, amount
),
released AS (
    -- The page's reservations (this attempt's), released: its charges replace them.
    DELETE FROM wq_reservations v
    USING fence
    WHERE v.run_id = fence.id AND v.scope = %(scope)s AND v.step_key = ANY (%(keys)s::text[])
      AND v.attempt = %(attempt)s
),
counted AS (
    -- The charges added to the run's budgets, under their row locks (only with charges).
    SELECT wq_budget_charge(%(run_id)s, %(org)s, %(play)s, array_agg(unit), array_agg(amount),
                            coalesce(%(now)s::timestamptz, now())) AS spent
    FROM charged
    HAVING count(*) > 0
)
SELECT
    EXISTS (SELECT 1 FROM fence) AS fenced,
    coalesce((SELECT spent FROM counted), false) AS budget_spent,
    run.attempt AS run_attempt,
    run.state::text AS run_state,
    ARRAY(SELECT step_key FROM written WHERE mine ORDER BY step_key) AS completed,
    ARRAY(
        SELECT step_key FROM settled
        UNION ALL
        SELECT step_key FROM written WHERE NOT mine AND status <> 'claimed'
        ORDER BY 1
    ) AS already,
    ARRAY(SELECT step_key FROM written WHERE status = 'claimed' ORDER BY step_key) AS busy
FROM (VALUES (1)) AS one (x)
LEFT JOIN run ON true

-- name: receipt_lookup_many :many
-- The recorded results of the completed steps among a page of keys (no locks).
SELECT r.step_key, r.result
FROM unnest(%(keys)s::text[]) AS k (step_key)
CROSS JOIN LATERAL (
    SELECT step_key, result FROM wq_receipts
    WHERE org = %(org)s AND play = %(play)s AND scope = %(scope)s
      AND step_key = k.step_key AND status = 'completed'
    OFFSET 0
) AS r

-- name: receipt_settled :many
-- The settled (completed or skipped) receipts of one scope, at most limit (no locks):
-- what an attempt replays without claiming each step (receipts.settled). The results
-- come only when together they are at most max_bytes as stored; `over` says they are
-- not (the attempt then claims step by step, reading one result at a time).
WITH settled AS (
    SELECT step_key, status::text AS status, result,
           coalesce(pg_column_size(result), 0) AS size
    FROM wq_receipts
    WHERE org = %(org)s AND play = %(play)s AND scope = %(scope)s
      AND status IN ('completed', 'skipped')
    LIMIT %(limit)s
), total AS (
    SELECT coalesce(sum(size), 0) > %(max_bytes)s AS over FROM settled
)
SELECT s.step_key, s.status, CASE WHEN t.over THEN NULL ELSE s.result END AS result, t.over
FROM settled s
CROSS JOIN total t

-- name: receipt_extend_leases :one
-- Extend the lease of every step one attempt holds (heartbeat); fenced by the run's attempt.
WITH run AS (
    SELECT id, attempt, state, lease_owner
    FROM wq_runs
    WHERE id = %(run_id)s
    FOR SHARE  -- lock 1; a locking read yields the newest row version, even after a wait
),
fence AS (
    -- The attempt fence: running, at this attempt, under this worker's lease.
    SELECT id FROM run
    WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
),
refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'receipt', %(count)s FROM run
    WHERE NOT EXISTS (SELECT 1 FROM fence)
),
held AS (
    SELECT r.org, r.play, r.scope, r.step_key
    FROM wq_receipts AS r
    JOIN fence ON r.owner_run = fence.id
    WHERE r.owner_attempt = %(attempt)s AND r.status = 'claimed'
    ORDER BY r.org, r.play, r.scope, r.step_key
    FOR UPDATE OF r
),
extended AS (
    UPDATE wq_receipts AS r
    SET lease_expires_at = coalesce(%(now)s::timestamptz, now())
                           + make_interval(secs => %(lease_s)s)
    FROM held
    WHERE (r.org, r.play, r.scope, r.step_key) = (held.org, held.play, held.scope, held.step_key)
      AND r.status = 'claimed' AND r.owner_attempt = %(attempt)s
    RETURNING r.step_key
)
SELECT
    EXISTS (SELECT 1 FROM fence) AS fenced,
    (SELECT count(*) FROM extended) AS extended,
    run.attempt AS run_attempt,
    run.state::text AS run_state
FROM (VALUES (1)) AS one (x)
LEFT JOIN run ON true

-- name: receipt_get :one
-- One receipt by its scoped key, for inspection.
SELECT org, play, scope, step_key, status, owner_run, owner_attempt, lease_expires_at,
       result, error, created_at, completed_at
FROM wq_receipts
WHERE org = %(org)s AND play = %(play)s AND scope = %(scope)s AND step_key = %(step_key)s

-- name: receipt_extend_for_attempts :exec
-- Extend the step leases of a worker's live attempts in one statement (its heartbeat
-- calls this with the attempts whose run leases it just renewed); fenced like every write:
-- only attempts that still own their run under this worker's lease.
UPDATE wq_receipts r
   SET lease_expires_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_s)s)
  FROM unnest(%(run_ids)s::uuid[], %(attempts)s::int[]) AS i (run_id, attempt)
  JOIN wq_runs w ON w.id = i.run_id
 WHERE w.attempt = i.attempt
   AND w.state = 'running'
   AND w.lease_owner = %(owner)s
   AND r.owner_run = i.run_id
   AND r.owner_attempt = i.attempt
   AND r.status = 'claimed';
