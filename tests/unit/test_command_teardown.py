"""A command ends when its own work does (worker.cli.common.run): a task it left running
that swallows cancellation (an attempt abandoned at the end of the grace, whose play does
not notice it was told to stop) no longer keeps the process alive, as asyncio.run's
unbounded teardown did."""

from __future__ import annotations

import asyncio
import threading

from structlog.testing import capture_logs

from worker.cli import common


async def _stubborn(started: asyncio.Event, gave_up: threading.Event) -> None:
    started.set()
    while not gave_up.is_set():
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()  # like code that does not notice it was told to stop


def test_a_task_that_swallows_cancellation_does_not_keep_the_command_alive() -> None:
    gave_up = threading.Event()
    answers: list[int] = []
    kept: list[asyncio.Task[None]] = []  # the command's leftovers, as a worker keeps them

    async def command() -> int:
        started = asyncio.Event()
        kept.append(asyncio.create_task(_stubborn(started, gave_up), name="stubborn-attempt"))
        await started.wait()
        return 7

    with capture_logs() as logs:
        thread = threading.Thread(target=lambda: answers.append(common.run(command())), daemon=True)
        thread.start()
        thread.join(timeout=30)
    ended = not thread.is_alive()
    gave_up.set()  # let the stubborn task end, whatever happened
    assert ended, "the command's teardown waited for a task that ignores cancellation"
    assert answers == [7]
    [left] = [e for e in logs if e["event"] == "tasks_left_at_exit"]
    assert left["tasks"] == ["stubborn-attempt"] and left["log_level"] == "error"


def test_tasks_that_end_when_cancelled_are_waited_for() -> None:
    ended: list[str] = []
    kept: list[asyncio.Task[None]] = []

    async def polite() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def command() -> str:
        kept.append(asyncio.create_task(polite(), name="polite"))
        await asyncio.sleep(0)
        return "done"

    assert common.run(command()) == "done"
    assert ended == ["cancelled"]
