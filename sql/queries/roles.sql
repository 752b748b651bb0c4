-- Roles: what `worker migrate` keeps in step with the schema, on any Postgres.
--
-- The migration owner (whoever runs `worker migrate`) owns every object and alone runs
-- DDL. Three group roles (NOLOGIN; a deployment grants them to its login users) get
-- exactly what their processes need, re-granted on every migrate so a new table is
-- covered:
--   wq_worker     workers, recovery, operator actions: DML on our tables and
--                 procrastinate's, the sequences, EXECUTE on the submit function; only
--                 SELECT on the migration bookkeeping; no DDL (objects are the owner's)
--   wq_admission  EXECUTE on wq_submit, wq_submit_many and wq_submit_with_options,
--                 nothing else: it cannot read a run, its params or its rows
--   wq_reader     SELECT on our tables and procrastinate's: observe, result, metrics,
--                 dashboards
-- Roles belong to the cluster, not the database: two databases of one cluster share them.

-- name: roles_ensure :exec
-- Create the group roles that do not exist yet (concurrent migrators of one cluster race
-- here harmlessly: a duplicate is ignored).
DO $$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['wq_worker', 'wq_admission', 'wq_reader'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another migrator created it first
            END;
        END IF;
    END LOOP;
END
$$;

-- name: roles_grant :exec
-- Grant each role what it needs on every object of ours and procrastinate's in this schema.
DO $$
DECLARE
    obj record;
    bookkeeping text[] := ARRAY['wq_migrations', 'wq_schema_contract',
                                'wq_procrastinate_migrations'];
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO wq_worker, wq_admission, wq_reader',
                   current_schema());
    FOR obj IN
        SELECT c.relname, c.relkind
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_schema()
           AND c.relkind IN ('r', 'p', 'v', 'S')
           AND (c.relname LIKE 'wq\_%' OR c.relname LIKE 'procrastinate\_%')
         ORDER BY c.relname
    LOOP
        IF obj.relkind = 'S' THEN
            EXECUTE format('GRANT USAGE, SELECT ON SEQUENCE %I TO wq_worker', obj.relname);
        ELSIF obj.relname = ANY (bookkeeping) THEN
            EXECUTE format('GRANT SELECT ON TABLE %I TO wq_worker, wq_reader', obj.relname);
        ELSE
            EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %I TO wq_worker',
                           obj.relname);
            EXECUTE format('GRANT SELECT ON TABLE %I TO wq_reader', obj.relname);
        END IF;
    END LOOP;
    GRANT EXECUTE ON FUNCTION wq_submit(uuid, text, text, jsonb, text, text, text, integer,
                                        jsonb, jsonb[], bigint, text)
        TO wq_admission, wq_worker;
    GRANT EXECUTE ON FUNCTION wq_submit_many(uuid[], text[], text[], jsonb[], text[], text[],
                                             text[], integer[], jsonb[])
        TO wq_admission, wq_worker;
    GRANT EXECUTE ON FUNCTION wq_submit_with_options(uuid, text, text, jsonb, text, text,
                                                     text, integer, jsonb, jsonb[], bigint,
                                                     text, jsonb)
        TO wq_admission, wq_worker;
    -- The wake of a cancel's worker (migration 0036): a worker acts only on the run's
    -- durable request, which only the worker role and the owner can write.
    GRANT EXECUTE ON FUNCTION wq_transport_notify_cancel(uuid) TO wq_worker;
END
$$;

-- name: roles_present :many
-- The group roles that exist (a migrator without CREATEROLE needs them made beforehand).
SELECT rolname FROM pg_roles WHERE rolname IN ('wq_worker', 'wq_admission', 'wq_reader')
 ORDER BY rolname;
