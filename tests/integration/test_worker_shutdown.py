"""A worker stopped in its event loop leaves no task of its own or of procrastinate's
maintenance worker pending: asyncio reports one destroyed while pending as an error, which
an operator would read at every shutdown."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from tests.apps.plays import registry
from tests.workers import running_worker


async def test_a_stopped_worker_leaves_no_pending_task_behind(db_url: str) -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        for _ in range(2):
            async with running_worker(db_url, registry, concurrency=2):
                await asyncio.sleep(1.0)  # the maintenance worker is in its polling wait
            gc.collect()
            await asyncio.sleep(0.1)
            gc.collect()
    finally:
        loop.set_exception_handler(previous)
    destroyed = [c for c in reported if "destroyed but it is pending" in str(c.get("message"))]
    assert destroyed == [], [repr(c.get("task")) for c in destroyed]
    assert reported == []
