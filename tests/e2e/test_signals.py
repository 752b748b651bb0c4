"""Shutdown signals: the first SIGTERM stops claiming and waits out the grace period; a
second one exits at once (non-zero), leaving the run to recovery."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import ledgers
from tests.workers import eventually, run_state, submit

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")


async def test_a_second_sigterm_exits_at_once(db_url: str, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [
                WORKER,
                "start",
                "--release",
                "t",
                "--app",
                "tests.apps.plays:registry",
                "--grace",
                "60",
                "--ready-file",
                str(ready),
            ],
            env=dict(os.environ, WORKER_DATABASE_URL=db_url, PYTHONPATH=str(ROOT)),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:

        async def is_ready() -> bool:
            return ready.exists()

        await eventually(is_ready, timeout=30)
        run_id = await submit(db_url, "slow", {"seconds": 120}, release="t")

        async def began() -> bool:
            # The play itself runs (a run is `running` from its claim: a stop that lands
            # before the claimed run starts hands it back at once).
            return bool(await ledgers.events(db_url, run_id, "play.began"))

        await eventually(began, timeout=30)
        assert await run_state(db_url, run_id) == "running"
        proc.send_signal(signal.SIGTERM)

        async def stopping() -> bool:
            return b"worker_stopping" in log_path.read_bytes()

        await eventually(stopping, timeout=30)
        # The first signal waits for the run (grace 60 s): still alive, the run still runs.
        assert proc.poll() is None
        assert await run_state(db_url, run_id) == "running"
        proc.send_signal(signal.SIGTERM)
        # The second exits at once, non-zero (the wait is only a hang guard).
        code = proc.wait(timeout=30)
        assert code == 1, (code, log_path.read_text(errors="replace")[-4000:])
        assert b"worker_exit_now" in log_path.read_bytes()
        assert await run_state(db_url, run_id) == "running"  # its lease will lapse
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
