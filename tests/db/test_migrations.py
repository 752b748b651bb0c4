"""The migration gate and the schema contract, against real Postgres.

Empty databases are created with ``CREATE DATABASE`` on the session's server (not cloned
from the migrated template), so ``migrate`` runs procrastinate's schema and ours from zero.
How procrastinate's own chain moves forward is tested in ``test_procrastinate_chain.py``.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queues import migrations
from queues.errors import SchemaContractMismatch

Conn = psycopg.AsyncConnection[Any]
WORKER = Path(sys.executable).parent / "worker"
PROCRASTINATE = migrations.installed_procrastinate()
ALL_NAMES = [m.name for m in migrations.code_migrations()]
# The last step this code needs (its trailing contract steps it does not: section 4b).
LAST_NEEDED = [m.name for m in migrations.code_migrations() if m.kind != migrations.CONTRACT][-1]
# What `migrate` applies to an empty database: procrastinate's schema.sql, then ours.
ALL_STEPS = [f"procrastinate/schema.sql@{PROCRASTINATE.version}", *ALL_NAMES]


async def connect(url: str) -> Conn:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def tracking_rows(url: str) -> list[tuple[str, str]]:
    async with await connect(url) as conn:
        cur = await conn.execute("SELECT name, checksum FROM wq_migrations ORDER BY name")
        return [(str(n), str(c)) for n, c in await cur.fetchall()]


async def procrastinate_rows(url: str) -> list[tuple[str, str, str | None]]:
    async with await connect(url) as conn:
        cur = await conn.execute(
            "SELECT name, applied_as, package FROM wq_procrastinate_migrations ORDER BY name"
        )
        return [(str(n), str(a), p) for n, a, p in await cur.fetchall()]


async def contract_row(url: str) -> tuple[int, str, Any]:
    async with await connect(url) as conn:
        cur = await conn.execute("SELECT version, checksum, updated_at FROM wq_schema_contract")
        rows = await cur.fetchall()
    assert len(rows) == 1, rows
    version, checksum, updated_at = rows[0]
    return int(version), str(checksum), updated_at


def cli_env(url: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "WORKER_DATABASE_URL", "WORKER_HOME"}
    }
    env["WORKER_DATABASE_URL"] = url
    return env


def worker(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(WORKER), *args],
        env=cli_env(url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def applied_count(stdout: str) -> int:
    match = re.search(r"applied (\d+) migration\(s\)", stdout)
    assert match, stdout
    return int(match.group(1))


# ---- 1. idempotency ---------------------------------------------------------------------


async def test_migrate_empty_database_then_again_applies_nothing(empty_db: Any) -> None:
    url = await empty_db()
    async with await connect(url) as conn:
        first = await migrations.migrate(conn)
    assert first.applied == ALL_STEPS
    assert first.contract == migrations.code_contract()
    assert first.procrastinate_version == PROCRASTINATE.version

    version, checksum, stamped = await contract_row(url)
    async with await connect(url) as conn:
        second = await migrations.migrate(conn)
        cur = await conn.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")
        assert (await cur.fetchone()) == (True,)
    assert second.applied == []
    assert second.contract == migrations.code_contract()

    code = migrations.code_migrations()
    assert await tracking_rows(url) == sorted((m.name, m.checksum) for m in code)
    # procrastinate's schema is recorded by version (its latest migration), never checksummed.
    assert await procrastinate_rows(url) == [
        (PROCRASTINATE.version, "schema", PROCRASTINATE.package)
    ]
    assert (version, checksum) == (
        migrations.code_contract().version,
        migrations.code_contract().checksum,
    )
    # A no-op migrate leaves the contract row alone (no rewrite, no new timestamp).
    assert await contract_row(url) == (version, checksum, stamped)


# ---- 2. concurrent migrators --------------------------------------------------------------


async def test_four_concurrent_migrators_apply_each_file_once(empty_db: Any) -> None:
    url = await empty_db()
    conns = [await connect(url) for _ in range(4)]
    try:
        reports = await asyncio.gather(*(migrations.migrate(c) for c in conns))
    finally:
        for c in conns:
            await c.close()
    # The advisory lock serialises them: one applies everything, the others find it done.
    assert sorted(len(r.applied) for r in reports) == [0, 0, 0, len(ALL_STEPS)]
    assert sorted(name for r in reports for name in r.applied) == sorted(ALL_STEPS)
    assert all(r.contract == migrations.code_contract() for r in reports)
    assert [n for n, _ in await tracking_rows(url)] == sorted(ALL_NAMES)


async def test_four_concurrent_migrate_subprocesses(empty_db: Any) -> None:
    url = await empty_db()
    procs = [
        subprocess.Popen(
            [str(WORKER), "migrate"],
            env=cli_env(url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
        assert "error[" not in err and "Traceback" not in err, err
    assert sorted(applied_count(out) for out, _ in outputs) == [0, 0, 0, len(ALL_STEPS)]
    assert [n for n, _ in await tracking_rows(url)] == sorted(ALL_NAMES)
    version, checksum, _ = await contract_row(url)
    assert migrations.Contract(version, checksum) == migrations.code_contract()


# ---- 3. migrate --check --------------------------------------------------------------------


async def test_check_on_empty_database_lists_everything_and_writes_nothing(
    empty_db: Any,
) -> None:
    url = await empty_db()
    res = worker("migrate", "--check", url=url)
    assert res.returncode == 1, res
    assert f"pending migrations ({len(ALL_STEPS)}):" in res.stdout
    listed = [
        line.split(" [")[0].strip() for line in res.stdout.splitlines() if line.startswith("  ")
    ]
    assert listed == ALL_STEPS
    async with await connect(url) as conn:  # --check is read-only: no tracking table made
        cur = await conn.execute(
            "SELECT to_regclass('wq_migrations'), to_regclass('wq_procrastinate_migrations')"
        )
        assert (await cur.fetchone()) == (None, None)


async def test_check_on_database_missing_last_row_lists_it(db_url: str) -> None:
    last = ALL_NAMES[-1]
    async with await connect(db_url) as conn:
        await conn.execute("DELETE FROM wq_migrations WHERE name = %(n)s", {"n": last})
    res = worker("migrate", "--check", url=db_url)
    assert res.returncode == 1, res
    listed = [
        line.split(" [")[0].strip() for line in res.stdout.splitlines() if line.startswith("  ")
    ]
    assert listed == [last]
    assert "pending migrations (1):" in res.stdout


async def test_check_on_current_database_exits_zero(db_url: str) -> None:
    res = worker("migrate", "--check", url=db_url)
    assert res.returncode == 0, res
    contract = migrations.code_contract()
    assert f"schema is current: version {contract.version}" in res.stdout
    assert f"procrastinate schema {PROCRASTINATE.version}" in res.stdout
    assert "pending" not in res.stdout


# ---- 4. contract verification --------------------------------------------------------------


async def test_verify_never_migrated_database(empty_db: Any) -> None:
    url = await empty_db()
    expected = migrations.code_contract()
    async with await connect(url) as conn:
        with pytest.raises(SchemaContractMismatch) as info:
            await migrations.verify_contract(conn)
    message = str(info.value)
    assert f"expects version {expected.version}" in message
    assert "never migrated" in message
    assert "worker migrate" in message
    assert info.value.code == "SCHEMA_CONTRACT_MISMATCH"


async def test_verify_a_database_behind_names_both_and_failure_is_not_cached(db_url: str) -> None:
    expected = migrations.code_contract()
    last = LAST_NEEDED
    async with await connect(db_url) as conn:
        cur = await conn.execute(
            "DELETE FROM wq_migrations WHERE name = %(n)s RETURNING checksum", {"n": last}
        )
        row = await cur.fetchone()
        assert row is not None
        await conn.execute("UPDATE wq_schema_contract SET version = 9999, checksum = 'feedface'")
        with pytest.raises(SchemaContractMismatch) as info:
            await migrations.verify_contract(conn)
        message = str(info.value)
        assert f"version {expected.version}" in message
        assert "version 9999" in message and "feedface" in message
        assert f"it lacks {last}" in message
        assert "worker migrate" in message

        # Fixed in the same process: the failure was not cached, verification now passes
        # (the history decides; the record is a summary of it).
        await conn.execute(
            "INSERT INTO wq_migrations (name, checksum) VALUES (%(n)s, %(c)s)",
            {"n": last, "c": row[0]},
        )
        await migrations.verify_contract(conn)


async def test_a_verified_schema_is_remembered_by_its_owner_until_forgotten(db_url: str) -> None:
    verified = migrations.VerifiedSchema()
    async with await connect(db_url) as conn:
        await verified.verify(conn)
        await conn.execute("DELETE FROM wq_migrations WHERE name = %(n)s", {"n": LAST_NEEDED})
        await conn.execute("UPDATE wq_schema_contract SET version = 1, checksum = 'broken'")
        await verified.verify(conn)  # remembered: no query
        # Another owner (another database, another schema) verifies for real.
        with pytest.raises(SchemaContractMismatch):
            await migrations.VerifiedSchema(schema="other").verify(conn)
        with pytest.raises(SchemaContractMismatch):
            await migrations.verify_contract(conn)
        verified.forget()
        with pytest.raises(SchemaContractMismatch):
            await verified.verify(conn)


async def _lock_is_free(url: str) -> bool:
    async with await connect(url) as other:
        cur = await other.execute(
            "SELECT pg_try_advisory_lock(%(k)s)", {"k": migrations.MIGRATION_LOCK_KEY}
        )
        row = await cur.fetchone()
        assert row is not None
        if row[0]:
            await other.execute(
                "SELECT pg_advisory_unlock(%(k)s)", {"k": migrations.MIGRATION_LOCK_KEY}
            )
        return bool(row[0])


async def test_edited_migration_is_refused_by_pending_and_migrate(db_url: str) -> None:
    edited = ALL_NAMES[0]
    async with await connect(db_url) as conn:
        await conn.execute(
            "UPDATE wq_migrations SET checksum = 'x' WHERE name = %(n)s", {"n": edited}
        )
        with pytest.raises(SchemaContractMismatch) as info:
            await migrations.pending(conn)
        assert edited in str(info.value) and "edited" in str(info.value)
        with pytest.raises(SchemaContractMismatch) as info:
            await migrations.migrate(conn)
        assert edited in str(info.value) and "edited" in str(info.value)
    # The refusal released the global migration lock.
    assert await _lock_is_free(db_url)
    res = worker("migrate", "--check", url=db_url)
    assert res.returncode == 1
    assert "error[SCHEMA_CONTRACT_MISMATCH]" in res.stderr and edited in res.stderr


async def test_unknown_applied_migration_among_the_codes_own_is_refused(db_url: str) -> None:
    async with await connect(db_url) as conn:
        await conn.execute(
            "INSERT INTO wq_migrations (name, checksum) VALUES ('0001_from_elsewhere', 'abc')"
        )
        with pytest.raises(SchemaContractMismatch, match="0001_from_elsewhere"):
            await migrations.pending(conn)
        with pytest.raises(SchemaContractMismatch, match="does not know"):
            await migrations.migrate(conn)
    assert await _lock_is_free(db_url)
