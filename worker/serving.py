"""The HTTP servers' setup, shared by the runtime gateway and the dashboard: uvicorn with
bounds on what one client may hold (docs/security.md, "Servers").

- **Body**: at most :attr:`Limits.max_body_bytes`. A ``Content-Length`` above it is
  answered 413 before any of the body is read; a chunked body is counted as it arrives
  and cut off at the limit. :class:`ReadBody` reads the whole body before the app runs,
  so no handler waits on a client and none sees more than the limit.
- **Time**: a client has :attr:`Limits.request_timeout_s` to send a whole request, headers
  and body, from the moment the server waits for it (a new connection, or the first byte
  of the next request on a kept-alive one); then the connection is closed. uvicorn has no
  such bound of its own (its keep-alive timeout only covers the pause between requests and
  restarts at every byte), so :func:`protocol` adds it to uvicorn's h11 protocol, and
  :class:`ReadBody` bounds the body's read again. A kept-alive connection idle for
  :data:`KEEP_ALIVE_S` is closed.
- **Headers**: at most :data:`MAX_HEADER_BYTES` (h11's bound on an incomplete event).
- **Connections**: at most :attr:`Limits.max_connections_per_client` open at once from one
  client (an IP address; on a Unix socket, one peer process) and
  :attr:`Limits.max_connections` in all, counted as each connection opens (uvicorn's
  ``limit_concurrency`` counts only at a request, after a slow client has its socket). One
  more is answered 429 (or 503) and closed.

Each limit has a variable (:data:`VARIABLES`); a bad value is refused at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import h11
import structlog
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from queues.errors import InvalidField, PayloadTooLarge

log = structlog.get_logger("worker.serving")

KEEP_ALIVE_S = 5  # uvicorn's own default, said here: an idle kept-alive connection closes
MAX_HEADER_BYTES = 16 * 1024  # a request line and its headers (a token, a cookie: ~2 KiB)
REQUEST_TIMEOUT_S = 20.0
CONNECTIONS_PER_CLIENT = 128
MAX_CONNECTIONS = 1024

VARIABLES = {
    "request_timeout_s": "WORKER_HTTP_REQUEST_TIMEOUT_S",
    "max_connections_per_client": "WORKER_HTTP_CONNECTIONS_PER_CLIENT",
    "max_connections": "WORKER_HTTP_MAX_CONNECTIONS",
}
_BOUNDS = {
    "request_timeout_s": (1, 3600),
    "max_connections_per_client": (1, 100_000),
    "max_connections": (1, 1_000_000),
}


def _default_max_connections() -> int:
    """:data:`MAX_CONNECTIONS`, or half the process's file descriptors if that is fewer:
    every connection holds one, and the process needs the rest (its database pool)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft // 2))


@dataclass(frozen=True, slots=True)
class Limits:
    """What one server takes from its clients."""

    max_body_bytes: int
    request_timeout_s: float = REQUEST_TIMEOUT_S
    max_connections_per_client: int = CONNECTIONS_PER_CLIENT
    max_connections: int = MAX_CONNECTIONS

    @classmethod
    def from_env(
        cls,
        *,
        max_body_bytes: int,
        body_variable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Limits:
        """The limits with ``max_body_bytes`` as the body's default, each overridden by its
        variable (:data:`VARIABLES`; the body's is ``body_variable``, when it has one)."""
        env = os.environ if env is None else env
        values: dict[str, float] = {
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "max_connections_per_client": CONNECTIONS_PER_CLIENT,
            "max_connections": _default_max_connections(),
        }
        for name, variable in VARIABLES.items():
            if env.get(variable, "").strip():
                whole = name != "request_timeout_s"
                values[name] = _number(env[variable], variable, *_BOUNDS[name], whole=whole)
        body = max_body_bytes
        if body_variable and env.get(body_variable, "").strip():
            body = int(_number(env[body_variable], body_variable, 1024, 1 << 40))
        return cls(
            max_body_bytes=body,
            request_timeout_s=float(values["request_timeout_s"]),
            max_connections_per_client=int(values["max_connections_per_client"]),
            max_connections=int(values["max_connections"]),
        )


def _number(text: str, variable: str, low: float, high: float, *, whole: bool = True) -> float:
    try:
        value = float(int(text.strip())) if whole else float(text.strip())
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise InvalidField(
            f"{variable} is {text.strip()[:40]!r}",
            field=variable,
            rule=f"{'a whole number' if whole else 'a number'} from {low:g} to {high:g}",
            fix=f"set {variable} to a number in range, or unset it for the default",
        )
    return value


def config(app: ASGIApp, *, limits: Limits, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration of a server of ``app`` under ``limits`` (``options``: host,
    port, ... as :class:`uvicorn.Config` takes them)."""
    return uvicorn.Config(
        ReadBody(app, limits),
        http=protocol(limits),
        ws="none",
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **options,
    )


# ---- the answers of the limits (the gateway's error format: {"error": {...}}) -----------------


def _answer(status: int, code: str, message: str, **extra: Any) -> bytes:
    error = {"code": code, "message": message, **extra}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


async def _respond(send: Send, status: int, body: bytes, *headers: tuple[bytes, bytes]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),  # the rest of the request is never read
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _raw(status: int, phrase: str, body: bytes, retry_after_s: int) -> bytes:
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {retry_after_s}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ReadBody:
    """Reads a request's whole body, within the size and time limits, before ``app`` runs;
    the app then receives it as one message."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._too_large(scope, send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left (or its time ran out): nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await self._too_large(scope, send, None)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            log.warning("http_body_timeout", client=_client(scope), read=size)
            body = _answer(
                408,
                "REQUEST_TIMEOUT",
                f"the request body was not received within {self.limits.request_timeout_s:g} s",
            )
            await _respond(send, 408, body)
            return
        whole = b"".join(chunks)
        given = False

        async def replay() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, send: Send, declared: int | None) -> None:
        limit = self.limits.max_body_bytes
        size = f"{declared} bytes" if declared is not None else f"more than {limit} bytes"
        log.warning("http_body_too_large", client=_client(scope), size=size, limit=limit)
        error = PayloadTooLarge(
            f"the request body is {size}; the limit is {limit}",
            field="body",
            rule=f"at most {limit} bytes",
            fix="send less (split a batch into several requests), or raise the server's limit",
        )
        body = json.dumps({"error": error.as_dict()}, separators=(",", ":")).encode()
        await _respond(send, 413, body)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _client(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None


# ---- the protocol: a deadline for each request, connections per client --------------------


class _Book:
    """The connections one server holds, by client."""

    def __init__(self) -> None:
        self.by_client: Counter[str] = Counter()
        self.total = 0


_PEERCRED = struct.Struct("3i")


def client_key(transport: asyncio.BaseTransport) -> str:
    """Who a connection's client is, for counting: its IP address, or on a Unix socket its
    peer process (each sandbox apart)."""
    sock: socket.socket | None = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError, AttributeError):
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            pid, _uid, _gid = _PEERCRED.unpack(raw)
            return f"pid:{pid}"
        return "unix"
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "unknown"


def protocol(limits: Limits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline for receiving each request and a cap on the
    connections of each client and in all (one book per server)."""
    book = _Book()

    class Guarded(H11Protocol):
        _key: str | None = None
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            key = client_key(transport)
            if book.by_client[key] >= limits.max_connections_per_client:
                self._refuse(
                    transport,
                    429,
                    "Too Many Requests",
                    "TOO_MANY_CONNECTIONS",
                    f"this client holds {limits.max_connections_per_client} connections "
                    "already: reuse them",
                    key,
                )
                return
            if book.total >= limits.max_connections:
                self._refuse(
                    transport,
                    503,
                    "Service Unavailable",
                    "SERVER_BUSY",
                    f"the server holds {limits.max_connections} connections",
                    key,
                )
                return
            self._key = key
            book.by_client[key] += 1
            book.total += 1
            self._arm()

        def _refuse(
            self,
            transport: asyncio.Transport,
            status: int,
            phrase: str,
            code: str,
            message: str,
            key: str,
        ) -> None:
            log.warning("http_connection_refused", client=key, status=status, code=code)
            transport.write(_raw(status, phrase, _answer(status, code, message), 1))
            transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._key is not None:
                book.by_client[self._key] -= 1
                if book.by_client[self._key] <= 0:
                    del book.by_client[self._key]
                book.total -= 1
                self._key = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._key is None:
                return  # refused: nothing it sends is read
            if self._deadline is None:
                self._arm()  # the first byte of a request: its time starts
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the whole request is in (or the connection is ending)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.request_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            log.warning(
                "http_request_timeout",
                client=self._key,
                phase="body" if state is h11.SEND_BODY else "headers",
                timeout_s=limits.request_timeout_s,
            )
            self.transport.close()

    return Guarded
