"""procrastinate's schema moves forward through procrastinate's own migrations.

- A database an older release left at procrastinate 3.0's schema (``tests/fixtures/``, the
  oldest 3.x schema version: 3.0.0 and 3.0.2 share it) is brought forward by ``worker
  migrate``, ends with exactly the schema of a fresh database, and serves runs.
- A changed installed procrastinate file stops nothing: the contract is computed from
  procrastinate's schema version, never from its file bytes.
- A database whose procrastinate schema is newer than the installed procrastinate is
  refused with ``PROCRASTINATE_TOO_OLD`` and its fix, by every entry point.
- A database of the releases that recorded procrastinate's schema as a checksummed
  ``0000_procrastinate_schema`` is recorded at its version once, and keeps that row.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import procrastinate
import psycopg
import pytest

from queues import migrations
from queues.errors import ProcrastinateTooOld, SchemaContractMismatch
from tests.apps.plays import registry
from tests.workers import eventually, fetch, run_state, running_worker, submit

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")
FIXTURE = ROOT / "tests" / "fixtures" / "procrastinate-3.0.2-schema.sql"
OLD_VERSION = "03.00.00_50_post_cancel_notification"
# A newer procrastinate's contract step (post): outside the window of this code.
FUTURE_VERSION = "99.00.00_50_post_from_a_newer_procrastinate"
# A newer procrastinate's pre step: additive by procrastinate's rule, inside the window.
FUTURE_PRE = "99.00.00_01_pre_from_a_newer_procrastinate"
INSTALLED = migrations.installed_procrastinate()


def load_dump_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "dump_schema", ROOT / "scripts" / "dump_schema.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def old_release_chain() -> migrations.ProcrastinateChain:
    """procrastinate 3.0.2 as an older release of ours had it installed."""
    old_key = migrations.procrastinate_key(OLD_VERSION)
    return dataclasses.replace(
        INSTALLED,
        package="3.0.2",
        migrations=tuple(m for m in INSTALLED.migrations if m.key <= old_key),
        schema_sql=lambda: FIXTURE.read_text(encoding="utf-8"),
    )


def cli(
    *args: str, url: str, pythonpath: str = str(ROOT), timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "WORKER_HOME"}}
    env.update(WORKER_DATABASE_URL=url, PYTHONPATH=pythonpath)
    return subprocess.run(
        [WORKER, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def listed(stdout: str) -> list[str]:
    return [line.split(" [")[0].strip() for line in stdout.splitlines() if line.startswith("  ")]


async def procrastinate_rows(url: str) -> list[tuple[str, str]]:
    rows = await fetch(
        url, "SELECT name, applied_as FROM wq_procrastinate_migrations ORDER BY name"
    )
    return [(str(n), str(a)) for n, a in rows]


async def connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


def test_installed_chain_is_ordered_by_version_then_serial() -> None:
    names = [m.name for m in INSTALLED.migrations]
    keys = [m.key for m in INSTALLED.migrations]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert names.index("03.01.00_01_pre_add_heartbeat") + 1 == names.index(
        "03.01.00_50_post_add_heartbeat"
    )
    assert INSTALLED.version == names[-1]
    assert INSTALLED.package == procrastinate.__version__
    # future_migrations/ holds files procrastinate has not released into its chain.
    future = Path(procrastinate.__file__).parent / "sql" / "future_migrations"
    unreleased = {p.stem for p in future.glob("*.sql")}
    assert unreleased, "procrastinate ships future_migrations/: this test checks they stay out"
    assert not unreleased & set(names)


async def test_database_at_procrastinate_3_0_is_brought_forward_and_runs(
    empty_db: Any, template_url: str
) -> None:
    url = await empty_db()
    old = old_release_chain()
    async with await connect(url) as conn:  # what a release on procrastinate 3.0.2 did
        report = await migrations.migrate(conn, procrastinate=old)
    assert report.applied[0] == f"procrastinate/schema.sql@{OLD_VERSION}"
    assert await procrastinate_rows(url) == [(OLD_VERSION, "schema")]
    # 3.0's schema has no procrastinate_workers table (3.1's heartbeat), which our worker uses.
    assert await fetch(url, "SELECT to_regclass('procrastinate_workers')") == [(None,)]
    deltas = [
        m.name for m in INSTALLED.migrations if m.key > migrations.procrastinate_key(OLD_VERSION)
    ]
    assert len(deltas) >= 2 and any("_pre_" in d for d in deltas)

    async with await connect(url) as conn:  # this release refuses it until migrated
        with pytest.raises(SchemaContractMismatch) as info:
            await migrations.verify_contract(conn)
    assert f"the code's {INSTALLED.version}, the database's {OLD_VERSION}" in str(info.value)

    check = cli("migrate", "--check", url=url)
    assert check.returncode == 1, check.stdout + check.stderr
    assert listed(check.stdout) == [f"procrastinate/{d}" for d in deltas]

    applied = cli("migrate", url=url)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert f"applied {len(deltas)} migration(s)" in applied.stdout
    assert listed(applied.stdout) == [f"procrastinate/{d}" for d in deltas]
    assert await procrastinate_rows(url) == sorted(
        [(OLD_VERSION, "schema"), *((d, "migration") for d in deltas)]
    )
    assert cli("migrate", "--check", url=url).returncode == 0

    async with await connect(url) as conn:
        await migrations.verify_contract(conn)
        assert await migrations.read_procrastinate_version(conn) == INSTALLED.version
    # Exactly the schema of a database migrated from empty by this release.
    dump = load_dump_script().dump
    assert dump(url) == dump(template_url)

    async with running_worker(url, registry):
        run_id = await submit(url, "echo", {"on": "3.0 brought forward"})

        async def succeeded() -> bool:
            return await run_state(url, run_id) == "succeeded"

        await eventually(succeeded, timeout=30)


def procrastinate_copy_with_edits(into: Path) -> Path:
    """A copy of the installed procrastinate whose files a local edit changed."""
    site = into / "site"
    package = site / "procrastinate"
    shutil.copytree(Path(procrastinate.__file__).parent, package)
    schema = package / "sql" / "schema.sql"
    schema.write_text(schema.read_text() + "\n-- a comment line added on this host\n")
    last = package / "sql" / "migrations" / f"{INSTALLED.version}.sql"
    last.write_text("-- reformatted by a packager\n" + last.read_text())
    return site


async def test_changed_installed_procrastinate_files_stop_nothing(
    db_url: str, empty_db: Any, tmp_path: Path
) -> None:
    site = procrastinate_copy_with_edits(tmp_path)
    pythonpath = f"{site}{os.pathsep}{ROOT}"
    probe = subprocess.run(
        [sys.executable, "-c", "import procrastinate; print(procrastinate.__file__)"],
        env=dict(os.environ, PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip().startswith(str(site)), probe.stdout  # the edited copy is used

    check = cli("migrate", "--check", url=db_url, pythonpath=pythonpath)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "schema is current" in check.stdout
    again = cli("migrate", url=db_url, pythonpath=pythonpath)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "applied 0 migration(s)" in again.stdout

    ready = tmp_path / "ready"
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "WORKER_HOME"}}
    env.update(WORKER_DATABASE_URL=db_url, PYTHONPATH=pythonpath)
    log = tmp_path / "worker.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [WORKER, "start", "--release", "t", "--ready-file", str(ready)],
            env=env,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:

        async def is_ready() -> bool:
            assert proc.poll() is None, log.read_text()
            return ready.exists()

        await eventually(is_ready, timeout=30)
        submitted = cli(
            "submit", "noop", "--release", "t", "--wait", url=db_url, pythonpath=pythonpath
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        assert "succeeded" in submitted.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()

    # A database migrated where the installed files differ is accepted where they do not:
    # the contract never saw the bytes, only the version.
    fresh = await empty_db()
    made = cli("migrate", url=fresh, pythonpath=pythonpath)
    assert made.returncode == 0, made.stdout + made.stderr
    assert f"procrastinate/schema.sql@{INSTALLED.version}" in listed(made.stdout)
    async with await connect(fresh) as conn:
        await migrations.verify_contract(conn)


async def test_newer_procrastinate_schema_is_refused_everywhere(db_url: str) -> None:
    # What a release on a newer procrastinate would have left: its migration and contract.
    newer = migrations.contract_of(
        [(m.name, m.checksum) for m in migrations.code_migrations()], FUTURE_VERSION
    )
    async with await connect(db_url) as conn:
        await conn.execute(
            "INSERT INTO wq_procrastinate_migrations (name, applied_as, package)"
            " VALUES (%(n)s, 'migration', '99.0.0')",
            {"n": FUTURE_VERSION},
        )
        await conn.execute(
            "UPDATE wq_schema_contract SET version = %(v)s, checksum = %(c)s",
            {"v": newer.version, "c": newer.checksum},
        )
        for refused in (
            lambda: migrations.pending(conn),
            lambda: migrations.migrate(conn),
            lambda: migrations.verify_contract(conn),
        ):
            with pytest.raises(ProcrastinateTooOld) as info:
                await refused()
            assert info.value.code == "PROCRASTINATE_TOO_OLD"
            assert FUTURE_VERSION in info.value.message and INSTALLED.version in info.value.message
            assert info.value.fix and "procrastinate" in info.value.fix
    assert await fetch(db_url, "SELECT version, checksum FROM wq_schema_contract") == [
        (newer.version, newer.checksum)
    ]

    for args in (["migrate"], ["migrate", "--check"], ["start", "--wait-for-schema", "60s"]):
        started = time.monotonic()
        res = cli(*args, url=db_url)
        detail = f"{args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        assert res.returncode == 1, detail
        assert "error[PROCRASTINATE_TOO_OLD]" in res.stderr, detail
        assert "Fix: install the procrastinate" in res.stderr, detail
        assert "Traceback" not in res.stderr, detail
        # Waiting cannot help a database that is ahead: refused at once, not after 60 s.
        assert time.monotonic() - started < 30, detail


async def test_a_newer_procrastinate_pre_step_is_inside_the_window(db_url: str) -> None:
    # A newer release upgraded procrastinate and applied only its pre step: this code, on
    # the older procrastinate, still runs here, and its migrate has nothing to apply.
    async with await connect(db_url) as conn:
        await conn.execute(
            "INSERT INTO wq_procrastinate_migrations (name, applied_as, package)"
            " VALUES (%(n)s, 'migration', '99.0.0')",
            {"n": FUTURE_PRE},
        )
        await conn.execute("UPDATE wq_schema_contract SET checksum = 'a-newer-release'")
        await migrations.verify_contract(conn)
        assert await migrations.pending(conn) == []
        report = await migrations.migrate(conn)
        assert report.applied == []
    # The newer release's record stays as it wrote it.
    assert await fetch(db_url, "SELECT checksum FROM wq_schema_contract") == [("a-newer-release",)]
    # Its post step leaves this code behind (the refusal itself: the test below).
    async with await connect(db_url) as conn:
        await conn.execute(
            "INSERT INTO wq_procrastinate_migrations (name, applied_as, package)"
            " VALUES (%(n)s, 'migration', '99.0.0')",
            {"n": FUTURE_VERSION},
        )
        with pytest.raises(ProcrastinateTooOld):
            await migrations.verify_contract(conn)


async def test_a_database_lacking_only_procrastinates_trailing_post_step_runs_this_code(
    db_url: str,
) -> None:
    # A release phase deferred the installed procrastinate's post step (a contract step):
    # this code runs without it, as procrastinate's own pre/post split intends; a missing
    # pre step is a database behind.
    names = [m.name for m in INSTALLED.migrations]
    post, pre = names[-1], names[-2]
    assert "_post_" in post and "_pre_" in pre
    async with await connect(db_url) as conn:
        await conn.execute("DELETE FROM wq_procrastinate_migrations")
        await conn.execute(
            "INSERT INTO wq_procrastinate_migrations (name, applied_as) VALUES (%s, 'recorded')",
            (pre,),
        )
        await conn.execute("UPDATE wq_schema_contract SET checksum = 'with-the-post-deferred'")
        await migrations.verify_contract(conn)
        assert await migrations.pending(conn) == [f"procrastinate/{post}"]
        await conn.execute("UPDATE wq_procrastinate_migrations SET name = %s", (names[-3],))
        with pytest.raises(SchemaContractMismatch, match="worker migrate"):
            await migrations.verify_contract(conn)


async def test_database_of_an_earlier_release_is_recorded_at_its_version(db_url: str) -> None:
    async with await connect(db_url) as conn:  # as the releases before this one left it
        await conn.execute("DROP TABLE wq_procrastinate_migrations")
        await conn.execute(
            "INSERT INTO wq_migrations (name, checksum) VALUES (%(n)s, 'sha-of-3.5-schema.sql')",
            {"n": migrations.LEGACY_PROCRASTINATE_ENTRY},
        )
        await conn.execute("UPDATE wq_schema_contract SET checksum = 'an-older-contract'")
        recorded = f"procrastinate/recorded@{migrations.LEGACY_PROCRASTINATE_VERSION}"
        todo = await migrations.pending(conn)
        assert todo[0] == recorded
        assert todo == [recorded] + [
            f"procrastinate/{m.name}"
            for m in INSTALLED.migrations
            if m.key > migrations.procrastinate_key(migrations.LEGACY_PROCRASTINATE_VERSION)
        ]
        report = await migrations.migrate(conn)
        assert report.applied == todo
        assert await migrations.pending(conn) == []
        await migrations.verify_contract(conn)
    assert (migrations.LEGACY_PROCRASTINATE_VERSION, "recorded") in await procrastinate_rows(db_url)
    # The earlier release's own row stays, so it can still read its history after a rollback.
    assert await fetch(
        db_url,
        "SELECT checksum FROM wq_migrations WHERE name = %(n)s",
        {"n": migrations.LEGACY_PROCRASTINATE_ENTRY},
    ) == [("sha-of-3.5-schema.sql",)]


async def test_procrastinate_tables_without_a_recorded_version_are_refused(
    empty_db: Any,
) -> None:
    url = await empty_db()
    async with await connect(url) as conn:  # e.g. `procrastinate schema --apply` ran first
        await conn.execute(migrations.procrastinate_schema())
        for refused in (lambda: migrations.pending(conn), lambda: migrations.migrate(conn)):
            with pytest.raises(SchemaContractMismatch, match="no procrastinate schema version"):
                await refused()
        cur = await conn.execute("SELECT to_regclass('wq_migrations')")
        assert await cur.fetchone() == (None,)  # refused before any DDL of ours
