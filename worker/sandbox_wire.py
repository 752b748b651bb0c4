"""The wire between the worker and a sandbox: all the two sides say to each other, defined
once for the worker's side (:mod:`worker.sandbox`, :mod:`worker.sandbox_launcher`) and the
child's (:mod:`worker.sandbox_child`).

Over the child's stdin the worker writes one JSON line, the :class:`Spec` (who the child
becomes, its limits and, unless it is a probe, the attempt it runs with its tokens: never in
an environment), then control lines: :data:`CANCEL` or :data:`STOP`; its stdin closed means
stop. Over its stdout the child answers :data:`READY` once it has confined itself, then,
when the play has ended, one JSON line of :class:`Outcome`. Whatever a play prints to
stdout in between is bounded and never trusted: the worker takes the last line with a
``status`` (:func:`last_outcome`).

This module is imported inside the sandbox: it names no launcher and no worker service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Required, TypedDict

from queues import fields
from queues.authority import AttemptTokens
from worker.context import RunInfo
from worker.plays import Resources

READY = b'{"sandbox": "ready"}'  # the child's first line: confined, about to run the play
CANCEL = "cancel"  # run the cleanup hooks, then stop (a cancel, the run's timeout)
STOP = "stop"  # stop at once (a lost lease, a hand-back)
CONTROLS = (CANCEL, STOP)
CLEANUP_HOOK_S = 60.0  # each cleanup hook's bound, in the child, after a cancel
# A line of the child's stdout the worker reads at most (the outcome line holds a result).
LINE_LIMIT = 2 * fields.MAX_RESULT_BYTES + 1024 * 1024
DEFAULT_MAX_OUTAGE_S = 60.0


def control(word: str) -> bytes:
    """A control line for the child's stdin (:data:`CANCEL` or :data:`STOP`)."""
    assert word in CONTROLS
    return word.encode() + b"\n"


def control_of(line: bytes) -> str | None:
    """The control word a line of the child's stdin holds, if any."""
    word = line.strip().decode(errors="replace")
    return word if word in CONTROLS else None


# ---- the spec: the worker to the child ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Attempt:
    """The attempt a sandbox runs: its play, its run and the tokens it calls the gateway
    with."""

    app: str  # the app's registry, ``module:attribute``
    play: str
    params: Mapping[str, Any]
    cleanup: bool  # a cleanup-only attempt: the play's cleanup hooks, not the play
    info: RunInfo
    tokens: AttemptTokens
    socket: str  # the gateway's Unix socket, as the sandbox sees it
    max_outage_s: float = DEFAULT_MAX_OUTAGE_S


@dataclass(frozen=True, slots=True)
class Spec:
    """The first line of the child's stdin."""

    user: tuple[int, int] | None  # the uid and gid the child drops to (a root worker's)
    resources: Resources
    attempt: Attempt | None = None  # None: a probe, which confines itself and exits

    def line(self) -> bytes:
        out: dict[str, Any] = {
            "user": list(self.user) if self.user is not None else None,
            "resources": dataclasses.asdict(self.resources),
        }
        a = self.attempt
        if a is None:
            return json.dumps(out | {"probe": True}).encode() + b"\n"
        info = a.info
        out |= {
            "app": a.app,
            "play": a.play,
            "params": dict(a.params),
            "cleanup": a.cleanup,
            "info": {
                "run_id": str(info.run_id),
                "attempt": info.attempt,
                "org": info.org,
                "play": info.play,
                "lane": info.lane,
                "release": info.release,
                "worker_id": info.worker_id,
                "created_at": info.created_at.isoformat(),
                "meta": dict(info.meta) if info.meta else None,
                "resumed": info.resumed,
            },
            "tokens": {"executor": a.tokens.executor, "ledger": a.tokens.ledger},
            "socket": a.socket,
            "max_outage_s": a.max_outage_s,
        }
        return json.dumps(out).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> Spec:
        data = json.loads(line)
        user = data.get("user")
        resources = Resources(**(data.get("resources") or {}))
        spec_user = (int(user[0]), int(user[1])) if user is not None else None
        if data.get("probe"):
            return cls(spec_user, resources)
        info = data["info"]
        tokens = data["tokens"]
        attempt = Attempt(
            app=str(data["app"]),
            play=str(data["play"]),
            params=dict(data.get("params") or {}),
            cleanup=bool(data.get("cleanup")),
            info=RunInfo(
                run_id=uuid.UUID(info["run_id"]),
                attempt=int(info["attempt"]),
                org=info["org"],
                play=info["play"],
                lane=info["lane"],
                release=info["release"],
                worker_id=info["worker_id"],
                created_at=datetime.fromisoformat(info["created_at"]),
                meta=info.get("meta"),
                resumed=bool(info.get("resumed")),
            ),
            tokens=AttemptTokens(executor=tokens["executor"], ledger=tokens["ledger"]),
            socket=str(data["socket"]),
            max_outage_s=float(data.get("max_outage_s", DEFAULT_MAX_OUTAGE_S)),
        )
        return cls(spec_user, resources, attempt)


# ---- the outcome: the child to the worker ---------------------------------------------------


class Status(StrEnum):
    """How a sandboxed play ended, as its child reports it."""

    RETURNED = "returned"  # with its ``result``
    RAISED = "raised"  # ``type``, ``message``, ``code``, ``traceback``, ``fatal``, ``interrupted``
    SUSPENDED = "suspended"  # until ``wake_at`` or the ``event``
    FENCED = "fenced"  # a write was refused by the attempt's fence: ``code``, ``message``
    CANCELLED = "cancelled"  # its cleanup hooks ran (a cancel, a cleanup-only attempt)
    STOPPED = "stopped"  # stopped at once, no cleanup


class Outcome(TypedDict, total=False):
    """The child's last line. The worker reads it as untrusted (a play can print a line of
    this shape), so it checks every field's type as it reads it."""

    status: Required[str]
    result: Any
    wake_at: str | None  # ISO 8601
    event: str | None
    code: str | None
    message: str
    type: str  # the exception's class name
    traceback: str | None
    fatal: bool
    interrupted: bool  # an outage its gateway calls could not absorb: not the play's fault
    counts: dict[str, Any]  # what its calls absorbed (worker.instruments.from_sandbox)


NO_OUTCOME: Outcome = {
    "status": Status.RAISED,
    "type": "SandboxCrashed",
    "message": "no outcome",
    "fatal": False,
}


def outcome_line(outcome: Outcome) -> str:
    """The child's last line (a result that is not JSON is written as its ``str``)."""
    return json.dumps(outcome, default=str) + "\n"


def last_outcome(lines: Iterable[bytes]) -> dict[str, Any]:
    """The last of the child's JSON lines that has a status, else :data:`NO_OUTCOME`."""
    for line in reversed(list(lines)):
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict) and "status" in found:
                return found
    return dict(NO_OUTCOME)
