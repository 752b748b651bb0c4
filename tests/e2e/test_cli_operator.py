"""The operator's commands as subprocesses: `worker queues set-policy`, `worker runs retry`,
`worker runs show` with a stored traceback, and `--metrics-port` on `worker start` and
`worker recover --every`, scraped over HTTP."""

from __future__ import annotations

import asyncio
import getpass
import signal
import socket
import time
from pathlib import Path

import httpx
import psycopg
from prometheus_client.parser import text_string_to_metric_families

from queues import costs, lanes, outcomes, runs
from tests import attempts, ledgers
from tests.e2e.test_cli_scheduler import REPO, WORKER, cli, cli_env, worker_process
from tests.workers import fetch

DEADLINE_S = 20.0


async def _failed_run(url: str) -> str:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        a = await attempts.start(conn)
        try:
            raise KeyError("score")
        except KeyError as exc:
            error = outcomes.error_of(exc)
        policy = a.claimed.retry
        final = outcomes.failed(
            a.run_id, a.fence.attempt, error, policy, now=attempts.T0, failure=policy.max_attempts
        )
        await runs.finish(conn, worker_id=a.fence.owner, finishes=[final])
        return str(a.run_id)


async def test_set_policy_refuses_bad_input_and_writes_nothing(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
    for args, field in (
        (["--lease-ttl", "soon"], "--lease-ttl"),
        (["--concurrency", "0"], "--concurrency"),
        (["--retry-jitter", "2"], "--retry-jitter"),
        (["--heartbeat", "40s"], "--heartbeat"),  # not below the lane's 30 s lease
        ([], "policy"),
    ):
        done = await cli(db_url, "queues", "set-policy", "t", *args)
        assert done.code == 2, (args, done.err)
        first = done.err.strip().splitlines()[0]
        assert first.startswith("error[FIELD_INVALID]: "), done.err
        assert f"({field}: " in first and "Fix: " in first, first
    assert await fetch(db_url, "SELECT concurrency, lease_ttl_s, heartbeat_s FROM wq_lanes") == [
        (16, 30.0, 5.0)
    ]
    assert await fetch(db_url, "SELECT count(*) FROM wq_operator_actions") == [(0,)]


async def test_set_policy_changes_the_lane_and_records_who(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
    done = await cli(
        db_url,
        "queues",
        "set-policy",
        "t",
        "--concurrency",
        "4",
        "--lease-ttl",
        "2m",
        "--max-attempts",
        "3",
        "--retention",
        "3d",
    )
    assert done.code == 0, done.err
    assert "lane r-t: concurrency 16 -> 4" in done.out
    assert "lease_ttl_s 30s -> 2m" in done.out and "retention_s 7d -> 3d" in done.out
    assert await fetch(
        db_url, "SELECT concurrency, lease_ttl_s, retry_max_attempts, retention_s FROM wq_lanes"
    ) == [(4, 120.0, 3, 3 * 86400.0)]
    assert await fetch(db_url, "SELECT actor, action FROM wq_operator_actions") == [
        (f"cli:{getpass.getuser()}", "set_policy")
    ]
    missing = await cli(db_url, "queues", "set-policy", "nowhere", "--concurrency", "2")
    assert missing.code != 0 and "error[LANE_NOT_PREPARED]" in missing.err


async def test_submit_with_a_budget_writes_the_runs_own_budget(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
    done = await cli(db_url, "submit", "noop", "--release", "t", "--budget", "5:usd:day", "--json")
    assert done.code == 0, done.err
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        (budget,) = await costs.list_budgets(conn)
    assert (budget.scope, budget.limit_amount, budget.unit, budget.period) == (
        "run",
        5,
        "usd",
        "day",
    )
    assert str(budget.run_id) in done.out


async def test_runs_retry_and_show_with_its_traceback(db_url: str) -> None:
    run_id = await _failed_run(db_url)
    shown = await cli(db_url, "runs", "show", run_id)
    assert shown.code == 0, shown.err
    assert "traceback:" in shown.out and "KeyError: 'score'" in shown.out
    assert "in _failed_run" in shown.out
    assert '"traceback"' not in shown.out  # printed as text, not as an escaped JSON string
    as_json = await cli(db_url, "runs", "show", run_id, "--json")
    assert "Traceback (most recent call last)" in as_json.out

    done = await cli(db_url, "runs", "retry", run_id, "--reason", "API fixed")
    assert done.code == 0, done.err
    assert f"run {run_id} retried (was failed)" in done.out
    again = await cli(db_url, "runs", "retry", run_id)
    assert again.code == 0 and "nothing to retry" in again.out
    bad = await cli(db_url, "runs", "retry", "not-a-run")
    assert bad.code == 2 and bad.err.startswith("error[FIELD_INVALID]")
    events = await ledgers.events(db_url, run_id, "run_retried")
    assert [(e.data["by"], e.data["reason"]) for e in events] == [
        (f"cli:{getpass.getuser()}", "API fixed")
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _scrape(port: int) -> dict[str, object]:
    deadline = time.monotonic() + DEADLINE_S
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            try:
                response = await client.get(f"http://127.0.0.1:{port}/metrics")
                families = {f.name: f for f in text_string_to_metric_families(response.text)}
                if families["wq_database_up"].samples[0].value == 1:
                    return dict(families)
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("/metrics never answered")
            await asyncio.sleep(0.1)


async def test_recover_and_start_serve_metrics(db_url: str, tmp_path: Path) -> None:
    once = await cli(db_url, "recover", "--once", "--metrics-port", "9")
    assert once.code == 2 and "(--metrics-port: " in once.err

    port = _free_port()
    recover = await asyncio.create_subprocess_exec(
        str(WORKER),
        "recover",
        "--every",
        "1s",
        "--metrics-port",
        str(port),
        cwd=REPO,
        env=cli_env(db_url),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        families = await _scrape(port)
        assert families["wq_runs_admitted"].type == "counter"  # type: ignore[attr-defined]
    finally:
        recover.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(recover.wait(), 20) == 0

    port = _free_port()
    async with worker_process(db_url, tmp_path, "w", "t", "--metrics-port", str(port)):
        families = await _scrape(port)
        live = families["wq_live_workers"].samples[0].value  # type: ignore[attr-defined]
        assert live >= 1
        assert families["wq_attempt_duration_seconds"].type == "histogram"  # type: ignore[attr-defined]


async def test_the_dashboard_command_serves_and_stops(db_url: str, tmp_path: Path) -> None:
    refused = await cli(db_url, "dashboard", "--port", "0", WORKER_ENV="production")
    assert refused.code == 2 and "error[FIELD_INVALID]" in refused.err
    assert "WORKER_DASHBOARD_SECRET" in refused.err

    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        str(WORKER),
        "dashboard",
        "--port",
        str(port),
        cwd=REPO,
        env=cli_env(db_url, WORKER_DASHBOARD_SECRET="s3cret-s3cret-s3cret"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + DEADLINE_S
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while True:
                try:
                    health = await client.get("/healthz")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the dashboard never answered"
                    await asyncio.sleep(0.1)
            assert health.text == "ok"
            login = await client.get("/login")
            assert login.status_code == 200 and "Dashboard secret" in login.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    assert proc.stderr is not None
    err = (await proc.stderr.read()).decode()
    assert "log in with the secret in $WORKER_DASHBOARD_SECRET" in err
    assert "s3cret" not in err
