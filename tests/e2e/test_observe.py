"""`worker observe` follows a run live (ledger lines and a progress bar over its rows) and
exits with the run's outcome once it is terminal."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.workers import running_worker, submit
from worker.demo import demo_plays

WORKER = str(Path(sys.executable).parent / "worker")


async def test_observe_follows_a_run_to_its_end_with_progress(db_url: str) -> None:
    rows = [(f"c{i}", {"domain": f"d{i}.com", "employees": i}) for i in range(2500)]
    run_id = await submit(db_url, "enrich", {"page_delay_s": 0.2}, release="obs", inputs=rows)
    observer = await asyncio.create_subprocess_exec(
        WORKER,
        "observe",
        str(run_id),
        env=dict(os.environ, WORKER_DATABASE_URL=db_url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with running_worker(db_url, demo_plays, release="obs"):
        out, _ = await asyncio.wait_for(observer.communicate(), 60)
    text = out.decode()
    assert observer.returncode == 0
    assert "run_created" in text and "attempt_started" in text and "run_succeeded" in text
    assert "2500/2500 rows" in text  # the total is known from the submit on
    assert f"run {run_id} succeeded" in text
