"""What every command shares: the state object, one connection per command, the output
convention (``--json`` with ISO 8601 timestamps), the duration type and the exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import psycopg
import structlog

from queues import fields, roles
from queues.errors import InvalidField, WorkerError
from worker import config, db, embedded, plays
from worker.outage import MAX_OUTAGE_S
from worker.output import EXIT_BY_STATE, exit_code_of, iso, printable, to_json

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
Conn = psycopg.AsyncConnection[Any]


class State:
    """The root command's options, passed to every command (``ctx.obj``)."""

    def __init__(self, database_url: str | None, home: Path | None) -> None:
        self.explicit_url = database_url
        self.home = home
        self._urls: dict[config.Purpose, str] = {}

    def url_for(self, purpose: config.Purpose) -> str:
        """The URL of the narrowest role this command needs (resolved once)."""
        if purpose not in self._urls:
            self._urls[purpose] = config.resolve_url(
                self.explicit_url, home=self.home, purpose=purpose
            )
        return self._urls[purpose]

    @property
    def url(self) -> str:
        """The worker role's URL (workers, recovery, operator actions)."""
        return self.url_for(config.Purpose.WORKER)

    def enable_embedded_logins(self) -> None:
        """After a migrate on the embedded server: its roles may log in (own passwords)."""
        if config.uses_embedded(self.explicit_url):
            server = embedded.ensure_running(self.home)
            server.enable_role_logins(role.value for role in roles.Role)


pass_state = click.make_pass_decorator(State)


# What a command's end gives the tasks its coroutine left running (an attempt the worker
# abandoned at the end of its grace, whose play swallows cancellation): asyncio.run would
# wait for them without a bound, and a SIGTERM would not end the process.
LEFTOVER_S = 1.0


def run(coro: Awaitable[T]) -> T:
    """Run a command's coroutine to its end, as ``asyncio.run`` does, except that the
    teardown is bounded: tasks still running once it returned are cancelled, given
    :data:`LEFTOVER_S`, then left (named in ``tasks_left_at_exit``). A command ends when
    its own work does."""

    async def main() -> T:
        return await coro

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main())
    finally:
        try:
            _cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            with contextlib.suppress(TimeoutError):
                loop.run_until_complete(
                    asyncio.wait_for(loop.shutdown_default_executor(), LEFTOVER_S)
                )
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    left = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not left:
        return
    for task in left:
        task.cancel()
    _, pending = loop.run_until_complete(asyncio.wait(left, timeout=LEFTOVER_S))
    if pending:
        structlog.get_logger("worker.cli").error(
            "tasks_left_at_exit",
            tasks=sorted(task.get_name() for task in pending),
            detail="they did not end when cancelled; the process exits without them",
        )


def connected(
    state: State,
    go: Callable[[Conn], Awaitable[int]],
    purpose: config.Purpose = config.Purpose.WORKER,
) -> NoReturn:
    """Run ``go`` on one autocommit connection, with the role of ``purpose``, and exit."""

    async def main() -> int:
        async with db.session(state.url_for(purpose)) as conn:
            return await go(conn)

    sys.exit(asyncio.run(main()))


# ---- output ---------------------------------------------------------------------------------


def emit_json(data: Any) -> None:
    """One JSON document (or one JSON line of a stream) on stdout."""
    click.echo(to_json(data))


def json_option(f: F) -> F:
    """``--json``: the command prints JSON instead of text (every command with data)."""
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (timestamps in ISO 8601)."
    )(f)


# ---- parameter types -------------------------------------------------------------------------


class Duration(click.ParamType):  # type: ignore[type-arg]  # generic only from click 8.2
    """Every time flag: ``500ms``, ``60s``, ``5m``, ``1h``, ``7d`` or a number of seconds,
    checked by the one rule in :func:`queues.fields.duration` (no nan, no inf)."""

    name = "duration"

    def __init__(
        self, *, minimum: float = 0.0, maximum: float = 365 * 86400.0, zero: bool = False
    ) -> None:
        self.minimum, self.maximum, self.zero = minimum, maximum, zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        flag = param.opts[0] if param is not None and param.opts else "duration"
        return fields.duration(
            value, field=flag, minimum=self.minimum, maximum=self.maximum, zero=self.zero
        )

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "DURATION"


def max_outage_option(when: str = "") -> Callable[[F], F]:
    """``--max-outage`` of a long-lived command: how long it rides out a lost database (a
    restart, a failover to a standby, reached again through a multi-host URL) before it
    ends with ``DATABASE_LOST``, exit 6 (:mod:`worker.outage`). ``when``: the option it
    applies with, e.g. "With --wait: "."""
    return click.option(
        "--max-outage",
        "max_outage",
        type=Duration(minimum=1, maximum=86400),
        default=f"{MAX_OUTAGE_S:g}s",
        show_default=True,
        help=f"{when}Ride out a lost database (a restart, a failover) this long, reconnecting "
        "and going on where it was; past it, exit 6 (DATABASE_LOST).",
    )


def release_option(f: F) -> F:
    return click.option(
        "--release",
        default=None,
        help="Release (lane) to use (default: $WORKER_RELEASE, a platform commit, or dev).",
    )(f)


def parse_run_id(value: str, *, field: str = "RUN") -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidField(
            f"{fields.shown(value)} is not a run id",
            field=field,
            rule="a UUID as printed by `worker submit`",
            fix="copy the id from `worker runs list`",
        ) from None


def actor() -> str:
    """Who runs this command, as the audit trail records it (``cli:<login name>``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = ""
    return f"cli:{user}" if user else "cli"


def report(exc: WorkerError) -> None:
    """An error on stderr: its message may quote what a user or a play wrote."""
    click.echo(f"error[{printable(exc.code)}]: {printable(exc.render(), lines=True)}", err=True)


__all__ = [
    "EXIT_BY_STATE",
    "Conn",
    "Duration",
    "State",
    "actor",
    "connected",
    "emit_json",
    "exit_code_of",
    "iso",
    "json_option",
    "max_outage_option",
    "parse_run_id",
    "pass_state",
    "printable",
    "release_option",
    "report",
    "run",
    "to_json",
]


def load_app(spec: str | None) -> plays.Registry:
    """The plays of ``module:attribute`` (``--app``, else ``WORKER_APP``); with neither, the
    project's demo plays (``worker.demo``), which are never mixed into an app's."""
    spec = spec or os.environ.get("WORKER_APP")
    if not spec:
        from worker.demo import demo_plays

        return demo_plays
    return plays.load_registry(spec)
