"""A worker's LISTEN session: it hears and tells, and decides nothing.

One session (a direct or session-mode URL, never pooled) listens on the worker's lanes'
job channels, the control channel and the worker's own wake channel, and holds the
worker's liveness lock: while it lasts the worker is not gone; when it ends its leases are
rescued within seconds (:mod:`worker.peers`), and spawns stop waking it on its own channel
(migration 0032). Cut off, it reconnects; past the worker's outage limit the outage account
stops the worker (:mod:`worker.outage`). What each notification means is its listener's:
``on_listening`` once listening (anything spawned before it listened), ``on_control`` with
a control message's payload, ``on_wake`` for a job's wake (``True``: on this worker's own
channel), awaited in the turn that read it so a claim for it goes out first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from queues import runs, transport
from queues.errors import DatabaseUnreachable
from worker import db
from worker.config import PoolMode
from worker.outage import TRANSIENT, Downtime, Outage


class Notifier:
    def __init__(
        self,
        url: str,
        *,
        lanes: Sequence[str],
        worker_id: str,
        downtime: Downtime,
        on_listening: Callable[[], None],
        on_control: Callable[[str], None],
        on_wake: Callable[[bool], Awaitable[None]],
    ) -> None:
        self._url = url
        self._lanes = list(lanes)
        self._worker_id = worker_id
        self._downtime = downtime
        self._on_listening = on_listening
        self._on_control = on_control
        self._on_wake = on_wake

    async def run(self) -> None:
        outage = Outage("listen", self._downtime)
        while True:
            try:
                async with db.session(
                    self._url, mode=PoolMode.SESSION, application=f"wq-listen {self._worker_id}"
                ) as conn:
                    await transport.listen(conn, self._lanes)
                    own = await runs.hold_liveness(conn, self._worker_id)
                    await transport.listen_wake(conn, own)
                    outage.ok()
                    self._on_listening()
                    async for note in conn.notifies():
                        if note.channel == transport.CONTROL_CHANNEL:
                            self._on_control(note.payload)
                        else:
                            await self._on_wake(note.channel == own)
            except (*TRANSIENT, DatabaseUnreachable) as exc:
                await outage.failed(exc)
