"""The repository's Procfile under honcho, and its release line as a release phase runs it.

honcho starts every line at once and stops them all as soon as one exits; on SIGINT or
SIGTERM it sends SIGTERM to each process group and SIGKILLs whatever still runs 5 s
(``honcho.manager.KILL_WAIT``) after the first one stopped. So under honcho the release
line holds after migrating, the worker and recovery wait for the schema, and the worker's
default grace plus its hand-back fits in those 5 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from honcho.environ import parse_procfile
from honcho.manager import KILL_WAIT

from queues import migrations
from tests.workers import eventually, fetch, run_state, submit

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROCFILE = ROOT / "Procfile"
RELEASE = "honcho-e2e"
STRIPPED = {"DATABASE_URL", "WORKER_DATABASE_URL", "WORKER_HOME", "WORKER_RELEASE", "WORKER_APP"}


def procfile_env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # the Procfile says `worker`
        WORKER_DATABASE_URL=url,
        WORKER_RELEASE=RELEASE,
        WORKER_APP="tests.apps.plays:registry",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


def lines_of(log: Path, process: str) -> list[str]:
    prefix = re.compile(rf"^\S+ {re.escape(process)}\s*\| ?(?P<line>.*)$")
    found = []
    for raw in log.read_text(errors="replace").splitlines():
        match = prefix.match(raw)
        if match:
            found.append(match["line"])
    return found


def events_of(log: Path, process: str) -> list[dict[str, Any]]:
    found = []
    for line in lines_of(log, process):
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                found.append(event)
    return found


def children(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"started \(pid=(\d+)\)", log.read_text(errors="replace"))]


@contextlib.contextmanager
def honcho(env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``honcho start -f Procfile``; on the way out, whatever still runs is killed."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [
                str(BIN / "honcho"),
                "--no-colour",
                "--env",
                str(log.parent / "absent.env"),  # never a developer's .env
                "start",
                "--procfile",
                str(PROCFILE),
                "--app-root",
                str(ROOT),
            ],
            env=env,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in children(log):  # honcho starts each line in its own session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def live_workers(url: str) -> int:
    with contextlib.suppress(psycopg.errors.UndefinedTable):  # not migrated yet
        return await _live_workers(url)
    return 0


async def _live_workers(url: str) -> int:
    rows = await fetch(
        url,
        "SELECT count(*) FROM wq_workers WHERE release = %s AND stopped_at IS NULL",
        (RELEASE,),
    )
    return int(rows[0][0])


async def attempt_outcomes(url: str, run_id: uuid.UUID) -> list[str]:
    rows = await fetch(
        url, "SELECT outcome FROM wq_attempts WHERE run_id = %s ORDER BY attempt", (run_id,)
    )
    return [str(o) for (o,) in rows]


async def test_honcho_keeps_the_system_up_and_stops_it_within_its_window(
    empty_db: Any, tmp_path: Path
) -> None:
    url = await empty_db()  # a first deploy: the release line migrates from nothing
    log = tmp_path / "honcho.log"
    with honcho(procfile_env(url), log) as proc:

        async def worker_up() -> bool:
            assert proc.poll() is None, log.read_text()
            recovering = any(e["event"] == "recovery_started" for e in events_of(log, "recovery.1"))
            return recovering and await live_workers(url) == 1

        await eventually(worker_up, timeout=60, interval=0.2)
        assert "migration gate done; holding until SIGTERM or SIGINT" in lines_of(log, "release.1")

        done = await submit(url, "echo", {"via": "honcho"}, release=RELEASE)

        async def succeeded() -> bool:
            assert proc.poll() is None, log.read_text()
            return await run_state(url, done) == "succeeded"

        await eventually(succeeded, timeout=30)

        # A run still running at Ctrl-C gets the grace, then is handed back, all before
        # honcho's SIGKILL.
        slow = await submit(url, "slow", {"seconds": 120}, release=RELEASE)

        async def running() -> bool:
            return await run_state(url, slow) == "running"

        await eventually(running, timeout=30)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=KILL_WAIT + 15)
        took = time.monotonic() - sent

    text = log.read_text(errors="replace")
    assert returncode == 130, text  # honcho's own code for SIGINT
    assert "SIGKILL" not in text, text
    for process in ("release.1", "worker.1", "recovery.1"):
        assert f"{process} stopped (rc=0)" in text, text
    assert took < KILL_WAIT, text
    # The worker stopped gracefully: it drained, handed the slow run back and said so.
    events = [e["event"] for e in events_of(log, "worker.1")]
    assert events.index("worker_ready") < events.index("worker_stopping"), events
    assert events[-1] == "worker_stopped", events
    stopping = next(e for e in events_of(log, "worker.1") if e["event"] == "worker_stopping")
    assert stopping["grace_s"] < KILL_WAIT
    assert await attempt_outcomes(url, slow) == ["handed_back"]
    assert await run_state(url, slow) == "queued"  # back on its lane for the next worker
    assert await attempt_outcomes(url, done) == ["succeeded"]
    assert await live_workers(url) == 0
    # The worker and recovery started on an empty database and waited for the gate instead
    # of exiting (which would have stopped the whole formation).
    assert [m for (m,) in await fetch(url, "SELECT version FROM wq_schema_contract")] == [
        migrations.code_contract().version
    ]


async def test_release_line_is_a_one_shot_outside_honcho(empty_db: Any) -> None:
    """Heroku runs the same line as its release phase, which must exit for the deploy to
    go on."""
    url = await empty_db()
    release = parse_procfile(PROCFILE.read_text()).processes["release"]
    env = procfile_env(url)
    env.pop("HONCHO_PROCESS_NAME", None)
    res = subprocess.run(
        ["/bin/sh", "-c", release],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "applied " in res.stdout and "holding" not in res.stdout, res.stdout
    check = subprocess.run(
        [str(BIN / "worker"), "migrate", "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


async def test_wait_for_schema_gives_up_at_its_deadline_and_never_waits_for_a_newer_one(
    empty_db: Any, db_url: str
) -> None:
    def start(url: str) -> tuple[subprocess.CompletedProcess[str], float]:
        began = time.monotonic()
        res = subprocess.run(
            [str(BIN / "worker"), "start", "--wait-for-schema", "2s"],
            env=procfile_env(url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return res, time.monotonic() - began

    behind, waited = start(await empty_db())  # nobody migrates it: waits 2 s, then refuses
    assert behind.returncode == 1, behind.stderr
    assert "error[SCHEMA_CONTRACT_MISMATCH]" in behind.stderr and "never migrated" in behind.stderr
    assert '"schema_waiting"' in behind.stderr
    assert waited >= 2

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        # A newer release migrated it and its contract step closed the window on this one.
        await conn.execute(
            "INSERT INTO wq_migrations (name, checksum, kind)"
            " VALUES ('9999_newer', 'x', 'contract')"
        )
        await conn.execute(
            "UPDATE wq_schema_contract SET version = 9999, floor = 9999,"
            " floor_migration = '9999_newer', floor_release = '9.0.0'"
        )
    ahead, _ = start(db_url)  # refused at once: no migration of this release can help
    assert ahead.returncode == 1, ahead.stderr
    assert "error[SCHEMA_WINDOW_CLOSED]" in ahead.stderr and "9999_newer" in ahead.stderr
    assert '"schema_waiting"' not in ahead.stderr


@pytest.mark.parametrize("command", [["start"], ["recover", "--every", "1s"]])
async def test_a_stop_signal_while_waiting_for_the_schema_exits_0_at_once(
    empty_db: Any, command: list[str]
) -> None:
    """honcho stops everything on Ctrl-C, maybe before the release line migrated: a process
    still waiting for the schema stops cleanly (exit 0), not killed by the signal."""
    with subprocess.Popen(
        [str(BIN / "worker"), "--json-logs", *command, "--wait-for-schema", "60s"],
        env=procfile_env(await empty_db()),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stderr is not None
            seen = []
            for line in proc.stderr:  # bounded: the wait itself gives up after 60 s
                seen.append(line)
                if '"schema_waiting"' in line:
                    break
            assert any('"schema_waiting"' in line for line in seen), "".join(seen)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=10)
            rest = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == 0, "".join(seen) + rest
    assert '"schema_wait_stopped"' in rest
