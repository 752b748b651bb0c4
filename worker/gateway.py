"""The runtime gateway: the HTTP data plane for plays that hold no database credentials.

``POST /runtime`` takes ``{"action", "input", "idempotencyKey"?, "deliveryLeaseOwner"?}`` or
a batch ``{"actions": [...]}``, with ``Authorization: Bearer TOKEN`` (an attempt token,
:mod:`queues.authority`). In this order it authenticates the token (401 for a missing,
forged or expired one), applies the policy (403 ``Unsupported runtime action capability
scope.``), refuses actions it does not serve (400 ``Unsupported action: NAME``), checks the
run scope (403), the attempt and its live lease (409), then dispatches to the same
functions the in-process path calls (:func:`queues.operations.dispatch`). Answers are
``{"result": ...}`` or ``{"error": {"code", "message", "field", "rule", "fix", ...}}``.

``worker gateway`` serves it on its own; a worker with sandboxed plays serves it in-process
on a loopback port of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Collection, Iterator
from typing import Any

import psycopg
import structlog
import uvicorn
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from queues import authority, operations
from queues.errors import InvalidField, WorkerError, translate

log = structlog.get_logger("worker.gateway")


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _error(exc: WorkerError) -> JSONResponse:
    return JSONResponse({"error": exc.as_dict()}, status_code=exc.http_status)


def make_app(
    pool: AsyncConnectionPool[Any],
    *,
    secret: bytes,
    served: Collection[str] | None = None,
) -> Starlette:
    """The gateway's ASGI app, serving ``served`` actions (default: all this release has;
    a subset acts as an older receiver)."""

    async def runtime(request: Request) -> JSONResponse:
        try:
            claims = authority.verify(_bearer(request.headers.get("authorization")), secret=secret)
            try:
                body = json.loads(await request.body())
            except ValueError as exc:
                raise InvalidField(
                    f"the request body is not JSON: {exc}",
                    field="body",
                    rule="a JSON object",
                    fix="send a JSON body",
                ) from exc
            async with pool.connection() as conn:
                result = await operations.dispatch(
                    conn, body, claims, served=served, check_lease=True
                )
        except WorkerError as exc:
            log.info("runtime_refused", code=exc.code, status=exc.http_status)
            return _error(exc)
        except psycopg.Error as exc:
            mapped = translate(exc)
            if mapped is not None:
                return _error(mapped)
            log.warning("runtime_database_error", error=str(exc).strip()[:300])
            return JSONResponse(
                {"error": {"code": "DATABASE_ERROR", "message": "the database failed"}},
                status_code=503,
            )
        except PoolTimeout:
            return JSONResponse(
                {"error": {"code": "DATABASE_UNREACHABLE", "message": "no database"}},
                status_code=503,
            )
        return JSONResponse({"result": result})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True, "actions": sorted(served or operations.SERVED_ACTIONS)})

    return Starlette(
        routes=[
            Route("/runtime", runtime, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


class _Server(uvicorn.Server):
    """uvicorn without its signal handling: the process that embeds it owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Served:
    """A gateway served on an asyncio loop (``await start()``; ``await stop()``)."""

    def __init__(self, app: Starlette, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = _Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        )
        self.task: asyncio.Task[None] | None = None
        self.host = host

    @property
    def url(self) -> str:
        socket = self.server.servers[0].sockets[0]
        port = socket.getsockname()[1]
        return f"http://{self.host}:{port}"

    async def start(self, timeout: float = 10.0) -> str:
        self.task = asyncio.create_task(self.server.serve(), name="gateway")
        async with asyncio.timeout(timeout):
            while not self.server.started:
                if self.task.done():
                    self.task.result()  # raises why it stopped
                await asyncio.sleep(0.01)
        return self.url

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self.task, 10)
