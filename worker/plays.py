"""The play registry: ``@registry.play`` on ``async def play(ctx, params)``.

A worker loads its registry from ``--app module:attribute`` (or ``WORKER_APP``,
:func:`load_registry`); without one the CLI serves the project's demo plays.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from queues import fields
from queues.errors import AppInvalid, InvalidField
from queues.schedules import Timing
from worker import endings

if TYPE_CHECKING:
    from worker.context import CleanupFn, RunContext

# Plays have always imported Fatal from here; the rule it belongs to is worker.endings'.
Fatal = endings.Fatal

PlayFn = Callable[["RunContext", dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Periodic:
    """A play's schedule (``@registry.play(..., cron=...)`` or ``every=...``): what each
    worker of the app declares at start (:mod:`queues.schedules`)."""

    name: str
    timing: Timing
    params: dict[str, Any]
    org: str


MIB = 1024 * 1024
_SIZE = re.compile(r"\s*(?P<n>\d+)\s*(?P<unit>[kmgt]i?b?)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"k": 1024, "m": MIB, "g": 1024 * MIB, "t": 1024 * 1024 * MIB}


@dataclass(frozen=True, slots=True)
class Resources:
    """What each attempt of a sandboxed play may use (``@registry.play(...,
    sandboxed=True, resources={...})``), enforced in its sandbox as resource limits
    (``setrlimit``) that every process of the sandbox inherits and cannot raise. ``None``:
    no limit of that kind. Sizes are bytes (``"512M"``, ``"2G"`` are read too), CPU time
    is seconds (``"10m"``, ``"1h"`` too)."""

    memory: int | None = 1024 * MIB  # address space of each process (RLIMIT_AS)
    cpu_s: int | None = 3600  # CPU seconds of each process (RLIMIT_CPU)
    processes: int | None = 128  # processes of the sandbox's user (RLIMIT_NPROC)
    file_size: int | None = 1024 * MIB  # the largest file it may write (RLIMIT_FSIZE)
    open_files: int | None = 1024  # descriptors of each process (RLIMIT_NOFILE)
    tmp: int = 256 * MIB  # the size of its private /tmp (a tmpfs)

    @classmethod
    def checked(cls, value: Resources | Mapping[str, Any] | None) -> Resources:
        """The defaults, overridden by ``value`` (a Resources, or a mapping of its fields)."""
        if value is None:
            return cls()
        if isinstance(value, Resources):
            value = dataclasses.asdict(value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidField(
                f"resources {', '.join(unknown)} are not known",
                field="resources",
                rule=f"one or more of {', '.join(sorted(known))}",
                fix="name a resource the sandbox limits",
            )
        out: dict[str, Any] = {}
        for name, raw in value.items():
            where = f"resources.{name}"
            if raw is None and name != "tmp":
                out[name] = None
            elif name == "cpu_s":
                out[name] = max(1, round(fields.duration(raw, field=where, minimum=1)))
            elif name in ("processes", "open_files"):
                out[name] = fields.whole_number(
                    raw,
                    field=where,
                    minimum=1 if name == "processes" else 16,
                    maximum=1_000_000,
                    example=64,
                )
            else:
                out[name] = _size(raw, where)
        return dataclasses.replace(cls(), **out)


def _size(value: object, where: str) -> int:
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value)):
        unit = (match["unit"] or "")[:1].lower()
        size = int(match["n"]) * _SIZE_UNITS.get(unit, 1)
    if size is None or size < MIB:
        raise InvalidField(
            f"{where} is {value!r:.80}",
            field=where,
            rule="a size of at least 1M: bytes, or a number with K, M, G or T",
            fix="pass e.g. 512M",
        )
    return size


@dataclass(frozen=True, slots=True)
class Play:
    name: str
    fn: PlayFn
    on_cancel: tuple[CleanupFn, ...] = ()
    sandboxed: bool = False  # runs in a sandbox with a token and no credentials
    periodic: Periodic | None = None  # admitted once per tick of its schedule
    # A sandboxed play's least authority: the plays it may spawn and the rate-limit keys
    # it may take permits of (its attempts' tokens carry only these), and what each of its
    # attempts may use. None for an in-process play: trusted code, not restricted.
    may_spawn: frozenset[str] | None = None
    limits: frozenset[str] | None = None
    resources: Resources | None = None


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
        may_spawn: Iterable[str] | None = None,
        limits: Iterable[str] | None = None,
        resources: Resources | Mapping[str, Any] | None = None,
    ) -> Callable[[PlayFn], PlayFn]:
        """Register a play. ``sandboxed=True``: it runs in a sandbox (bubblewrap: its own
        user, PID, mount and network namespaces; docs/security.md) that holds no database
        URL or secret, only the runtime gateway's socket and its attempt's tokens (for play
        code that is not trusted). Its tokens allow it to spawn only the plays named in
        ``may_spawn`` and to take permits only of the rate-limit keys in ``limits`` (none
        by default); ``resources`` bounds what each attempt may use (:class:`Resources`).
        In-process plays are trusted code: these three are for sandboxed plays only.

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

        declared = _least_authority(sandboxed, may_spawn, limits, resources)

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
                *declared,
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


def _least_authority(
    sandboxed: bool,
    may_spawn: Iterable[str] | None,
    limits: Iterable[str] | None,
    resources: Resources | Mapping[str, Any] | None,
) -> tuple[frozenset[str] | None, frozenset[str] | None, Resources | None]:
    """A play's declared authority: for a sandboxed play, what its tokens carry and what
    its sandbox may use (nothing to spawn, no limit to take by default)."""
    if not sandboxed:
        given = [
            n
            for n, v in (("may_spawn", may_spawn), ("limits", limits), ("resources", resources))
            if v is not None
        ]
        if given:
            raise InvalidField(
                f"{', '.join(given)} given for a play that is not sandboxed",
                field=given[0],
                rule="an in-process play is trusted code: it is not restricted, so these "
                "apply to sandboxed plays only",
                fix="add sandboxed=True, or drop them",
            )
        return None, None, None
    if isinstance(may_spawn, str) or isinstance(limits, str):
        raise InvalidField(
            "may_spawn and limits are lists of names, not one string",
            field="may_spawn" if isinstance(may_spawn, str) else "limits",
            rule='a list, e.g. may_spawn=["child-play"]',
            fix="wrap the name in a list",
        )
    spawnable = frozenset(fields.play_name(p, field="may_spawn") for p in may_spawn or ())
    keys = frozenset(fields.limit_key(k, field="limits") for k in limits or ())
    return spawnable, keys, Resources.checked(resources)


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
            fix=f"fix the module (python -c 'import {module_name}' shows the traceback)",
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
