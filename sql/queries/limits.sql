-- Rate limits shared by every worker (sql/migrations/0017): their definitions, a play's
-- permits (acquire, release) and the recovery pass's sweep of dead holds.
--
-- Lock order of a permit: the acquiring run's row FOR SHARE (the attempt fence, as every
-- write of an attempt), then the limit's bucket row FOR UPDATE (so grants of one bucket
-- are serialized: the GCRA step and the concurrency count see every earlier grant), then
-- the holds. A release holds the run FOR SHARE and deletes one hold row of its own. Nothing
-- here waits for a run while holding a bucket.

-- name: limit_set :one
-- Define or redefine a limit (its buckets keep their state: a redefinition does not reset
-- what was granted).
INSERT INTO wq_limits AS l (key, rate_per_s, rate, burst, concurrency, per_org, updated_by)
VALUES (%(key)s, %(rate_per_s)s, %(rate)s, %(burst)s, %(concurrency)s, %(per_org)s,
        %(actor)s)
ON CONFLICT (key) DO UPDATE
   SET rate_per_s = excluded.rate_per_s,
       rate = excluded.rate,
       burst = excluded.burst,
       concurrency = excluded.concurrency,
       per_org = excluded.per_org,
       updated_by = excluded.updated_by,
       updated_at = now()
RETURNING key, rate_per_s, rate, burst, concurrency, per_org, created_at, updated_at,
          updated_by, 0 AS holding;

-- name: limit_list :many
-- Every limit, with the permits its live attempts hold now (over all its buckets).
SELECT l.key, l.rate_per_s, l.rate, l.burst, l.concurrency, l.per_org, l.created_at,
       l.updated_at, l.updated_by,
       (SELECT count(*)
          FROM wq_limit_holds h
          JOIN wq_runs r ON r.id = h.run_id AND r.attempt = h.attempt
                        AND r.state = 'running' AND r.lease_owner = h.owner
                        AND r.lease_expires_at > now()
         WHERE h.key = l.key)::integer AS holding
  FROM wq_limits l
 ORDER BY l.key;

-- name: limit_delete :one
-- Delete a limit, its buckets and its holds; a play that asks for it afterwards is refused.
DELETE FROM wq_limits WHERE key = %(key)s RETURNING key;

-- name: limit_bucket_ensure :exec
-- Make the bucket an attempt's permit needs (one per limit, or per limit and org), on its
-- first use; only for a run that is running at that attempt under that lease owner (a
-- stale attempt makes nothing: its limit_acquire is refused and logged right after).
INSERT INTO wq_limit_buckets (key, org)
SELECT l.key, CASE WHEN l.per_org THEN r.org ELSE '' END
  FROM wq_limits l
 CROSS JOIN wq_runs r
 WHERE l.key = %(key)s
   AND r.id = %(run_id)s AND r.attempt = %(attempt)s AND r.state = 'running'
   AND r.lease_owner = %(owner)s
ON CONFLICT (key, org) DO NOTHING;

-- name: limit_acquire :one
-- Take one permit of a limit for an attempt, or learn how long to wait; fenced by the
-- attempt in this statement. GCRA: a grant moves the bucket's tat on by 1 / rate and is
-- allowed while tat stays within `burst` intervals of now; the concurrency cap counts the
-- holds of live attempts only. A bucket not made yet (`bucket` false) grants nothing: the
-- caller makes it (limit_bucket_ensure) and asks again.
WITH run AS (
    SELECT id, attempt, state, lease_owner, org
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR SHARE  -- lock 1: the fence
), fence AS (
    SELECT id, org FROM run
     WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'limit', 1 FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), def AS (
    SELECT l.key, l.rate_per_s, l.burst, l.concurrency,
           CASE WHEN l.per_org THEN f.org ELSE '' END AS org
      FROM wq_limits l
     CROSS JOIN fence f
     WHERE l.key = %(key)s
), prior AS (
    -- This attempt's hold of that name, taken already: the call is a repeat of a grant
    -- whose answer was lost, answered granted again without a second permit.
    SELECT 1 FROM wq_limit_holds h
      JOIN fence f ON h.run_id = f.id
     WHERE h.hold = %(hold)s AND h.attempt = %(attempt)s AND h.owner = %(owner)s
), state AS (
    -- lock 2: the bucket, FOR UPDATE (a locking read yields its newest version)
    SELECT b.key, b.org, b.tat
      FROM wq_limit_buckets b
      JOIN def d ON d.key = b.key AND d.org = b.org
       FOR UPDATE OF b
), clock AS (
    -- Read after the bucket's lock was granted: grants of one bucket are in clock order.
    SELECT coalesce(%(now)s::timestamptz, clock_timestamp()) AS at FROM state
), verdict AS (
    -- The live holds are counted by a VOLATILE function, called here, after the bucket's
    -- lock: its fresh snapshot sees every earlier grant's hold (migration 0017).
    SELECT s.key, s.org, c.at, d.concurrency,
           EXISTS (SELECT 1 FROM prior) AS repeat,
           d.concurrency IS NOT NULL AND NOT EXISTS (SELECT 1 FROM prior)
           AND wq_limit_live_holds(s.key, s.org, c.at) >= d.concurrency AS busy,
           CASE WHEN d.rate_per_s IS NOT NULL
                THEN greatest(s.tat, c.at) + make_interval(secs => 1.0 / d.rate_per_s) END
               AS next_tat,
           make_interval(secs => d.burst / coalesce(d.rate_per_s, 1.0)) AS tolerance
      FROM state s
      JOIN def d ON d.key = s.key AND d.org = s.org
     CROSS JOIN clock c
), decided AS (
    SELECT v.*,
           v.repeat OR (NOT v.busy AND (v.next_tat IS NULL OR v.next_tat - v.at <= v.tolerance))
               AS granted,
           CASE WHEN NOT v.repeat AND v.next_tat IS NOT NULL AND v.next_tat - v.at > v.tolerance
                THEN extract(epoch FROM v.next_tat - v.tolerance - v.at)::float8 END
               AS wait_s
      FROM verdict v
), advanced AS (
    UPDATE wq_limit_buckets b
       SET tat = d.next_tat
      FROM decided d
     WHERE d.granted AND NOT d.repeat AND d.next_tat IS NOT NULL
       AND b.key = d.key AND b.org = d.org
), holding AS (
    INSERT INTO wq_limit_holds (run_id, hold, key, org, attempt, owner, acquired_at)
    SELECT f.id, %(hold)s, d.key, d.org, %(attempt)s, %(owner)s, d.at
      FROM decided d
     CROSS JOIN fence f
     WHERE d.granted AND d.concurrency IS NOT NULL
    ON CONFLICT (run_id, hold) DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced,
       EXISTS (SELECT 1 FROM def) AS known,
       EXISTS (SELECT 1 FROM decided) AS bucket,
       coalesce((SELECT granted FROM decided), false) AS granted,
       coalesce((SELECT busy FROM decided), false) AS busy,
       (SELECT wait_s FROM decided) AS wait_s,
       (SELECT concurrency IS NOT NULL FROM decided) AS held,
       (SELECT at FROM decided) AS at,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state;

-- name: limit_release :one
-- Release a permit an attempt holds under a concurrency cap; fenced by the attempt. (A
-- stale attempt's hold stopped counting when its attempt stopped being live; the recovery
-- pass deletes it.)
WITH run AS (
    SELECT id, attempt, state, lease_owner
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR SHARE  -- the fence
), fence AS (
    SELECT id FROM run
     WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'limit', 1 FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), released AS (
    DELETE FROM wq_limit_holds h
     USING fence f
     WHERE h.run_id = f.id AND h.hold = %(hold)s AND h.attempt = %(attempt)s
    RETURNING h.key
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced,
       (SELECT count(*) FROM released)::integer AS released,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state;

-- name: limit_holds_sweep :one
-- Delete a batch of holds whose attempt is no longer live (its run moved on, or its lease
-- lapsed): they stopped counting already; this keeps the table small. SKIP LOCKED.
WITH dead AS (
    SELECT h.run_id, h.hold
      FROM wq_limit_holds h
      LEFT JOIN wq_runs r ON r.id = h.run_id AND r.attempt = h.attempt
                         AND r.state = 'running' AND r.lease_owner = h.owner
                         AND r.lease_expires_at > coalesce(%(now)s::timestamptz, now())
     WHERE r.id IS NULL
     LIMIT %(batch)s
       FOR UPDATE OF h SKIP LOCKED
), gone AS (
    DELETE FROM wq_limit_holds h
     USING dead d
     WHERE h.run_id = d.run_id AND h.hold = d.hold
    RETURNING 1
)
SELECT count(*)::integer AS swept FROM gone;
