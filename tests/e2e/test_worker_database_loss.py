"""A worker survives its database: after a Postgres crash-restart it reconnects (LISTEN
included) and runs new work; when Postgres stays down it ends at its `--max-outage` with
`DATABASE_LOST` (exit 6), never 0 and never later; and a SIGTERM during an outage is
honoured within the grace. Uses its own server, since it restarts and stops it.

The times are read from the worker's own log lines (the first failure it saw, the moment
it declared the database lost, the stop signal) and bounded from above only: a slow
machine may make a worker notice late, never stop late."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queues.errors import ExitCode
from tests.workers import eventually, fetch, submit
from worker import embedded

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")
MAX_OUTAGE_S = 4.0
GRACE_S = 2.0
# What a stop may take beyond its bound: the last loop's turn, closing the pool, the
# heartbeat thread and the interpreter's exit, on a loaded machine. It stays under one
# more MAX_OUTAGE_S, so a worker that waited for the database once more (the limit per
# loop or per write these bounds exist for) still fails each of them.
MARGIN_S = 3.0
assert MARGIN_S < MAX_OUTAGE_S


@pytest.fixture
def own_server() -> Iterator[tuple[Path, str]]:
    home = Path(tempfile.mkdtemp(prefix="dbloss-", dir="/tmp"))
    home.chmod(0o755)
    try:
        server = embedded.ensure_running(home)
        with psycopg.connect(server.url("postgres"), autocommit=True) as admin:
            admin.execute("CREATE DATABASE loss")
        url = server.url("loss")
        env = dict(os.environ, WORKER_DATABASE_URL=url)
        subprocess.run([WORKER, "migrate"], env=env, check=True, capture_output=True)
        yield home, url
    finally:
        embedded.stop(home, mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def worker(url: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A `worker start` process (JSON logs in a file), ready; killed if still running."""
    ready = tmp_path / "ready"
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [
                WORKER,
                "--json-logs",
                "start",
                "--release",
                "t",
                "--app",
                "tests.apps.plays:registry",
                "--max-outage",
                f"{MAX_OUTAGE_S:g}s",
                "--grace",
                f"{GRACE_S:g}s",
                "--ready-file",
                str(ready),
            ],
            env=dict(os.environ, WORKER_DATABASE_URL=url, PYTHONPATH=str(ROOT)),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "the worker did not get ready"
            time.sleep(0.05)
        yield proc, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def lines(log_path: Path) -> list[dict[str, Any]]:
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and "event" in entry:
                found.append(entry)
    return found


def at(entry: dict[str, Any]) -> float:
    """A log line's time, as seconds since the epoch."""
    return datetime.fromisoformat(str(entry["timestamp"]).replace("Z", "+00:00")).timestamp()


def first(log_path: Path, event: str) -> dict[str, Any]:
    found = [e for e in lines(log_path) if e["event"] == event]
    assert found, f"no {event} in the worker's log: {log_path.read_text()[-4000:]}"
    return found[0]


async def busy_worker(url: str, count: int) -> None:
    """``count`` slow runs started (their attempts live through the outage)."""
    for _ in range(count):
        await submit(url, "slow", {"seconds": 120}, release="t")

    async def began() -> bool:
        rows = await fetch(url, "SELECT count(*) FROM wq_ledger WHERE kind = 'play.began'")
        return bool(rows[0][0] >= count)

    await eventually(began, timeout=30)


async def test_worker_reconnects_after_restart_and_ends_at_its_max_outage(
    own_server: tuple[Path, str], tmp_path: Path
) -> None:
    home, url = own_server
    with worker(url, tmp_path) as (proc, log_path):
        # A crash-restart: every connection of the worker dies at once.
        embedded.stop(home, mode="immediate")
        embedded.ensure_running(home)
        run_id = await submit(url, "echo", {"after": "restart"}, release="t")

        async def done() -> bool:
            ((state,),) = await fetch(
                url, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,)
            )
            return state == "succeeded"

        await eventually(done, timeout=30)
        assert proc.poll() is None  # it carried on

        # Postgres gone for good, with attempts running (their calls, the final writes of
        # their hand-backs and the stop's own writes all want the database): the worker
        # ends at its outage limit, not a limit per loop or per write later.
        await busy_worker(url, 3)
        embedded.stop(home, mode="immediate")
        killed = time.time()  # every connection is gone by now
        code = proc.wait(timeout=MAX_OUTAGE_S + 30)
        exited = time.time()
    assert code == ExitCode.DATABASE_UNREACHABLE, log_path.read_text()[-4000:]
    lost = first(log_path, "worker_database_lost")
    # Declared lost at the limit (the worker's own account says how long it waited), and
    # the process ended right then.
    down_s = float(lost["error"].split("did not answer for ")[1].split("s,")[0])
    assert down_s >= MAX_OUTAGE_S, lost
    assert at(lost) - killed <= MAX_OUTAGE_S + MARGIN_S, (killed, lost)
    assert exited - at(lost) <= MARGIN_S, log_path.read_text()[-4000:]
    assert "past the outage limit" in lost["error"]
    assert first(log_path, "worker_stopped")
    assert "error[DATABASE_LOST]" in log_path.read_text()


async def test_sigterm_during_an_outage_is_honoured_within_the_grace(
    own_server: tuple[Path, str], tmp_path: Path
) -> None:
    home, url = own_server
    with worker(url, tmp_path) as (proc, log_path):
        await busy_worker(url, 3)
        embedded.stop(home, mode="immediate")

        async def noticed() -> bool:
            return any(e["event"] == "database_unavailable" for e in lines(log_path))

        await eventually(noticed, timeout=MAX_OUTAGE_S)
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=GRACE_S + 30)
        exited = time.time()
    assert code == ExitCode.OK, log_path.read_text()[-4000:]
    stopping = first(log_path, "worker_stopping")
    assert exited - at(stopping) <= GRACE_S + MARGIN_S, log_path.read_text()[-4000:]
    # The attempts got their grace, then were left to their leases (nothing could be
    # written): a stop, not the outage's end.
    assert first(log_path, "shutdown_abandoned_attempts")["count"] == 3
    assert not [e for e in lines(log_path) if e["event"] == "worker_database_lost"]
