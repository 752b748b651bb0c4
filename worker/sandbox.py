"""Sandboxed plays: untrusted play code in a bubblewrap sandbox that holds no credentials.

A play registered with ``@registry.play(..., sandboxed=True)`` runs each attempt in a child
process (``python -m worker.sandbox_child``) that bubblewrap starts with its own user, PID,
mount and network namespaces and resource limits it cannot raise
(:mod:`worker.sandbox_launcher` says how the sandbox is made).

Where bubblewrap is missing or cannot create its namespaces, a sandboxed play refuses to
run: its run fails with ``SANDBOX_UNAVAILABLE``; it never runs unsandboxed. The worker
probes the mechanism as it starts and logs it (``sandbox_mechanism``).

The environment of the sandbox holds no database URL and no secret: the gateway's socket,
and what Python needs. Its run context is the same API (:class:`worker.context.RunContext`)
over a :class:`~worker.contract.GatewayTransport`, so every step, sheet write, event and
ledger event goes through the gateway, checked against the attempt's tokens (which the
worker writes to the child's stdin with the attempt's spec, never into an environment) and
fenced by the attempt.

This module is the worker's side of one attempt (:func:`run_attempt`): it writes the spec,
relays the child's stderr, stops it when told to and turns the outcome it reports into an
ending (:mod:`worker.endings`). The protocol between the two sides is
:mod:`worker.sandbox_wire`: the worker writes the spec line to the child's stdin; the child
confines itself (drops its user, sets its limits), answers ``READY``, runs the play and
writes one line of outcome. To stop it, the worker writes a control line: ``cancel`` runs
the cleanup hooks first (a cancel, the run's timeout), ``stop`` stops it at once (a lost
lease, a hand-back); past :data:`STOP_GRACE_S` the whole sandbox is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import deque
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import structlog

from queues import outcomes, runs
from queues.authority import AttemptTokens
from queues.errors import SandboxUnavailable
from worker import endings, instruments, sandbox_wire
from worker.context import RunInfo
from worker.contract import gateway_socket
from worker.plays import Resources
from worker.sandbox_launcher import (
    BWRAP_VARIABLE,
    DEFAULT_USER,
    ETC_PATHS,
    FIX,
    INHERITED,
    INSIDE_SOCKET,
    INSIDE_UID,
    OWN_PATHS,
    PROBE_TIMEOUT_S,
    SOCKET_VARIABLE,
    SYSTEM_PATHS,
    USER_VARIABLE,
    Launcher,
    Mechanism,
    app_root,
    code_roots,
    kill,
    tail,
)
from worker.sandbox_wire import LINE_LIMIT, READY, Attempt, Spec, Status

__all__ = [
    "BWRAP_VARIABLE",
    "DEFAULT_USER",
    "ETC_PATHS",
    "FIX",
    "INHERITED",
    "INSIDE_SOCKET",
    "INSIDE_UID",
    "LINE_LIMIT",
    "OWN_PATHS",
    "PROBE_TIMEOUT_S",
    "READY",
    "SOCKET_VARIABLE",
    "STDERR_BUDGET",
    "STOP_GRACE_S",
    "SYSTEM_PATHS",
    "USER_VARIABLE",
    "Launcher",
    "Mechanism",
    "app_root",
    "code_roots",
    "run_attempt",
]

log = structlog.get_logger("worker.sandbox")

# A cancel's grace: the child's cleanup hooks, each bounded, and a margin.
STOP_GRACE_S = sandbox_wire.CLEANUP_HOOK_S + 10.0
STDERR_BUDGET = 1024 * 1024  # bytes of a sandbox's stderr relayed to the worker's, per attempt


async def run_attempt(
    c: runs.Claimed,
    info: RunInfo,
    *,
    app: str,
    gateway_url: str,
    tokens: AttemptTokens,
    stop_reason: Any,
    launcher: Launcher,
    resources: Resources | None = None,
    max_outage_s: float = 60.0,
) -> endings.Ending:
    """Run one attempt in a sandbox; how it ended (:mod:`worker.endings`)."""
    assert c.attempt is not None
    mechanism = await launcher.ready()
    if not mechanism.available:
        return _unavailable(c, mechanism.reason or "no sandbox")
    socket = gateway_socket(gateway_url)
    if socket is None:
        return _unavailable(c, f"the gateway {gateway_url} is not a Unix socket")
    attempt = Attempt(
        app=app,
        play=str(c.play),
        params=c.params or {},
        cleanup=bool(c.cleanup),
        info=info,
        tokens=tokens,
        socket=INSIDE_SOCKET,
        max_outage_s=max_outage_s,
    )
    spec = Spec(launcher.user_of(mechanism), resources or Resources(), attempt)
    try:
        proc = await launcher.spawn(mechanism, socket=socket, resources=spec.resources)
    except OSError as exc:
        launcher.failed(str(exc))
        return _unavailable(c, f"bubblewrap could not be started: {exc}")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    reading = asyncio.create_task(_read_outcome(proc.stdout))
    relaying = asyncio.create_task(_relay(proc.stderr))
    reason: str | None = None
    try:
        try:
            await _tell(proc, spec.line())
            await asyncio.shield(proc.wait())
        except asyncio.CancelledError:
            reason = stop_reason() or "handback"
            # A cancel or the run's timeout runs the cleanup hooks first.
            word = sandbox_wire.CANCEL if reason in ("cancel", "timeout") else sandbox_wire.STOP
            await _tell(proc, sandbox_wire.control(word))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
    finally:
        kill(proc)  # whatever is left of it: its PID namespace dies with its init
        await proc.wait()
        proc.stdin.close()
    ready, lines = await reading
    err = await relaying
    if reason == "lease_lost":
        return endings.Stopped("lease_lost")  # a newer attempt or the rescuer owns the run
    if reason == "handback":
        return endings.Stopped("handback")
    if not ready and reason is None:
        detail = tail(err) or f"exit status {proc.returncode}"
        launcher.failed(detail)
        return _unavailable(c, f"the sandbox did not start: {detail}")
    return _ending(c, sandbox_wire.last_outcome(lines))


async def _tell(proc: asyncio.subprocess.Process, line: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
        proc.stdin.write(line)
        await proc.stdin.drain()


async def _read_outcome(stream: asyncio.StreamReader) -> tuple[bool, list[bytes]]:
    """Whether the child said it was ready, and the last few JSON lines it wrote after (the
    outcome is the last one with a status; what a play prints is bounded, never kept)."""
    ready = False
    last: deque[bytes] = deque(maxlen=4)
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line over LINE_LIMIT: dropped
            continue
        if not line:
            return ready, list(last)
        if not ready:
            ready = line.rstrip(b"\n") == READY
        elif line.startswith(b"{"):
            last.append(line)


async def _relay(stream: asyncio.StreamReader) -> bytes:
    """Copy a sandbox's stderr (its log lines) to the worker's, up to STDERR_BUDGET bytes;
    the last bytes of it, for a diagnosis."""
    relayed = 0
    recent = b""
    while chunk := await stream.read(65536):
        recent = (recent + chunk)[-4096:]
        if relayed < STDERR_BUDGET:
            part = chunk[: STDERR_BUDGET - relayed]
            relayed += len(part)
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sink = getattr(sys.stderr, "buffer", None)
                if sink is not None:
                    sink.write(part)
                    sink.flush()
                else:  # a text stream without its bytes (an embedding program's)
                    sys.stderr.write(part.decode(errors="replace"))
    if relayed >= STDERR_BUDGET:
        log.warning("sandbox_stderr_truncated", relayed_bytes=relayed)
    return recent


def _unavailable(c: runs.Claimed, detail: str) -> endings.Ending:
    """How a sandboxed attempt that had no sandbox ends: failed, not retried here (never
    run unsandboxed); a cleanup-only attempt is still cancelled."""
    exc = SandboxUnavailable(
        f"play {c.play!r} is sandboxed and this worker cannot sandbox it: {detail}", fix=FIX
    )
    log.error("sandbox_unavailable", play=c.play, error=exc.message[:500])
    if c.cleanup:
        return endings.Stopped("cancel")
    return endings.Raised(outcomes.error_of(exc), fatal=True, interrupted=False)


def _ending(c: runs.Claimed, outcome: Mapping[str, Any]) -> endings.Ending:
    """How the sandboxed play ended, from the last line it reported
    (:class:`worker.sandbox_wire.Outcome`, read as untrusted)."""
    instruments.from_sandbox(c.play or "", outcome.get("counts"))
    status = outcome.get("status")
    if status == Status.RETURNED:
        return endings.Returned(outcome.get("result"))
    if status == Status.CANCELLED:
        return endings.Stopped("cancel")
    if status == Status.FENCED:
        code, message = outcome.get("code"), outcome.get("message")
        return endings.Fenced(
            code if isinstance(code, str) else None, message if isinstance(message, str) else None
        )
    if status == Status.SUSPENDED:
        wake = outcome.get("wake_at")
        return endings.Suspended(
            datetime.fromisoformat(wake) if wake else None, outcome.get("event") or None
        )
    error = {
        "type": str(outcome.get("type") or "Exception"),
        "message": str(outcome.get("message") or "the sandboxed play raised"),
        "code": outcome.get("code"),
    }
    if isinstance(outcome.get("traceback"), str):
        error["traceback"] = outcome["traceback"][-outcomes.TRACEBACK_MAX_BYTES :]
    return endings.Raised(
        error,
        fatal=bool(outcome.get("fatal")),
        # The gateway went away under it: not its fault.
        interrupted=bool(outcome.get("interrupted")),
    )
