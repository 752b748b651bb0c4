"""Sandboxed plays: untrusted play code in a child process with no database credentials.

A play registered with ``@registry.play(..., sandboxed=True)`` runs in a child process
(``python -m worker.sandbox``) whose environment holds no database URL and no secret: only
the gateway's address and its attempt's two tokens (the executor's and the run-ledger's).
Its run context is the same API (:class:`worker.context.RunContext`) over a
:class:`~worker.contract.GatewayTransport`, so every step, sheet write, event and ledger
event goes through the gateway, checked against the token and fenced by the attempt.

The parent (the worker) writes the attempt's spec to the child's stdin and reads one JSON
line of outcome from its stdout: ``returned``, ``raised``, ``suspended``, ``fenced`` or
``cancelled``. To stop it, the worker signals it: SIGUSR1 runs the cleanup hooks first (a
cancel), SIGTERM stops it at once (a lost lease, a hand-back).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx
import structlog

from queues import outcomes, runs
from queues.authority import AttemptTokens
from queues.errors import FenceError, WorkerError
from worker.context import RunContext, RunInfo, Suspend
from worker.contract import GatewayTransport
from worker.plays import Fatal, Play, load_registry

log = structlog.get_logger("worker.sandbox")

# What a sandbox inherits from the worker's environment (to find Python and its code);
# nothing else. Never a database URL, a secret or the worker's home.
INHERITED = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL", "TZ", "HOME", "TMPDIR")
STOP_GRACE_S = 70.0  # the cleanup hooks' own bound is 60 s


def child_environment(
    *, gateway_url: str, tokens: AttemptTokens, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of a sandbox: what Python needs, the gateway, the tokens."""
    base = os.environ if base is None else base
    env = {name: base[name] for name in INHERITED if base.get(name)}
    env.update(
        WORKER_GATEWAY_URL=gateway_url,
        WORKER_RUN_TOKEN=tokens.executor,
        WORKER_LEDGER_TOKEN=tokens.ledger,
    )
    return env


def spec_of(c: runs.Claimed, info: RunInfo, *, app: str, cleanup: bool) -> dict[str, Any]:
    return {
        "app": app,
        "play": c.play,
        "params": c.params or {},
        "cleanup": cleanup,
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
        },
    }


async def run_attempt(
    c: runs.Claimed,
    info: RunInfo,
    *,
    app: str,
    gateway_url: str,
    tokens: AttemptTokens,
    stop_reason: Any,
) -> outcomes.Finish | tuple[outcomes.Finish, str] | None:
    """Run one attempt in a sandbox; its final write (None: stale, write nothing; a pair:
    a suspension on an event, written under the event's lock)."""
    assert c.attempt is not None
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker.sandbox",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=child_environment(gateway_url=gateway_url, tokens=tokens),
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(spec_of(c, info, app=app, cleanup=bool(c.cleanup))).encode())
    await proc.stdin.drain()
    proc.stdin.close()
    reading = asyncio.create_task(proc.stdout.read())
    reason: str | None = None
    try:
        await asyncio.shield(proc.wait())
    except asyncio.CancelledError:
        reason = stop_reason() or "handback"
        with contextlib.suppress(ProcessLookupError):
            # A cancel or the run's timeout runs the cleanup hooks first (SIGUSR1).
            proc.send_signal(
                signal.SIGUSR1 if reason in ("cancel", "timeout") else signal.SIGTERM
            )
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    out = await reading
    outcome = _last_json(out)
    if reason == "lease_lost":
        return None  # a newer attempt or the rescuer owns the run: no write at all
    if reason == "handback":
        return outcomes.handed_back(c.run_id, c.attempt)
    return _finish(c, outcome)


def _last_json(out: bytes) -> dict[str, Any]:
    for line in reversed(out.decode(errors="replace").splitlines()):
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict) and "status" in found:
                return found
    return {"status": "raised", "type": "SandboxCrashed", "message": "no outcome", "fatal": False}


def _finish(
    c: runs.Claimed, outcome: dict[str, Any]
) -> outcomes.Finish | tuple[outcomes.Finish, str] | None:
    from worker import attempt as attempts  # the outcome rules of an in-process attempt

    assert c.attempt is not None
    status = outcome.get("status")
    if status == "returned":
        return attempts.success(c, outcome.get("result"))
    if status == "cancelled":
        return outcomes.cancelled(c.run_id, c.attempt, "cancel requested")
    if status == "fenced":
        log.warning("attempt_fenced", error_code=outcome.get("code"), sandboxed=True)
        return None
    if status == "suspended":
        wake = outcome.get("wake_at")
        event = outcome.get("event")
        final = outcomes.suspended(
            c.run_id,
            c.attempt,
            wake_at=datetime.fromisoformat(wake) if wake else None,
            wait_event=event,
        )
        return (final, event) if event else final
    error = {
        "type": str(outcome.get("type") or "Exception"),
        "message": str(outcome.get("message") or "the sandboxed play raised"),
        "code": outcome.get("code"),
    }
    if isinstance(outcome.get("traceback"), str):
        error["traceback"] = outcome["traceback"][-outcomes.TRACEBACK_MAX_BYTES :]
    log.warning(
        "attempt_raised",
        play=c.play,
        sandboxed=True,
        error=f"{error['type']}: {error['message']}"[:500],
        traceback=error.get("traceback"),
    )
    budget = attempts.budget(c)
    now = datetime.now(UTC)
    if outcome.get("interrupted"):  # the gateway went away under it: not its fault
        return outcomes.interrupted(
            c.run_id,
            c.attempt,
            error,
            budget.policy,
            now=now,
            failure=budget.failures + 1,
            interruption=budget.interruptions + 1,
            max_interruptions=budget.max_interruptions,
        )
    return outcomes.failed(
        c.run_id,
        c.attempt,
        error,
        budget.policy,
        now=now,
        failure=budget.failures + 1,
        retryable=not outcome.get("fatal"),
    )


# ---- the child ---------------------------------------------------------------------------


async def _child(spec: dict[str, Any]) -> dict[str, Any]:
    registry = load_registry(str(spec["app"]))
    play: Play | None = registry.get(str(spec["play"]))
    info_data = spec["info"]
    info = RunInfo(
        run_id=uuid.UUID(info_data["run_id"]),
        attempt=int(info_data["attempt"]),
        org=info_data["org"],
        play=info_data["play"],
        lane=info_data["lane"],
        release=info_data["release"],
        worker_id=info_data["worker_id"],
        created_at=datetime.fromisoformat(info_data["created_at"]),
        meta=info_data.get("meta"),
    )
    transport = GatewayTransport(
        os.environ["WORKER_GATEWAY_URL"],
        executor_token=os.environ["WORKER_RUN_TOKEN"],
        ledger_token=os.environ["WORKER_LEDGER_TOKEN"],
        owner=info.worker_id,
    )
    ctx = RunContext(info, dict(spec.get("params") or {}), transport)
    loop = asyncio.get_running_loop()
    stopping = {"reason": ""}

    async def body() -> Any:
        if play is None:
            raise Fatal(f"play {spec['play']!r} is not in the sandbox's app")
        if spec.get("cleanup"):
            return await _cleanup(play, ctx)
        return await play.fn(ctx, ctx.params)

    task = asyncio.create_task(body())

    def stop(reason: str) -> None:
        stopping["reason"] = reason
        task.cancel()

    loop.add_signal_handler(signal.SIGUSR1, stop, "cancel")
    loop.add_signal_handler(signal.SIGTERM, stop, "stop")
    try:
        result = await task
        if spec.get("cleanup"):
            return {"status": "cancelled"}
        return {"status": "returned", "result": result}
    except asyncio.CancelledError:
        if stopping["reason"] == "cancel" and play is not None:
            await _cleanup(play, ctx)
            return {"status": "cancelled"}
        return {"status": "stopped"}
    except Suspend as suspend:
        return {
            "status": "suspended",
            "wake_at": suspend.wake_at.isoformat() if suspend.wake_at else None,
            "event": suspend.event,
        }
    except FenceError as exc:
        return {"status": "fenced", "code": exc.code, "message": exc.message}
    except Exception as exc:
        return {
            "status": "raised",
            "type": type(exc).__name__,
            "message": str(exc)[:2000],
            "code": getattr(exc, "code", None),
            "traceback": outcomes.bounded_traceback(exc),
            "fatal": isinstance(exc, Fatal | WorkerError),
            "interrupted": isinstance(exc, httpx.TransportError),
        }
    finally:
        await transport.aclose()


async def _cleanup(play: Play, ctx: RunContext) -> None:
    for hook in [*play.on_cancel, *ctx.cleanups]:
        try:
            async with asyncio.timeout(60):
                await hook(ctx)
        except Exception as exc:  # the child's stderr is the worker's: logged there
            log.warning("cleanup_hook_failed", play=play.name, error=repr(exc)[:500])


def main() -> None:
    from worker import logs

    logs.configure(json=True)  # the child's stderr is the worker's: one log format
    spec = json.loads(sys.stdin.read())
    outcome = asyncio.run(_child(spec))
    sys.stdout.write(json.dumps(outcome, default=str) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
