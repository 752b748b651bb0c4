-- Child runs (sql/migrations/0019): a play admits a child run from its attempt, reads it
-- while waiting for it, and a parent's cancel reaches its children.
--
-- Lock order of a spawn: the parent's row FOR SHARE (the attempt fence), then the new
-- child's row (an insert: nobody else can see it), then the ledger's seq locks of the
-- parent and of the child (sql/migrations/0010). The spawn's step receipt is written in the
-- same transaction, by the receipt statements (sql/queries/receipts.sql), which take the
-- parent's row FOR SHARE too (compatible).

-- name: child_spawn :one
-- Admit a child run of a running attempt, fenced by the parent's attempt in this
-- statement: on the parent's lane (its release: a child runs the parent's code), in its org,
-- with the key `child:<parent>:<step>`. A key that admitted a child already (the spawn was
-- written but its reply was lost) creates nothing: `created_id` is NULL and the caller
-- reads the child by its key. The child's job carries its priority.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org, release, lane
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR SHARE  -- the fence: a rescue or a newer claim waits for this spawn, or refuses it
), fence AS (
    SELECT id, org, release, lane FROM run
     WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'spawn', 1 FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), child AS (
    INSERT INTO wq_runs (id, org, play, params, release, lane, idempotency_key, job_id,
                         authority, parent_id, retry_max_attempts, retry_kind, retry_base_s,
                         retry_factor, retry_cap_s, retry_jitter, timeout_s, start_by, meta,
                         ledger_seq, created_lane)
    SELECT %(child_id)s, f.org, %(play)s, %(params)s::jsonb, f.release, f.lane, %(key)s,
           wq_transport_next_id(),
           %(authority)s::jsonb || jsonb_build_object('release', f.release),
           f.id, %(max_attempts)s, %(retry_kind)s, %(retry_base_s)s, %(retry_factor)s,
           %(retry_cap_s)s, %(retry_jitter)s, %(timeout_s)s, %(start_by)s::timestamptz,
           %(meta)s::jsonb,
           1, f.lane  -- the ledger counter: run_created is seq 1 (docs/design.md, 11b)
      FROM fence f
    ON CONFLICT (org, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, org, play, lane, job_id
), job AS (
    -- The transport (migration 0013): one row, read by the final SELECT so that it runs.
    SELECT wq_transport_spawn(array_agg(c.job_id), array_agg(c.lane), array_agg(c.id), NULL,
                              array_agg(%(priority)s::integer)) AS spawned
      FROM child c
), created AS (
    INSERT INTO wq_events (run_id, kind, data)
    SELECT c.id, 'run_created',
           jsonb_build_object('play', c.play, 'lane', c.lane, 'org', c.org,
                              'parent', %(run_id)s::text)
      FROM child c
), spawned AS (
    INSERT INTO wq_events (run_id, attempt, kind, data)
    SELECT f.id, %(attempt)s::integer, 'child_spawned',
           jsonb_build_object('child', c.id, 'play', c.play, 'step', %(step)s::text)
      FROM fence f
     CROSS JOIN child c
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced,
       (SELECT id FROM child) AS created_id,
       (SELECT spawned FROM job) AS jobs,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state;

-- name: child_by_key :one
-- The child a spawn's key admitted (in a new statement: it sees a concurrent spawn's commit).
SELECT id, play, params
  FROM wq_runs
 WHERE org = %(org)s AND idempotency_key = %(key)s AND parent_id = %(parent_id)s;

-- name: child_get :one
-- A child of a run, as its parent sees it while waiting for it (NULL: not its child).
SELECT id, play, state::text AS state, result, error, finished_at
  FROM wq_runs
 WHERE id = %(child_id)s AND parent_id = %(parent_id)s;

-- name: children_unfinished :many
-- The unfinished children of a run (what its cancel reaches), oldest first; bounded.
SELECT id
  FROM wq_runs
 WHERE parent_id = %(parent_id)s AND state IN ('queued', 'running', 'sleeping')
 ORDER BY created_at, id
 LIMIT %(limit)s;

-- name: children_list :many
-- A run's children, newest first (for `worker runs show`); bounded.
SELECT id, play, state::text AS state, created_at, finished_at
  FROM wq_runs
 WHERE parent_id = %(parent_id)s
 ORDER BY created_at DESC, id
 LIMIT %(limit)s;

-- name: children_of_cancelled :many
-- Unfinished children, with no cancel of their own yet, of parents whose cancel was asked:
-- what the recovery pass cancels (a parent's cancel that stopped before reaching them all).
-- Through wq_runs_children_unfinished_idx; bounded.
SELECT c.id, c.parent_id
  FROM wq_runs c
  JOIN wq_runs p ON p.id = c.parent_id
 WHERE c.parent_id IS NOT NULL
   AND c.state IN ('queued', 'running', 'sleeping')
   AND c.cancel_requested_at IS NULL
   AND p.cancel_requested_at IS NOT NULL
 ORDER BY c.id
 LIMIT %(batch)s;
