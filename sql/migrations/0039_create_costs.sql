-- kind: expand
-- What paid work costs, and budgets nobody can overspend (queues/costs.py,
-- sql/queries/costs.sql, docs/explanation/costs.md).
--
-- A **charge** is what one step (or one row's step) cost: an amount in a unit (credits,
-- usd, ...) from a provider, recorded with the step's receipt, in the very statement that
-- completes or fails the receipt (sql/queries/receipts.sql). A receipt settles once, so a
-- charge is recorded once: a replayed step writes nothing, a stale attempt's charge is
-- refused with the rest of its write (the same fence), and a completion sent again after
-- its answer was lost finds the receipt settled and adds nothing.
--
-- A **budget** caps the charges of one unit over a period (day, month, or none) for an
-- org, an org's play, or one run. Its `spent` is the charges of its current period,
-- counted by the statements that record them under the budget's row lock. A step that
-- declares an estimate **reserves** it first, in one statement under the row locks of
-- every budget that applies (wq_reservations); the reservation counts against them while
-- its attempt is the run's live one, and is released by the completion that records the
-- step's actual charges. A reservation that does not fit pauses the run.

-- ---- the rules, one place for the checks below and for queues/costs.py ------------------

CREATE FUNCTION wq_cost_rules() RETURNS jsonb
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT jsonb_build_object(
        'name', '^[a-z0-9][a-z0-9_.:-]{0,99}$',   -- a unit or a provider (a limit key's rule)
        'max_amount', 1000000000000,             -- one charge, one estimate, one budget
        'periods', jsonb_build_array('day', 'month', 'none'))
$$;

-- A page of charges or of estimates (units, amounts, providers side by side): NULL, or the
-- first problem as {sqlstate, field, rule, message, fix} (wq_refuse raises it). The same
-- rules as queues.costs.check_amount / check_name: the database refuses what the API does.
CREATE FUNCTION wq_cost_problem(p_units text[], p_amounts numeric[], p_providers text[],
                                p_what text)
RETURNS text[]
LANGUAGE plpgsql
IMMUTABLE
SET search_path = public, pg_temp
AS $$
DECLARE
    v_pattern text := wq_cost_rules() ->> 'name';
    v_max numeric := (wq_cost_rules() ->> 'max_amount')::numeric;
    i integer;
BEGIN
    IF coalesce(cardinality(p_units), 0) <> coalesce(cardinality(p_amounts), 0)
       OR (p_providers IS NOT NULL
           AND cardinality(p_providers) <> coalesce(cardinality(p_units), 0)) THEN
        RETURN ARRAY['WQ010', p_what, 'units, amounts (and providers) side by side',
                     format('the %s hold %s units and %s amounts', p_what,
                            coalesce(cardinality(p_units), 0),
                            coalesce(cardinality(p_amounts), 0)),
                     'send one unit and one amount per entry'];
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_units), 0) LOOP
        IF p_units[i] IS NULL OR p_units[i] !~ v_pattern THEN
            RETURN ARRAY['WQ010', p_what || '.unit',
                         'lower-case letters, digits, ''.'', ''_'', '':'' or ''-'', starting '
                         'with a letter or digit, up to 100 characters',
                         format('unit %s is not a unit name', coalesce(wq_shown(p_units[i]),
                                                                      'null')),
                         'name the unit like credits or usd'];
        END IF;
        -- NaN compares above every number and Infinity above the bound: both refused here.
        IF p_amounts[i] IS NULL OR NOT (p_amounts[i] >= 0 AND p_amounts[i] <= v_max) THEN
            RETURN ARRAY['WQ010', p_what || '.amount',
                         format('a finite number from 0 to %s', v_max),
                         format('the amount in %s is %s', p_units[i],
                                coalesce(p_amounts[i]::text, 'null')),
                         'pass what the call cost, e.g. 1 or 0.002'];
        END IF;
        IF p_providers IS NOT NULL AND p_providers[i] IS NOT NULL AND p_providers[i] <> ''
           AND p_providers[i] !~ v_pattern THEN
            RETURN ARRAY['WQ010', p_what || '.provider',
                         'lower-case letters, digits, ''.'', ''_'', '':'' or ''-'', starting '
                         'with a letter or digit, up to 100 characters',
                         format('provider %s is not a provider name', wq_shown(p_providers[i])),
                         'name the provider like clearbit or openai'];
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- Raise the problem of a page of charges or estimates, or answer true: a statement calls
-- it in the CTE its fence reads, so nothing is written when it raises.
CREATE FUNCTION wq_cost_check(p_units text[], p_amounts numeric[], p_providers text[],
                              p_what text)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
DECLARE
    v_problem text[] := wq_cost_problem(p_units, p_amounts, p_providers, p_what);
BEGIN
    IF v_problem IS NOT NULL THEN
        PERFORM wq_refuse(v_problem);
    END IF;
    RETURN true;
END
$$;

-- Why a sleeping run waits when the wait is not its own: 'BUDGET_EXHAUSTED' for a run a
-- spent budget paused (its wait event is $budget:<the org's epoch>, queues.costs), else
-- NULL. The one rule every reader of a run (runs show, the dashboard, metrics, the wake
-- of a budget write) goes through.
CREATE FUNCTION wq_wait_reason(p_state wq_run_state, p_wait_event text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_state = 'sleeping' AND starts_with(p_wait_event, '$budget:')
                THEN 'BUDGET_EXHAUSTED' END
$$;

-- ---- budgets ------------------------------------------------------------------------------

-- One budget: an org's (play '' and no run), an org's play's, or one run's (run_id; play
-- ''), in one unit, over a period. `spent` holds the charges of the period that began at
-- `period_start`: a statement that finds the period over counts from 0 (and a charge
-- writes the new start), so a period rolls over without a job of its own.
CREATE TABLE wq_budgets (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org                 text NOT NULL CHECK (org <> ''),
    play                text NOT NULL DEFAULT '',   -- '': every play of the org
    run_id              uuid REFERENCES wq_runs (id) ON DELETE CASCADE,
    unit                text NOT NULL CHECK (unit ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    period              text NOT NULL CHECK (period IN ('day', 'month', 'none')),
    limit_amount        numeric NOT NULL CHECK (limit_amount >= 0
                                                AND limit_amount <= 1000000000000),
    spent               numeric NOT NULL DEFAULT 0 CHECK (spent >= 0),
    period_start        timestamptz NOT NULL DEFAULT '-infinity',
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    updated_by          text,
    CONSTRAINT wq_budgets_run_has_no_play CHECK (run_id IS NULL OR play = '')
);
CREATE UNIQUE INDEX wq_budgets_org_play_unit_key ON wq_budgets (org, play, unit)
    WHERE run_id IS NULL;
CREATE UNIQUE INDEX wq_budgets_run_unit_key ON wq_budgets (run_id, unit)
    WHERE run_id IS NOT NULL;

-- One row per org that ever had a budget: its epoch moves on with every budget write (set
-- or delete). A run pauses on a refused reservation only if the epoch it was refused at
-- is still the org's (read FOR SHARE, which a budget write's FOR UPDATE waits for): a
-- budget written in between hands the run straight back instead, so no raise is missed.
CREATE TABLE wq_budget_epochs (
    org                 text PRIMARY KEY,
    epoch               bigint NOT NULL DEFAULT 0
);

-- The start of the period of `p_at` (UTC days and months; -infinity for none).
CREATE FUNCTION wq_budget_period_start(p_period text, p_at timestamptz)
RETURNS timestamptz
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT CASE p_period
               WHEN 'day' THEN date_trunc('day', p_at, 'UTC')
               WHEN 'month' THEN date_trunc('month', p_at, 'UTC')
               ELSE '-infinity'::timestamptz
           END
$$;

-- The end of the period that begins at `p_start` (NULL for none: it never ends).
CREATE FUNCTION wq_budget_period_end(p_period text, p_start timestamptz)
RETURNS timestamptz
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT CASE p_period
               WHEN 'day' THEN ((p_start AT TIME ZONE 'UTC') + interval '1 day') AT TIME ZONE 'UTC'
               WHEN 'month' THEN ((p_start AT TIME ZONE 'UTC') + interval '1 month')
                                 AT TIME ZONE 'UTC'
           END
$$;

-- ---- reservations and charges ---------------------------------------------------------

-- A step's estimate, reserved before it runs: per (run, scope, step key, unit). It counts
-- against every budget of its org that applies to its run while its attempt is the run's
-- live one (the run running at that attempt); the completion of the step deletes it, and
-- the recovery pass deletes those of attempts that ended otherwise.
CREATE TABLE wq_reservations (
    run_id              uuid NOT NULL REFERENCES wq_runs (id) ON DELETE CASCADE,
    scope               text NOT NULL,
    step_key            text NOT NULL,
    unit                text NOT NULL,
    attempt             integer NOT NULL,
    org                 text NOT NULL,
    play                text NOT NULL,
    amount              numeric NOT NULL CHECK (amount >= 0 AND amount <= 1000000000000),
    reserved_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, scope, step_key, unit)
);
CREATE INDEX wq_reservations_org_unit_idx ON wq_reservations (org, unit);

-- What the live reservations of a budget's runs hold, leaving out one run's keys of one
-- scope (the reservation asking now: a repeat of it must not count itself). VOLATILE, so
-- a statement that calls it after taking the budget's row lock sees every reservation
-- committed before the lock was granted (as wq_limit_live_holds, migration 0017).
CREATE FUNCTION wq_budget_reserved(p_org text, p_play text, p_run uuid, p_unit text,
                                   p_self uuid, p_scope text, p_keys text[])
RETURNS numeric
LANGUAGE sql
VOLATILE
AS $$
    SELECT coalesce(sum(v.amount), 0)
      FROM wq_reservations v
      JOIN wq_runs r ON r.id = v.run_id AND r.attempt = v.attempt AND r.state = 'running'
     WHERE v.org = p_org AND v.unit = p_unit
       AND (p_play = '' OR v.play = p_play)
       AND (p_run IS NULL OR v.run_id = p_run)
       AND NOT (v.run_id = p_self AND v.scope = p_scope AND v.step_key = ANY (p_keys))
$$;

-- A charge: what one step of one attempt cost, in one unit, from one provider ('' when
-- not named). Written only by the statement that settles the step's receipt; kept when
-- its run is deleted (costs are history: org, play and run id are copied here).
CREATE TABLE wq_charges (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id              uuid NOT NULL,
    attempt             integer NOT NULL,
    org                 text NOT NULL,
    play                text NOT NULL,
    scope               text NOT NULL,
    step_key            text NOT NULL,
    outcome             text NOT NULL CHECK (outcome IN ('completed', 'failed')),
    unit                text NOT NULL CHECK (unit ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    provider            text NOT NULL DEFAULT ''
                        CHECK (provider = '' OR provider ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    amount              numeric NOT NULL CHECK (amount >= 0 AND amount <= 1000000000000),
    charged_at          timestamptz NOT NULL DEFAULT now(),
    -- A step's attempt settles its receipt once: a second row here would be a double.
    CONSTRAINT wq_charges_once UNIQUE (run_id, attempt, scope, step_key, outcome, unit,
                                       provider)
);
CREATE INDEX wq_charges_org_at_idx ON wq_charges (org, charged_at);
CREATE INDEX wq_charges_run_idx ON wq_charges (run_id);

-- A settled step's charges added to the budgets of its run that count their units, under
-- their row locks taken in id order (the lock order of sql/queries/costs.sql); a budget
-- whose period is over counts from 0 in the new one. Called by the statements that settle
-- receipts (sql/queries/receipts.sql), only when they recorded charges, with the charges
-- they recorded. Returns whether one of those budgets is now spent (spent >= its limit).
CREATE FUNCTION wq_budget_charge(p_run uuid, p_org text, p_play text, p_units text[],
                                 p_amounts numeric[], p_at timestamptz)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = public, pg_temp
AS $$
DECLARE
    v_spent boolean;
BEGIN
    PERFORM 1
       FROM wq_budgets b
      WHERE b.org = p_org AND (b.run_id = p_run OR (b.run_id IS NULL AND b.play IN ('', p_play)))
        AND b.unit = ANY (p_units)
      ORDER BY b.id
        FOR UPDATE;
    WITH charged AS (
        SELECT c.unit, sum(c.amount) AS amount
          FROM unnest(p_units, p_amounts) AS c (unit, amount)
         GROUP BY c.unit
    ), counted AS (
        UPDATE wq_budgets b
           SET spent = CASE WHEN b.period_start < wq_budget_period_start(b.period, p_at)
                            THEN 0 ELSE b.spent END + c.amount,
               period_start = greatest(b.period_start, wq_budget_period_start(b.period, p_at))
          FROM charged c
         WHERE b.org = p_org
           AND (b.run_id = p_run OR (b.run_id IS NULL AND b.play IN ('', p_play)))
           AND b.unit = c.unit
        RETURNING b.spent >= b.limit_amount AS spent
    )
    SELECT coalesce(bool_or(counted.spent), false) INTO v_spent FROM counted;
    RETURN v_spent;
END
$$;

-- ---- a run's own budget at admission ------------------------------------------------------

-- wq_submit_with_options takes a `budget` option ({"limit", "unit", "period"}): the run's
-- own budget, written with the run (only when this call created it).
CREATE FUNCTION wq_budget_problem(p_budget jsonb) RETURNS text[]
LANGUAGE plpgsql
IMMUTABLE
SET search_path = public, pg_temp
AS $$
DECLARE
    v_unknown text;
    v_limit jsonb := p_budget -> 'limit';
BEGIN
    IF p_budget IS NULL THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(p_budget) <> 'object' THEN
        RETURN ARRAY['WQ010', 'budget', 'an object {"limit", "unit", "period"}',
                     format('the budget is a JSON %s', jsonb_typeof(p_budget)),
                     'pass e.g. budget 50'];
    END IF;
    SELECT k INTO v_unknown FROM jsonb_object_keys(p_budget) AS k
     WHERE k NOT IN ('limit', 'unit', 'period') LIMIT 1;
    IF v_unknown IS NOT NULL THEN
        RETURN ARRAY['WQ010', 'budget.' || v_unknown, 'limit, unit and period only',
                     format('budget field %s is not known', wq_shown(v_unknown)),
                     'drop it'];
    END IF;
    IF jsonb_typeof(v_limit) IS DISTINCT FROM 'number' THEN
        RETURN ARRAY['WQ010', 'budget.limit',
                     format('a number from 0 to %s', wq_cost_rules() ->> 'max_amount'),
                     'the budget''s limit is ' || coalesce(left(v_limit::text, 60), 'missing'),
                     'pass e.g. budget 50'];
    END IF;
    IF jsonb_typeof(p_budget -> 'unit') IS DISTINCT FROM 'string'
       OR jsonb_typeof(p_budget -> 'period') IS DISTINCT FROM 'string' THEN
        RETURN ARRAY['WQ010', 'budget', 'unit and period as strings',
                     'the budget''s unit or period is not a string',
                     'pass e.g. {"limit": 50, "unit": "credits", "period": "none"}'];
    END IF;
    IF NOT (wq_cost_rules() -> 'periods') ? (p_budget ->> 'period') THEN
        RETURN ARRAY['WQ010', 'budget.period', 'day, month or none',
                     'the budget''s period is ' || wq_shown(p_budget ->> 'period'),
                     'pass day, month or none'];
    END IF;
    RETURN wq_cost_problem(ARRAY[p_budget ->> 'unit'], ARRAY[(v_limit::text)::numeric],
                           NULL, 'budget');
END
$$;

-- As migration 0036's, with the `budget` option.
CREATE OR REPLACE FUNCTION wq_submit_with_options(
    p_id uuid,
    p_org text,
    p_play text,
    p_params jsonb,
    p_release text,
    p_lane text,
    p_key text,
    p_priority integer,
    p_authority jsonb,
    p_input_pages jsonb[],
    p_input_rows bigint,
    p_input_digest text,
    p_options jsonb
) RETURNS TABLE (run_id uuid, created boolean, lane text, job_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_admitted record;
    v_unknown text;
    v_retry jsonb;
    v_budget jsonb;
    v_problem text[];
BEGIN
    v_problem := coalesce(wq_options_problem(p_options - 'budget'),
                          wq_budget_problem(p_options -> 'budget'));
    IF v_problem IS NOT NULL THEN
        PERFORM wq_refuse(v_problem);
    END IF;
    v_retry := coalesce(p_options -> 'retry', '{}'::jsonb);
    v_budget := p_options -> 'budget';

    SELECT k INTO v_unknown
      FROM jsonb_object_keys(coalesce(p_options, '{}'::jsonb)) AS k
     WHERE k NOT IN ('max_attempts', 'retry', 'timeout_s', 'start_by', 'meta', 'budget')
     UNION ALL
    SELECT 'retry.' || k
      FROM jsonb_object_keys(v_retry) AS k
     WHERE k NOT IN ('kind', 'base_s', 'factor', 'cap_s', 'jitter')
     LIMIT 1;
    IF v_unknown IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'WQ008',
            MESSAGE = format('run option %L is not known to this database: nothing was '
                             'written', v_unknown),
            DETAIL = json_build_object('field', v_unknown,
                                       'rule', 'max_attempts, retry (kind, base_s, factor, '
                                               'cap_s, jitter), timeout_s, start_by, meta, '
                                               'budget')::text,
            HINT = 'run `worker migrate` with the release that sends this option, or drop it';
    END IF;

    SELECT s.run_id, s.created, s.lane, s.job_id INTO v_admitted
      FROM wq_submit(p_id, p_org, p_play, p_params, p_release, p_lane, p_key, p_priority,
                     p_authority, p_input_pages, p_input_rows, p_input_digest) AS s;
    IF v_admitted.created THEN
        UPDATE wq_runs r
           SET retry_max_attempts = (p_options ->> 'max_attempts')::integer,
               retry_kind = v_retry ->> 'kind',
               retry_base_s = (v_retry ->> 'base_s')::double precision,
               retry_factor = (v_retry ->> 'factor')::double precision,
               retry_cap_s = (v_retry ->> 'cap_s')::double precision,
               retry_jitter = (v_retry ->> 'jitter')::double precision,
               timeout_s = (p_options ->> 'timeout_s')::double precision,
               start_by = (p_options ->> 'start_by')::timestamptz,
               meta = p_options -> 'meta'
         WHERE r.id = v_admitted.run_id;
        IF v_budget IS NOT NULL THEN
            INSERT INTO wq_budget_epochs (org) VALUES (p_org) ON CONFLICT (org) DO NOTHING;
            INSERT INTO wq_budgets (org, run_id, unit, period, limit_amount, updated_by)
            VALUES (p_org, v_admitted.run_id, v_budget ->> 'unit', v_budget ->> 'period',
                    (v_budget ->> 'limit')::numeric, 'submit');
        END IF;
    END IF;
    RETURN QUERY SELECT v_admitted.run_id, v_admitted.created, v_admitted.lane::text,
                        v_admitted.job_id;
END;
$$;
