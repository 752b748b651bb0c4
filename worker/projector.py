"""The projector: delivers the run ledger's outbox to its sinks (when and how).

``queues.ledger`` owns what a delivery is (the lease, the fenced marks); this module owns
the loop and the HTTP client. It runs inside ``worker start`` (one more loop of the worker)
and ``worker recover --every`` (next to the recovery passes): no process of its own. Any
number of projectors share one outbox: a lease is taken with ``FOR UPDATE SKIP LOCKED``,
so no row is delivered by two at once. The built-in progress sink needs no projector: the
statement that appends the events folds them (``queues.ledger``).

One pass (:func:`project_once`): lease a batch of due deliveries; POST their events (a
thread pool of its own, standard library ``urllib``, ``timeout_s`` each, no redirects
followed) with ``Idempotency-Key: <run_id>:<seq>``; mark the 2xx answers delivered and
record every other answer or connection error as a failure, retried with capped
exponential backoff. A mark is applied only while the lease is still this projector's; a
lease that lapsed mid-delivery was taken over, and the next holder delivers again with the
same key (receivers dedupe on it).

The loop (:func:`project_forever`), on a connection of its own, LISTENs on ``wq_outbox``
(a statement that wrote outbox rows NOTIFYs it: an HTTP sink is enabled, migration 0033;
it listened to every ledger append before, and ran a pass for each) and polls every
``poll_s`` as well (a lost notification, a retry coming due), outlives database outages
(reconnecting with backoff; a failover is one: every new connection of a multi-host URL
finds the new primary) and never ends before its stop event. Given the process's
:class:`worker.outage.Downtime`, it counts its lost connections and its passes in the
process's outage, whose owner ends the process past its ``--max-outage``. Inside a worker it only
polls (``listen=False``): with HTTP sinks enabled, every append would notify every worker
host, and ``bench.scale`` shows the CPU per run those notifications cost at many hosts;
a delivery then waits up to ``poll_s``. Behind a transaction-mode pooler
it polls too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import socket
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import structlog

from queues import ledger
from queues.errors import InvalidField
from worker import db
from worker.blips import is_blip
from worker.config import PoolMode
from worker.outage import Downtime

log = structlog.get_logger("worker.projector")

TIMEOUT_S = 5.0  # one HTTP delivery, connect to last byte
CONCURRENCY = 10  # HTTP deliveries at once, per projector
POLL_S = 1.0  # a pass at least this often without a notification
CHANNEL = "wq_outbox"  # an append NOTIFYs it when it wrote outbox rows (migration 0033)
MAX_BACKOFF_S = 5.0  # between reconnects while the database is away
_BODY_SAMPLE = 200  # characters of a failing answer kept in last_error


@dataclass(frozen=True, slots=True)
class Report:
    """What one pass did."""

    leased: int = 0  # deliveries leased
    delivered: int = 0  # 2xx answers recorded
    failed: int = 0  # failures recorded, each with its retry time
    lost: int = 0  # deliveries whose lease another projector took before the mark


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a redirect is not a 2xx: a failed delivery, never re-sent elsewhere


_OPENER = urllib.request.build_opener(_NoRedirect)


def post_json(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> str | None:
    """POST ``body`` to ``url``; None for a 2xx answer, else what went wrong (blocking)."""
    request = urllib.request.Request(url, data=body, method="POST", headers=dict(headers))
    try:
        with _OPENER.open(request, timeout=timeout_s) as answer:
            answer.read(64 * 1024)  # drain a little so the connection closes cleanly
            return None
    except urllib.error.HTTPError as exc:
        with contextlib.closing(exc):
            sample = exc.read(_BODY_SAMPLE).decode("utf-8", "replace").strip()
        return f"HTTP {exc.code}" + (f": {sample}" if sample else "")
    except urllib.error.URLError as exc:
        return f"connection failed: {exc.reason}"
    except Exception as exc:  # a timeout, a reset, a malformed answer: the sink's failure
        return f"delivery failed: {exc!r}"[: _BODY_SAMPLE * 2]


def headers_for(delivery: ledger.Delivery) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Idempotency-Key": delivery.idempotency_key,
        "User-Agent": "worker-projector",
    }


async def project_once(
    conn: psycopg.AsyncConnection[Any],
    owner: str,
    *,
    limit: int = ledger.DEFAULT_BATCH,
    lease_s: float = ledger.DEFAULT_LEASE_S,
    timeout_s: float = TIMEOUT_S,
    now: datetime | None = None,
    executor: ThreadPoolExecutor | None = None,
    rng: random.Random | None = None,
) -> Report:
    """Lease a batch of due deliveries, deliver them, record each outcome (fenced)."""
    http = await ledger.lease_deliveries(conn, owner, limit, lease_s, now=now)
    if not http:
        return Report()
    loop = asyncio.get_running_loop()
    errors = await asyncio.gather(
        *(
            loop.run_in_executor(
                executor,
                post_json,
                d.url or "",
                json.dumps(d.body(), separators=(",", ":"), default=str).encode(),
                headers_for(d),
                timeout_s,
            )
            for d in http
        )
    )
    ok = [d.id for d, error in zip(http, errors, strict=True) if error is None]
    marked = await ledger.mark_delivered(conn, owner, ok, now=now)
    failed = 0
    for d, error in zip(http, errors, strict=True):
        if error is None:
            continue
        retry_at = d.retry_at(rng=rng)
        if await ledger.mark_failed(conn, owner, d.id, error, retry_at):
            failed += 1
            log.warning(
                "delivery_failed",
                sink=d.sink,
                run_id=str(d.event.run_id),
                seq=d.event.seq,
                attempts=d.attempts,
                error=error,
                retry_at=retry_at.isoformat(),
            )
    report = Report(
        leased=len(http),
        delivered=len(marked),
        failed=failed,
        lost=len(http) - len(marked) - failed,
    )
    if report.lost:
        log.warning("delivery_lease_lost", owner=owner, deliveries=report.lost)
    return report


def check_settings(*, batch: int, lease_s: float, timeout_s: float, concurrency: int) -> None:
    """A batch of HTTP deliveries must finish well inside its lease, or another projector
    takes it over and every receiver sees it twice."""
    worst_s = math.ceil(batch / concurrency) * timeout_s
    if batch < 1 or concurrency < 1 or worst_s >= lease_s:
        raise InvalidField(
            f"a batch of {batch} deliveries, {concurrency} at a time, {timeout_s:g}s each, "
            f"can outlast its {lease_s:g}s lease",
            field="lease_s",
            rule="ceil(batch / concurrency) * timeout_s < lease_s",
            fix="lower the batch or the timeout, or raise the lease",
        )


def default_owner(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


async def project_forever(
    url: str,
    stop: asyncio.Event,
    *,
    owner: str | None = None,
    batch: int = ledger.DEFAULT_BATCH,
    lease_s: float = ledger.DEFAULT_LEASE_S,
    timeout_s: float = TIMEOUT_S,
    concurrency: int = CONCURRENCY,
    poll_s: float = POLL_S,
    listen: bool = True,
    mode: PoolMode | None = None,
    downtime: Downtime | None = None,
) -> int:
    """Deliver the outbox until ``stop`` is set; returns the deliveries made.

    With ``listen`` the loop LISTENs on its connection, unless ``mode`` (default:
    ``WORKER_POOL_MODE``) is a transaction pooler; otherwise it polls every ``poll_s``.
    It never ends before ``stop`` (a failure is logged, the connection replaced after a
    backoff), so it can run next to loops whose end means the process ends.
    """
    check_settings(batch=batch, lease_s=lease_s, timeout_s=timeout_s, concurrency=concurrency)
    owner = owner or default_owner("projector")
    executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="wq-projector")
    try:
        delivered = await _loop(
            url,
            stop,
            owner=owner,
            batch=batch,
            lease_s=lease_s,
            timeout_s=timeout_s,
            poll_s=poll_s,
            executor=executor,
            listen=listen,
            mode=mode,
            downtime=downtime,
        )
    finally:
        # A delivery still in flight ends at its timeout; its lease lapses and another
        # projector delivers it again, under the same key.
        executor.shutdown(wait=False, cancel_futures=True)
    log.info("projector_stopped", owner=owner, delivered=delivered)
    return delivered


async def _loop(
    url: str,
    stop: asyncio.Event,
    *,
    owner: str,
    batch: int,
    lease_s: float,
    timeout_s: float,
    poll_s: float,
    executor: ThreadPoolExecutor,
    listen: bool,
    mode: PoolMode | None,
    downtime: Downtime | None,
) -> int:
    delivered = 0
    delay = 0.1
    listen = listen and db.listens(mode)
    while not stop.is_set():
        try:
            async with db.session(url, mode=mode, application=f"wq-projector {owner}") as conn:
                if listen:
                    await conn.execute(f"LISTEN {CHANNEL}")
                if delay > 0.1:
                    log.info("projector_reconnected", owner=owner)
                delay = 0.1
                while not stop.is_set():
                    report = await project_once(
                        conn,
                        owner,
                        limit=batch,
                        lease_s=lease_s,
                        timeout_s=timeout_s,
                        executor=executor,
                    )
                    delivered += report.delivered
                    if downtime is not None:
                        downtime.ok()
                    if report.leased < batch:
                        if listen:
                            await _wait(conn, stop, poll_s)
                        else:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(stop.wait(), poll_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database went away, or a bug: never fatal here
            log.warning("projector_failed", owner=owner, error=repr(exc)[:300])
            if downtime is not None and is_blip(exc):
                downtime.failed("projector", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
    return delivered


def start(
    url: str,
    stop: asyncio.Event,
    *,
    owner: str | None = None,
    listen: bool = True,
    mode: PoolMode | None = None,
    downtime: Downtime | None = None,
) -> asyncio.Task[int]:
    """:func:`project_forever` as a task, next to a worker's or a recoverer's loops (their
    process's ``downtime``)."""
    return asyncio.create_task(
        project_forever(url, stop, owner=owner, listen=listen, mode=mode, downtime=downtime),
        name="projector",
    )


async def _wait(conn: psycopg.AsyncConnection[Any], stop: asyncio.Event, timeout_s: float) -> None:
    """Until a ledger notification, ``stop``, or ``timeout_s``."""

    async def notified() -> None:
        async for _ in conn.notifies(timeout=timeout_s, stop_after=1):
            break
        # Whatever else arrived meanwhile is covered by the same next pass.
        async for _ in conn.notifies(timeout=0):
            pass

    listening = asyncio.ensure_future(notified())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({listening, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not listening.done():
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
    if listening.done() and not listening.cancelled():
        listening.result()  # re-raises a lost connection: the loop reconnects
