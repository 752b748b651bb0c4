"""Stop signals reach a loop only from the main thread; elsewhere the caller is told."""

from __future__ import annotations

import asyncio
import os
import signal

from worker import runtime


async def test_the_main_threads_loop_takes_sigterm_and_sigint() -> None:
    loop = asyncio.get_running_loop()
    called: list[int] = []
    assert runtime.on_stop_signals(lambda: called.append(1)) is True
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if called:
                break
            await asyncio.sleep(0.01)
        assert called == [1]
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)


async def test_a_loop_in_another_thread_installs_nothing_and_says_so() -> None:
    async def install() -> bool:
        return runtime.on_stop_signals(lambda: None)

    assert await asyncio.to_thread(asyncio.run, install()) is False
