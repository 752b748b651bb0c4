-- Monotonic totals for the Prometheus counters (`/metrics`, queues.totals).
--
-- A total is the live rows plus what retention deleted (wq_metric_tallies, kept by the
-- DELETE triggers of migration 0012). The statement reads both in one snapshot, so a
-- retention pass that commits between two scrapes moves rows from one side to the other
-- and the sum never goes down. It scans wq_runs, wq_attempts and wq_refusals (what
-- retention keeps): run it per scrape, never per request.

-- name: metrics_totals :many
-- Every counter total as (metric, label, value): runs admitted, rows completed, attempts
-- by outcome, refused writes and refused rows by kind.
SELECT metric, label, sum(value)::bigint AS value
  FROM (SELECT 'runs_admitted' AS metric, '' AS label, count(*)::bigint AS value
          FROM wq_runs
        UNION ALL
        SELECT 'rows_completed', '', coalesce(sum(rows_done), 0)::bigint FROM wq_runs
        UNION ALL
        SELECT 'attempts', outcome::text, count(*)
          FROM wq_attempts
         WHERE outcome <> 'running'
         GROUP BY outcome
        UNION ALL
        SELECT 'refusals', kind, count(*) FROM wq_refusals GROUP BY kind
        UNION ALL
        SELECT 'refused_rows', kind, coalesce(sum(rows), 0)::bigint
          FROM wq_refusals GROUP BY kind
        UNION ALL
        SELECT metric, label, value FROM wq_metric_tallies) AS parts
 GROUP BY metric, label
 ORDER BY metric, label;

-- name: metrics_live_workers :one
-- Worker processes alive now: not stopped, and a heartbeat within the lease TTL of one of
-- their lanes (the same rule as a lane's live workers, counted once per process).
SELECT count(DISTINCT w.id)
  FROM wq_workers w
  JOIN wq_lanes l ON l.name = ANY (w.lanes)
 WHERE w.stopped_at IS NULL
   AND w.heartbeat_at > coalesce(%(now)s::timestamptz, now()) - make_interval(secs => l.lease_ttl_s);

-- name: metrics_charged :many
-- What the recorded charges add up to per org, play, provider ('' for none) and unit. A
-- charge is written once with its step's receipt and never updated or deleted, so each
-- sum only grows. Scans wq_charges: run it per scrape, never per request.
SELECT org, play, provider, unit, sum(amount) AS amount
  FROM wq_charges
 GROUP BY org, play, provider, unit
 ORDER BY org, play, provider, unit;
