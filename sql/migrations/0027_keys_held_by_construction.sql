-- Three foreign keys give way to the rules that already hold them, per statement.
--
-- Postgres checks a foreign key row by row: one lookup and one KEY SHARE lock of the
-- referenced row per inserted row. On the admission path three keys were checked again
-- for what the writing statement had just made sure of: about 18 us of the 98 us a run of
-- a batch admission costs the server, and the outbox's two on every claim, step and
-- finish that appends an event.
--
-- wq_outbox rows are written by one statement only: wq_events_outbox, the AFTER INSERT
-- trigger of wq_events, which pairs the events its statement just appended (its transition
-- table: rows of this transaction, which no other can delete) with the enabled sinks. A
-- run's lane is the one its admission locked FOR SHARE and checked (wq_submit,
-- wq_submit_many), or its parent's (a child run). What the keys did, and what does it now:
-- * wq_outbox.event_id, ON DELETE CASCADE: events are deleted only with their run
--   (retention deletes runs; their events go by wq_events' own key). wq_events_gone, an
--   AFTER DELETE statement trigger, deletes the outbox rows of the deleted events, once
--   per statement through the (event_id, sink) unique index, where the key cascaded once
--   per event.
-- * wq_outbox.sink, ON DELETE CASCADE, and wq_runs.lane, no delete or rename while a run
--   refers to it: a sink is disabled and a lane reclaimed, neither is ever deleted or
--   renamed (no command does either; the built-in progress sink always exists).
--   wq_sinks_kept and wq_lanes_kept (one function, wq_named_row_kept) refuse both with
--   SQLSTATE 23001 (restrict_violation), as a RESTRICT key would, so every outbox row's
--   sink and every run's lane exists.
--
-- tests/db/test_ledger.py and tests/db/test_admission.py hold them: a run's retention
-- takes its outbox rows, and a sink or a lane cannot be deleted or renamed.

ALTER TABLE wq_outbox
    DROP CONSTRAINT wq_outbox_event_id_fkey,
    DROP CONSTRAINT wq_outbox_sink_fkey;
ALTER TABLE wq_runs DROP CONSTRAINT wq_runs_lane_fkey;

CREATE FUNCTION wq_events_gone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM wq_outbox o USING gone g WHERE o.event_id = g.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_events_gone AFTER DELETE ON wq_events
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION wq_events_gone();

-- One rule for both tables: a row that other rows name by its `name` is never deleted or
-- renamed. The trigger's arguments: what the row is, why it is kept, the rule, and the fix,
-- in which {} stands for the row's column named by the last argument.
CREATE FUNCTION wq_named_row_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.name = OLD.name THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'restrict_violation',
        MESSAGE = format('%s %L is never %s: %s', TG_ARGV[0], OLD.name,
                         CASE TG_OP WHEN 'DELETE' THEN 'deleted' ELSE 'renamed' END,
                         TG_ARGV[1]),
        DETAIL = json_build_object('field', TG_ARGV[0], 'rule', TG_ARGV[2])::text,
        HINT = replace(TG_ARGV[3], '{}', to_jsonb(OLD) ->> TG_ARGV[4]);
END;
$$;

CREATE TRIGGER wq_sinks_kept BEFORE DELETE OR UPDATE OF name ON wq_sinks
    FOR EACH ROW EXECUTE FUNCTION wq_named_row_kept(
        'sink', 'its deliveries name it', 'a sink is disabled, never deleted or renamed',
        'disable it with `worker sinks disable {}`; add a sink under the new name with '
        '`worker sinks add`', 'name');

CREATE TRIGGER wq_lanes_kept BEFORE DELETE OR UPDATE OF name ON wq_lanes
    FOR EACH ROW EXECUTE FUNCTION wq_named_row_kept(
        'lane', 'its runs are pinned to it', 'a lane is reclaimed, never deleted or renamed',
        'stop its admissions with `worker queues drain {}`, then `worker queues reclaim {}` '
        'once it is empty', 'release');
