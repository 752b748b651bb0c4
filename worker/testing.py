"""Test a play the way a worker runs it: admitted, claimed and executed by the real
executor, its final write made by the real fenced statement, against a real database, in a
transaction that is rolled back when the test's call returns.

::

    async with await psycopg.AsyncConnection.connect(url) as conn:
        played = await run_play(conn, registry, "enrich", {"rows": 3})
    assert played.state == "succeeded" and played.result == {"enriched": 3}
    assert [s.step_key for s in played.steps] == ["fetch:0", "fetch:1", "fetch:2"]

Everything the play writes (its steps' receipts, its sheet rows, its events, the run
itself) goes through the same actions and statements as in a worker, on ``conn``, inside a
transaction (a savepoint when ``conn`` is already in one) that is rolled back before
:func:`run_play` returns: nothing is kept, so tests can share one database. What it saw is
in the returned :class:`Played`.

``attempts`` runs that many attempts while the run is due again (a retry), claiming each at
the time its retry is due, so a test can check what a second attempt replays from the
first one's receipts instead of paying for again. A run that sleeps, waits for an event or
spawns children is reported as it stands (``sleeping``; its children queued); neither time
nor children are run. A sandboxed play runs in this process here (no sandbox): it is the
play's logic under test, not the sandbox. ``conn`` needs the worker role's rights (the
database's owner in a test) and a migrated database (``worker migrate``).
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from queues import admission, dashboard, lanes, runs
from queues.outcomes import FinishStatus
from worker import attempt
from worker.completer import InlineCompleter
from worker.context import RunContext, RunInfo
from worker.contract import ConnectionTransport, in_process_claims
from worker.plays import Registry

Conn = psycopg.AsyncConnection[Any]
WORKER_ID = "worker-testing"
RELEASE = "test"


@dataclass(frozen=True, slots=True)
class Played:
    """What a run looked like after its attempts: its row, attempts, ledger, steps and
    sheets, read in the transaction before it was rolled back."""

    run: runs.Run
    attempts: list[runs.Attempt]
    events: list[runs.Event]  # the run's whole ledger, in seq order
    steps: list[dashboard.Step]  # the receipts of the run's own steps
    sheets: list[dashboard.SheetProgress]  # per sheet: rows admitted, committed, ...
    final_writes: list[FinishStatus]  # each attempt's final write, as the statement answered

    @property
    def run_id(self) -> uuid.UUID:
        return self.run.id

    @property
    def state(self) -> str:
        return self.run.state

    @property
    def result(self) -> Any:
        return self.run.result

    @property
    def error(self) -> Any:
        return self.run.error

    @property
    def kinds(self) -> list[str]:
        """The ledger's kinds, in order (``run_created``, ``attempt_started``, ...)."""
        return [e.kind for e in self.events]


async def run_play(
    conn: Conn,
    registry: Registry,
    play: str,
    params: Mapping[str, Any] | None = None,
    *,
    org: str = "test",
    release: str = RELEASE,
    inputs: Sequence[tuple[str, Any]] | None = None,
    attempts: int = 1,
    idempotency_key: str | None = None,
) -> Played:
    """Admit a run of ``play`` (from ``registry``) with ``params`` and ``inputs`` (rows for
    its sheet), run up to ``attempts`` attempts of it with the worker's executor, and return
    what it looked like, all in a transaction that is rolled back. Bad input is refused as
    by ``submit`` (an unknown play with ``PLAY_UNKNOWN``), before anything is written."""
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: at least 1")
    sub = admission.Submission(
        play=play,
        params=dict(params or {}),
        release=release,
        org=org,
        idempotency_key=idempotency_key,
    )
    admission.validate(sub, frozenset(registry.names()))
    async with conn.transaction(force_rollback=True):
        await lanes.prepare(conn, release)
        admitted = await admission.submit(conn, sub, inputs=inputs)
        writes: list[FinishStatus] = []
        due: datetime | None = None  # the claim's time: the database's now, then a retry's
        for _ in range(attempts):
            status = await _attempt(conn, registry, admitted.run_id, release, due)
            if status is not None:
                writes.append(status)
            run = await runs.get(conn, admitted.run_id)
            if run.state != "queued":
                break
            due = run.available_at
        detail = await dashboard.run_detail(conn, admitted.run_id)
        return Played(
            run=await runs.get(conn, admitted.run_id),
            attempts=await runs.attempts(conn, admitted.run_id),
            events=await runs.events(conn, admitted.run_id),
            steps=detail.steps,
            sheets=detail.sheets,
            final_writes=writes,
        )


async def _attempt(
    conn: Conn, registry: Registry, run_id: uuid.UUID, release: str, due: datetime | None
) -> FinishStatus | None:
    """Claim the run (it must be the lane's next due run) and execute one attempt of it."""
    got = await runs.claim(
        conn,
        lanes=[lanes.lane_name(release)],
        worker_id=WORKER_ID,
        limit=1,
        plays=sorted(registry.names()),
        now=due,
    )
    claimed = [c for c in got if c.claimed]
    if not claimed:
        return None  # dropped by the claim (its play or its deadline): the run says why
    c = claimed[0]
    if c.run_id != run_id:
        raise RuntimeError(
            f"the claim took run {c.run_id} of lane {c.lane}, not the run under test: pass "
            "run_play a release of its own (release=...) whose lane holds no other run"
        )
    info = RunInfo.of_claim(c, WORKER_ID)
    transport = ConnectionTransport(conn, functools.partial(in_process_claims, c, WORKER_ID))
    ctx = RunContext(info, dict(c.params or {}), transport)
    found = registry.get(info.play)
    ended = await attempt.run(c, ctx, found, stop_reason=lambda: None)

    @contextlib.asynccontextmanager
    async def connection() -> AsyncIterator[Conn]:
        yield conn

    completer = InlineCompleter(conn, WORKER_ID)
    _, status = await attempt.settle(
        c, ctx, found, ended, write=completer.write, connection=connection
    )
    return status
