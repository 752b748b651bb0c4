-- Periodic plays (sql/migrations/0018): declared by an app's registry or added by an
-- operator, and admitted once per tick by whichever worker locks a due schedule first.
--
-- Lock order: the schedule rows FOR UPDATE SKIP LOCKED (a worker that finds one locked
-- leaves it to the worker that holds it), then the admission of its tick (wq_submit: the
-- lane row FOR SHARE, the run). Operators' writes lock one schedule row.

-- name: schedule_declare :one
-- Upsert a schedule an app declares (@registry.play(..., cron=...)), at a worker's start.
-- A schedule an operator added under the same name is left alone (returned unchanged, with
-- its source). A changed timing, play or org starts again from the next tick after now; the
-- same declaration keeps its next tick (a restart admits nothing twice, skips nothing).
INSERT INTO wq_schedules AS s (name, play, params, org, cron, every_s, source, next_at)
VALUES (%(name)s, %(play)s, %(params)s::jsonb, %(org)s, %(cron)s, %(every_s)s, 'app',
        %(next_at)s)
ON CONFLICT (name) DO UPDATE
   SET play = excluded.play,
       params = excluded.params,
       org = excluded.org,
       cron = excluded.cron,
       every_s = excluded.every_s,
       next_at = CASE WHEN (s.play, s.org, s.cron, s.every_s)
                           IS DISTINCT FROM
                           (excluded.play, excluded.org, excluded.cron, excluded.every_s)
                      THEN excluded.next_at ELSE s.next_at END,
       updated_at = now()
 WHERE s.source = 'app'
RETURNING name, source;

-- name: schedule_add :one
-- Add or change an operator's schedule (`worker schedules add`). An app's schedule of the
-- same name is not replaced: no row comes back.
INSERT INTO wq_schedules AS s (name, play, params, org, cron, every_s, source, next_at,
                               updated_by)
VALUES (%(name)s, %(play)s, %(params)s::jsonb, %(org)s, %(cron)s, %(every_s)s, 'cli',
        %(next_at)s, %(actor)s)
ON CONFLICT (name) DO UPDATE
   SET play = excluded.play,
       params = excluded.params,
       org = excluded.org,
       cron = excluded.cron,
       every_s = excluded.every_s,
       next_at = excluded.next_at,
       enabled = true,
       updated_by = excluded.updated_by,
       updated_at = now()
 WHERE s.source = 'cli'
RETURNING name, play, params, org, cron, every_s, source, enabled, next_at, last_tick,
          last_run_id, last_release, missed_ticks, created_at, updated_at, updated_by;

-- name: schedule_source :one
-- Who declared a schedule (app or cli), if it exists.
SELECT source FROM wq_schedules WHERE name = %(name)s;

-- name: schedule_delete :one
-- Delete a schedule (runs it admitted stay).
DELETE FROM wq_schedules WHERE name = %(name)s RETURNING name, source;

-- name: schedule_list :many
-- Every schedule, next due first.
SELECT name, play, params, org, cron, every_s, source, enabled, next_at, last_tick,
       last_run_id, last_release, missed_ticks, created_at, updated_at, updated_by
  FROM wq_schedules
 ORDER BY next_at, name;

-- name: schedule_clock :one
-- The database's time: every worker computes ticks from the same clock.
SELECT coalesce(%(now)s::timestamptz, now()) AS now;

-- name: schedule_due :many
-- Lock a batch of due schedules of the given plays (SKIP LOCKED: each is admitted by one
-- worker, the others skip it); bounded, through wq_schedules_due_idx.
SELECT name, play, params, org, cron, every_s, next_at
  FROM wq_schedules
 WHERE enabled
   AND next_at <= %(now)s::timestamptz
   AND play = ANY (%(plays)s::text[])
 ORDER BY next_at
 LIMIT %(batch)s
   FOR UPDATE SKIP LOCKED;

-- name: schedule_advance :exec
-- Record a schedule's admitted tick and move it to its next one (in the admitting
-- transaction, under the row lock schedule_due took).
UPDATE wq_schedules
   SET next_at = %(next_at)s,
       last_tick = %(tick)s,
       last_run_id = %(run_id)s,
       last_release = %(release)s,
       missed_ticks = missed_ticks + %(missed)s,
       updated_at = now()
 WHERE name = %(name)s;

-- name: schedule_next_due :one
-- When the next schedule of the given plays is due (NULL: none is enabled).
SELECT min(next_at) AS next_at
  FROM wq_schedules
 WHERE enabled AND play = ANY (%(plays)s::text[]);
