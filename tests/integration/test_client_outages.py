"""The long-lived clients ride out a lost connection (worker.outage): ``worker result
--wait``, ``worker observe`` and ``worker events --follow`` whose connection is terminated
(as a restart or a failover terminates it) reconnect, go on from where they were (no
event printed twice, none missed) and report the run's end; a database that stays away
past their ``--max-outage`` ends them with ``DATABASE_LOST`` (exit 6). So does the
recovery loop (``worker recover --every``), whose pass runs again as soon as the database
answers. The failover itself is tests/e2e/test_failover.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from structlog.testing import capture_logs

from queues import operator
from queues.errors import DatabaseLost, ExitCode
from tests.workers import connect, eventually, fetch, submit
from worker import observe
from worker import recovery as worker_recovery
from worker.cli.ledger import print_events

Follow = Callable[[str, uuid.UUID, list[str], float], Coroutine[Any, Any, Any]]


async def _result(url: str, run_id: uuid.UUID, lines: list[str], max_outage_s: float) -> Any:
    return await observe.wait_terminal(url, run_id, max_outage_s=max_outage_s)


async def _observe(url: str, run_id: uuid.UUID, lines: list[str], max_outage_s: float) -> Any:
    return await observe.follow(url, run_id, lines.append, as_json=True, max_outage_s=max_outage_s)


async def _events(url: str, run_id: uuid.UUID, lines: list[str], max_outage_s: float) -> Any:
    return await print_events(
        url, run_id, follow=True, as_json=True, echo=lines.append, max_outage_s=max_outage_s
    )


CLIENTS: dict[str, tuple[str, Follow]] = {
    "result": ("wq-result", _result),
    "observe": ("wq-observe", _observe),
    "events": ("wq-events", _events),
}


async def _backend(url: str, application: str) -> int | None:
    rows = await fetch(
        url, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (application,)
    )
    return int(rows[0][0]) if rows else None


@contextlib.asynccontextmanager
async def following(
    url: str, client: str, run_id: uuid.UUID, max_outage_s: float
) -> AsyncIterator[tuple[asyncio.Task[Any], list[str], int]]:
    """The client following ``run_id`` in a task, once its session is up (its pid)."""
    application, follow = CLIENTS[client]
    lines: list[str] = []
    task = asyncio.create_task(follow(url, run_id, lines, max_outage_s))
    try:
        pid = await eventually(lambda: _backend(url, application), timeout=15)
        yield task, lines, pid
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_a_client_goes_on_after_its_connection_is_terminated(
    db_url: str, client: str
) -> None:
    run_id = await submit(db_url, "echo", {}, release="outage")
    async with following(db_url, client, run_id, 30.0) as (task, lines, pid):
        async with connect(db_url) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

        async def reconnected() -> bool:
            found = await _backend(db_url, CLIENTS[client][0])
            return found is not None and found != pid

        await eventually(reconnected, timeout=15)
        assert not task.done()
        async with connect(db_url) as conn:
            await operator.cancel(conn, run_id, actor="test", force=True)
        outcome = await asyncio.wait_for(task, 30)
    if client == "result":
        assert outcome.id == run_id and outcome.state == "cancelled"
        return
    assert outcome == (ExitCode.CANCELLED if client == "observe" else 0)
    # Every event once, in order: the reconnect went on after the last one printed.
    printed = [json.loads(line) for line in lines]
    seqs = [p.get("event", p)["seq"] for p in printed if "seq" in p.get("event", p)]
    assert seqs == sorted(set(seqs)) and seqs[0] == 1, lines
    ((last,),) = await fetch(db_url, "SELECT max(seq) FROM wq_ledger WHERE run_id = %s", (run_id,))
    assert seqs[-1] == last


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_a_client_ends_with_database_lost_past_its_max_outage(
    db_url: str, pg_admin_url: str, client: str
) -> None:
    run_id = await submit(db_url, "echo", {}, release="outage")
    dbname = sql.Identifier(str(conninfo_to_dict(db_url)["dbname"]))
    async with following(db_url, client, run_id, 1.0) as (task, _, pid):
        try:
            # Nothing can connect to the database any more, and the session is cut.
            async with connect(pg_admin_url) as admin:
                await admin.execute(
                    sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(dbname)
                )
                await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            with pytest.raises(DatabaseLost) as lost:
                await asyncio.wait_for(task, 30)
        finally:
            async with connect(pg_admin_url) as admin:
                await admin.execute(
                    sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(dbname)
                )
    assert lost.value.code == "DATABASE_LOST"
    assert lost.value.exit_code == ExitCode.DATABASE_UNREACHABLE
    assert "past the outage limit of 1s" in lost.value.message


async def test_the_recovery_loop_rides_out_an_outage_and_ends_past_its_max_outage(
    db_url: str, pg_admin_url: str
) -> None:
    dbname = sql.Identifier(str(conninfo_to_dict(db_url)["dbname"]))
    stop = asyncio.Event()
    passes: list[Any] = []
    with capture_logs() as logs:
        recovering = asyncio.create_task(
            worker_recovery.recover_forever(
                db_url, 0.1, stop, on_pass=passes.append, max_outage_s=2
            )
        )
        try:
            await eventually(lambda: _passes(passes, 1), timeout=15)
            async with connect(pg_admin_url) as admin:
                await admin.execute(
                    sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(dbname)
                )
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (str(conninfo_to_dict(db_url)["dbname"]),),
                )
                done_before = len(passes)
                # A short outage: the passes go on as soon as the database answers again.
                await asyncio.sleep(0.5)
                await admin.execute(
                    sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(dbname)
                )
            await eventually(lambda: _passes(passes, done_before + 2), timeout=15)
            assert not recovering.done()
            # A long one ends it.
            async with connect(pg_admin_url) as admin:
                await admin.execute(
                    sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(dbname)
                )
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (str(conninfo_to_dict(db_url)["dbname"]),),
                )
            with pytest.raises(DatabaseLost):
                await asyncio.wait_for(recovering, 30)
        finally:
            stop.set()
            async with connect(pg_admin_url) as admin:
                await admin.execute(
                    sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(dbname)
                )
            with contextlib.suppress(BaseException):
                await recovering
    outage = [e for e in logs if e.get("loop") == "recovery"]
    assert {"database_unavailable", "database_reconnected"} <= {e["event"] for e in outage}


async def _passes(passes: list[Any], at_least: int) -> bool:
    return len(passes) >= at_least
