-- Rate limits shared by every worker and host: named limits with a rate, a burst and an
-- optional concurrency cap, stored here so that every process counts against the same
-- numbers (queues/limits.py, sql/queries/limits.sql).
--
-- The rate is a GCRA (the generic cell rate algorithm, a token bucket kept as one
-- timestamp): each permit moves the bucket's theoretical arrival time (tat) on by one
-- emission interval (1 / rate), and a permit is granted while tat stays within `burst`
-- intervals of now. With burst 1, grants are at least one interval apart: a limit of 10/s
-- grants at most 10 in any one-second window. The concurrency cap counts the holds of live
-- attempts only (the holder's run still running at that attempt, under that lease owner,
-- with an unexpired lease): a dead worker's holds stop counting when its lease lapses.

CREATE TABLE wq_limits (
    key                 text PRIMARY KEY CHECK (key ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    rate_per_s          double precision CHECK (rate_per_s > 0 AND rate_per_s <= 1000000),
    rate                text,               -- as given (10/s, 600/m), for display
    burst               integer NOT NULL DEFAULT 1 CHECK (burst BETWEEN 1 AND 1000000),
    concurrency         integer CHECK (concurrency BETWEEN 1 AND 1000000),
    per_org             boolean NOT NULL DEFAULT false,  -- one bucket per org of the caller
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    updated_by          text,
    CONSTRAINT wq_limits_something CHECK (rate_per_s IS NOT NULL OR concurrency IS NOT NULL),
    CONSTRAINT wq_limits_rate_text CHECK ((rate_per_s IS NULL) = (rate IS NULL))
);

-- One bucket per limit, or per limit and org (per_org; org '' otherwise). Made on first use.
CREATE TABLE wq_limit_buckets (
    key                 text NOT NULL REFERENCES wq_limits (key) ON DELETE CASCADE,
    org                 text NOT NULL,
    tat                 timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (key, org)
);

-- A permit held under a concurrency cap: by one attempt of one run, until released.
CREATE TABLE wq_limit_holds (
    run_id              uuid NOT NULL REFERENCES wq_runs (id) ON DELETE CASCADE,
    hold                text NOT NULL,      -- the attempt's name for this permit
    key                 text NOT NULL,
    org                 text NOT NULL,
    attempt             integer NOT NULL,
    owner               text NOT NULL,      -- the lease owner that took it
    acquired_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, hold),
    FOREIGN KEY (key, org) REFERENCES wq_limit_buckets (key, org) ON DELETE CASCADE
);
CREATE INDEX wq_limit_holds_bucket_idx ON wq_limit_holds (key, org);

-- The permits of a bucket held by live attempts now. VOLATILE, so a statement that calls it
-- after taking the bucket's lock (sql/queries/limits.sql, limit_acquire) counts with a
-- snapshot taken then, which sees the hold of every grant that committed before the lock
-- was granted; a plain read in that statement would use the statement's own, older
-- snapshot and could miss one, letting a cap be exceeded.
CREATE FUNCTION wq_limit_live_holds(p_key text, p_org text, p_at timestamptz)
RETURNS integer
LANGUAGE sql
VOLATILE
AS $$
    SELECT count(*)::integer
      FROM wq_limit_holds h
      JOIN wq_runs r ON r.id = h.run_id AND r.attempt = h.attempt AND r.state = 'running'
                    AND r.lease_owner = h.owner AND r.lease_expires_at > p_at
     WHERE h.key = p_key AND h.org = p_org
$$;
