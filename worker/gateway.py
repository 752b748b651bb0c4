"""The runtime gateway: the HTTP data plane for plays that hold no database credentials.

``POST /runtime`` takes ``{"action", "input", "idempotencyKey"?, "deliveryLeaseOwner"?}`` or
a batch ``{"actions": [...]}``, with ``Authorization: Bearer TOKEN`` (an attempt token,
:mod:`queues.authority`). In this order it authenticates the token (401 for a missing,
forged or expired one), applies the policy (403 ``Unsupported runtime action capability
scope.``), refuses actions it does not serve (400 ``Unsupported action: NAME``), checks the
run scope (403), the attempt and its live lease (409), then dispatches to the same
functions the in-process path calls (:func:`queues.operations.dispatch`). Answers are
``{"result": ...}`` or ``{"error": {"code", "message", "field", "rule", "fix", ...}}``.

``worker gateway`` serves it on its own (on a TCP port, or on a Unix socket with
``--socket``); a worker with sandboxed plays serves it in-process on a Unix socket of its
own, in a private directory, which each sandbox gets bound in (a sandbox has no network:
the socket is its only way out, :mod:`worker.sandbox`).

Either way the server's limits hold (:mod:`worker.serving`): a body above
``WORKER_GATEWAY_MAX_BODY_BYTES`` (default :data:`queues.operations.MAX_BODY_BYTES`, the
largest legal step result in its envelope) is answered 413; a body that is not JSON, nests
too deep or carries a field of the wrong type 400; a client that does not send its whole
request in time is disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
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
from worker import serving
from worker.blips import is_blip
from worker.contract import PoolCheck, gateway_socket

log = structlog.get_logger("worker.gateway")

BODY_VARIABLE = "WORKER_GATEWAY_MAX_BODY_BYTES"


def default_limits() -> serving.Limits:
    """The gateway's server limits (:mod:`worker.serving`): its body's default is the
    largest legal request, :data:`queues.operations.MAX_BODY_BYTES`."""
    return serving.Limits.from_env(
        max_body_bytes=operations.MAX_BODY_BYTES, body_variable=BODY_VARIABLE
    )


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

    check = PoolCheck(pool)  # dead idle connections replaced after a blip

    async def runtime(request: Request) -> JSONResponse:
        try:
            claims = authority.verify(_bearer(request.headers.get("authorization")), secret=secret)
            body = operations.decode(await request.body())
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
            # A lost connection is DATABASE_UNREACHABLE: the caller's blip to absorb, on a
            # connection this check made sure of.
            code = "DATABASE_ERROR"
            if is_blip(exc):
                code = "DATABASE_UNREACHABLE"
                await check()
            return JSONResponse(
                {"error": {"code": code, "message": "the database failed"}},
                status_code=503,
            )
        except PoolTimeout:
            return JSONResponse(
                {"error": {"code": "DATABASE_UNREACHABLE", "message": "no database"}},
                status_code=503,
            )
        except Exception:  # a bug: logged with its traceback, answered in the error format
            log.exception("runtime_failed")
            return JSONResponse(
                {"error": {"code": "INTERNAL_ERROR", "message": "the gateway failed"}},
                status_code=500,
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


UNIX = "unix:"  # a gateway URL naming a Unix socket: unix:/path/to/gateway.sock


def socket_path(url: str) -> str | None:
    """The Unix socket of a gateway URL (``unix:/path`` or ``unix:///path``), or None for
    an HTTP one."""
    path = gateway_socket(url)
    if path is None:
        return None
    if not os.path.isabs(path):
        raise InvalidField(
            f"the gateway socket {path!r} is not an absolute path",
            field="--gateway-url",
            rule="unix:/absolute/path/to/gateway.sock",
            fix="name the socket `worker gateway --socket PATH` serves by its absolute path",
        )
    return path


PRIVATE_PREFIX = "wq-gateway-"


def sweep_private_dirs(root: str | None = None) -> list[str]:
    """Remove the private gateway directories of processes that are gone (a worker that
    was killed never removed its own); returns those removed. Only this user's, named
    ``wq-gateway-<pid>-...``; a directory of a live process is left alone."""
    base = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            if not entry.name.startswith(PRIVATE_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            pid, _, rest = entry.name[len(PRIVATE_PREFIX) :].partition("-")
            if not (pid.isdigit() and rest):  # another release's name: not ours to judge
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if _alive(int(pid)):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Served:
    """A gateway served on an asyncio loop (``await start()``; ``await stop()``), on a TCP
    port, or on a Unix socket (``uds``; :meth:`private` makes one in a directory of its
    own that only this process's user may enter)."""

    def __init__(
        self,
        app: Starlette,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | None = None,
        limits: serving.Limits | None = None,
    ) -> None:
        self.limits = limits or default_limits()
        self.server = _Server(
            serving.config(app, limits=self.limits, host=host, port=port, uds=uds)
        )
        self.task: asyncio.Task[None] | None = None
        self.host = host
        self.uds = uds
        self.private_dir: str | None = None

    @classmethod
    def private(cls, app: Starlette) -> Served:
        """Served on a socket in a fresh directory of mode 0700 (the socket itself is 0666:
        the directory decides who may reach it; a sandbox gets it bound in). The directory
        names its process, so the ones a killed worker left are removed here."""
        sweep_private_dirs()
        directory = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-")
        served = cls(app, uds=os.path.join(directory, "gateway.sock"))
        served.private_dir = directory
        return served

    @property
    def url(self) -> str:
        if self.uds is not None:
            return f"{UNIX}{self.uds}"
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
        if self.uds is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.uds)
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
