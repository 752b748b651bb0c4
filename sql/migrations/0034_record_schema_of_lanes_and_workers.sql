-- kind: expand
-- The schema window (docs/design.md, "The schema window"): a contract migration waits for
-- the lanes and workers of releases older than itself, so each lane and each worker
-- records the schema of the code that prepared or started it (its highest migration
-- number). NULL: prepared or started before this migration, which counts as older than
-- every contract step.
ALTER TABLE wq_lanes ADD COLUMN schema_version integer;
ALTER TABLE wq_workers ADD COLUMN schema_version integer;

-- The database is the last line: once a contract step raised the floor, a worker or a lane
-- of a release below it is refused here (WQ009, SCHEMA_WINDOW_CLOSED), whatever the code
-- that asks checked before. A worker that verified its schema before the step and
-- registers after it is caught by this; the contract step holds wq_workers in SHARE mode
-- while it runs, so no registration slips between its check for live workers and its commit.
-- Fires only on registration and lane preparation (INSERT, or an UPDATE that sets
-- schema_version): heartbeats and claims never pay for it.
CREATE FUNCTION wq_refuse_below_floor() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    floor_now integer;
    raised_by text;
    raised_in text;
BEGIN
    SELECT c.floor, c.floor_migration, c.floor_release
      INTO floor_now, raised_by, raised_in
      FROM wq_schema_contract c;
    IF floor_now IS NOT NULL AND coalesce(NEW.schema_version, 0) < floor_now THEN
        RAISE EXCEPTION USING
            ERRCODE = 'WQ009',
            MESSAGE = format(
                '%s of release %s (schema %s) is below the database''s compatibility floor %s, '
                'raised by contract migration %s (applied by release %s)',
                CASE TG_TABLE_NAME WHEN 'wq_workers' THEN 'a worker' ELSE 'the lane' END,
                NEW.release, coalesce(NEW.schema_version::text, 'unknown'), floor_now,
                coalesce(raised_by, '?'), coalesce(raised_in, '?')),
            DETAIL = '{"field": "schema floor", "rule": "a release runs against a database whose floor is at or below its schema"}',
            HINT = 'admit and run with a release at or above the floor; move this release''s unfinished runs there with `worker queues adopt`';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER wq_workers_above_floor
    BEFORE INSERT OR UPDATE OF schema_version ON wq_workers
    FOR EACH ROW EXECUTE FUNCTION wq_refuse_below_floor();
CREATE TRIGGER wq_lanes_above_floor
    BEFORE INSERT OR UPDATE OF schema_version ON wq_lanes
    FOR EACH ROW EXECUTE FUNCTION wq_refuse_below_floor();
