-- Costs (sql/migrations/0039): budgets, a step's reservation, a budget pause's write, the
-- recovery pass's sweep of dead reservations, and the reads of charges.
--
-- Charges themselves are written by the statements that settle a step's receipt
-- (receipt_finish, receipt_complete_many in receipts.sql), never here.
--
-- Lock order, here and in the settling statements: the run's row FOR SHARE (the attempt
-- fence), then its receipts, then the budgets that apply to the run FOR UPDATE in id order
-- (a reservation, and a settlement that adds charges), then reservation rows. A budget
-- write takes its org's epoch row FOR UPDATE first, then the budget row, then (in its
-- next statement) the paused runs it wakes; a pause takes the epoch row FOR SHARE, then
-- its run's row. Nothing here waits for an epoch while holding a budget.

-- name: budget_set_org :one
-- Define or redefine an org's budget (play '') or an org's play's budget, moving the org's
-- epoch on first (waiting for a pause in flight: migration 0039). A changed period starts
-- the budget over (spent 0 from the current period); otherwise what it spent stays.
WITH epoch AS (
    INSERT INTO wq_budget_epochs AS e (org) VALUES (%(org)s)
    ON CONFLICT (org) DO UPDATE SET epoch = e.epoch + 1
    RETURNING e.epoch
), written AS (
    INSERT INTO wq_budgets AS b (org, play, unit, period, limit_amount, period_start,
                                 updated_by)
    SELECT %(org)s, %(play)s, %(unit)s, %(period)s, %(limit)s,
           wq_budget_period_start(%(period)s, coalesce(%(now)s::timestamptz, now())),
           %(actor)s
      FROM epoch
    ON CONFLICT (org, play, unit) WHERE run_id IS NULL DO UPDATE
       SET limit_amount = excluded.limit_amount,
           spent = CASE WHEN b.period = excluded.period THEN b.spent ELSE 0 END,
           period_start = CASE WHEN b.period = excluded.period THEN b.period_start
                               ELSE excluded.period_start END,
           period = excluded.period,
           updated_by = excluded.updated_by,
           updated_at = now()
    RETURNING b.id
)
SELECT id FROM written;

-- name: budget_set_run :one
-- Define or redefine one run's own budget (the run's org), moving the org's epoch on first.
WITH run AS (
    SELECT id, org FROM wq_runs WHERE id = %(run_id)s
), epoch AS (
    INSERT INTO wq_budget_epochs AS e (org) SELECT org FROM run
    ON CONFLICT (org) DO UPDATE SET epoch = e.epoch + 1
    RETURNING e.epoch
), written AS (
    INSERT INTO wq_budgets AS b (org, run_id, unit, period, limit_amount, period_start,
                                 updated_by)
    SELECT run.org, run.id, %(unit)s, %(period)s, %(limit)s,
           wq_budget_period_start(%(period)s, coalesce(%(now)s::timestamptz, now())),
           %(actor)s
      FROM run CROSS JOIN epoch
    ON CONFLICT (run_id, unit) WHERE run_id IS NOT NULL DO UPDATE
       SET limit_amount = excluded.limit_amount,
           spent = CASE WHEN b.period = excluded.period THEN b.spent ELSE 0 END,
           period_start = CASE WHEN b.period = excluded.period THEN b.period_start
                               ELSE excluded.period_start END,
           period = excluded.period,
           updated_by = excluded.updated_by,
           updated_at = now()
    RETURNING b.id
)
SELECT id FROM written;

-- name: budget_delete :one
-- Delete a budget, moving its org's epoch on first; returns what it was, for the wake.
WITH target AS (
    SELECT id, org FROM wq_budgets
     WHERE org = coalesce(%(org)s, (SELECT org FROM wq_runs WHERE id = %(run_id)s))
       AND unit = %(unit)s
       AND CASE WHEN %(run_id)s::uuid IS NULL THEN run_id IS NULL AND play = %(play)s
                ELSE run_id = %(run_id)s END
), epoch AS (
    UPDATE wq_budget_epochs e SET epoch = e.epoch + 1
      FROM target t
     WHERE e.org = t.org
    RETURNING e.epoch
), gone AS (
    DELETE FROM wq_budgets b USING target t, epoch
     WHERE b.id = t.id
    RETURNING b.id
)
SELECT id FROM gone;

-- name: budget_wake :one
-- Wake the runs paused on a budget of an org (those of one play, or one run, when the
-- budget written was theirs): each gets a job now, as an emit's waiters do. Run after the
-- budget write, in its transaction: a new statement, so it sees every pause that committed
-- while the write waited for the org's epoch (no pause is missed).
WITH waiting AS (
    SELECT r.id, r.lane, wq_transport_next_id() AS job_id
      FROM wq_runs r
     WHERE r.org = %(org)s AND r.state = 'sleeping'
       AND wq_wait_reason(r.state, r.wait_event) = 'BUDGET_EXHAUSTED'
       AND (%(play)s::text IS NULL OR r.play = %(play)s)
       AND (%(run_id)s::uuid IS NULL OR r.id = %(run_id)s)
       AND r.cancel_requested_at IS NULL
       AND r.wake_payload IS NULL  -- already woken, its job pending: once is enough
     ORDER BY r.id
       FOR UPDATE OF r
), woken AS (
    UPDATE wq_runs r
       SET job_id = w.job_id, available_at = NULL,
           wake_payload = jsonb_build_object('budget', %(reason)s::text), updated_at = now()
      FROM waiting w
     WHERE r.id = w.id
    RETURNING r.id
), jobs AS (
    -- One row, read by the final SELECT so that the spawn runs.
    SELECT wq_transport_spawn(array_agg(w.job_id), array_agg(w.lane), array_agg(w.id))
               AS spawned
      FROM waiting w
), events AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT w.id, 'budget_changed', jsonb_build_object('reason', %(reason)s::text)
      FROM waiting w
)
SELECT (SELECT count(*) FROM woken)::integer AS woken
  FROM jobs;

-- name: budget_list :many
-- Budgets, optionally of one org, play or run: what each spent in its current period
-- (0 once the period is over), what live reservations hold against it, when it rolls over.
SELECT b.id, b.org, nullif(b.play, '') AS play, b.run_id, b.unit, b.period,
       b.limit_amount,
       CASE WHEN b.period_start < wq_budget_period_start(b.period, c.at) THEN 0
            ELSE b.spent END AS spent,
       wq_budget_reserved(b.org, b.play, b.run_id, b.unit, NULL, '', '{}') AS reserved,
       nullif(wq_budget_period_start(b.period, c.at), '-infinity') AS period_start,
       wq_budget_period_end(b.period, wq_budget_period_start(b.period, c.at)) AS period_end,
       b.created_at, b.updated_at, b.updated_by
  FROM wq_budgets b
 CROSS JOIN (SELECT coalesce(%(now)s::timestamptz, now()) AS at) c
 WHERE (%(org)s::text IS NULL OR b.org = %(org)s)
   AND (%(play)s::text IS NULL OR b.play = %(play)s)
   AND (%(run_id)s::uuid IS NULL OR b.run_id = %(run_id)s)
 ORDER BY b.org, b.play, b.run_id NULLS FIRST, b.unit;

-- name: budget_reserve :one
-- Reserve a step's estimate (or a page of row steps', the same estimate each) against
-- every budget that applies to the run, or learn why not; fenced by the attempt. Under the
-- budgets' row locks (in id order), a budget grants as many keys, in their order, as fit
-- in what it has left: its limit, less what its period spent, less the live reservations
-- of other steps. An estimate of 0 fits while anything is left. The keys granted are
-- reserved (one row per key and unit of the estimate); `exhausted` says the next key was
-- refused by spending alone (no reservation in flight would make room), `wake_at` when
-- the budgets that refused it roll over (NULL: one of them never does).
WITH run AS (
    SELECT id, attempt, state, lease_owner, org, play
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR SHARE  -- lock 1: the fence
), checked AS (
    SELECT wq_cost_check(%(units)s::text[], %(amounts)s::numeric[], NULL, 'estimate') AS ok
), fence AS (
    SELECT run.id, run.org, run.play
      FROM run CROSS JOIN checked
     WHERE checked.ok
       AND attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'budget', %(count)s FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS at
), estimate AS (
    SELECT e.unit, e.amount
      FROM unnest(%(units)s::text[], %(amounts)s::numeric[]) AS e (unit, amount)
), applies AS (
    -- lock 2: every budget of the run (its org's, its play's, its own), in id order. A
    -- locking read yields each row's newest version: its spent is current.
    SELECT b.id, b.play, b.run_id, b.unit, b.period, b.limit_amount, b.spent, b.period_start
      FROM wq_budgets b
      JOIN fence f ON b.org = f.org
     WHERE b.run_id = f.id OR (b.run_id IS NULL AND b.play IN ('', f.play))
     ORDER BY b.id
       FOR UPDATE OF b
), room AS (
    SELECT a.id, a.period, a.limit_amount,
           CASE WHEN a.period_start < wq_budget_period_start(a.period, c.at) THEN 0
                ELSE a.spent END AS spent,
           -- Counted after the row lock (a VOLATILE function: a fresh snapshot).
           wq_budget_reserved(f.org, a.play, a.run_id, a.unit, f.id, %(scope)s,
                              %(keys)s::text[]) AS reserved,
           coalesce((SELECT e.amount FROM estimate e WHERE e.unit = a.unit), 0) AS each,
           wq_budget_period_end(a.period, wq_budget_period_start(a.period, c.at))
               AS period_end
      FROM applies a CROSS JOIN fence f CROSS JOIN clock c
), fits AS (
    -- How many keys fit: with the reservations in flight (fit), and by spending alone.
    SELECT r.*,
           CASE WHEN r.limit_amount - r.spent - r.reserved <= 0 THEN 0
                WHEN r.each = 0 THEN cardinality(%(keys)s::text[])
                ELSE least(cardinality(%(keys)s::text[]),
                           floor((r.limit_amount - r.spent - r.reserved) / r.each))
           END::integer AS fit,
           CASE WHEN r.limit_amount - r.spent <= 0 THEN 0
                WHEN r.each = 0 THEN cardinality(%(keys)s::text[])
                ELSE least(cardinality(%(keys)s::text[]),
                           floor((r.limit_amount - r.spent) / r.each))
           END::integer AS fit_spent
      FROM room r
), decided AS (
    SELECT coalesce(min(fit), cardinality(%(keys)s::text[]))::integer AS granted,
           count(*)::integer AS budgets
      FROM fits
), keys AS (
    SELECT k.step_key, k.ord
      FROM unnest(%(keys)s::text[]) WITH ORDINALITY AS k (step_key, ord)
), reserved AS (
    INSERT INTO wq_reservations AS v
        (run_id, scope, step_key, unit, attempt, org, play, amount, reserved_at)
    SELECT f.id, %(scope)s, k.step_key, e.unit, %(attempt)s, f.org, f.play, e.amount, c.at
      FROM fence f
     CROSS JOIN decided d
     CROSS JOIN keys k
     CROSS JOIN estimate e
     CROSS JOIN clock c
     -- Nothing to hold where no budget applies (the attempt then stops reserving).
     WHERE k.ord <= d.granted AND e.amount > 0 AND d.budgets > 0
     ORDER BY k.step_key, e.unit
    -- A reservation of an earlier attempt for the same step is this attempt's now; one of
    -- this attempt's (a repeat whose answer was lost) is written again as asked.
    ON CONFLICT (run_id, scope, step_key, unit) DO UPDATE
       SET attempt = excluded.attempt, amount = excluded.amount,
           reserved_at = excluded.reserved_at
    RETURNING 1
), dropped AS (
    -- Keys past the grant that a repeat of this call had reserved are not granted now.
    DELETE FROM wq_reservations v
     USING fence f, decided d, keys k
     WHERE v.run_id = f.id AND v.scope = %(scope)s AND v.step_key = k.step_key
       AND k.ord > d.granted
    RETURNING 1
), blocking AS (
    -- The budgets that refused the first key not granted, and those of them that its
    -- spending alone refuses.
    SELECT f.*
      FROM fits f CROSS JOIN decided d
     WHERE d.granted < cardinality(%(keys)s::text[]) AND f.fit <= d.granted
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state,
       d.granted,
       d.budgets,
       EXISTS (SELECT 1 FROM blocking b WHERE b.fit_spent <= d.granted) AS exhausted,
       (SELECT CASE WHEN bool_or(b.period_end IS NULL) THEN NULL ELSE max(b.period_end) END
          FROM blocking b WHERE b.fit_spent <= d.granted) AS wake_at,
       (SELECT b.id FROM blocking b ORDER BY b.fit_spent, b.id LIMIT 1) AS budget_id,
       coalesce((SELECT e.epoch FROM wq_budget_epochs e JOIN fence f ON e.org = f.org), 0)
           AS epoch,
       (SELECT count(*) FROM reserved)::integer AS reserved_rows,
       (SELECT count(*) FROM dropped)::integer AS dropped_rows
  FROM decided d;

-- name: budget_epoch_share :one
-- An org's budget epoch, FOR SHARE until the pause's commit: a budget write (FOR UPDATE)
-- waits for the pause, and its wake, a later statement, sees the paused run.
SELECT epoch FROM wq_budget_epochs WHERE org = %(org)s FOR SHARE;

-- name: reservations_sweep :one
-- Delete a batch of reservations whose attempt is no longer its run's live one (the run
-- moved on: finished, rescued, suspended): they stopped counting already; this keeps the
-- table small. SKIP LOCKED.
WITH dead AS (
    SELECT v.run_id, v.scope, v.step_key, v.unit
      FROM wq_reservations v
      LEFT JOIN wq_runs r ON r.id = v.run_id AND r.attempt = v.attempt
                         AND r.state = 'running'
     WHERE r.id IS NULL
     LIMIT %(batch)s
       FOR UPDATE OF v SKIP LOCKED
), gone AS (
    DELETE FROM wq_reservations v
     USING dead d
     WHERE (v.run_id, v.scope, v.step_key, v.unit) = (d.run_id, d.scope, d.step_key, d.unit)
    RETURNING 1
)
SELECT count(*)::integer AS swept FROM gone;

-- name: costs_grouped :many
-- The sum of charges grouped by what was asked (run, org, play, provider, UTC day; always
-- by unit), of one run, org or play, since and until a time. A dimension not asked for
-- comes back NULL.
SELECT CASE WHEN %(by_run)s THEN c.run_id END AS run_id,
       CASE WHEN %(by_org)s THEN c.org END AS org,
       CASE WHEN %(by_play)s THEN c.play END AS play,
       CASE WHEN %(by_provider)s THEN nullif(c.provider, '') END AS provider,
       CASE WHEN %(by_day)s THEN (c.charged_at AT TIME ZONE 'UTC')::date END AS day,
       c.unit,
       sum(c.amount) AS amount,
       count(*)::integer AS charges
  FROM wq_charges c
 WHERE (%(run_id)s::uuid IS NULL OR c.run_id = %(run_id)s)
   AND (%(org)s::text IS NULL OR c.org = %(org)s)
   AND (%(play)s::text IS NULL OR c.play = %(play)s)
   AND (%(since)s::timestamptz IS NULL OR c.charged_at >= %(since)s)
   AND (%(until)s::timestamptz IS NULL OR c.charged_at < %(until)s)
 GROUP BY 1, 2, 3, 4, 5, 6
 ORDER BY 5 NULLS FIRST, 2 NULLS FIRST, 3 NULLS FIRST, 1 NULLS FIRST, 4 NULLS FIRST, 6
 LIMIT %(limit)s;

-- name: charges_list :many
-- The charges themselves, newest first, of one run, org or play, since a time.
SELECT c.id, c.run_id, c.attempt, c.org, c.play, c.scope, c.step_key, c.outcome, c.unit,
       nullif(c.provider, '') AS provider, c.amount, c.charged_at
  FROM wq_charges c
 WHERE (%(run_id)s::uuid IS NULL OR c.run_id = %(run_id)s)
   AND (%(org)s::text IS NULL OR c.org = %(org)s)
   AND (%(play)s::text IS NULL OR c.play = %(play)s)
   AND (%(since)s::timestamptz IS NULL OR c.charged_at >= %(since)s)
 ORDER BY c.charged_at DESC, c.id DESC
 LIMIT %(limit)s;
