-- The operator's surface: retrying a finished run, an audit log of operator actions, and
-- monotonic metric totals that survive retention.

-- ---- retry: a new attempt sequence on the same run ------------------------------------------

-- `worker runs retry` (and the dashboard) requeues a failed or cancelled run as itself: the
-- same id, its receipts and write intents, its ledger. Attempt numbers keep growing (the
-- fence stays exact: no attempt of the earlier sequence can write again), and the retry
-- budget counts only the attempts after the latest retry: attempts numbered up to
-- retry_floor were spent by an earlier sequence.
ALTER TABLE wq_runs ADD COLUMN retry_floor integer NOT NULL DEFAULT 0
    CONSTRAINT wq_runs_retry_floor_check CHECK (retry_floor >= 0);

-- ---- operator actions -------------------------------------------------------------------------

-- Who changed what, for actions that have no run ledger to go in (a lane's policy, drain,
-- reclaim); run actions (cancel, retry) append to the run's ledger with `by` as well.
-- Append-only; small (operators act rarely), so it has no retention.
CREATE TABLE wq_operator_actions (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at                  timestamptz NOT NULL DEFAULT now(),
    actor               text NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
    action              text NOT NULL,     -- set_policy | drain | reclaim | retry | cancel
    lane                text,
    run_id              uuid,
    data                jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX wq_operator_actions_lane_idx ON wq_operator_actions (lane, at DESC);

-- ---- metric totals ------------------------------------------------------------------------------

-- The Prometheus counters (runs admitted, attempts by outcome, rows completed, refused
-- writes) are read as totals from the tables. Retention deletes rows, which would make a
-- total go down; so what a delete removes is added here first, in the deleting statement
-- (statement-level triggers on DELETE only: the hot paths, which insert and update, pay
-- nothing). A total is then the live rows plus this tally, and never decreases.
CREATE TABLE wq_metric_tallies (
    metric              text NOT NULL,     -- runs_admitted | rows_completed | attempts | refusals | refused_rows
    label               text NOT NULL DEFAULT '',   -- the attempt outcome or refusal kind
    value               bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (metric, label)
);

-- Lock order: the tally rows in (metric, label) order; concurrent retention passes touch
-- the same few rows briefly and in the same order, so they queue instead of deadlocking.
CREATE FUNCTION wq_tally_deleted_runs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wq_metric_tallies AS t (metric, label, value)
    SELECT m.metric, '', m.value
      FROM (SELECT 'rows_completed' AS metric, coalesce(sum(g.rows_done), 0)::bigint AS value
              FROM gone g
            UNION ALL
            SELECT 'runs_admitted', count(*) FROM gone) m
     WHERE m.value > 0
     ORDER BY m.metric
    ON CONFLICT (metric, label) DO UPDATE SET value = t.value + excluded.value;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_tally_deleted_runs AFTER DELETE ON wq_runs
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION wq_tally_deleted_runs();

CREATE FUNCTION wq_tally_deleted_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wq_metric_tallies AS t (metric, label, value)
    SELECT 'attempts', g.outcome::text, count(*)
      FROM gone g
     WHERE g.outcome <> 'running'
     GROUP BY g.outcome::text
     ORDER BY g.outcome::text
    ON CONFLICT (metric, label) DO UPDATE SET value = t.value + excluded.value;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_tally_deleted_attempts AFTER DELETE ON wq_attempts
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION wq_tally_deleted_attempts();

CREATE FUNCTION wq_tally_deleted_refusals() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wq_metric_tallies AS t (metric, label, value)
    SELECT m.metric, m.kind, m.value
      FROM (SELECT 'refusals' AS metric, g.kind, count(*)::bigint AS value
              FROM gone g GROUP BY g.kind
            UNION ALL
            SELECT 'refused_rows', g.kind, sum(g.rows)::bigint
              FROM gone g GROUP BY g.kind) m
     ORDER BY m.metric, m.kind
    ON CONFLICT (metric, label) DO UPDATE SET value = t.value + excluded.value;
    RETURN NULL;
END;
$$;

CREATE TRIGGER wq_tally_deleted_refusals AFTER DELETE ON wq_refusals
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION wq_tally_deleted_refusals();
