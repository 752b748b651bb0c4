"""Inside the sandbox: the child bubblewrap runs (``python -B -P -m worker.sandbox_child``).

It reads its :class:`~worker.sandbox_wire.Spec` from stdin, confines itself before any play
code is imported (drops to the sandbox's user, sets its resource limits), answers
:data:`~worker.sandbox_wire.READY`, runs the play over a
:class:`~worker.contract.GatewayTransport` (the gateway's socket is its only way out) and
writes its :class:`~worker.sandbox_wire.Outcome`. The worker's control lines on stdin stop
it: ``cancel`` runs the cleanup hooks first, ``stop`` stops it at once.

It imports what running a play needs and nothing of the worker's side (the launcher, the
attempt, the runtime): :mod:`worker.sandbox` says how the sandbox is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

import structlog

from queues import outcomes
from queues.errors import FenceError
from worker import endings, sandbox_wire
from worker.blips import is_blip
from worker.context import RunContext, Suspend
from worker.contract import Absorbing, GatewayTransport
from worker.endings import Fatal
from worker.plays import Play, Resources, load_registry
from worker.sandbox_wire import Outcome, Spec, Status

log = structlog.get_logger("worker.sandbox")

_RLIMITS = (
    ("memory", resource.RLIMIT_AS),
    ("cpu_s", resource.RLIMIT_CPU),
    ("processes", resource.RLIMIT_NPROC),
    ("file_size", resource.RLIMIT_FSIZE),
    ("open_files", resource.RLIMIT_NOFILE),
)


def confine(user: tuple[int, int] | None, resources: Resources) -> None:
    """Before any play code: drop to the sandbox's user (set up as root), then set the
    resource limits; refuse to go on as root."""
    if user is not None:
        uid, gid = user
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise RuntimeError("the sandbox could take root back after dropping it")
    if os.geteuid() == 0 or os.getuid() == 0:
        raise RuntimeError("the sandbox runs as root")
    for name, which in _RLIMITS:
        value = getattr(resources, name)
        if value is not None:
            resource.setrlimit(which, (int(value), int(value)))


def _read_spec() -> tuple[bytes, bytes]:
    """The spec's line from stdin (unbuffered: what follows it is the control stream)."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


async def _controls(pending: bytes, stop: Callable[[str], None]) -> None:
    """The worker's control lines on stdin: ``cancel`` or ``stop`` (its end: stop)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    if pending:
        reader.feed_data(pending)
    pipe = os.fdopen(os.dup(0), "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        while line := await reader.readline():
            word = sandbox_wire.control_of(line)
            if word is not None:
                stop(word)
        stop(sandbox_wire.STOP)
    finally:
        transport.close()


async def _child(attempt: sandbox_wire.Attempt, pending: bytes) -> Outcome:
    registry = load_registry(attempt.app)
    play: Play | None = registry.get(attempt.play)
    info = attempt.info
    transport = GatewayTransport(
        f"unix:{attempt.socket}",
        executor_token=attempt.tokens.executor,
        ledger_token=attempt.tokens.ledger,
        owner=info.worker_id,
    )
    absorbing = Absorbing(transport, max_outage_s=attempt.max_outage_s)
    ctx = RunContext(info, dict(attempt.params), absorbing)
    stopping = {"reason": ""}

    async def body() -> Any:
        if play is None:
            raise Fatal(f"play {attempt.play!r} is not in the sandbox's app")
        if attempt.cleanup:
            return await _cleanup(play, ctx)
        return await play.fn(ctx, ctx.params)

    task = asyncio.create_task(body())

    def stop(reason: str) -> None:
        if not stopping["reason"]:
            stopping["reason"] = reason
            task.cancel()

    controls = asyncio.create_task(_controls(pending, stop))
    try:
        outcome = await _ended(task, attempt, play, ctx, stopping)
        outcome["counts"] = {
            "absorbed": dict(absorbing.absorbed),
            "duplicate_suspects": ctx.duplicate_suspects,
        }
        return outcome
    finally:
        controls.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await controls
        await transport.aclose()


async def _ended(
    task: asyncio.Task[Any],
    attempt: sandbox_wire.Attempt,
    play: Play | None,
    ctx: RunContext,
    stopping: dict[str, str],
) -> Outcome:
    """How the sandboxed play ended, for the worker (:func:`worker.sandbox.run_attempt`)."""
    try:
        result = await task
        if attempt.cleanup:
            return {"status": Status.CANCELLED}
        return {"status": Status.RETURNED, "result": result}
    except asyncio.CancelledError:
        if stopping["reason"] == sandbox_wire.CANCEL and play is not None:
            await _cleanup(play, ctx)
            return {"status": Status.CANCELLED}
        return {"status": Status.STOPPED}
    except Suspend as suspend:
        return {
            "status": Status.SUSPENDED,
            "wake_at": suspend.wake_at.isoformat() if suspend.wake_at else None,
            "event": suspend.event,
        }
    except FenceError as exc:
        return {"status": Status.FENCED, "code": exc.code, "message": exc.message}
    except Exception as exc:
        return {
            "status": Status.RAISED,
            "type": type(exc).__name__,
            "message": str(exc)[:2000],
            "code": getattr(exc, "code", None),
            "traceback": outcomes.bounded_traceback(exc),
            "fatal": endings.is_fatal(exc),
            # An outage its calls could not absorb (worker.contract): not the play's fault.
            "interrupted": is_blip(exc),
        }


async def _cleanup(play: Play, ctx: RunContext) -> None:
    for hook in [*play.on_cancel, *ctx.cleanups]:
        try:
            async with asyncio.timeout(sandbox_wire.CLEANUP_HOOK_S):
                await hook(ctx)
        except Exception as exc:  # the child's stderr is relayed to the worker's log
            log.warning("cleanup_hook_failed", play=play.name, error=repr(exc)[:500])


def main() -> None:
    from worker import logs

    logs.configure(json=True)  # the child's stderr is relayed to the worker's: one format
    line, pending = _read_spec()
    spec = Spec.parse(line)
    try:
        confine(spec.user, spec.resources)
    except Exception as exc:
        sys.stderr.write(f"sandbox: cannot confine the play: {exc!r}\n")
        sys.stderr.flush()
        sys.exit(3)
    sys.stdout.buffer.write(sandbox_wire.READY + b"\n")
    sys.stdout.flush()
    if spec.attempt is None:  # a probe
        return
    outcome = asyncio.run(_child(spec.attempt, pending))
    sys.stdout.write(sandbox_wire.outcome_line(outcome))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
