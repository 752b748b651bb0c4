"""A worker survives its database: after a Postgres crash-restart it reconnects (LISTEN
included) and runs new work; when Postgres stays down it exits non-zero, never 0 and
never hanging. Uses its own server, since it restarts and stops it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.workers import eventually, fetch, submit
from worker import embedded

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")


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


async def test_worker_reconnects_after_restart_and_exits_1_when_postgres_stays_down(
    own_server: tuple[Path, str], tmp_path: Path
) -> None:
    home, url = own_server
    ready = tmp_path / "ready"
    env = dict(os.environ, WORKER_DATABASE_URL=url, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            WORKER,
            "start",
            "--release",
            "t",
            "--app",
            "tests.apps.plays:registry",
            "--max-outage",
            "4",
            "--ready-file",
            str(ready),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        async def is_ready() -> bool:
            return ready.exists()

        await eventually(is_ready, timeout=30)

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

        # Postgres gone for good: the worker must exit non-zero within its outage limit.
        embedded.stop(home, mode="immediate")
        started = time.monotonic()
        code = proc.wait(timeout=60)
        assert code == 1
        assert time.monotonic() - started < 30
        assert proc.stderr is not None
        assert b"database" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
