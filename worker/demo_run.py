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
from worker import config, db, observe, runtime
from worker.demo import demo_with_sandbox, sample_path

DEMO_RELEASE = "demo"


async def run_demo(
    urls: Callable[[config.Purpose], str],
    *,
    rows: int,
    echo: Callable[[str], None],
    token_secret: bytes,
    after_migrate: Callable[[], None] = lambda: None,
) -> int:
    """The demo. ``urls`` gives each purpose's URL: it migrates as the owner, then runs the
    worker as the worker role and follows the run as the reader (least privilege)."""
    started = time.perf_counter()
    async with db.session(urls(config.Purpose.MIGRATE)) as conn:
        report = await migrations.migrate(conn)
        echo(f"schema ready (version {report.contract.version})")
    after_migrate()
    url = urls(config.Purpose.WORKER)
    worker = runtime.Worker(
        runtime.Settings(
            url=url,
            release=DEMO_RELEASE,
            registry=demo_with_sandbox,
            concurrency=4,
            grace_s=5.0,
            token_secret=token_secret,
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
        async with db.session(url) as conn:
            admitted = await admission.Admitter().submit(
                conn,
                admission.Submission(
                    play="enrich", params={"page_delay_s": 0.8}, release=DEMO_RELEASE
                ),
                known_plays=demo_with_sandbox.names(),
                inputs=sample,
            )
        echo(f"admitted run {admitted.run_id} with {len(sample)} rows")
        code = await observe.follow(urls(config.Purpose.READ), admitted.run_id)
        async with db.session(url) as conn:
            run = await runs.get(conn, admitted.run_id)
        echo("")
        echo(f"summary: {json.dumps(run.result, sort_keys=True)}")
        # The same play, sandboxed: a child process with a token and no credentials.
        async with db.session(url) as conn:
            boxed = await admission.Admitter().submit(
                conn,
                admission.Submission(play="enrich-sandboxed", release=DEMO_RELEASE),
                known_plays=demo_with_sandbox.names(),
                inputs=sample[:100],
            )
        done = await observe.wait_terminal(urls(config.Purpose.READ), boxed.run_id, timeout=60)
        state = done.state if done is not None else "still running"
        echo(
            f"sandboxed run {boxed.run_id} (100 rows, through the runtime gateway with a "
            f"token, no database credentials in its process): {state}"
        )
        if done is None or done.state != "succeeded":
            code = code or 1
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
