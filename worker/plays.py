"""The play registry: ``@registry.play`` on ``async def play(ctx, params)``.

A worker loads its registry from ``--app module:attribute`` (or ``WORKER_APP``); without
one it serves the project's demo plays.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from queues import fields
from queues.errors import AppInvalid
from queues.schedules import Timing

if TYPE_CHECKING:
    from worker.context import RunContext

PlayFn = Callable[["RunContext", dict[str, Any]], Awaitable[Any]]
CleanupFn = Callable[["RunContext"], Awaitable[None]]


class Fatal(Exception):
    """Raised by a play for a failure that retrying cannot fix (bad params, 4xx)."""


@dataclass(frozen=True, slots=True)
class Periodic:
    """A play's schedule (``@registry.play(..., cron=...)`` or ``every=...``): what each
    worker of the app declares at start (:mod:`queues.schedules`)."""

    name: str
    timing: Timing
    params: dict[str, Any]
    org: str


@dataclass(frozen=True, slots=True)
class Play:
    name: str
    fn: PlayFn
    on_cancel: tuple[CleanupFn, ...] = ()
    sandboxed: bool = False  # runs in a child process with a token and no credentials
    periodic: Periodic | None = None  # admitted once per tick of its schedule


@dataclass
class Registry:
    """The plays a worker can run, by name: register each with ``@registry.play()`` and
    start a worker with ``--app module:registry``."""

    plays: dict[str, Play] = field(default_factory=dict)
    spec: str | None = None  # module:attribute it was loaded from (a sandbox imports it)

    def play(
        self,
        name: str | None = None,
        *,
        on_cancel: CleanupFn | None = None,
        sandboxed: bool = False,
        cron: str | None = None,
        every: float | str | None = None,
        params: Mapping[str, Any] | None = None,
        org: str = "default",
        schedule: str | None = None,
    ) -> Callable[[PlayFn], PlayFn]:
        """Register a play. ``sandboxed=True``: it runs in a child process that holds no
        database URL or secret, only the runtime gateway's address and its attempt's
        tokens (for play code that is not trusted).

        ``cron="0 * * * *"`` (UTC; 6 fields with the seconds first) or ``every="15m"``
        makes it periodic: one run per tick, with ``params`` in ``org``, admitted by a
        worker of the app on its own lane (:mod:`queues.schedules`; the schedule is named
        ``schedule``, default the play's name)."""
        periodic_params = dict(params or {})
        timing = None
        if cron is not None or every is not None or params is not None:
            timing = Timing.checked(cron=cron, every=every)
            fields.org(org)
            fields.encode(periodic_params, field="params", max_bytes=fields.MAX_PARAMS_BYTES)

        def register(fn: PlayFn) -> PlayFn:
            play_name = fields.play_name(name or fn.__name__.replace("_", "-"))
            periodic = None
            if timing is not None:
                schedule_name = fields.schedule_name(schedule or play_name, field="schedule")
                periodic = Periodic(schedule_name, timing, periodic_params, org)
            self.plays[play_name] = Play(
                play_name,
                fn,
                (on_cancel,) if on_cancel is not None else (),
                sandboxed,
                periodic,
            )
            return fn

        return register

    def get(self, name: str) -> Play | None:
        return self.plays.get(name)

    def names(self) -> frozenset[str]:
        return frozenset(self.plays)

    def merged(self, other: Registry) -> Registry:
        return Registry({**self.plays, **other.plays}, spec=other.spec or self.spec)

    def sandboxed(self) -> list[str]:
        return sorted(p.name for p in self.plays.values() if p.sandboxed)

    def periodic(self) -> list[Play]:
        """The plays with a schedule."""
        return sorted((p for p in self.plays.values() if p.periodic), key=lambda p: p.name)

    def __iter__(self) -> Iterator[Play]:
        return iter(self.plays.values())


def load_app(spec: str | None) -> Registry:
    """The plays of ``module:attribute`` (``--app``, else ``WORKER_APP``); with neither, the
    project's demo plays (``worker.demo``), which are never mixed into an app's."""
    spec = spec or os.environ.get("WORKER_APP")
    if not spec:
        from worker.demo import demo_plays

        return demo_plays
    return load_registry(spec)


_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def load_registry(spec: str) -> Registry:
    """The Registry named by ``module:attribute``, remembering where it came from.

    Importing runs the app's code: whatever it raises (a syntax error, an exception, even
    ``sys.exit``) is reported as :class:`~queues.errors.AppInvalid` naming the module and
    the cause, never as a traceback or a silent exit."""
    module_name, _, attribute = spec.partition(":")
    if not _MODULE_PATH.fullmatch(module_name) or not attribute.isidentifier():
        raise AppInvalid(
            f"invalid app {spec!r}",
            field="--app",
            rule="module:attribute with a dotted module path (no file path), e.g. "
            "myapp.plays:registry",
            fix="pass the module path and the Registry attribute separated by ':'; run from "
            "the directory that holds the package, or add it to PYTHONPATH",
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise AppInvalid(
            f"cannot import app module {module_name!r}: {exc}",
            field="--app",
            rule="an importable module",
            fix="check the module path and PYTHONPATH",
        ) from exc
    except SyntaxError as exc:
        raise AppInvalid(
            f"app module {module_name!r} has a syntax error: {exc.msg} "
            f"({exc.filename}, line {exc.lineno})",
            field="--app",
            rule="an importable module",
            fix="fix the syntax error",
        ) from exc
    except (Exception, SystemExit) as exc:
        where = _origin(exc)
        raise AppInvalid(
            f"app module {module_name!r} failed while importing: "
            f"{type(exc).__name__}: {exc}{where}",
            field="--app",
            rule="a module that imports without raising or exiting",
            fix="fix the module (python -c 'import "
            f"{module_name}' shows the traceback)",
        ) from exc
    registry = getattr(module, attribute, None)
    if not isinstance(registry, Registry):
        raise AppInvalid(
            f"{spec!r} is not a play Registry",
            field="--app",
            rule="module:attribute naming a worker.plays.Registry",
            fix="point --app at the Registry your plays are registered on",
        )
    registry.spec = spec
    return registry


def _origin(exc: BaseException) -> str:
    """`` (file, line N)`` of the innermost frame of ``exc``, or nothing."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f" ({tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})"
