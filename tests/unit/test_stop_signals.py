"""Stop signals reach a loop only from the main thread; elsewhere the caller is told. A
signal between two loops of one service process is kept for the next (worker.stopping)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from worker import stopping


@pytest.fixture
def released() -> Iterator[None]:
    yield
    stopping.release()


async def test_the_main_threads_loop_takes_sigterm_and_sigint(released: None) -> None:
    called: list[int] = []
    assert stopping.on_stop_signals(lambda: called.append(1)) is True
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(os.getpid(), sig)
    for _ in range(100):
        if len(called) == 2:
            break
        await asyncio.sleep(0.01)
    assert called == [1, 1]
    assert stopping.received() == 2


async def test_a_loop_in_another_thread_installs_nothing_and_says_so() -> None:
    async def install() -> bool:
        return stopping.on_stop_signals(lambda: None)

    assert await asyncio.to_thread(asyncio.run, install()) is False


def test_release_puts_the_default_handlers_back() -> None:
    assert stopping.latch() is True
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    stopping.release()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


SERVICE = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from worker import stopping

    def asyncio_only(callback):  # handlers only while a loop runs
        loop = asyncio.get_running_loop()
        for sig in stopping.STOP_SIGNALS:
            loop.add_signal_handler(sig, callback)

    latched = sys.argv[1] == "latch"
    listen = stopping.on_stop_signals if latched else asyncio_only
    if latched:
        stopping.latch()

    async def first() -> None:  # like waiting for the schema
        listen(lambda: None)

    asyncio.run(first())
    os.kill(os.getpid(), signal.SIGTERM)  # the gap between loops

    async def serve() -> int:
        stop = asyncio.Event()
        listen(stop.set)
        await asyncio.wait_for(stop.wait(), timeout=10)
        return 0

    sys.exit(asyncio.run(serve()))
    """
)


@pytest.mark.parametrize(("how", "returncode"), [("latch", 0), ("asyncio", -signal.SIGTERM)])
def test_a_signal_between_two_loops_stops_the_next_loop_cleanly(how: str, returncode: int) -> None:
    # With asyncio's handlers alone the gap has the default one: death by SIGTERM.
    done = subprocess.run(
        [sys.executable, "-c", SERVICE, how],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == returncode, done.stderr
