"""Least privilege on a real Postgres: each role may do its job and nothing more.

`worker migrate` (the template was built with it) creates the group roles and grants;
each test makes login users in them, as a deployment would (``CREATE ROLE ... LOGIN IN
ROLE wq_worker``), and proves what they can and cannot do with real connections.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, recovery, runs
from queues.errors import InvalidField
from queues.fence import Fence
from queues.receipts import Scope
from tests.workers import eventually, login_users, run_state, running_worker
from worker.context import RunContext
from worker.plays import Registry

Conn = psycopg.AsyncConnection[Any]


@pytest.fixture
async def logins(db_url: str) -> AsyncIterator[dict[str, str]]:
    """A login user in each group role, as a deployment makes them; URLs by role."""
    async with login_users(db_url, ("wq_worker", "wq_admission", "wq_reader")) as made:
        yield made


async def refused(url: str, statement: str, params: Any = None) -> str:
    """Run ``statement`` as the user of ``url``; it must be refused. Returns the reason."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as raised:
            await conn.execute(statement, params)  # type: ignore[arg-type]
    assert isinstance(
        raised.value,
        psycopg.errors.InsufficientPrivilege | psycopg.errors.UndefinedFunction,
    ), repr(raised.value)
    return str(raised.value)


async def test_the_admission_role_can_admit_and_read_nothing(
    db_url: str, logins: dict[str, str]
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        await lanes.prepare(admin, "roles")
    url = logins["wq_admission"]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit(
            conn,
            admission.Submission(
                play="noop", release="roles", params={"api_key": "secret"}, idempotency_key="k1"
            ),
            inputs=[("a", {"email": "x@example.com"})],
        )
        assert admitted.created
        # An idempotent retry answers with the same run, still without reading anything.
        again = await admission.submit(
            conn,
            admission.Submission(
                play="noop", release="roles", params={"api_key": "secret"}, idempotency_key="k1"
            ),
            inputs=[("a", {"email": "x@example.com"})],
        )
        assert (again.run_id, again.created) == (admitted.run_id, False)
    for table in (
        "wq_runs",
        "wq_run_inputs",
        "wq_sheet_rows",
        "wq_receipts",
        "wq_events",
        "wq_ledger",  # the events as readers see them (docs/design.md, 11b)
    ):
        assert "permission denied" in await refused(url, f"SELECT * FROM {table}")
    await refused(url, "SELECT args FROM procrastinate_jobs")
    await refused(url, "UPDATE wq_runs SET state = 'succeeded'")
    await refused(
        url,
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
        " VALUES ('r-roles', 'x', '{}')",
    )
    await refused(url, "INSERT INTO wq_lanes (name, release) VALUES ('r-mine', 'mine')")
    await refused(url, "CREATE TABLE mine (x int)")


async def test_the_worker_role_runs_the_queue_but_no_ddl_and_no_os_commands(
    db_url: str, logins: dict[str, str]
) -> None:
    url = logins["wq_worker"]
    for ddl in (
        "CREATE TABLE mine (x int)",
        "DROP TABLE wq_runs",
        "ALTER TABLE wq_runs ADD COLUMN x int",
        "CREATE INDEX ON wq_runs (org)",
        "TRUNCATE wq_runs",
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    ):
        await refused(url, ddl)
    await refused(url, "UPDATE wq_schema_contract SET version = 0")
    await refused(url, "DELETE FROM wq_migrations")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("CREATE TEMP TABLE x (t text)")  # a session's scratch space
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="program"):
            await conn.execute("COPY x FROM PROGRAM 'id'")
        cur = await conn.execute(
            "SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user"
        )
        assert await cur.fetchone() == (False, False)

    # What it is for: admit (locally), prepare, claim, execute, finish, recover.
    registry = Registry()

    @registry.play("echo")
    async def echo(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"echo": params, "attempt": ctx.attempt}

    async with running_worker(url, registry, release="w") as worker:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            admitted = await admission.Admitter().submit(
                conn, admission.Submission(play="echo", release="w", params={"n": 1})
            )
            report = await recovery.run_once(conn)
        assert report.expired == ()

        async def done() -> bool:
            # The worker counts an attempt after its final write commits: wait for both.
            state = await run_state(url, admitted.run_id)
            return state == "succeeded" and worker.stats["succeeded"] == 1

        await eventually(done)
    # And announce the runs it claimed (worker.producer; a quick play is never announced).
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await runs.announce(conn, [admitted.run_id])


async def test_the_reader_role_reads_and_writes_nothing(
    db_url: str, logins: dict[str, str]
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        await lanes.prepare(admin, "rd")
        admitted = await admission.submit(admin, admission.Submission(play="noop", release="rd"))
    url = logins["wq_reader"]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, admitted.run_id)
        assert run.state == "queued"
        assert [e.kind for e in await runs.events(conn, admitted.run_id)] == ["run_created"]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await runs.cancel(conn, admitted.run_id)
    await refused(url, "UPDATE wq_runs SET state = 'succeeded'")
    await refused(url, "DELETE FROM procrastinate_jobs")
    await refused(url, "CREATE TABLE mine (x int)")
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        assert (await runs.get(admin, admitted.run_id)).state == "queued"


async def test_a_hostile_play_gets_nothing_to_reach_other_runs_with(
    db_url: str, logins: dict[str, str]
) -> None:
    """What a play is given (its context and its process environment) reaches no other
    run: no raw connection, no database URL, no way to name another run's scope or org.
    (In-process plays are trusted code all the same; untrusted plays run sandboxed.)"""
    url = logins["wq_worker"]
    registry = Registry()
    found: dict[str, Any] = {}

    @registry.play("victim")
    async def victim(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    @registry.play("hostile")
    async def hostile(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        found["connection"] = hasattr(ctx, "connection")
        other = str(params["victim"])
        try:
            await ctx.step("peek", lambda: 1, scope=f"run:{other}")
            found["other_scope"] = "allowed"
        except InvalidField as exc:
            found["other_scope"] = exc.code
        # Its own fence names its own run; a forged one for the victim's run is refused.
        forged = Fence(uuid.UUID(other), 1, ctx.info.worker_id)
        found["forged_fence_is_not_own"] = forged != ctx.fence
        return {"done": True}

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        await lanes.prepare(admin, "h")
        victim_run = await admission.submit(
            admin,
            admission.Submission(
                play="victim", release="h", org="victim-org", params={"api_key": "k-123"}
            ),
        )
        # The victim waits unclaimed (its job is held back), so nothing but the hostile
        # play could touch it.
        await admin.execute(
            "UPDATE procrastinate_jobs SET scheduled_at = now() + interval '1 hour' WHERE id = %s",
            (victim_run.job_id,),
        )
        hostile_run = await admission.submit(
            admin,
            admission.Submission(
                play="hostile",
                release="h",
                org="attacker",
                params={"victim": str(victim_run.run_id)},
            ),
        )
    async with running_worker(url, registry, release="h"):

        async def done() -> bool:
            return await run_state(url, hostile_run.run_id) == "succeeded"

        await eventually(done)
    assert found == {
        "connection": False,
        "other_scope": "FIELD_INVALID",
        "forged_fence_is_not_own": True,
    }
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        victim_now = await runs.get(admin, victim_run.run_id)
        assert (victim_now.state, victim_now.result, victim_now.attempt) == ("queued", None, 0)
        cur = await admin.execute(
            "SELECT count(*) FROM wq_receipts WHERE scope = %s",
            (str(Scope.of_run(victim_run.run_id)),),
        )
        assert await cur.fetchone() == (0,)
