"""Sandboxed plays: untrusted play code in a bubblewrap sandbox that holds no credentials.

A play registered with ``@registry.play(..., sandboxed=True)`` runs in a child process
(``python -m worker.sandbox``) started by bubblewrap (``bwrap``), which gives it:

- its own **user**: a worker running as root sets the sandbox up as root, and the child
  drops to an unprivileged user (``nobody``, or ``WORKER_SANDBOX_USER``) with no
  capability left before any play code is imported; a worker that is not root runs it in a
  user namespace (uid 65534 inside, no capability, no nested user namespace);
- its own **PID namespace**, with a fresh ``/proc``: the worker's processes are not there
  to read; when the attempt ends, the namespace's init dies and takes every process of the
  sandbox with it (a ``start_new_session`` child included), and the worker kills bwrap's
  process group as well;
- its own **mount namespace**, which shows only ``/usr`` and the system's library
  directories, a few files of ``/etc`` (the dynamic linker's cache, the time zone), the
  Python runtime with its site-packages and the directories of the play's code (the app's
  root and the worker's Python path), all read-only; a private ``/tmp`` (a tmpfs of
  :attr:`Resources.tmp` bytes); nothing of ``WORKER_HOME`` (masked where it lies inside a
  directory that is shown);
- **no network** (its own network namespace, with nothing but a loopback of its own): the
  runtime gateway's Unix socket, bound in at :data:`INSIDE_SOCKET`, is its only way out;
- resource limits (:class:`worker.plays.Resources`: address space, CPU seconds, processes,
  file size, open files) that every process of the sandbox inherits and cannot raise;
- ``--die-with-parent`` (it dies with the worker) and ``--new-session`` (no terminal).

Where bubblewrap is missing or cannot create its namespaces, a sandboxed play refuses to
run: its run fails with ``SANDBOX_UNAVAILABLE``; it never runs unsandboxed. The worker
probes the mechanism as it starts and logs it (``sandbox_mechanism``).

The environment of the sandbox holds no database URL and no secret: the gateway's socket,
and what Python needs. Its run context is the same API (:class:`worker.context.RunContext`)
over a :class:`~worker.contract.GatewayTransport`, so every step, sheet write, event and
ledger event goes through the gateway, checked against the attempt's tokens (which the
worker writes to the child's stdin with the attempt's spec, never into an environment) and
fenced by the attempt.

The protocol: the worker writes one JSON line (the spec) to the child's stdin; the child
confines itself (drops its user, sets its limits), answers :data:`READY` on stdout, then
runs the play and writes one JSON line of outcome: ``returned``, ``raised``, ``suspended``,
``fenced`` or ``cancelled``. To stop it, the worker writes a line to its stdin: ``cancel``
runs the cleanup hooks first (a cancel, the run's timeout), ``stop`` stops it at once (a
lost lease, a hand-back); past :data:`STOP_GRACE_S` the whole sandbox is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pwd
import resource
import shutil
import sys
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog

from queues import fields, outcomes, runs
from queues.authority import AttemptTokens
from queues.errors import FenceError, SandboxUnavailable
from worker import endings, instruments
from worker.blips import is_blip
from worker.context import RunContext, RunInfo, Suspend
from worker.contract import Absorbing, GatewayTransport, gateway_socket
from worker.endings import Fatal
from worker.plays import Play, Resources, load_registry

log = structlog.get_logger("worker.sandbox")

BWRAP_VARIABLE = "WORKER_SANDBOX_BWRAP"  # bubblewrap's path (default: `bwrap` on PATH)
USER_VARIABLE = "WORKER_SANDBOX_USER"  # who a root worker's sandboxes run as (default nobody)
DEFAULT_USER = "nobody"
INSIDE_UID = 65534  # who the play is inside a user namespace (a worker that is not root)
INSIDE_SOCKET = "/run/worker/gateway.sock"  # where the gateway's socket is in a sandbox
SOCKET_VARIABLE = "WORKER_GATEWAY_SOCKET"
# The whole environment of a sandbox: these (the worker's PATH, locale, time zone and
# virtualenv when it has them; its Python path; HOME, TMPDIR and PWD are the sandbox's /tmp)
# and the gateway's socket. Never a database URL, a secret, a token or the worker's home.
INHERITED = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LANG",
    "LC_ALL",
    "TZ",
    "HOME",
    "TMPDIR",
    "PWD",
)
STOP_GRACE_S = 70.0  # the cleanup hooks' own bound is 60 s
PROBE_TIMEOUT_S = 30.0
READY = b'{"sandbox": "ready"}'
# What a sandbox is shown of the system, read-only (a symlink is made a symlink).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
OWN_PATHS = ("/tmp", "/run", "/dev", "/proc")  # a sandbox's own, never the host's
ETC_PATHS = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
# A line of the child's stdout the worker reads at most (the outcome line holds a result).
LINE_LIMIT = 2 * fields.MAX_RESULT_BYTES + 1024 * 1024
STDERR_BUDGET = 1024 * 1024  # bytes of a sandbox's stderr relayed to the worker's, per attempt
FIX = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; or set "
    f"{BWRAP_VARIABLE} to its path); where it is installed but cannot create namespaces "
    "(a container that forbids them), allow them: run the worker as root with "
    "CAP_SYS_ADMIN, or as another user with user namespaces allowed "
    "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1)"
)


@dataclass(frozen=True, slots=True)
class Mechanism:
    """How this worker sandboxes plays, or why it cannot."""

    available: bool
    bwrap: str | None
    mode: str  # "drop": set up as root, the child drops to `user`; "userns": a user namespace
    uid: int
    gid: int
    version: str | None = None
    reason: str | None = None  # why it is not available

    def describe(self) -> dict[str, Any]:
        if not self.available:
            return {"mechanism": "none", "reason": self.reason, "fix": FIX}
        return {
            "mechanism": "bubblewrap",
            "bwrap": self.bwrap,
            "version": self.version,
            "user": (
                f"uid {self.uid} gid {self.gid} (dropped to from root)"
                if self.mode == "drop"
                else f"uid {INSIDE_UID} in a user namespace (uid {os.geteuid()} outside)"
            ),
            "namespaces": ("user, " if self.mode == "userns" else "")
            + "pid, mount, network, ipc, uts",
            "network": "none (the gateway's Unix socket only)",
        }


def _user(spec: str) -> tuple[int, int]:
    """The uid and gid of ``WORKER_SANDBOX_USER``: a name, a uid, or uid:gid."""
    name, _, group = spec.partition(":")
    if name.isdigit():
        uid = int(name)
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = uid
    else:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise SandboxUnavailable(
                f"the sandbox user {name!r} does not exist",
                field=USER_VARIABLE,
                rule="a user name, a uid, or uid:gid; never root",
                fix=f"create the user, or set {USER_VARIABLE} to an unprivileged uid",
            ) from None
        uid, gid = entry.pw_uid, entry.pw_gid
    if group:
        gid = int(group) if group.isdigit() else -1
    if uid == 0 or gid <= 0:
        raise SandboxUnavailable(
            f"the sandbox user {spec!r} is root or has no valid group",
            field=USER_VARIABLE,
            rule="an unprivileged user: not uid 0, not gid 0",
            fix=f"set {USER_VARIABLE} to an unprivileged user (default {DEFAULT_USER})",
        )
    return uid, gid


def _covered(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def app_root(app: str | None) -> str | None:
    """The directory the app's top package is imported from (``module:attribute``)."""
    if not app:
        return None
    name = app.partition(":")[0]
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return None
    depth = name.count(".") + (1 if Path(file).name == "__init__.py" else 0)
    return str(Path(file).resolve().parents[depth])


def code_roots(app: str | None) -> list[str]:
    """The directories a sandbox is shown read-only besides the system's: the app's root
    (where its top package lives), the worker's own code, the Python runtime and every
    entry of the worker's Python path; nested ones folded into their parent."""
    root = app_root(app)
    candidates: list[str] = [root] if root else []
    import worker

    candidates.append(str(Path(worker.__file__).resolve().parents[1]))
    candidates += [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    candidates.append(str(Path(os.path.realpath(sys.executable)).parents[1]))
    candidates += [p for p in sys.path if p]
    candidates += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    found: set[str] = set()
    for candidate in candidates:
        for path in {os.path.abspath(candidate), os.path.realpath(candidate)}:
            if path != "/" and os.path.exists(path) and not _covered(path, SYSTEM_PATHS):
                found.add(path if os.path.isdir(path) else os.path.dirname(path))
    roots: list[str] = []
    for path in sorted(found):
        # Never the host's own /tmp, /run, /dev or /proc (or what holds them): the sandbox
        # has its own; a directory below them is fine.
        if any(_covered(own, [path]) for own in OWN_PATHS) or _covered(path, roots):
            continue
        roots.append(path)
    return roots


def _hidden_defaults() -> list[Path]:
    from worker import config, embedded

    return [embedded.default_home(), *map(Path, config.credential_files())]


class Launcher:
    """Starts sandboxes for one worker: finds bubblewrap, probes it once (and again while it
    is unavailable), builds each sandbox's command line."""

    def __init__(
        self,
        app: str | None,
        *,
        bwrap: str | None = None,
        user: str | None = None,
        hidden: Iterable[Path] = (),
    ) -> None:
        self.app = app
        configured = bwrap or os.environ.get(BWRAP_VARIABLE) or None
        self.configured = configured
        self.bwrap = shutil.which(configured or "bwrap") or configured
        self.user_spec = user or os.environ.get(USER_VARIABLE) or DEFAULT_USER
        self.roots = code_roots(app)
        self.hidden = [*hidden, *_hidden_defaults()]
        self.mechanism: Mechanism | None = None
        self._disable_userns = False

    # ---- the mechanism ----------------------------------------------------------------

    def _unavailable(self, reason: str) -> Mechanism:
        return Mechanism(False, self.bwrap, "none", -1, -1, reason=reason)

    def _planned(self) -> Mechanism:
        """What would sandbox a play here, before trying it."""
        if self.bwrap is None:
            return self._unavailable("bubblewrap (bwrap) is not on PATH")
        if not (os.path.isfile(self.bwrap) and os.access(self.bwrap, os.X_OK)):
            where = f"{BWRAP_VARIABLE}={self.configured}" if self.configured else self.bwrap
            return self._unavailable(f"no bubblewrap executable at {where}")
        if os.geteuid() == 0:
            try:
                uid, gid = _user(self.user_spec)
            except SandboxUnavailable as exc:
                return self._unavailable(exc.render())
            return Mechanism(True, self.bwrap, "drop", uid, gid)
        return Mechanism(True, self.bwrap, "userns", INSIDE_UID, INSIDE_UID)

    async def probe(self) -> Mechanism:
        """Start one sandbox that confines itself and exits: the mechanism if it worked,
        else why not. Logged as ``sandbox_mechanism``."""
        planned = self._planned()
        if planned.available:
            planned = await self._try(planned)
        self.mechanism = planned
        if planned.available:
            log.info("sandbox_mechanism", **planned.describe())
        else:
            log.warning("sandbox_mechanism", **planned.describe())
        return planned

    async def _try(self, planned: Mechanism) -> Mechanism:
        assert planned.bwrap is not None
        version = await _output(planned.bwrap, "--version")
        usage = await _output(planned.bwrap, "--help")
        self._disable_userns = "--disable-userns" in usage
        planned = dataclasses.replace(planned, version=version.strip() or None)
        self.mechanism = planned
        spec = {"probe": True, "user": self.user_of(planned), "resources": _limits(None)}
        try:
            proc = await self._spawn(planned, socket=None, resources=Resources())
        except OSError as exc:
            return self._unavailable(f"bubblewrap could not be started: {exc}")
        assert proc.stdin is not None
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                proc.stdin.write(json.dumps(spec).encode() + b"\n")
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    await proc.stdin.drain()
                out, err = await proc.communicate()
        except TimeoutError:
            _kill(proc)
            await proc.wait()
            return self._unavailable(f"a probe sandbox did not answer in {PROBE_TIMEOUT_S:g}s")
        if proc.returncode == 0 and out.splitlines()[:1] == [READY]:
            return planned
        detail = _tail(err) or f"exit status {proc.returncode}"
        return self._unavailable(f"bubblewrap cannot create the sandbox here: {detail}")

    async def ready(self) -> Mechanism:
        """The mechanism to run an attempt with (probed again while it is unavailable: a
        bubblewrap installed meanwhile is used without a restart)."""
        if self.mechanism is None or not self.mechanism.available:
            return await self.probe()
        return self.mechanism

    def failed(self, reason: str) -> None:
        """A sandbox did not start: the next attempt probes again first."""
        self.mechanism = self._unavailable(reason)

    @staticmethod
    def user_of(mechanism: Mechanism) -> list[int] | None:
        return [mechanism.uid, mechanism.gid] if mechanism.mode == "drop" else None

    # ---- one sandbox ------------------------------------------------------------------

    def command(
        self, mechanism: Mechanism, *, socket: str | None, resources: Resources
    ) -> list[str]:
        """bubblewrap's command line for one sandbox (see the module's docstring)."""
        assert mechanism.bwrap is not None
        args = [mechanism.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net"]
        args += ["--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        args += ["--die-with-parent", "--new-session"]
        if mechanism.mode == "userns":
            args += ["--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]
            if self._disable_userns:
                args.append("--disable-userns")
            args += ["--cap-drop", "ALL"]
        else:  # set up as root: the child keeps only what it needs to drop its user
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--perms", "1777", "--size", str(resources.tmp), "--tmpfs", "/tmp"]
        for path in SYSTEM_PATHS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in ETC_PATHS:
            args += ["--ro-bind-try", path, path]
        parents = sorted(
            {str(p) for root in self.roots for p in Path(root).parents if str(p) != "/"},
            key=lambda p: (p.count("/"), p),
        )
        for parent in parents:
            if not _covered(parent, SYSTEM_PATHS) and parent not in OWN_PATHS:
                args += ["--perms", "0755", "--dir", parent]
        for root in self.roots:
            args += ["--ro-bind", root, root]
        for path in self._masks():
            if os.path.isdir(path):
                args += ["--tmpfs", path]
            else:
                args += ["--ro-bind", "/dev/null", path]
        if socket is not None:
            args += ["--perms", "0755", "--dir", os.path.dirname(INSIDE_SOCKET)]
            args += ["--bind", socket, INSIDE_SOCKET]
        args += ["--chdir", "/tmp", "--", sys.executable, "-B", "-P", "-m", "worker.sandbox"]
        return args

    def _masks(self) -> list[str]:
        """The secret paths that lie inside a directory a sandbox is shown (the worker's
        home, credential files): each is covered by an empty one."""
        out: set[str] = set()
        for hidden in self.hidden:
            for path in {os.path.abspath(hidden), os.path.realpath(hidden)}:
                if os.path.exists(path) and _covered(path, self.roots):
                    out.add(path)
        return sorted(out)

    def environment(self) -> dict[str, str]:
        """The sandbox's whole environment (see :data:`INHERITED`)."""
        kept = ("PATH", "LANG", "LC_ALL", "TZ", "VIRTUAL_ENV")
        env = {name: os.environ[name] for name in kept if os.environ.get(name)}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        root = app_root(self.app)
        path = [*([root] if root else []), *(p for p in sys.path if os.path.isabs(p or "."))]
        env.update(
            HOME="/tmp",
            TMPDIR="/tmp",
            PYTHONPATH=os.pathsep.join(dict.fromkeys(path)),
            **{SOCKET_VARIABLE: INSIDE_SOCKET},
        )
        return env

    async def _spawn(
        self, mechanism: Mechanism, *, socket: str | None, resources: Resources
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *self.command(mechanism, socket=socket, resources=resources),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.environment(),
            start_new_session=True,  # its own process group: killed whole at the end
            limit=LINE_LIMIT,
        )


async def _output(*command: str) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    except (OSError, TimeoutError):
        return ""
    return out.decode(errors="replace")


def _tail(err: bytes, limit: int = 500) -> str:
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-limit:]


def _kill(proc: asyncio.subprocess.Process) -> None:
    """Kill bubblewrap's whole process group (the sandbox's init with it, and so every
    process of its PID namespace), while its leader is not reaped yet."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _limits(resources: Resources | None) -> dict[str, Any]:
    return dataclasses.asdict(resources or Resources())


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
            "resumed": info.resumed,
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
    limits = resources or Resources()
    spec = spec_of(c, info, app=app, cleanup=bool(c.cleanup)) | {
        "tokens": {"executor": tokens.executor, "ledger": tokens.ledger},
        "socket": INSIDE_SOCKET,
        "user": launcher.user_of(mechanism),
        "resources": _limits(limits),
        "max_outage_s": max_outage_s,
    }
    try:
        proc = await launcher._spawn(mechanism, socket=socket, resources=limits)
    except OSError as exc:
        launcher.failed(str(exc))
        return _unavailable(c, f"bubblewrap could not be started: {exc}")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    reading = asyncio.create_task(_read_outcome(proc.stdout))
    relaying = asyncio.create_task(_relay(proc.stderr))
    reason: str | None = None
    try:
        try:
            await _tell(proc, json.dumps(spec).encode())
            await asyncio.shield(proc.wait())
        except asyncio.CancelledError:
            reason = stop_reason() or "handback"
            # A cancel or the run's timeout runs the cleanup hooks first.
            await _tell(proc, b"cancel" if reason in ("cancel", "timeout") else b"stop")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
    finally:
        _kill(proc)  # whatever is left of it: its PID namespace dies with its init
        await proc.wait()
        proc.stdin.close()
    ready, lines = await reading
    err = await relaying
    if reason == "lease_lost":
        return endings.Stopped("lease_lost")  # a newer attempt or the rescuer owns the run
    if reason == "handback":
        return endings.Stopped("handback")
    if not ready and reason is None:
        detail = _tail(err) or f"exit status {proc.returncode}"
        launcher.failed(detail)
        return _unavailable(c, f"the sandbox did not start: {detail}")
    return _ending(c, _last_json(lines))


async def _tell(proc: asyncio.subprocess.Process, line: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
        proc.stdin.write(line + b"\n")
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
    tail = b""
    while chunk := await stream.read(65536):
        tail = (tail + chunk)[-4096:]
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
    return tail


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


def _last_json(lines: list[bytes]) -> dict[str, Any]:
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict) and "status" in found:
                return found
    return {"status": "raised", "type": "SandboxCrashed", "message": "no outcome", "fatal": False}


def _ending(c: runs.Claimed, outcome: dict[str, Any]) -> endings.Ending:
    """How the sandboxed play ended, from the last line it reported (:func:`_ended`)."""
    instruments.from_sandbox(c.play or "", outcome.get("counts"))
    status = outcome.get("status")
    if status == "returned":
        return endings.Returned(outcome.get("result"))
    if status == "cancelled":
        return endings.Stopped("cancel")
    if status == "fenced":
        code, message = outcome.get("code"), outcome.get("message")
        return endings.Fenced(
            code if isinstance(code, str) else None, message if isinstance(message, str) else None
        )
    if status == "suspended":
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


# ---- the child ---------------------------------------------------------------------------

_RLIMITS = (
    ("memory", resource.RLIMIT_AS),
    ("cpu_s", resource.RLIMIT_CPU),
    ("processes", resource.RLIMIT_NPROC),
    ("file_size", resource.RLIMIT_FSIZE),
    ("open_files", resource.RLIMIT_NOFILE),
)


def confine(spec: Mapping[str, Any]) -> None:
    """Before any play code: drop to the sandbox's user (set up as root), then set the
    resource limits; refuse to go on as root."""
    user = spec.get("user")
    if user is not None:
        uid, gid = int(user[0]), int(user[1])
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
    limits = spec.get("resources") or {}
    for name, which in _RLIMITS:
        value = limits.get(name)
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


async def _controls(pending: bytes, stop: Any) -> None:
    """The worker's control lines on stdin: ``cancel`` or ``stop`` (its end: stop)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    if pending:
        reader.feed_data(pending)
    pipe = os.fdopen(os.dup(0), "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        while line := await reader.readline():
            word = line.strip().decode(errors="replace")
            if word in ("cancel", "stop"):
                stop(word)
        stop("stop")
    finally:
        transport.close()


async def _child(spec: dict[str, Any], pending: bytes) -> dict[str, Any]:
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
        resumed=bool(info_data.get("resumed")),
    )
    tokens = spec["tokens"]
    transport = GatewayTransport(
        f"unix:{spec['socket']}",
        executor_token=tokens["executor"],
        ledger_token=tokens["ledger"],
        owner=info.worker_id,
    )
    absorbing = Absorbing(transport, max_outage_s=float(spec.get("max_outage_s", 60.0)))
    ctx = RunContext(info, dict(spec.get("params") or {}), absorbing)
    stopping = {"reason": ""}

    async def body() -> Any:
        if play is None:
            raise Fatal(f"play {spec['play']!r} is not in the sandbox's app")
        if spec.get("cleanup"):
            return await _cleanup(play, ctx)
        return await play.fn(ctx, ctx.params)

    task = asyncio.create_task(body())

    def stop(reason: str) -> None:
        if not stopping["reason"]:
            stopping["reason"] = reason
            task.cancel()

    controls = asyncio.create_task(_controls(pending, stop))
    try:
        return await _ended(task, spec, play, ctx, stopping) | {
            "counts": {
                "absorbed": dict(absorbing.absorbed),
                "duplicate_suspects": ctx.duplicate_suspects,
            }
        }
    finally:
        controls.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await controls
        await transport.aclose()


async def _ended(
    task: asyncio.Task[Any],
    spec: dict[str, Any],
    play: Play | None,
    ctx: RunContext,
    stopping: dict[str, str],
) -> dict[str, Any]:
    """How the sandboxed play ended, for the worker (:func:`_ending`)."""
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
            "fatal": endings.is_fatal(exc),
            # An outage its calls could not absorb (worker.contract): not the play's fault.
            "interrupted": is_blip(exc),
        }


async def _cleanup(play: Play, ctx: RunContext) -> None:
    for hook in [*play.on_cancel, *ctx.cleanups]:
        try:
            async with asyncio.timeout(60):
                await hook(ctx)
        except Exception as exc:  # the child's stderr is relayed to the worker's log
            log.warning("cleanup_hook_failed", play=play.name, error=repr(exc)[:500])


def main() -> None:
    from worker import logs

    logs.configure(json=True)  # the child's stderr is relayed to the worker's: one format
    line, pending = _read_spec()
    spec = json.loads(line)
    try:
        confine(spec)
    except Exception as exc:
        sys.stderr.write(f"sandbox: cannot confine the play: {exc!r}\n")
        sys.stderr.flush()
        sys.exit(3)
    sys.stdout.buffer.write(READY + b"\n")
    sys.stdout.flush()
    if spec.get("probe"):
        return
    outcome = asyncio.run(_child(spec, pending))
    sys.stdout.write(json.dumps(outcome, default=str) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
