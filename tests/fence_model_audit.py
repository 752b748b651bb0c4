"""Test-only audit triggers for the fence model (tests/integration/test_fence_model.py).

Installed in a throwaway clone of the template database, never by a migration. Each trigger
runs inside the writing transaction, right after the writing statement, and compares the
write with the run's state *at that moment*: a write whose attempt is not the run's live
attempt is recorded in ``wq_audit_violations`` (the model asserts that table stays empty).
So a fence that lets a stale write through is caught even if a later write hides it.

The writer: the model names the fence of every write it makes in the session setting
``wq_audit.writer`` (``run_id attempt owner``, :func:`writing_as`). Without it (a write
from outside a play), the row's own run and attempt columns stand for the writer.

What is audited (``check`` names the model's invariant):

- ``wq_sheet_rows`` (insert, update): the writer's run must be ``running`` at its attempt
  under its lease owner, and the row it wrote must be its run's, stamped with its attempt
  (a write never lands on another run's row). Every pending->terminal and
  terminal->anything change is logged in ``wq_audit_terminal`` with a global order
  (``wq_audit_seq``).
- ``wq_receipts`` (insert, update that changes the row): the same, for the receipt's owner
  ``(owner_run, owner_attempt)`` after a claim, a completion, a failure or a lease
  extension; a completed or skipped receipt never changes again.
- ``wq_emitted_events`` (insert, update) by a play: its run must be running at that
  attempt under that lease owner (an emit from the app is not fenced).
- ``wq_attempts``: an attempt opens as the run's live attempt under its worker's lease;
  its close (``running`` -> any outcome) is logged in ``wq_audit_closes`` with the same
  global order; a closed attempt never changes again.
- ``wq_runs`` (update): a terminal run never changes state (cancel is final); the attempt
  number never goes down; a run that stays ``running`` keeps its attempt and its lease
  owner (a lease never changes hands without its attempt being closed); a claim bumps the
  attempt by one and opens it; a run that leaves ``running`` has closed its attempt; with
  a cancel pending the run only ever becomes ``cancelled`` (or ``queued`` for a
  cleanup-only attempt, or ``running`` in it), and the request is never dropped.

The machine runs one statement at a time, except in its races, where the live attempt's
statement runs with another that writes nothing audited (it is refused, and writes only its
``wq_refusals`` row, or replays a final write): so ``wq_audit_seq`` orders the audited
writes as they committed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg

from queues.fence import Fence

Conn = psycopg.AsyncConnection[Any]

AUDIT_SQL = r"""
CREATE TABLE wq_audit_violations (
    id         bigserial PRIMARY KEY,
    check_name text NOT NULL,
    detail     text NOT NULL
);
CREATE SEQUENCE wq_audit_seq;
CREATE TABLE wq_audit_closes (
    run_id  uuid NOT NULL,
    attempt int NOT NULL,
    outcome text NOT NULL,
    seq     bigint NOT NULL,
    PRIMARY KEY (run_id, attempt)
);
CREATE TABLE wq_audit_terminal (
    id      bigserial PRIMARY KEY,
    org     text NOT NULL,
    sheet   text NOT NULL,
    row_key text NOT NULL,
    run_id  uuid,
    attempt int,
    change  text NOT NULL,
    seq     bigint NOT NULL
);

-- NULL when (run, attempt[, owner]) is the run's live attempt now; else what the run is.
CREATE FUNCTION wq_audit_not_live(p_run uuid, p_attempt int, p_owner text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    SELECT state::text AS state, attempt, lease_owner INTO r FROM wq_runs WHERE id = p_run;
    IF NOT FOUND THEN
        RETURN 'the run does not exist';
    END IF;
    IF r.state = 'running' AND r.attempt = p_attempt
       AND (p_owner IS NULL OR r.lease_owner = p_owner) THEN
        RETURN NULL;
    END IF;
    RETURN format('the run is %s at attempt %s (lease owner %s)',
                  r.state, r.attempt, coalesce(r.lease_owner, 'none'));
END $$;

-- The fence the model named for the writes of this session (NULL: none named).
CREATE FUNCTION wq_audit_writer() RETURNS text[] LANGUAGE sql AS $$
    SELECT CASE WHEN coalesce(current_setting('wq_audit.writer', true), '') <> ''
                THEN string_to_array(current_setting('wq_audit.writer', true), ' ') END;
$$;

-- The write of a row of run p_run stamped with attempt p_attempt: NULL when it is fine,
-- else why not (the writer named for the session, else the row's own run and attempt).
CREATE FUNCTION wq_audit_write(p_run uuid, p_attempt int) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    w text[] := wq_audit_writer();
    why text;
BEGIN
    IF w IS NULL THEN
        RETURN wq_audit_not_live(p_run, p_attempt, NULL);
    END IF;
    why := wq_audit_not_live(w[1]::uuid, w[2]::int, w[3]);
    IF why IS NOT NULL THEN
        RETURN format('written by run %s attempt %s (worker %s), but %s', w[1], w[2], w[3], why);
    END IF;
    IF p_run IS DISTINCT FROM w[1]::uuid OR p_attempt IS DISTINCT FROM w[2]::int THEN
        RETURN format('written by run %s attempt %s (worker %s), live, on a row of run %s '
                      'stamped attempt %s', w[1], w[2], w[3], p_run, p_attempt);
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION wq_audit_violation(p_check text, p_detail text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO wq_audit_violations (check_name, detail) VALUES (p_check, p_detail);
$$;

CREATE FUNCTION wq_audit_sheet_rows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    why text;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW IS NOT DISTINCT FROM OLD THEN
        RETURN NULL;
    END IF;
    why := wq_audit_write(NEW.run_id, NEW.attempt);
    IF why IS NOT NULL THEN
        PERFORM wq_audit_violation('2: no write by a closed attempt', format(
            'wq_sheet_rows %s of row %s/%s/%s (now %s, version %s, run %s, attempt %s): %s',
            TG_OP, NEW.org, NEW.sheet, NEW.row_key, NEW.status, NEW.write_version,
            NEW.run_id, NEW.attempt, why));
    END IF;
    IF NEW.status <> 'pending' AND (TG_OP = 'INSERT' OR OLD.status = 'pending') THEN
        INSERT INTO wq_audit_terminal (org, sheet, row_key, run_id, attempt, change, seq)
        VALUES (NEW.org, NEW.sheet, NEW.row_key, NEW.run_id, NEW.attempt,
                format('%s->%s by run %s attempt %s',
                       CASE WHEN TG_OP = 'INSERT' THEN 'none' ELSE OLD.status::text END,
                       NEW.status, NEW.run_id, NEW.attempt),
                nextval('wq_audit_seq'));
    ELSIF TG_OP = 'UPDATE' AND OLD.status <> 'pending' THEN
        INSERT INTO wq_audit_terminal (org, sheet, row_key, run_id, attempt, change, seq)
        VALUES (NEW.org, NEW.sheet, NEW.row_key, NEW.run_id, NEW.attempt,
                format('%s->%s by run %s attempt %s', OLD.status, NEW.status,
                       NEW.run_id, NEW.attempt),
                nextval('wq_audit_seq'));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER wq_audit_sheet_rows AFTER INSERT OR UPDATE ON wq_sheet_rows
    FOR EACH ROW EXECUTE FUNCTION wq_audit_sheet_rows();

CREATE FUNCTION wq_audit_receipts() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    why text;
BEGIN
    -- receipt_claim's conflict arm always updates; a row it may not take keeps every value.
    IF TG_OP = 'UPDATE' AND NEW IS NOT DISTINCT FROM OLD THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.status IN ('completed', 'skipped') THEN
        PERFORM wq_audit_violation('2: no write by a closed attempt', format(
            'settled receipt %s/%s (%s by run %s attempt %s) rewritten as %s by run %s attempt %s',
            NEW.scope, NEW.step_key, OLD.status, OLD.owner_run, OLD.owner_attempt,
            NEW.status, NEW.owner_run, NEW.owner_attempt));
    END IF;
    IF NEW.owner_run IS NOT NULL THEN
        why := wq_audit_write(NEW.owner_run, NEW.owner_attempt);
        IF why IS NOT NULL THEN
            PERFORM wq_audit_violation('2: no write by a closed attempt', format(
                'wq_receipts %s of step %s/%s (now %s, owner run %s attempt %s): %s',
                TG_OP, NEW.scope, NEW.step_key, NEW.status, NEW.owner_run, NEW.owner_attempt,
                why));
        END IF;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER wq_audit_receipts AFTER INSERT OR UPDATE ON wq_receipts
    FOR EACH ROW EXECUTE FUNCTION wq_audit_receipts();

CREATE FUNCTION wq_audit_emitted_events() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    w text[] := wq_audit_writer();
    why text;
BEGIN
    IF w IS NULL THEN
        RETURN NULL;  -- an emit from outside a play (the app): not fenced
    END IF;
    why := wq_audit_not_live(w[1]::uuid, w[2]::int, w[3]);
    IF why IS NOT NULL THEN
        PERFORM wq_audit_violation('2: no write by a closed attempt', format(
            'wq_emitted_events %s of event %s/%s by run %s attempt %s (worker %s): %s',
            TG_OP, NEW.org, NEW.name, w[1], w[2], w[3], why));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER wq_audit_emitted_events AFTER INSERT OR UPDATE ON wq_emitted_events
    FOR EACH ROW EXECUTE FUNCTION wq_audit_emitted_events();

CREATE FUNCTION wq_audit_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF wq_audit_not_live(NEW.run_id, NEW.attempt, NEW.worker_id) IS NOT NULL THEN
            PERFORM wq_audit_violation('1: at most one live attempt per run', format(
                'attempt %s of run %s opened by %s, but %s', NEW.attempt, NEW.run_id,
                NEW.worker_id, wq_audit_not_live(NEW.run_id, NEW.attempt, NEW.worker_id)));
        END IF;
        RETURN NULL;
    END IF;
    IF OLD.outcome = 'running' AND NEW.outcome <> 'running' THEN
        INSERT INTO wq_audit_closes (run_id, attempt, outcome, seq)
        VALUES (NEW.run_id, NEW.attempt, NEW.outcome::text, nextval('wq_audit_seq'));
    ELSIF OLD.outcome <> 'running' AND NEW IS DISTINCT FROM OLD THEN
        PERFORM wq_audit_violation('1: at most one live attempt per run', format(
            'closed attempt %s of run %s changed: outcome %s -> %s, finished_at %s -> %s',
            NEW.attempt, NEW.run_id, OLD.outcome, NEW.outcome, OLD.finished_at,
            NEW.finished_at));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER wq_audit_attempts AFTER INSERT OR UPDATE ON wq_attempts
    FOR EACH ROW EXECUTE FUNCTION wq_audit_attempts();

CREATE FUNCTION wq_audit_runs() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    what text := format('run %s: %s at attempt %s (lease %s) -> %s at attempt %s (lease %s)',
                        NEW.id, OLD.state, OLD.attempt, coalesce(OLD.lease_owner, 'none'),
                        NEW.state, NEW.attempt, coalesce(NEW.lease_owner, 'none'));
    open_outcome text;
BEGIN
    IF OLD.state IN ('succeeded', 'failed', 'cancelled') AND NEW.state <> OLD.state THEN
        PERFORM wq_audit_violation('3: a cancelled run stays cancelled',
                                   'a terminal run changed state: ' || what);
    END IF;
    IF NEW.attempt < OLD.attempt THEN
        PERFORM wq_audit_violation('1: at most one live attempt per run',
                                   'the attempt number went down: ' || what);
    END IF;
    IF OLD.state = 'running' AND NEW.state = 'running'
       AND (NEW.attempt <> OLD.attempt OR NEW.lease_owner IS DISTINCT FROM OLD.lease_owner) THEN
        PERFORM wq_audit_violation('1: at most one live attempt per run',
                                   'the lease changed hands while running: ' || what);
    END IF;
    IF OLD.state <> 'running' AND NEW.state = 'running' AND NEW.attempt <> OLD.attempt + 1 THEN
        PERFORM wq_audit_violation('1: at most one live attempt per run',
                                   'a claim did not start attempt + 1: ' || what);
    END IF;
    IF OLD.state = 'running' AND NEW.state <> 'running' THEN
        SELECT outcome::text INTO open_outcome
          FROM wq_attempts WHERE run_id = NEW.id AND attempt = OLD.attempt;
        IF open_outcome = 'running' THEN
            PERFORM wq_audit_violation('1: at most one live attempt per run',
                                       'the run left running with its attempt open: ' || what);
        END IF;
    END IF;
    IF OLD.cancel_requested_at IS NOT NULL
       AND (NEW.cancel_requested_at IS NULL
            OR NEW.state NOT IN ('running', 'queued', 'cancelled')) THEN
        PERFORM wq_audit_violation('3: a cancelled run stays cancelled',
                                   'a run with a cancel pending became: ' || what);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER wq_audit_runs AFTER UPDATE ON wq_runs
    FOR EACH ROW EXECUTE FUNCTION wq_audit_runs();
"""


async def install(conn: Conn) -> None:
    """Install the audit tables and triggers (in a throwaway database)."""
    async with conn.transaction():
        await conn.execute(AUDIT_SQL)


@asynccontextmanager
async def writing_as(conn: Conn, fence: Fence | None) -> AsyncIterator[None]:
    """Name ``fence`` as the writer of the writes made on ``conn`` inside the block (None:
    a write from outside a play)."""
    writer = "" if fence is None else f"{fence.run_id} {fence.attempt} {fence.owner}"
    await conn.execute("SELECT set_config('wq_audit.writer', %s, false)", (writer,))
    try:
        yield
    finally:
        await conn.execute("SELECT set_config('wq_audit.writer', '', false)")


async def _rows(conn: Conn, sql: Any, params: dict[str, Any] | None = None) -> list[Any]:
    cur = await conn.execute(sql, params)
    return list(await cur.fetchall())


async def violations(conn: Conn) -> list[tuple[str, str]]:
    """Every (check, detail) the triggers recorded, in order."""
    return await _rows(conn, "SELECT check_name, detail FROM wq_audit_violations ORDER BY id")


async def rows_written_after_close(conn: Conn) -> list[tuple[Any, ...]]:
    """Terminal sheet rows written by an attempt after it was closed.

    Two clocks: the row's ``finished_at`` against the attempt's ``finished_at`` (the
    database's and the model's time; the model's runs ahead of the database's), and the
    audit order of the terminal write against the audit order of the close.
    """
    return await _rows(
        conn,
        """
        SELECT 'finished_at', s.org, s.sheet, s.row_key, s.run_id, s.attempt,
               s.finished_at::text, a.outcome::text, a.finished_at::text
          FROM wq_sheet_rows s
          JOIN wq_attempts a ON a.run_id = s.run_id AND a.attempt = s.attempt
         WHERE s.status <> 'pending' AND a.outcome <> 'running'
           AND s.finished_at > a.finished_at
        UNION ALL
        SELECT 'audit order', t.org, t.sheet, t.row_key, t.run_id, t.attempt,
               t.seq::text, c.outcome, c.seq::text
          FROM wq_audit_terminal t
          JOIN wq_audit_closes c ON c.run_id = t.run_id AND c.attempt = t.attempt
         WHERE t.seq > c.seq
        """,
    )


async def rows_written_twice(conn: Conn) -> list[tuple[Any, ...]]:
    """Rows with more than one terminal write (pending->terminal or terminal->anything)."""
    return await _rows(
        conn,
        """
        SELECT org, sheet, row_key, count(*), array_agg(change ORDER BY seq)
          FROM wq_audit_terminal
         GROUP BY org, sheet, row_key
        HAVING count(*) > 1
        """,
    )
