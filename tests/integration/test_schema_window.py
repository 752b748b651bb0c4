"""The schema window, against a real database: a newer release's expand step leaves this
code running; a contract step waits for the lanes and workers of older releases, is
audited when forced, and then closes the window, which the database itself enforces on a
worker that registers or a lane that is prepared below the floor, also in a race with the
contract step.

"A newer release" is this code's migrations plus one more (``migrate(code=...)``); the
N-1 test (tests/e2e/test_release_window.py) does the same with real releases.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from queues import admission, lanes, migrations, runs
from queues.errors import ContractBlockedByLanes, MigrationFailed, SchemaWindowClosed
from queues.queries import q
from tests.workers import connect, eventually, fetch

CODE = migrations.code_migrations()
V = migrations.code_schema().version
WORKER = Path(sys.executable).parent / "worker"
ROOT = Path(__file__).resolve().parents[2]


def extra(number: int, kind: str, sql: str) -> migrations.Migration:
    """One more migration, as a newer release would carry it."""
    text = f"-- kind: {kind}\n{sql}\n"
    name = f"{number:04d}_window_{kind}"
    assert migrations.kind_of(f"{name}.sql", text, number) == kind
    return migrations.Migration(
        name=name,
        number=number,
        checksum=hashlib.sha256(text.encode()).hexdigest(),
        sql=text,
        kind=kind,
    )


EXPAND = extra(V + 1, "expand", "CREATE TABLE wq_window_probe (id integer PRIMARY KEY);")
CONTRACT = extra(V + 1, "contract", "COMMENT ON TABLE wq_runs IS 'contracted';")


def cli(*args: str, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "WORKER_HOME", "VERCEL", "WORKER_ADMISSION_ONLY"}
    }
    return subprocess.run(
        [str(WORKER), *args],
        env={**base, "WORKER_DATABASE_URL": url, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def admit(url: str, release: str) -> None:
    """One run of ``release``, admitted the lazy way (this code prepares the lane)."""
    async with connect(url) as conn:
        await admission.Admitter().submit(
            conn, admission.Submission(play="echo", params={}, release=release)
        )


async def register(url: str, worker_id: str, release: str) -> None:
    async with connect(url) as conn:
        await runs.register_worker(
            conn,
            worker_id=worker_id,
            lanes=[lanes.lane_name(release)],
            release=release,
            host="test",
            pid=os.getpid(),
        )


async def blockers(url: str, below: int) -> list[migrations.Blocker]:
    async with connect(url) as conn:
        return await migrations.contract_blockers(conn, below=below)


async def test_a_newer_releases_expand_step_leaves_this_release_running(db_url: str) -> None:
    async with connect(db_url) as conn:
        report = await migrations.migrate(conn, code=[*CODE, EXPAND])
        assert report.applied == [EXPAND.name] and not report.deferred
        # This (older) release still verifies, and its migrate has nothing to apply.
        await migrations.verify_contract(conn)
        assert (await migrations.plan(conn)).newer == [EXPAND.name]
        older = await migrations.migrate(conn)
        assert older.applied == [] and older.newer == [EXPAND.name]
        assert older.newer_release == migrations.code_release()
    # The newer release's record stays (this release's migrate wrote nothing).
    assert await fetch(db_url, "SELECT version FROM wq_schema_contract") == [(V + 1,)]
    # Its workers register, its app admits and prepares its lane, its CLI works.
    await register(db_url, "older-worker", "older")
    await admit(db_url, "older")
    res = cli("migrate", url=db_url)
    assert res.returncode == 0, res.stderr
    assert "nothing to apply" in res.stdout and f"version {V + 1}" in res.stdout
    check = cli("migrate", "--check", "--json", url=db_url)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["newer"] == [EXPAND.name]
    assert cli("submit", "echo", "--release", "older", url=db_url).returncode == 0


async def test_a_contract_step_waits_for_older_lanes_then_closes_the_window(
    db_url: str,
) -> None:
    await admit(db_url, "older")  # an unfinished run on a lane of this (older) release
    newer = [*CODE, CONTRACT]
    async with connect(db_url) as conn:
        planned = await migrations.plan(conn, code=newer)
        assert [(s.name, s.kind) for s in planned.steps] == [(CONTRACT.name, "contract")]
        (blocker,) = planned.steps[0].blocked_by
        assert (blocker.lane, blocker.schema_version, blocker.unfinished) == ("r-older", V, 1)

        # Deferred: nothing applied, the report names the lane.
        report = await migrations.migrate(conn, code=newer)
        assert report.applied == [] and report.deferred == [CONTRACT.name]
        assert [b.lane for b in report.blocked_by] == ["r-older"]
        # Asked for, it is refused; and so is a batch with an expand step behind it,
        # before anything of that batch is applied.
        with pytest.raises(ContractBlockedByLanes, match="r-older") as info:
            await migrations.migrate(conn, code=newer, contract=True)
        assert info.value.fix and "worker queues adopt" in info.value.fix
        behind = extra(V + 2, "expand", "CREATE TABLE wq_window_after (id integer);")
        with pytest.raises(ContractBlockedByLanes, match=behind.name):
            await migrations.migrate(conn, code=[*newer, behind])
    assert (
        await fetch(
            db_url, "SELECT name FROM wq_migrations WHERE name LIKE %s", (f"{V + 1:04d}_%",)
        )
        == []
    )
    assert await fetch(db_url, "SELECT to_regclass('wq_window_after')") == [(None,)]

    # A reclaimed lane no longer blocks it (the operator retired it).
    async with connect(db_url) as conn:
        await lanes.reclaim(conn, "older", force=True)
        report = await migrations.migrate(conn, code=newer)
        assert report.applied == [CONTRACT.name] and not report.deferred
        recorded = await migrations.read_recorded(conn)
        assert recorded is not None
        assert (recorded.floor, recorded.floor_migration) == (V + 1, CONTRACT.name)
        assert recorded.floor_release == migrations.code_release()

        # This code is now outside the window, wherever it asks.
        with pytest.raises(SchemaWindowClosed) as closed:
            await migrations.verify_contract(conn)
        assert CONTRACT.name in closed.value.message and "floor" in closed.value.message
        assert "Migrating with this release cannot help" in (closed.value.fix or "")
        with pytest.raises(SchemaWindowClosed):
            await migrations.migrate(conn)
        with pytest.raises(SchemaWindowClosed):
            await migrations.plan(conn)
        # The database itself refuses its workers and lanes (the last line).
        with pytest.raises(SchemaWindowClosed, match=CONTRACT.name):
            await lanes.prepare(conn, "older-again")
    with pytest.raises(SchemaWindowClosed, match="below the database's compatibility floor"):
        await register(db_url, "too-old", "older")
    for args in (["start", "--release", "older"], ["submit", "echo", "--release", "older"]):
        res = cli(*args, url=db_url)
        assert res.returncode == 1, res.stderr
        assert "error[SCHEMA_WINDOW_CLOSED]" in res.stderr and CONTRACT.name in res.stderr
        assert "worker migrate`" not in res.stderr.split("Fix:")[-1]


async def test_each_pending_contract_step_waits_for_the_lanes_below_its_own_floor(
    db_url: str,
) -> None:
    # Two pending contract steps; a lane with an unfinished run, prepared by a release that
    # has the first of them: it needs what the second removes, not what the first does.
    first = extra(V + 1, "contract", "COMMENT ON TABLE wq_runs IS 'first';")
    second = extra(V + 2, "contract", "COMMENT ON TABLE wq_runs IS 'second';")
    await admit(db_url, "between")
    async with connect(db_url) as conn:
        await conn.execute(
            "UPDATE wq_lanes SET schema_version = %s WHERE name = 'r-between'", (V + 1,)
        )
        planned = await migrations.plan(conn, code=[*CODE, first, second])
        assert [[b.lane for b in s.blocked_by] for s in planned.steps] == [[], ["r-between"]]
        report = await migrations.migrate(conn, code=[*CODE, first, second])
        assert report.applied == [first.name] and report.deferred == [second.name]
        assert [b.lane for b in report.blocked_by] == ["r-between"]
        with pytest.raises(ContractBlockedByLanes, match=second.name):
            await migrations.migrate(conn, code=[*CODE, first, second], contract=True)


async def test_live_workers_of_an_older_release_block_until_they_stop(db_url: str) -> None:
    await register(db_url, "older-worker", "older")
    async with connect(db_url) as conn, conn.transaction():
        await lanes.prepare(conn, "older")
    (blocker,) = await blockers(db_url, V + 1)
    assert (blocker.lane, blocker.unfinished, blocker.live_workers) == ("r-older", 0, 1)
    assert await blockers(db_url, V) == []  # a step below its schema does not concern it
    async with connect(db_url) as conn:
        await conn.execute(q("worker_stop"), {"id": "older-worker"})
    assert await blockers(db_url, V + 1) == []


async def test_a_forced_contract_step_is_applied_and_audited(db_url: str) -> None:
    await admit(db_url, "older")
    async with connect(db_url) as conn:
        with pytest.raises(MigrationFailed, match="reason"):
            await migrations.migrate(conn, code=[*CODE, CONTRACT], contract=True, force=True)
        report = await migrations.migrate(
            conn,
            code=[*CODE, CONTRACT],
            contract=True,
            force=True,
            actor="cli:operator",
            reason="the older release's runs are adopted by hand",
        )
    assert report.applied == [CONTRACT.name] and report.forced
    ((actor, data),) = await fetch(
        db_url,
        "SELECT actor, data FROM wq_operator_actions WHERE action = 'migrate_contract_forced'",
    )
    assert actor == "cli:operator"
    assert data["migration"] == CONTRACT.name and data["floor"] == V + 1
    assert data["reason"] == "the older release's runs are adopted by hand"
    assert data["blocked_by"] and "r-older" in data["blocked_by"][0]
    # The lane below the new floor is retired with it (audited), so an old admission-only
    # deployment that still admits there is refused instead of stranding a run.
    assert await fetch(db_url, "SELECT state::text FROM wq_lanes WHERE name = 'r-older'") == [
        ("reclaimed",)
    ]
    ((reclaimed,),) = await fetch(
        db_url, "SELECT data FROM wq_operator_actions WHERE action = 'reclaim'"
    )
    assert reclaimed["migration"] == CONTRACT.name and reclaimed["floor"] == V + 1
    res = cli("submit", "echo", "--release", "older", url=db_url, WORKER_ADMISSION_ONLY="1")
    assert res.returncode == 1 and "error[LANE_RECLAIMED]" in res.stderr, res.stderr


async def test_the_cli_refuses_a_force_without_contract_or_reason(db_url: str) -> None:
    for args, field in (
        (["migrate", "--force"], "--force"),
        (["migrate", "--contract", "--force"], "--reason"),
        (["migrate", "--check", "--contract"], "--contract"),
    ):
        res = cli(*args, url=db_url)
        assert res.returncode == 2, res.stderr
        assert "error[FIELD_INVALID]" in res.stderr and field in res.stderr


async def test_a_worker_registering_during_a_contract_step_is_refused_by_the_database(
    db_url: str,
) -> None:
    """The race: a worker of an older release verified its schema before the contract
    step, and registers while the step runs. The step holds wq_workers until it commits;
    then the floor refuses the registration (never a worker running below the floor)."""
    gate = 4242_0034
    contract = extra(V + 1, "contract", f"SELECT pg_advisory_xact_lock({gate});")
    async with connect(db_url) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", (gate,))
        async with connect(db_url) as conn:
            migrating = asyncio.create_task(migrations.migrate(conn, code=[*CODE, contract]))

            async def waiting(query: str) -> bool:
                rows = await fetch(
                    db_url,
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND query LIKE %s",
                    (query,),
                )
                return bool(rows[0][0])

            await eventually(lambda: waiting("%pg_advisory_xact_lock%"))
            registering = asyncio.create_task(register(db_url, "racer", "older"))
            await eventually(lambda: waiting("%INSERT INTO wq_workers%"))
            assert not registering.done()
            await holder.execute("SELECT pg_advisory_unlock(%s)", (gate,))
            report = await migrating
    assert report.applied == [contract.name]
    with pytest.raises(SchemaWindowClosed):
        await registering
    assert await fetch(db_url, "SELECT id FROM wq_workers WHERE id = 'racer'") == []
