"""How a sandbox is made: the mechanism (bubblewrap), its probe, and each sandbox's command
line and environment. :mod:`worker.sandbox` runs an attempt in what this starts.

bubblewrap (``bwrap``) runs the child (:mod:`worker.sandbox_child`) and gives it:

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

Where bubblewrap is missing or cannot create its namespaces, :meth:`Launcher.probe` says
why (``sandbox_mechanism``) and a sandboxed play refuses to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pwd
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from queues.errors import SandboxUnavailable
from worker import sandbox_wire
from worker.plays import Resources
from worker.sandbox_wire import Spec

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
PROBE_TIMEOUT_S = 30.0
CHILD = "worker.sandbox_child"  # the module bubblewrap runs (``python -B -P -m``)
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
        spec = Spec(self.user_of(planned), Resources())
        try:
            proc = await self.spawn(planned, socket=None, resources=spec.resources)
        except OSError as exc:
            return self._unavailable(f"bubblewrap could not be started: {exc}")
        assert proc.stdin is not None
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                proc.stdin.write(spec.line())
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    await proc.stdin.drain()
                out, err = await proc.communicate()
        except TimeoutError:
            kill(proc)
            await proc.wait()
            return self._unavailable(f"a probe sandbox did not answer in {PROBE_TIMEOUT_S:g}s")
        if proc.returncode == 0 and out.splitlines()[:1] == [sandbox_wire.READY]:
            return planned
        detail = tail(err) or f"exit status {proc.returncode}"
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
    def user_of(mechanism: Mechanism) -> tuple[int, int] | None:
        """Who the child drops to: a root worker's sandbox user (else a user namespace's)."""
        return (mechanism.uid, mechanism.gid) if mechanism.mode == "drop" else None

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
        args += ["--chdir", "/tmp", "--", sys.executable, "-B", "-P", "-m", CHILD]
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

    async def spawn(
        self, mechanism: Mechanism, *, socket: str | None, resources: Resources
    ) -> asyncio.subprocess.Process:
        """Start one sandbox; its stdin takes the spec (:mod:`worker.sandbox_wire`)."""
        return await asyncio.create_subprocess_exec(
            *self.command(mechanism, socket=socket, resources=resources),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.environment(),
            start_new_session=True,  # its own process group: killed whole at the end
            limit=sandbox_wire.LINE_LIMIT,
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


def tail(err: bytes, limit: int = 500) -> str:
    """The last few lines of a sandbox's stderr, for a diagnosis."""
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-limit:]


def kill(proc: asyncio.subprocess.Process) -> None:
    """Kill bubblewrap's whole process group (the sandbox's init with it, and so every
    process of its PID namespace), while its leader is not reaped yet."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
