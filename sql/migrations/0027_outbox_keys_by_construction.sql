-- The outbox's two foreign keys give way to the rules that already hold them, per statement.
--
-- wq_outbox rows are written by one statement only: wq_events_outbox, the AFTER INSERT
-- trigger of wq_events, which pairs the events its statement just appended (its transition
-- table: rows of this transaction, which no other can delete) with the enabled sinks.
-- Postgres checked both keys again row by row, one lookup and one KEY SHARE lock per key
-- per outbox row: about 13 us of the 98 us a run of a batch admission costs the server, and
-- the same on every claim, step and finish that appends an event.
--
-- What the keys did, and what does it now:
-- * event_id ON DELETE CASCADE: events are deleted only with their run (retention deletes
--   runs; their events go by wq_events' own key). wq_events_gone, an AFTER DELETE
--   statement trigger, deletes the outbox rows of the deleted events, once per statement
--   through the (event_id, sink) unique index, where the key cascaded once per event.
-- * sink ON DELETE CASCADE, and no rename while rows refer to it: a sink is disabled,
--   never deleted or renamed (`worker sinks` has no such command; the built-in progress
--   sink always exists). wq_sinks_kept refuses both with SQLSTATE 23001
--   (restrict_violation), as a RESTRICT key would, so every outbox row's sink exists.
--
-- tests/db/test_ledger.py holds both: a run's retention takes its outbox rows, and a sink
-- cannot be deleted or renamed.

ALTER TABLE wq_outbox
    DROP CONSTRAINT wq_outbox_event_id_fkey,
    DROP CONSTRAINT wq_outbox_sink_fkey;

CREATE FUNCTION wq_events_gone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM wq_outbox o USING gone g WHERE o.event_id = g.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_events_gone AFTER DELETE ON wq_events
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION wq_events_gone();

CREATE FUNCTION wq_sinks_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.name = OLD.name THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'restrict_violation',
        MESSAGE = format('sink %L is never %s: its deliveries name it', OLD.name,
                         CASE TG_OP WHEN 'DELETE' THEN 'deleted' ELSE 'renamed' END),
        DETAIL = json_build_object('field', 'sink',
                                   'rule', 'a sink is disabled, never deleted or renamed')::text,
        HINT = format('disable it with `worker sinks disable %s`; add a sink under the new '
                      'name with `worker sinks add`', OLD.name);
END;
$$;

CREATE TRIGGER wq_sinks_kept BEFORE DELETE OR UPDATE OF name ON wq_sinks
    FOR EACH ROW EXECUTE FUNCTION wq_sinks_kept();
