"""The CLI of issue 14 as subprocesses: a run's own options at submit (shown by `runs show`,
text and JSON), `worker limits set|list|delete`, `worker schedules add|list|delete`, and a
lane's new defaults through `worker queues set-policy`."""

from __future__ import annotations

import json

import psycopg

from queues import lanes
from tests.e2e.test_cli_scheduler import cli


async def test_submit_stores_a_runs_own_options_and_runs_show_prints_them(db_url: str) -> None:
    done = await cli(
        db_url,
        "submit",
        "noop",
        "--release",
        "opts",
        "--max-attempts",
        "2",
        "--retry",
        "exponential:base=1s,factor=3,cap=1m",
        "--timeout",
        "90s",
        "--start-by",
        "2031-01-01T00:00:00+00:00",
        "--priority",
        "7",
        "--meta",
        '{"trace": "abc"}',
        "--json",
    )
    assert done.code == 0, done.err
    run_id = json.loads(done.out)["run_id"]
    shown = await cli(db_url, "runs", "show", run_id)
    assert shown.code == 0, shown.err
    for line in (
        'meta:     {"trace": "abc"}',
        "max tries: 2",
        "retry:    exponential:base=1s,factor=3,cap=1m,jitter=0.1",
        "timeout:  90s",
        "start by: 2031-01-01T00:00:00+00:00",
    ):
        assert line in shown.out, shown.out
    data = json.loads((await cli(db_url, "runs", "show", run_id, "--json")).out)
    assert data["options"] == {
        "max_attempts": 2,
        "retry": "exponential:base=1s,factor=3,cap=1m,jitter=0.1",
        "timeout_s": 90.0,
        "start_by": "2031-01-01T00:00:00+00:00",
        "meta": {"trace": "abc"},
        "parent_id": None,
        "children": 0,
    }
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT priority FROM procrastinate_jobs WHERE args ->> 'run_id' = %s", (run_id,)
        )
        assert await cur.fetchone() == (7,)


async def test_limits_set_list_delete(db_url: str) -> None:
    done = await cli(
        db_url, "limits", "set", "plan:pro", "--concurrency", "2", "--per-org", "--json"
    )
    assert done.code == 0, done.err
    assert json.loads(done.out)["per_org"] is True
    done = await cli(db_url, "limits", "set", "clearbit", "--rate", "600/m", "--burst", "5")
    assert (done.code, done.out.strip()) == (0, "limit clearbit: rate 600/m (burst 5)")
    listed = json.loads((await cli(db_url, "limits", "list", "--json")).out)
    assert [(x["key"], x["rate_per_s"], x["concurrency"]) for x in listed] == [
        ("clearbit", 10.0, None),
        ("plan:pro", None, 2),
    ]
    assert (await cli(db_url, "limits", "delete", "clearbit")).out.strip() == (
        "limit clearbit deleted"
    )
    assert "no limit clearbit" in (await cli(db_url, "limits", "delete", "clearbit")).out


async def test_schedules_add_list_delete(db_url: str) -> None:
    done = await cli(
        db_url,
        "schedules",
        "add",
        "nightly",
        "--play",
        "noop",
        "--cron",
        "0 3 * * *",
        "--params",
        '{"n": 1}',
        "--json",
    )
    assert done.code == 0, done.err
    added = json.loads(done.out)
    assert (added["timing"], added["source"], added["params"]) == (
        "cron 0 3 * * *",
        "cli",
        {"n": 1},
    )
    assert added["next_at"].endswith("03:00:00+00:00")
    listed = await cli(db_url, "schedules", "list")
    assert listed.out.startswith("nightly"), listed.out
    assert (await cli(db_url, "schedules", "delete", "nightly")).out.strip() == (
        "schedule nightly deleted"
    )
    assert json.loads((await cli(db_url, "schedules", "list", "--json")).out) == []


async def test_set_policy_sets_a_lanes_run_timeout_and_org_cap(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
    done = await cli(
        db_url, "queues", "set-policy", "t", "--run-timeout", "10m", "--org-concurrency", "4"
    )
    assert done.code == 0, done.err
    assert "run_timeout_s 0ms -> 10m" in done.out and "org_concurrency 0 -> 4" in done.out
