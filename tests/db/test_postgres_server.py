"""The supported Postgres range against the real server: the suite's server is in it (read
once per process), and `worker start` refuses a server below it before it prepares a lane
or registers (the range raised above this server stands in for an older server)."""

from __future__ import annotations

import psycopg
import pytest

from queues import server
from queues.errors import PostgresUnsupported
from tests.workers import connect, fetch
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
