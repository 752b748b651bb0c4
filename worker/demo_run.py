"""``worker demo``: the whole system on the embedded database in under a minute.

Migrates, starts a worker in-process, admits an ``enrich`` run over the bundled sample,
follows it live with a progress bar, prints a summary and shuts everything down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from queues import admission, inputs, migrations, runs
from worker import db, observe, runtime
from worker.demo import demo_plays, sample_path

DEMO_RELEASE = "demo"


async def run_demo(url: str, *, rows: int, echo: Callable[[str], None]) -> int:
    started = time.perf_counter()
    conn = await db.connect(url, autocommit=True)
    async with conn:
        report = await migrations.migrate(conn)
        echo(f"schema ready (version {report.contract.version})")
    worker = runtime.Worker(
        runtime.Settings(
            url=url, release=DEMO_RELEASE, registry=demo_plays, concurrency=4, grace_s=5.0
        )
    )
    serving = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        return serving.result() or 1
    echo(f"worker ready on lane {worker.lane_names[0]}")
    try:
        sample = inputs.read_rows(sample_path())[:rows]
        conn = await db.connect(url, autocommit=True)
        async with conn:
            admitted = await admission.Admitter().submit(
                conn,
                admission.Submission(
                    play="enrich", params={"page_delay_s": 0.8}, release=DEMO_RELEASE
                ),
                url=url,
                known_plays=demo_plays.names(),
                inputs=sample,
            )
        echo(f"admitted run {admitted.run_id} with {len(sample)} rows")
        code = await observe.follow(url, admitted.run_id, echo)
        conn = await db.connect(url, autocommit=True)
        async with conn:
            run = await runs.get(conn, admitted.run_id)
        echo("")
        echo(f"summary: {json.dumps(run.result, sort_keys=True)}")
        echo(f"finished in {time.perf_counter() - started:.1f}s")
        echo("look closer:")
        echo(f"  worker runs show {run.id}")
        echo(f"  worker result {run.id} --json")
        echo("  worker queues list")
        return code
    finally:
        worker.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
