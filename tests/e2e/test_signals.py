"""Shutdown signals: the first SIGTERM stops claiming and waits out the grace period; a
second one exits at once (non-zero), leaving the run to recovery."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workers import eventually, run_state, submit

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")


async def test_a_second_sigterm_exits_at_once(db_url: str, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
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
        stderr=subprocess.DEVNULL,
    )
    try:

        async def is_ready() -> bool:
            return ready.exists()

        await eventually(is_ready, timeout=30)
        run_id = await submit(db_url, "slow", {"seconds": 120}, release="t")

        async def running() -> bool:
            return await run_state(db_url, run_id) == "running"

        await eventually(running, timeout=30)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # the first signal waits for the run (grace 60 s)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(timeout=10) == 1
        assert time.monotonic() - started < 5
        assert await run_state(db_url, run_id) == "running"  # its lease will lapse
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
