"""The scheduler's CLI as subprocesses: `worker start`, `submit`, `result --wait`, signals.

Each test gets a fresh database (``db_url``) passed as ``WORKER_DATABASE_URL``; subprocess
workers load the test plays with ``--app tests.apps.plays:registry`` (``PYTHONPATH`` holds
the repository root). States are polled with a deadline, never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from queues import admission, lanes, outcomes, runs
from queues.admission import Submission
from tests.workers import connect

Conn = psycopg.AsyncConnection[Any]
T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(sys.executable).parent / "worker"
APP = "tests.apps.plays:registry"
DEADLINE_S = 15.0


# ---- helpers --------------------------------------------------------------------------


def cli_env(db_url: str, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "DATABASE_URL",
            "VERCEL",
            "WORKER_ADMISSION_ONLY",
            "WORKER_RELEASE",
            "WORKER_APP",
            "WORKER_HOME",
            "PGAPPNAME",
        }
    }
    env["WORKER_DATABASE_URL"] = db_url
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@dataclass
class Done:
    code: int
    out: str
    err: str


async def cli(db_url: str, *args: str, **env: str) -> Done:
    proc = await asyncio.create_subprocess_exec(
        str(WORKER),
        *args,
        cwd=REPO,
        env=cli_env(db_url, **env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Done(proc.returncode, out.decode(), err.decode())


async def value(conn: Conn, sql: str, params: dict[str, Any] | None = None) -> Any:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    return None if row is None else row[0]


async def eventually(
    check: Callable[[], Awaitable[T | None]], what: str, timeout: float = DEADLINE_S
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def worker_process(
    db_url: str, tmp_path: Path, name: str, release: str, *extra: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, Path]]:
    """A `worker start` subprocess that has written its ready file: (process, id, log)."""
    ready = tmp_path / f"{name}.ready"
    log_path = tmp_path / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            str(WORKER),
            "--json-logs",
            "start",
            "--release",
            release,
            "--app",
            APP,
            "--ready-file",
            str(ready),
            *extra,
            cwd=REPO,
            env=cli_env(db_url),
            stdout=log_file,
            stderr=log_file,
        )
        try:

            async def is_ready() -> str | None:
                if proc.returncode is not None:
                    raise AssertionError(
                        f"worker {name} exited {proc.returncode}: {log_path.read_text()}"
                    )
                with contextlib.suppress(OSError, ValueError):
                    return str(json.loads(ready.read_text())["worker_id"])
                return None

            worker_id = await eventually(is_ready, f"worker {name} to be ready")
            yield proc, worker_id, log_path
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def counts(conn: Conn) -> dict[str, int]:
    return {
        table: int(await value(conn, f"SELECT count(*) FROM {table}"))
        for table in ("wq_runs", "procrastinate_jobs", "wq_ledger", "wq_lanes")
    }


# ---- 10. result --wait is woken by NOTIFY ------------------------------------------------


async def wait_listening(conn: Conn, app_name: str) -> None:
    """Return once the `result --wait` backend LISTENs and idles after reading the run.

    Its first statement is LISTEN; its second reads the run (``FROM wq_runs``); then it
    waits on notifications for up to its 2 s poll interval.
    """

    async def idle_after_read() -> bool:
        return bool(
            await value(
                conn,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(app)s"
                " AND state = 'idle' AND query LIKE '%%FROM wq_runs%%'",
                {"app": app_name},
            )
        )

    await eventually(idle_after_read, "`worker result --wait` to listen")


async def test_result_wait_is_woken_by_notify_within_a_second(db_url: str) -> None:
    async with connect(db_url) as conn:
        await lanes.prepare(conn, "t1")
        done = await admission.submit(conn, Submission(play="echo", release="t1"))
        cancelled = await admission.submit(conn, Submission(play="echo", release="t1"))
        [claimed] = await runs.claim(conn, lanes=["r-t1"], worker_id="w", limit=1, plays=["echo"])
        assert claimed.run_id == done.run_id

        for run_id, finish, expected_code, expected_state in (
            (done.run_id, "succeed", 0, "succeeded"),
            (cancelled.run_id, "cancel", 3, "cancelled"),
        ):
            app_name = f"wq-result-{uuid.uuid4().hex[:8]}"
            proc = await asyncio.create_subprocess_exec(
                str(WORKER),
                "result",
                str(run_id),
                "--wait",
                "--json",
                cwd=REPO,
                # No fallback poll within the deadline: only the NOTIFY can wake the waiter.
                env=cli_env(db_url, PGAPPNAME=app_name, WORKER_OBSERVE_POLL_S="600"),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                await wait_listening(conn, app_name)
                assert proc.returncode is None
                if finish == "succeed":
                    final = outcomes.succeeded(run_id, 1, {"answer": 42})
                    applied = await runs.finish(conn, worker_id="w", finishes=[final])
                    assert applied == {(run_id, 1): outcomes.FinishStatus.APPLIED}
                else:
                    assert (await runs.cancel(conn, run_id)).after == "cancelled"
                out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            assert proc.returncode == expected_code, err.decode()
            data = json.loads(out)
            assert data["id"] == str(run_id) and data["state"] == expected_state
            if finish == "succeed":
                assert data["result"] == {"answer": 42}


# ---- 11. SIGTERM hands a run back -------------------------------------------------------


async def test_sigterm_hands_the_run_back_and_another_worker_finishes_it(
    db_url: str, tmp_path: Path
) -> None:
    async with connect(db_url) as conn:
        async with worker_process(db_url, tmp_path, "a", "t1", "--grace", "0.5") as (
            a,
            worker_a,
            log_a,
        ):
            admitted = await admission.submit(conn, Submission(play="slow", release="t1"))

            async def running_under_a() -> bool:
                run = await runs.get(conn, admitted.run_id)
                return run.state == "running" and run.lease_owner == worker_a

            await eventually(running_under_a, "worker A to start the slow run")
            sent = time.monotonic()
            a.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(a.wait(), DEADLINE_S)
            took = time.monotonic() - sent
            assert code == 0, log_a.read_text()
            assert took < 5.0, f"worker A took {took:.1f}s to stop with --grace 0.5"

        run = await runs.get(conn, admitted.run_id)
        assert (run.state, run.attempt, run.lease_owner) == ("queued", 1, None)
        assert run.job_id is not None and run.job_id != admitted.job_id
        assert (
            await value(
                conn,
                "SELECT status::text FROM procrastinate_jobs WHERE id = %(id)s",
                {"id": run.job_id},
            )
            == "todo"
        )
        assert [t.outcome for t in await runs.attempts(conn, admitted.run_id)] == ["handed_back"]
        handed = [
            e for e in await runs.events(conn, admitted.run_id) if e.kind == "run_handed_back"
        ]
        assert len(handed) == 1 and handed[0].attempt == 1

        async with worker_process(db_url, tmp_path, "b", "t1") as (b, worker_b, log_b):

            async def finished() -> runs.Run | None:
                found = await runs.get(conn, admitted.run_id)
                return found if found.terminal else None

            run = await eventually(finished, "worker B to finish the handed-back run")
            b.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(b.wait(), DEADLINE_S) == 0, log_b.read_text()
        assert run.state == "succeeded", run.error
        assert run.result == {"attempt": 2, "worker": worker_b}
        assert [t.outcome for t in await runs.attempts(conn, admitted.run_id)] == [
            "handed_back",
            "succeeded",
        ]


# ---- 12. unknown play at the CLI --------------------------------------------------------


async def test_submit_of_an_unknown_play_exits_2_with_did_you_mean(db_url: str) -> None:
    done = await cli(db_url, "submit", "slwo", "--release", "t1", "--app", APP)
    assert done.code == 2, done.err
    assert "error[PLAY_UNKNOWN]" in done.err
    assert "did you mean 'slow'?" in done.err
    assert "Traceback" not in done.err
    async with connect(db_url) as conn:
        assert await counts(conn) == {
            "wq_runs": 0,
            "procrastinate_jobs": 0,
            "wq_ledger": 0,
            "wq_lanes": 0,
        }


# ---- 13. input errors exit 2 and write nothing ----------------------------------------


async def test_cli_input_errors_exit_2_with_a_code_and_write_nothing(
    db_url: str, tmp_path: Path
) -> None:
    multi_line = tmp_path / "params.json"
    multi_line.write_text('{\n  "limit": 10,\n  oops: 1\n}\n', encoding="utf-8")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("name,domain\nacme,acme.com\nbeta,beta.com,extra\n", encoding="utf-8")
    misquoted = tmp_path / "misquoted.csv"
    misquoted.write_text('name,domain\nacme,acme.com\nbeta,"beta.com"x\n', encoding="utf-8")
    latin1_csv = tmp_path / "latin1.csv"
    latin1_csv.write_bytes("name,city\nacme,Paris\nbeta,Düsseldorf\n".encode("latin-1"))

    base = ("submit", "echo", "--release", "t1", "--app", APP)
    cases: list[tuple[tuple[str, ...], dict[str, str], str, list[str]]] = [
        (
            (*base, "--params", '{"limit": 10,}'),
            {},
            "FIELD_INVALID",
            ["--params is not valid JSON", "line 1, column 14"],
        ),
        ((*base, "--params", "[1, 2]"), {}, "FIELD_INVALID", ["must be a JSON object"]),
        (
            (*base, "--params-file", str(multi_line)),
            {},
            "FIELD_INVALID",
            ["--params-file is not valid JSON", "line 3, column 3"],
        ),
        (
            (*base, "--input", str(ragged)),
            {},
            "FIELD_INVALID",
            ["ragged.csv, line 3", "3 fields where the header has 2"],
        ),
        (
            (*base, "--input", str(misquoted)),
            {},
            "FIELD_INVALID",
            ["misquoted.csv, line 3", "malformed CSV"],
        ),
        (
            (*base, "--input", str(latin1_csv)),
            {},
            "FIELD_INVALID",
            ["latin1.csv, line 3", "not UTF-8"],
        ),
        (
            ("submit", "echo", "--release", "v1'; DROP TABLE wq_runs; --", "--app", APP),
            {},
            "FIELD_INVALID",
            ["invalid release name"],
        ),
        (
            ("submit", "echo", "--release", 'v1"x', "--app", APP),
            {},
            "FIELD_INVALID",
            ["invalid release name"],
        ),
        (
            ("submit", "echo", "--release", "r" * 500, "--app", APP),
            {},
            "FIELD_INVALID",
            ["invalid release name", "..."],
        ),
        (
            ("submit", "echo", "--app", APP),
            {"WORKER_RELEASE": "v1;rm -rf"},
            "FIELD_INVALID",
            ["invalid release name"],
        ),
        (
            ("start", "--release", "v1;x", "--app", APP),
            {},
            "FIELD_INVALID",
            ["invalid release name"],
        ),
        (("queues", "reclaim", "a'b"), {}, "FIELD_INVALID", ["invalid release name"]),
        (("result", "not-a-run-id"), {}, "FIELD_INVALID", ["is not a run id"]),
    ]
    # The cases are independent and each writes nothing: run them side by side.
    permits = asyncio.Semaphore(6)

    async def check(
        args: tuple[str, ...], env: dict[str, str], code: str, needles: list[str]
    ) -> str | None:
        async with permits:
            done = await cli(db_url, *args, **env)
        problems = []
        if done.code != 2:
            problems.append(f"exit {done.code}")
        if f"error[{code}]" not in done.err:
            problems.append(f"no error[{code}]")
        problems += [f"no {needle!r}" for needle in needles if needle not in done.err]
        if "Traceback" in done.err:
            problems.append("a traceback")
        if len(done.err) > 1000:
            problems.append(f"{len(done.err)} characters of stderr")
        if problems:
            return f"{' '.join(args)[:80]}: {', '.join(problems)}\n{done.err[-500:]}"
        return None

    found = await asyncio.gather(*(check(*case) for case in cases))
    failures = [f for f in found if f is not None]
    async with connect(db_url) as conn:
        assert await counts(conn) == {
            "wq_runs": 0,
            "procrastinate_jobs": 0,
            "wq_ledger": 0,
            "wq_lanes": 0,
        }
    assert not failures, "\n".join(failures)

    # The same shapes, made valid, are admitted (the refusals above were about the input).
    good_csv = tmp_path / "good.csv"
    good_csv.write_text("name,domain\nacme,acme.com\n", encoding="utf-8")
    done = await cli(db_url, *base, "--params", '{"limit": 10}', "--input", str(good_csv), "--json")
    assert done.code == 0, done.err
    data = json.loads(done.out)
    assert data["created"] is True and data["lane"] == "r-t1"
    async with connect(db_url) as conn:
        assert (await counts(conn))["wq_runs"] == 1


async def test_non_utf8_params_file_is_an_input_error(db_url: str, tmp_path: Path) -> None:
    latin1_params = tmp_path / "latin1.json"
    latin1_params.write_bytes('{\n"city": "Düsseldorf"}'.encode("latin-1"))
    done = await cli(
        db_url,
        "submit",
        "echo",
        "--release",
        "t1",
        "--app",
        APP,
        "--params-file",
        str(latin1_params),
    )
    assert "Traceback" not in done.err, done.err[-800:]
    assert done.code == 2, done.err
    assert "error[FIELD_INVALID]" in done.err and "UTF-8" in done.err
    assert "--params-file" in done.err
    async with connect(db_url) as conn:
        assert (await counts(conn))["wq_runs"] == 0
