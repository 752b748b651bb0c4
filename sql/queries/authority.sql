-- name: ledger_append_delivered :one
-- A keyed outbox delivery to a run's ledger (the run-ledger token's actions), fenced by the
-- live lease like every write of an attempt: the events are appended only while the run is
-- running at the credential's attempt under its lease owner, and only when the delivery
-- lease the request names is that live lease (its owner), each once per key (a replayed
-- delivery stores nothing twice). Refused deliveries of a stale attempt are logged in
-- wq_refusals; a delivery naming another lease is answered `delivering` false (the caller
-- raises RUNTIME_DELIVERY_LEASE_MISMATCH).
WITH run AS (
    SELECT id, attempt, state, lease_owner
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR SHARE  -- the fence
), fence AS (
    SELECT id, lease_owner FROM run
     WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
), delivery AS (
    -- The delivery lease named in the request is the live attempt's, read under the lock.
    SELECT id FROM fence
     WHERE lease_owner = %(delivery_owner)s::text
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'ledger', %(count)s FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), appended AS (
    INSERT INTO wq_events (run_id, attempt, kind, data, idempotency_key)
    SELECT delivery.id, %(attempt)s, e.kind,
           e.data || jsonb_build_object('delivery_owner', %(delivery_owner)s::text), e.key
      FROM delivery
     CROSS JOIN unnest(%(kinds)s::text[], %(datas)s::jsonb[], %(keys)s::text[])
           WITH ORDINALITY AS e (kind, data, key, n)
     ORDER BY e.n
    ON CONFLICT (run_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT EXISTS (SELECT 1 FROM fence) AS fenced,
       EXISTS (SELECT 1 FROM delivery) AS delivering,
       (SELECT count(*) FROM appended) AS appended,
       (SELECT attempt FROM run) AS run_attempt,
       (SELECT state::text FROM run) AS run_state;
