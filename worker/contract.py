"""How a run context reaches the operation contract: typed calls, two ways to run them.

A run context hands its transport typed calls (:mod:`queues.calls`) with :meth:`run`.
``call(action, payload)`` sends a wire dict, as the reference runtime's clients do.

- :class:`LocalTransport` (in-process plays): runs each call with
  :func:`queues.operations.perform` on a pooled connection with the attempt's claims, the
  same policy and the same calls the gateway's dispatch serves; no dict on the way. With
  ``hold``, the attempt keeps the connection it took between its calls (see the class).
- :class:`Absorbing` wraps either: a call that lost its connection
  (:func:`worker.blips.is_blip`) is
  sent again, with capped backoff, while the outage lasts less than ``max_outage_s``, when
  its action is repeatable (:attr:`queues.operations.Action.repeatable`). A play's ``ctx``
  calls just take longer through a database restart or a terminated backend.
- :class:`GatewayTransport` (sandboxed plays): encodes the call with its action's codec
  (:data:`queues.operations.ACTIONS`) and posts it to the gateway with
  the attempt's token (the run-ledger token for the ledger actions), with the reference
  runtime's per-action timeouts, and turns an error answer back into the error it was.
  An answer of an older gateway that lacks the stable-intent admission becomes
  ``RUNTIME_SHEET_WRITE_INTENT_UNAVAILABLE`` (retry after the rollout), never a fallback.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import httpx
import structlog
from psycopg_pool import AsyncConnectionPool

from queues import authority, calls, errors, operations, runs
from queues.authority import Claims
from queues.errors import InvalidField, WriteIntentUnavailable
from worker.blips import is_blip

log = structlog.get_logger("worker.contract")

T = TypeVar("T")

ABSORB_FIRST_DELAY_S = 0.05
ABSORB_MAX_DELAY_S = 1.0

INTENT_ACTION = "runtime_sheet_start_with_intent"
# The answers of a receiver that does not have the intent action (the reference's list).
_OLDER_RECEIVER_MESSAGES = (
    operations.SCOPE_MESSAGE,
    "Unsupported runtime data-plane action.",
    f"Unsupported action: {INTENT_ACTION}",
)


class WireSender(Protocol):
    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        """Send a wire request (an action and its camelCase input); the wire's answer."""
        ...


class Transport(WireSender, Protocol):
    async def run(self, call: calls.Call[T]) -> T:
        """Run a typed call for the attempt; its typed answer."""
        ...


async def run_over_wire(sender: WireSender, call: calls.Call[T]) -> T:
    """A typed call sent as its wire request: encoded with its action's codec, and the
    wire's answer decoded back (the client's half of the codec the gateway serves)."""
    codec = operations.codec(call.action)
    key = call.key if isinstance(call, calls.LedgerDelivery) else None
    answer: T = codec.answer(await sender.call(call.action, codec.wire(call), idempotency_key=key))
    return answer


class OverWire:
    """A transport that speaks only the wire (``call``), given typed calls through the
    codecs (:func:`run_over_wire`)."""

    def __init__(self, inner: WireSender) -> None:
        self.inner = inner

    async def run(self, call: calls.Call[T]) -> T:
        return await run_over_wire(self.inner, call)

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        return await self.inner.call(action, payload, idempotency_key=idempotency_key)


def typed(transport: Transport | WireSender) -> Transport:
    """``transport`` as one that runs typed calls (one that speaks only the wire is
    wrapped in :class:`OverWire`)."""
    if callable(getattr(transport, "run", None)):
        return transport  # type: ignore[return-value]
    return OverWire(transport)


def _body(action: str, payload: dict[str, Any], key: str | None, owner: str) -> dict[str, Any]:
    body: dict[str, Any] = {"action": action, "input": payload}
    if key is not None:  # a keyed outbox delivery: the key and the delivery lease owner
        body["idempotencyKey"] = key
        body["deliveryLeaseOwner"] = owner
    return body


class Absorbing:
    """A transport that absorbs blips: a repeatable call that failed with :func:`is_blip`
    is sent again, backing off from 50 ms to 1 s, until it is answered or the outage has
    lasted ``max_outage_s`` (then its error goes to the play, and the attempt ends as
    interrupted). Safe because every repeatable write is recognized when it is sent again
    after a commit whose answer was lost (``tests/db/test_repeatable_actions.py``), and
    bounded by the lease: a worker that cannot renew it stops the attempt (the heartbeat's
    watchdog), and the fence refuses whatever a stopped attempt still sends.

    ``on_absorbed(action)`` is told of each retried call once it was answered;
    ``before_retry()`` runs before each retry (a pool's check, :class:`PoolCheck`)."""

    def __init__(
        self,
        inner: Transport | WireSender,
        *,
        max_outage_s: float,
        on_absorbed: Callable[[str], None] | None = None,
        before_retry: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.inner = inner
        self.max_outage_s = max_outage_s
        self._on_absorbed = on_absorbed
        self._before_retry = before_retry
        self._absorbed: collections.Counter[str] | None = None  # made at the first absorbed

    async def run(self, call: calls.Call[T]) -> T:
        inner = typed(self.inner)
        answer: T = await self._absorb(call.action, lambda: inner.run(call))
        return answer

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        return await self._absorb(
            action, lambda: self.inner.call(action, payload, idempotency_key=idempotency_key)
        )

    async def _absorb(self, action: str, send: Callable[[], Awaitable[Any]]) -> Any:
        since: float | None = None
        delay = ABSORB_FIRST_DELAY_S
        while True:
            try:
                answer = await send()
            except Exception as exc:
                if not is_blip(exc) or not operations.repeatable(action):
                    raise
                now = time.monotonic()
                since = now if since is None else since
                if now - since + delay > self.max_outage_s:
                    raise
                log.warning(
                    "call_blip",
                    action=action,
                    error=str(exc).strip()[:300],
                    down_s=round(now - since, 2),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, ABSORB_MAX_DELAY_S)
                if self._before_retry is not None:
                    await self._before_retry()
                continue
            if since is not None:
                if self._absorbed is None:
                    self._absorbed = collections.Counter()
                self._absorbed[action] += 1
                log.info("call_absorbed", action=action, down_s=round(time.monotonic() - since, 2))
                if self._on_absorbed is not None:
                    self._on_absorbed(action)
            return answer

    @property
    def absorbed(self) -> collections.Counter[str]:
        """The calls answered after a blip was absorbed, by action."""
        return self._absorbed if self._absorbed is not None else collections.Counter()

    async def aclose(self) -> None:
        closing = getattr(self.inner, "aclose", None)
        if closing is not None:
            await closing()


class PoolCheck:
    """A pool's idle connections checked after a blip, once at a time for all attempts.

    A server that cut every connection (a restart, a failover) leaves the pool's idle ones
    dead too, and the pool hands them out unchecked: each retry would take the next dead
    one. One check replaces them all; attempts that meet the blip meanwhile wait for the
    check under way instead of starting their own."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool
        self._running: asyncio.Future[None] | None = None
        self.checks = 0

    async def __call__(self) -> None:
        if self._running is None or self._running.done():
            self.checks += 1
            self._running = asyncio.ensure_future(self._pool.check())
        try:
            await asyncio.shield(self._running)
        except Exception as exc:  # the next call meets the outage again, and says so
            log.debug("pool_check_failed", error=str(exc).strip()[:300])


def in_process_claims(c: runs.Claimed, owner: str, ledger: bool) -> Claims:
    """An in-process attempt's claims, from its run's authority: the executor's, or with
    ``ledger`` the ledger projector's."""
    assert c.attempt is not None
    capabilities = [authority.LEDGER_PROJECT] if ledger else None
    return authority.claims_of_attempt(
        c.descriptor, attempt=c.attempt, owner=owner, capabilities=capabilities
    )


class _AttemptClaims:
    """An in-process attempt's claims, each kind made at its first call that needs it (most
    attempts of a trivial play make no call): ``make(False)`` the executor's,
    ``make(True)`` the ledger projector's, for the ledger's actions."""

    __slots__ = ("_made", "_make")

    def __init__(self, make: Callable[[bool], Claims]) -> None:
        self._make = make
        self._made: dict[bool, Claims] = {}

    def of(self, action: str) -> Claims:
        ledger = action in operations.LEDGER_ACTIONS
        claims = self._made.get(ledger)
        if claims is None:
            claims = self._made[ledger] = self._make(ledger)
        return claims


class ConnectionTransport:
    """In process, on one connection its caller holds (a test's transaction,
    :mod:`worker.testing`): the gateway's own dispatch with the attempt's claims, one call
    at a time (calls a play makes at once take turns on the connection)."""

    def __init__(self, conn: Any, claims: Callable[[bool], Claims]) -> None:
        self._conn = conn
        self._claims = _AttemptClaims(claims)
        self._turn = asyncio.Lock()

    async def run(self, call: calls.Call[T]) -> T:
        claims = self._claims.of(call.action)
        async with self._turn:
            return await operations.perform(self._conn, call, claims)

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        claims = self._claims.of(action)
        body = _body(action, payload, idempotency_key, claims.owner)
        async with self._turn:
            return await operations.dispatch(self._conn, body, claims)


class LocalTransport:
    """In process: the gateway's own dispatch, with the attempt's claims.

    With ``hold`` (the pool has a connection for every attempt and the worker's loops),
    the attempt keeps the connection it first took until :meth:`aclose`, instead of taking
    one from the pool per call: the pool hands its connections out in turn, and a call on a
    connection other than the last one used costs more (its server process has gone to
    sleep), a large share of a short step. A call made while another call of the attempt
    is running (a play that gathers steps) takes a pooled connection as before; a call
    that fails gives the held connection back to the pool, which checks it.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        claims: Callable[[bool], Claims],
        *,
        hold: bool = False,
    ) -> None:
        self._pool = pool
        self._claims = _AttemptClaims(claims)
        self._hold = hold
        self._held: Any = None  # the attempt's connection between its calls
        self._busy = False
        self._returning: set[asyncio.Future[None]] = set()  # give-backs still in flight

    async def run(self, call: calls.Call[T]) -> T:
        claims = self._claims.of(call.action)
        answer: T = await self._on_connection(lambda conn: operations.perform(conn, call, claims))
        return answer

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        claims = self._claims.of(action)
        body = _body(action, payload, idempotency_key, claims.owner)
        return await self._on_connection(lambda conn: operations.dispatch(conn, body, claims))

    async def _on_connection(self, send: Callable[[Any], Awaitable[Any]]) -> Any:
        if not self._hold or self._busy:
            async with self._pool.connection() as conn:
                return await send(conn)
        self._busy = True
        try:
            if self._held is None:
                self._held = await self._pool.getconn()
            conn = self._held
            try:
                return await send(conn)
            except BaseException:
                self._held = None
                await self._give_back(conn)
                raise
        finally:
            self._busy = False

    async def aclose(self) -> None:
        """Give the held connection back to the pool and wait until every connection this
        transport gave back is in (the attempt is over; idempotent)."""
        conn, self._held = self._held, None
        if conn is not None:
            await self._give_back(conn)
        if self._returning:
            await asyncio.gather(*self._returning, return_exceptions=True)

    async def _give_back(self, conn: Any) -> None:
        # Shielded: a cancel of the attempt (a lost lease, a hand-back) that arrives while
        # the connection is on its way back must not leave it unreturned and unclosed;
        # the give-back is kept so aclose can wait for it.
        returning = asyncio.ensure_future(self._pool.putconn(conn))
        self._returning.add(returning)
        returning.add_done_callback(self._returning.discard)
        await asyncio.shield(returning)


def gateway_socket(url: str) -> str | None:
    """The Unix socket a gateway URL names (``unix:/path``, ``unix:///path``), or None."""
    if not url.startswith("unix:"):
        return None
    path = url[len("unix:") :]
    return "/" + path.lstrip("/") if path.startswith("//") else path


def gateway_origin(url: str) -> str:
    """A gateway's origin, as an attempt's tokens carry it (``runtimeOrigin``,
    ``runLedgerIngressPrefixOrigin``): ``scheme://host[:port]`` of an HTTP URL, lower case;
    the socket's ``unix:/path`` for a Unix socket (the socket is the receiver)."""
    socket = gateway_socket(url)
    if socket is not None:
        return f"unix:{socket}"
    parts = httpx.URL(url)
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{parts.host}{port}".lower()


class GatewayTransport:
    """Through the gateway: ``POST {url}/runtime`` with ``Authorization: Bearer TOKEN``
    (``url`` may name a Unix socket, ``unix:/path``: what a sandbox reaches it by)."""

    def __init__(
        self,
        url: str,
        *,
        executor_token: str,
        ledger_token: str,
        owner: str,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        socket = gateway_socket(url)
        base = "http://gateway" if socket is not None else url.rstrip("/")
        self.url = base + "/runtime"
        self._executor = executor_token
        self._ledger = ledger_token
        self._owner = owner
        if client is None and socket is not None:
            client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket))
        self._client = client or httpx.AsyncClient()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def run(self, call: calls.Call[T]) -> T:
        """Encode the call with its action's codec, post it, decode the answer."""
        return await run_over_wire(self, call)

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        ledger = action in operations.LEDGER_ACTIONS
        body = _body(action, payload, idempotency_key, self._owner)
        try:
            # Compact, as the receiver measures a stored value (the gateway's body limit).
            content = json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise InvalidField(
                f"the input of {action} is not JSON: {exc}",
                field="input",
                rule="JSON values only (dict, list, str, int, finite float, bool, None)",
                fix="return plain data, e.g. convert objects with a to_dict() or str()",
            ) from exc
        found = operations.ACTIONS.get(action)
        response = await self._client.post(
            self.url,
            content=content.encode(),
            headers={
                "Authorization": f"Bearer {self._ledger if ledger else self._executor}",
                "Content-Type": "application/json",
            },
            timeout=found.timeout_s if found else operations.DEFAULT_TIMEOUT_S,
        )
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if response.status_code == 200:
            return answer.get("result")
        error = answer.get("error") if isinstance(answer, dict) else None
        error = error if isinstance(error, dict) else {"message": response.text[:500]}
        cause = errors.from_wire(error)
        if (
            action == INTENT_ACTION
            and response.status_code in (400, 403)
            and error.get("message") in _OLDER_RECEIVER_MESSAGES
        ):
            raise WriteIntentUnavailable(
                "Runtime Sheet write intent is unavailable on this gateway. Retry after the "
                f"runtime rollout. ({error.get('message')}; status {response.status_code})",
                field="action",
                rule=f"{INTENT_ACTION} needs a receiver that serves it",
                fix="retry once the runtime rollout reaches the gateway; never fall back to a "
                "legacy admission",
            ) from cause
        raise cause
