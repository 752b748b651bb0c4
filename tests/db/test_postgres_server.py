"""The supported Postgres range against the real server: the suite's server is in it (read
once per process), and `worker start` refuses a server below it before it prepares a lane
or registers (the range raised above this server stands in for an older server); it warns
when the database acknowledges commits before they are durable (``synchronous_commit``
off)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from structlog.testing import capture_logs

from queues import server
from queues.errors import PostgresUnsupported
from tests.workers import connect, fetch, running_worker
from worker.plays import Registry
from worker.runtime import Settings, Worker


async def test_the_suites_server_is_in_the_range_and_read_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "_checked", {})
    async with await psycopg.AsyncConnection.connect(db_url) as conn:
        major = await server.require_supported(conn)
        assert major == conn.info.server_version // 10000
        assert server.OLDEST_MAJOR <= major <= server.NEWEST_MAJOR
        assert list(server._checked.values()) == [conn.info.server_version]
        # Read once: a second check asks nothing of the connection, whose transaction
        # now refuses every statement.
        with pytest.raises(psycopg.errors.DivisionByZero):
            await conn.execute("SELECT 1 / 0")
        assert await server.require_supported(conn) == major
        await conn.rollback()


async def test_worker_start_refuses_a_server_below_the_range(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with connect(db_url) as conn:
        major = conn.info.server_version // 10000
    monkeypatch.setattr(server, "_checked", {})
    monkeypatch.setattr(server, "OLDEST_MAJOR", major + 1)
    worker = Worker(
        Settings(
            url=db_url,
            release="old-server",
            registry=Registry(),
            concurrency=1,
            install_signals=False,
        )
    )
    with pytest.raises(PostgresUnsupported) as caught:
        await worker.run()
    assert caught.value.code == "POSTGRES_UNSUPPORTED"
    assert f"runs on Postgres {major + 1} to" in caught.value.message
    assert server._checked == {}  # a refusal is never cached
    assert await fetch(db_url, "SELECT count(*) FROM wq_workers") == [(0,)]
    assert await fetch(db_url, "SELECT count(*) FROM wq_lanes WHERE release = 'old-server'") == [
        (0,)
    ]


async def test_synchronous_commit_is_read_as_the_connection_commits(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    assert await server.synchronous_commit(conn) == "on"  # the suite's server: the default
    await conn.execute("SET LOCAL synchronous_commit = off")
    assert await server.synchronous_commit(conn) == "off"
    assert "off" in server.UNDURABLE_COMMITS and "on" not in server.UNDURABLE_COMMITS


@pytest.mark.parametrize("setting", ["off", "on"])
async def test_worker_start_warns_when_commits_are_acknowledged_before_they_are_durable(
    db_url: str, setting: str
) -> None:
    # A database whose commits are not durable (set for the database: the worker's own
    # connections see it, as they would see the server's).
    dbname = conninfo_to_dict(db_url)["dbname"]
    async with connect(db_url) as admin:
        await admin.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = {}").format(
                sql.Identifier(str(dbname)), sql.Literal(setting)
            )
        )
    with capture_logs() as logs:
        async with running_worker(db_url, Registry(), release="commits", concurrency=1):
            pass
    warned = [e for e in logs if e["event"] == "synchronous_commit_off"]
    if setting == "on":
        assert warned == []
        return
    assert len(warned) == 1, logs
    assert warned[0]["log_level"] == "warning"
    assert warned[0]["code"] == "SYNCHRONOUS_COMMIT_OFF"
    assert warned[0]["synchronous_commit"] == "off"
    assert "high-availability" in warned[0]["detail"]
