"""A service process's stop signals (SIGTERM, SIGINT), kept from its first line to its exit.

asyncio takes signals only while a loop runs and puts the default handlers back when the
loop closes. A service command runs several loops in turn (wait for the schema, then
serve) and works between them (load the app, prepare the lane); a signal in such a gap
would kill the process by default, which a supervisor reports as a death by SIGTERM
rather than a clean stop. So a service calls :func:`latch` first: from then on every stop
signal is counted, and a loop that registers with :func:`on_stop_signals` later still
hears one that came before it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Latch:
    """The process's one latch: the signals counted and the loops listening."""

    def __init__(self) -> None:
        self.received = 0
        self.installed = False
        self.listeners: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []

    def on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.received += 1
        for loop, callback in self.live():
            loop.call_soon_threadsafe(callback)

    def live(self) -> list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]]:
        self.listeners[:] = [(loop, cb) for loop, cb in self.listeners if not loop.is_closed()]
        return list(self.listeners)


_LATCH = _Latch()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def latch() -> bool:
    """Keep stop signals from now on (only the main thread can); whether it could."""
    if not _in_main_thread():
        return False
    if not _LATCH.installed:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _LATCH.on_signal)
        _LATCH.installed = True
    return True


def received() -> int:
    """Stop signals since :func:`latch`."""
    return _LATCH.received


def on_stop_signals(callback: Callable[[], None]) -> bool:
    """Call ``callback`` on the running loop for every stop signal, and at once (soon) when
    one came already; whether it could.

    Only the main thread takes signals. Elsewhere (a worker run by a test, or inside an
    application's own thread) nothing is installed and False comes back: that caller stops
    its loop another way (``Worker.stop``, its own stop event).
    """
    if not latch():
        return False
    loop = asyncio.get_running_loop()
    _LATCH.live()
    _LATCH.listeners.append((loop, callback))
    if _LATCH.received:
        loop.call_soon(callback)
    return True


def release() -> None:
    """Forget the listeners and the count and put the default handlers back (tests)."""
    if _LATCH.installed and _in_main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _LATCH.listeners.clear()
    _LATCH.received = 0
    _LATCH.installed = False
