-- The run ledger (wq_events) and its projection: sinks, the leased outbox, progress.
--
-- Appending: every statement that changes a run appends its event itself (see runs.sql,
-- sheets.sql, receipts.sql, recovery.sql, wq_submit); ledger_append is the generic form.
-- The triggers on wq_events give each event its seq and, in the appending statement, one
-- outbox row per enabled HTTP sink and the fold of the events into wq_progress (the
-- built-in progress sink: migration 0030).
--
-- Delivering: a projector leases a batch of due outbox rows (FOR UPDATE SKIP LOCKED, so
-- projectors never take the same row), delivers them outside any transaction, and marks
-- each one delivered or failed only while the lease is still its own: the owner check is
-- in the writing statement (the same fence as every attempt write). A lease that lapsed
-- mid-delivery lets another projector deliver the row again, with the same
-- Idempotency-Key; the receiver dedupes.
--
-- Lock order: wq_outbox rows by sink, then due time and id. Nothing here locks a run.

-- name: ledger_append :one
-- Append an event to a run's ledger; a repeated idempotency key stores nothing.
-- The run's row FOR SHARE comes first (the ledger's lock order: the run, then its seq
-- lock). An empty answer with the run found means the key exists: re-read it in a new
-- statement (ledger_event_by_key), whose snapshot sees a concurrent winner's commit.
WITH run AS (
    SELECT id
      FROM wq_runs
     WHERE id = %(run_id)s
       FOR SHARE
), appended AS (
    INSERT INTO wq_events (run_id, attempt, kind, data, idempotency_key)
    SELECT run.id, %(attempt)s::int, %(kind)s::text, %(data)s::jsonb, %(key)s::text
      FROM run
    ON CONFLICT (run_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, run_id, seq, attempt, kind, data, idempotency_key, at
)
SELECT EXISTS (SELECT 1 FROM run) AS found, a.id, a.run_id, a.seq, a.attempt, a.kind,
       a.data, a.idempotency_key, a.at
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN appended a ON true;

-- name: ledger_event_by_key :one
-- The event a run's idempotency key stored.
SELECT id, run_id, seq, attempt, kind, data, idempotency_key, at
  FROM wq_events
 WHERE run_id = %(run_id)s AND idempotency_key = %(key)s;

-- name: outbox_lease :many
-- Lease up to N due deliveries of enabled sinks for one owner until now + lease_s; each
-- lease counts as an attempt. Per sink, an ordered walk of wq_outbox_due_idx that stops
-- after N rows (a disabled sink's backlog is never scanned); then the N most due, taken in
-- turns across sinks, so one sink's backlog never crowds out another's. SKIP LOCKED keeps projectors off each other's rows; a row leased by another
-- projector is not due (next_attempt_at = its lease expiry) until that lease lapses.
WITH picked AS (
    SELECT o.id,
           row_number() OVER (PARTITION BY s.name ORDER BY o.next_attempt_at, o.id) AS turn,
           o.next_attempt_at
      FROM wq_sinks s
     CROSS JOIN LATERAL (
            SELECT o.id, o.next_attempt_at
              FROM wq_outbox o
             WHERE o.sink = s.name
               AND o.status = 'pending'
               AND o.next_attempt_at <= coalesce(%(now)s::timestamptz, now())
             ORDER BY o.next_attempt_at, o.id
             LIMIT %(limit)s
               FOR UPDATE OF o SKIP LOCKED
           ) o
     WHERE s.enabled
     ORDER BY turn, o.next_attempt_at, o.id
     LIMIT %(limit)s
), leased AS (
    UPDATE wq_outbox o
       SET lease_owner = %(owner)s,
           lease_expires_at = coalesce(%(now)s::timestamptz, now())
                              + make_interval(secs => %(lease_s)s::float8),
           next_attempt_at = coalesce(%(now)s::timestamptz, now())
                             + make_interval(secs => %(lease_s)s::float8),
           attempts = o.attempts + 1
      FROM picked
     WHERE o.id = picked.id
    RETURNING o.id, o.event_id, o.run_id, o.seq, o.sink, o.attempts, o.lease_expires_at
)
-- A delivery names its event by (run_id, seq) (migration 0038), read from the ledger view
-- (the event may be one a state row stands for); one written before that names it by
-- event_id alone.
SELECT l.id, l.sink, s.url, l.attempts, l.lease_expires_at,
       coalesce(%(now)s::timestamptz, now()) AS leased_at,
       e.id AS event_id, e.run_id, e.seq, e.attempt, e.kind, e.data, e.idempotency_key, e.at
  FROM leased l
  JOIN wq_sinks s ON s.name = l.sink
 CROSS JOIN LATERAL (
        SELECT v.id, v.run_id, v.seq, v.attempt, v.kind, v.data, v.idempotency_key, v.at
          FROM wq_ledger v
         WHERE v.run_id = l.run_id AND v.seq = l.seq
        UNION ALL
        SELECT w.id, w.run_id, w.seq, w.attempt, w.kind, w.data, w.idempotency_key, w.at
          FROM wq_events w
         WHERE l.run_id IS NULL AND w.id = l.event_id
       ) e
 ORDER BY e.run_id, e.seq, l.sink;

-- name: outbox_delivered :many
-- Mark leased deliveries delivered, only those still leased by this owner (fenced); the
-- ids it marked. A row another projector leased since (this lease lapsed) is left alone.
UPDATE wq_outbox
   SET status = 'delivered',
       delivered_at = coalesce(%(now)s::timestamptz, now()),
       lease_owner = NULL,
       lease_expires_at = NULL,
       last_error = NULL
 WHERE id = ANY (%(ids)s::bigint[])
   AND status = 'pending'
   AND lease_owner = %(owner)s
RETURNING id;

-- name: outbox_failed :one
-- Record a failed delivery and when to try again, only while this owner holds the lease
-- (fenced); the id when it was recorded.
UPDATE wq_outbox
   SET lease_owner = NULL,
       lease_expires_at = NULL,
       next_attempt_at = %(retry_at)s,
       last_error = %(error)s
 WHERE id = %(id)s
   AND status = 'pending'
   AND lease_owner = %(owner)s
RETURNING id;

-- name: progress_get :one
-- A run's progress projection, with the run's last seq in the ledger view (behind only for
-- events appended while the progress sink was disabled).
SELECT p.run_id, p.state::text AS state, p.attempt, p.rows_admitted, p.rows_done,
       p.last_event_seq, p.updated_at,
       (SELECT coalesce(max(e.seq), 0) FROM wq_ledger e WHERE e.run_id = p.run_id)
           AS ledger_seq
  FROM wq_progress p
 WHERE p.run_id = %(run_id)s;

-- name: sink_add :one
-- Add an HTTP sink, or point an existing HTTP sink at a new URL (and the kinds it wants:
-- NULL, every kind) and enable it. The built-in progress sink is never changed (no row
-- comes back for it).
INSERT INTO wq_sinks AS s (name, kind, url, enabled, kinds)
VALUES (%(name)s, 'http', %(url)s, true, %(kinds)s::text[])
ON CONFLICT (name) DO UPDATE
   SET url = excluded.url, kinds = excluded.kinds, enabled = true, updated_at = now()
 WHERE s.kind = 'http'
RETURNING s.name, s.kind::text AS kind, s.url, s.enabled, s.kinds, (s.xmax = 0) AS created;

-- name: sink_disable :one
-- Stop delivering to an HTTP sink: new events get no outbox row for it and its pending
-- deliveries wait (they resume when it is added again). The progress sink stays enabled.
UPDATE wq_sinks
   SET enabled = false, updated_at = now()
 WHERE name = %(name)s AND kind = 'http'
RETURNING name, kind::text AS kind, url, enabled, kinds, false AS created;

-- name: sink_list :many
-- Every sink with its pending deliveries (of which failing: tried and not delivered yet),
-- the oldest pending one's age and the latest error. Reads only pending rows (the partial
-- index): delivered rows stay until retention and are not counted.
SELECT s.name, s.kind::text AS kind, s.url, s.enabled, s.kinds,
       count(o.id) AS pending,
       count(o.id) FILTER (WHERE o.last_error IS NOT NULL) AS failing,
       coalesce(extract(epoch FROM now() - min(o.created_at)), 0)::float8 AS oldest_pending_s,
       (array_agg(o.last_error ORDER BY o.next_attempt_at DESC)
            FILTER (WHERE o.last_error IS NOT NULL))[1] AS last_error
  FROM wq_sinks s
  LEFT JOIN wq_outbox o ON o.sink = s.name AND o.status = 'pending'
 GROUP BY s.name, s.kind, s.url, s.enabled, s.kinds
 ORDER BY s.name;

-- name: sink_names :many
-- The names of every sink (for a did-you-mean).
SELECT name FROM wq_sinks ORDER BY name;
