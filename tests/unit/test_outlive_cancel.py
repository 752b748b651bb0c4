"""Stopping procrastinate's maintenance worker: a cancel of the waiter is passed on only
after the worker ended, never into it (worker.recovery._outlive_cancel)."""

from __future__ import annotations

import asyncio

import pytest

from worker.recovery import _outlive_cancel


async def test_a_cancelled_waiter_still_waits_for_the_task_and_does_not_cancel_it() -> None:
    async def shutdown() -> str:
        await asyncio.sleep(0.2)
        return "stopped"

    task = asyncio.create_task(shutdown())
    waiter = asyncio.create_task(_outlive_cancel(task))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert task.done() and not task.cancelled()
    assert task.result() == "stopped"


async def test_a_second_cancel_while_waiting_is_not_passed_on_either() -> None:
    task = asyncio.create_task(asyncio.sleep(0.2, "stopped"))
    waiter = asyncio.create_task(_outlive_cancel(task))
    for _ in range(2):
        await asyncio.sleep(0.03)
        waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert task.result() == "stopped"


async def test_the_tasks_own_failure_is_raised_and_its_cancel_is_not() -> None:
    async def broken() -> None:
        raise ValueError("pool gone")

    failed = asyncio.create_task(broken())
    with pytest.raises(ValueError, match="pool gone"):
        await _outlive_cancel(failed)

    stopped = asyncio.create_task(asyncio.sleep(10))
    await asyncio.sleep(0)
    stopped.cancel()  # how the maintenance worker is asked to stop
    assert await _outlive_cancel(stopped) is None
