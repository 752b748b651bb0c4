"""The play registry: ``@registry.play`` on ``async def play(ctx, params)``.

A worker loads its registry from ``--app module:attribute`` (or ``WORKER_APP``); the
project's demo plays are always registered too.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from queues.errors import InvalidField

if TYPE_CHECKING:
    from worker.context import RunContext

PlayFn = Callable[["RunContext", dict[str, Any]], Awaitable[Any]]
CleanupFn = Callable[["RunContext"], Awaitable[None]]
_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,99}$")


class Fatal(Exception):
    """Raised by a play for a failure that retrying cannot fix (bad params, 4xx)."""


@dataclass(frozen=True, slots=True)
class Play:
    name: str
    fn: PlayFn
    on_cancel: tuple[CleanupFn, ...] = ()


@dataclass
class Registry:
    plays: dict[str, Play] = field(default_factory=dict)

    def play(
        self, name: str | None = None, *, on_cancel: CleanupFn | None = None
    ) -> Callable[[PlayFn], PlayFn]:
        def register(fn: PlayFn) -> PlayFn:
            play_name = name or fn.__name__.replace("_", "-")
            if not _NAME.match(play_name):
                raise InvalidField(
                    f"invalid play name {play_name!r}",
                    field="play",
                    rule="lower-case letters, digits, '.', '_' or '-', up to 100 characters",
                    fix="pass a valid name to @play(name=...)",
                )
            self.plays[play_name] = Play(
                play_name, fn, (on_cancel,) if on_cancel is not None else ()
            )
            return fn

        return register

    def get(self, name: str) -> Play | None:
        return self.plays.get(name)

    def names(self) -> frozenset[str]:
        return frozenset(self.plays)

    def merged(self, other: Registry) -> Registry:
        return Registry({**self.plays, **other.plays})

    def __iter__(self) -> Iterator[Play]:
        return iter(self.plays.values())


def load_app(spec: str | None) -> Registry:
    """The demo plays plus those of ``module:attribute`` (a Registry)."""
    from worker.demo import demo_plays

    spec = spec or os.environ.get("WORKER_APP")
    if not spec:
        return demo_plays
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidField(
            f"invalid app {spec!r}",
            field="--app",
            rule="module:attribute, e.g. myapp.plays:registry",
            fix="pass the module path and the Registry attribute separated by ':'",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidField(
            f"cannot import app module {module_name!r}: {exc}",
            field="--app",
            rule="an importable module",
            fix="check the module path and PYTHONPATH",
        ) from exc
    registry = getattr(module, attribute, None)
    if not isinstance(registry, Registry):
        raise InvalidField(
            f"{spec!r} is not a play Registry",
            field="--app",
            rule="module:attribute naming a worker.plays.Registry",
            fix="point --app at the Registry your plays are registered on",
        )
    return demo_plays.merged(registry)
