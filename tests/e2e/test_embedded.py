"""End-to-end tests of the embedded Postgres: real initdb, real postmasters, real kill -9.

The tests about the first start (initdb, the secret's creation, concurrent first starts)
start from an empty home. Every other test starts from a copy of one home that a first
:func:`ensure_running` made and :func:`stop` stopped (``made_home``): the same state an
initdb per test would leave, without an initdb per test. Likewise the data directories
from before passwords are copies of one made with ``initdb --auth=trust``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from structlog.testing import capture_logs

from tests.scratch import scratch
from worker import embedded, postmaster
from worker.embedded import EmbeddedPostgresError, default_home, ensure_running, status, stop

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(sys.executable).parent / "worker"
AUTH = "scram-sha-256"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="only root can act as another user")
CHILD = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from worker.embedded import ensure_running\n"
    "s = ensure_running(Path(sys.argv[1]))\n"
    "print('RESULT ' + json.dumps({'pid': s.pid, 'port': s.port}))\n"
)


def _new_home() -> Path:
    path = Path(tempfile.mkdtemp(prefix="worker-embedded-", dir=scratch()))
    path.chmod(0o755)
    return path


def _cleanup(path: Path) -> None:
    with contextlib.suppress(Exception):
        stop(path, mode="immediate")
    shutil.rmtree(path, ignore_errors=True)


def _copy_home(source: Path, target: Path) -> None:
    """Copy a stopped home into ``target`` as it is: owners and modes kept (the data
    directory the server's user's, mode 0700; the secret ours, mode 0600)."""
    subprocess.run(["cp", "-a", f"{source}/.", str(target)], check=True, timeout=60)


@pytest.fixture
def empty_home() -> Iterator[Path]:
    """A home with nothing in it yet: for the first start itself."""
    path = _new_home()
    try:
        yield path
    finally:
        _cleanup(path)


@pytest.fixture(scope="module")
def made_home() -> Iterator[Path]:
    """A home as a first start leaves it (its cluster, secret and embedded.json), stopped."""
    path = _new_home()
    try:
        ensure_running(path)
        assert stop(path) is True
        yield path
    finally:
        _cleanup(path)


@pytest.fixture
def home(made_home: Path) -> Iterator[Path]:
    """A home whose server was made and stopped: a copy of ``made_home``."""
    path = _new_home()
    try:
        _copy_home(made_home, path)
        yield path
    finally:
        _cleanup(path)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def _parse_child(stdout: str, stderr: str) -> dict[str, int]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, int] = json.loads(line.removeprefix("RESULT "))
            return result
    raise AssertionError(f"child failed:\n{stdout}\n{stderr}")


def _server_user() -> tuple[int, int] | None:
    """uid/gid Postgres runs as, for files the test writes into the datadir (None: ourselves)."""
    if os.geteuid() != 0:
        return None
    pw = pwd.getpwnam(os.environ.get("WORKER_PG_USER", "postgres"))
    return pw.pw_uid, pw.pw_gid


def _write_as_server(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    if (owner := _server_user()) is not None:
        os.chown(path, *owner)


def _create_marker(url: str) -> None:
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE marker (x int)")
        conn.execute("INSERT INTO marker VALUES (42)")


def _read_marker(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT x FROM marker").fetchone()
    assert row is not None
    return int(row[0])


def test_default_home_honours_worker_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_HOME", "/tmp/some-worker-home")
    assert default_home() == Path("/tmp/some-worker-home")
    monkeypatch.delenv("WORKER_HOME")
    expected = "/var/lib/worker" if os.geteuid() == 0 else "worker"
    assert str(default_home()).endswith(expected)


def test_first_start_reuse_and_persistence(empty_home: Path) -> None:
    home = empty_home
    server = ensure_running(home)
    secret = (home / "secret").read_text().strip()
    assert server.url() == f"postgresql://postgres:{secret}@127.0.0.1:{server.port}/worker"
    assert secret not in repr(server)
    assert server.datadir == home / "pgdata"
    assert (home / "pgdata" / "PG_VERSION").read_text().strip() == str(server.major_version)
    with psycopg.connect(server.url()) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    _create_marker(server.url())

    # Reused, not restarted: the same postmaster, and the server log has no second start.
    starts = (home / "log" / "postgres.log").read_text().count("database system is ready")
    assert ensure_running(home) == server
    assert (home / "log" / "postgres.log").read_text().count("database system is ready") == starts

    current = status(home)
    assert current.running and current.pid == server.pid and current.port == server.port
    assert current.url == server.url() and current.major_version == server.major_version
    meta = json.loads((home / "embedded.json").read_text())
    assert meta["port"] == server.port and meta["major_version"] == server.major_version
    assert meta["bindir"] == str(server.bindir) and meta["created_at"]
    assert meta["auth"] == "scram-sha-256" and secret not in json.dumps(meta)

    assert stop(home) is True
    assert not status(home).running and status(home).url is None
    assert stop(home) is False

    again = ensure_running(home)
    assert again.port == server.port  # the port is kept across restarts
    assert again.pid != server.pid
    assert _read_marker(again.url()) == 42


def test_second_process_reuses_server(home: Path) -> None:
    server = ensure_running(home)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(home)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_child_env(),
        check=False,
    )
    assert _parse_child(proc.stdout, proc.stderr) == {"pid": server.pid, "port": server.port}


def test_concurrent_first_start_shares_one_server(empty_home: Path) -> None:
    home = empty_home
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(home)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        for _ in range(4)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(_parse_child(out, err))
    assert len({(r["pid"], r["port"]) for r in results}) == 1
    # The server outlives the processes that started it.
    current = status(home)
    assert current.running and current.pid == results[0]["pid"]


def test_recovers_after_kill_9_with_orphaned_backend(home: Path) -> None:
    server = ensure_running(home)
    _create_marker(server.url())
    # An open client whose backend is frozen: it outlives the postmaster and keeps shared memory.
    client = psycopg.connect(server.url())
    backend = client.info.backend_pid
    os.kill(backend, signal.SIGSTOP)
    os.kill(server.pid, signal.SIGKILL)
    try:
        recovered = ensure_running(home)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(backend, signal.SIGCONT)
        with contextlib.suppress(Exception):
            client.close()
    assert recovered.pid != server.pid
    assert not _alive(backend)
    assert _read_marker(recovered.url()) == 42
    assert status(home).running


def test_stale_postmaster_pid_dead_or_reused(home: Path) -> None:
    server = ensure_running(home)
    pidfile = home / "pgdata" / "postmaster.pid"
    saved = pidfile.read_bytes()
    assert stop(home) is True
    assert not pidfile.exists() and not _alive(server.pid)

    # A lock file left by a dead postmaster.
    _write_as_server(pidfile, saved)
    assert ensure_running(home).pid != server.pid
    assert stop(home) is True

    # A lock file whose pid now belongs to an unrelated live process of the same user.
    owner = _server_user()
    sleeper = subprocess.Popen(
        ["sleep", "300"], user=owner[0] if owner else None, group=owner[1] if owner else None
    )
    try:
        lines = saved.decode().splitlines()
        lines[0] = str(sleeper.pid)
        _write_as_server(pidfile, ("\n".join(lines) + "\n").encode())
        recovered = ensure_running(home)
        assert recovered.pid != sleeper.pid
        assert sleeper.poll() is None  # the unrelated process was left alone
        assert status(home).pid == recovered.pid
    finally:
        sleeper.kill()
        sleeper.wait()


def test_recorded_port_taken_picks_new_port(home: Path) -> None:
    server = ensure_running(home)
    assert stop(home) is True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        moved = ensure_running(home)
        assert moved.port != server.port
        assert json.loads((home / "embedded.json").read_text())["port"] == moved.port
        with psycopg.connect(moved.url()) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_version_mismatch_is_refused(home: Path) -> None:
    server = ensure_running(home)
    assert stop(home) is True
    other = _new_home()
    try:
        shutil.copytree(home / "pgdata", other / "pgdata", symlinks=True)
        shutil.copy2(home / "embedded.json", other / "embedded.json")
        wrong = server.major_version - 1
        (other / "pgdata" / "PG_VERSION").write_text(f"{wrong}\n")
        with pytest.raises(EmbeddedPostgresError) as caught:
            ensure_running(other, timeout=30)
        assert caught.value.code == "EMBEDDED_VERSION_MISMATCH"
        message = str(caught.value)
        assert f"Postgres {wrong}" in message and f"Postgres {server.major_version}" in message
        assert str(other / "pgdata") in message and "WORKER_PG_BIN" in message
        assert (other / "pgdata" / "PG_VERSION").read_text() == f"{wrong}\n"  # untouched
        assert not status(other).running
    finally:
        _cleanup(other)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands Postgres to another user")
def test_home_unreachable_by_postgres_user_is_refused() -> None:
    private = Path(tempfile.mkdtemp(prefix="worker-embedded-", dir="/tmp"))  # mode 0700
    try:
        with pytest.raises(EmbeddedPostgresError) as caught:
            ensure_running(private / "home", timeout=10)
        assert caught.value.code == "EMBEDDED_HOME_UNREACHABLE"
        assert "WORKER_HOME" in str(caught.value)
    finally:
        shutil.rmtree(private, ignore_errors=True)


# ---- the password ---------------------------------------------------------------------------


def _secret(home: Path) -> str:
    return (home / "secret").read_text().strip()


def _write_secret(home: Path, secret: str) -> None:
    path = home / "secret"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")


def _client(port: int, password: str | None, *, dbname: str = "worker") -> str:
    """A conninfo that brings exactly ``password`` (None: no password at all; no PGPASSWORD,
    no password file)."""
    return make_conninfo(
        host="127.0.0.1",
        port=port,
        user="postgres",
        dbname=dbname,
        password=password or "",
        passfile="/nonexistent/pgpass",
        connect_timeout=5,
    )


def _refusal(conninfo: str) -> str:
    """The message of a connection attempt that must fail."""
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(conninfo).close()
    return str(caught.value)


def _hba_rules(home: Path) -> list[list[str]]:
    text = (home / "pgdata" / "pg_hba.conf").read_text()
    return [line.split() for line in text.splitlines() if line.split() and line[0] != "#"]


def _as_user(user: str, cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    pw = pwd.getpwnam(user)
    return subprocess.run(
        cmd,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C", **env},
        capture_output=True,
        text=True,
        timeout=60,
        user=pw.pw_uid,
        group=pw.pw_gid,
        extra_groups=[],
        cwd="/",
        check=False,
    )


def _psql_as(user: str, server: embedded.EmbeddedServer, password: str | None) -> tuple[int, str]:
    env = {"PGPASSFILE": "/nonexistent/pgpass"} | ({"PGPASSWORD": password} if password else {})
    target = ["-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres", "-d", "worker"]
    res = _as_user(
        user, [str(server.bindir / "psql"), "-w", "-X", *target, "-Atc", "SELECT 42"], env
    )
    return res.returncode, res.stdout.strip() + res.stderr.strip()


def _python_client_as(user: str, server: embedded.EmbeddedServer, home: Path) -> dict[str, Any]:
    """What a Python client and ``ensure_running`` meet as ``user``: in a forked child that
    drops to that user for good (this interpreter lives where other users may not read, so
    no new one is started), so this test process never changes its own identity."""
    pw = pwd.getpwnam(user)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            seen: dict[str, Any] = {
                "no_password": _refusal_text(_client(server.port, None)),
                "wrong_password": _refusal_text(_client(server.port, "wrong")),
            }
            try:
                ensure_running(home)
                seen["ensure_running"] = {"code": None, "message": "started"}
            except EmbeddedPostgresError as exc:
                seen["ensure_running"] = {"code": exc.code, "message": str(exc)}
            os.write(write, json.dumps(seen).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    _, status_code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status_code) == 0 and out, out
    found: dict[str, Any] = json.loads(out)
    return found


def _refusal_text(conninfo: str) -> str:
    """The message of a connection attempt (``connected`` if it was not refused)."""
    try:
        psycopg.connect(conninfo).close()
    except psycopg.OperationalError as exc:
        return str(exc)
    return "connected"


def test_password_required_and_secret_private(empty_home: Path) -> None:
    home = empty_home
    with capture_logs() as logs:
        server = ensure_running(home)
    info = (home / "secret").stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    secret = _secret(home)
    assert len(secret) >= 43  # 32 random bytes
    assert not list(home.glob(".initdb-pw.*"))  # initdb's pwfile is gone

    rules = _hba_rules(home)
    assert rules and all(rule[-1] == AUTH for rule in rules)
    assert {rule[0] for rule in rules} == {"local", "host"}
    assert "trust" not in (home / "pgdata" / "pg_hba.conf").read_text()
    with psycopg.connect(server.url()) as conn:
        loaded = conn.execute("SELECT DISTINCT auth_method, error FROM pg_hba_file_rules")
        assert loaded.fetchall() == [(AUTH, None)]
        assert conn.execute("SHOW password_encryption").fetchone() == (AUTH,)
        stored = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = 'postgres'")
        assert str(stored.fetchone()[0]).startswith("SCRAM-SHA-256$")  # type: ignore[index]

    assert "no password supplied" in _refusal(_client(server.port, None))
    assert "password authentication failed" in _refusal(_client(server.port, "wrong"))
    with psycopg.connect(_client(server.port, secret)) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)

    # Never logged, and in no file but the secret file.
    events = [entry["event"] for entry in logs]
    assert "embedded_postgres_secret_created" in events and "embedded_postgres_ready" in events
    assert secret not in repr(logs)
    assert secret not in (home / "log" / "postgres.log").read_text()
    assert secret not in (home / "embedded.json").read_text()


@ROOT_ONLY
def test_local_user_without_the_secret_is_refused(home: Path) -> None:
    server = ensure_running(home)
    secret = _secret(home)
    # The control: with the secret, nobody does get in, so the refusals are about the password.
    assert _psql_as("nobody", server, secret) == (0, "42")
    code, out = _psql_as("nobody", server, None)
    assert code != 0 and "no password supplied" in out, out
    code, out = _psql_as("nobody", server, "wrong")
    assert code != 0 and "password authentication failed" in out, out

    # Neither nobody nor the postgres user that runs the server can read the secret.
    for user in ("nobody", os.environ.get("WORKER_PG_USER", "postgres")):
        res = _as_user(user, ["cat", str(home / "secret")], {})
        assert res.returncode != 0 and "Permission denied" in res.stderr, (user, res)

    # A Python client as nobody, and the project's own entry point as nobody.
    seen = _python_client_as("nobody", server, home)
    assert "no password supplied" in seen["no_password"], seen
    assert "password authentication failed" in seen["wrong_password"], seen
    refused = seen["ensure_running"]
    assert refused["code"] == "EMBEDDED_SECRET_UNREADABLE", seen
    assert str(home / "secret") in refused["message"] and "DATABASE_URL" in refused["message"]
    assert status(home).pid == server.pid


def test_secret_readable_by_others_is_refused(home: Path) -> None:
    server = ensure_running(home)
    (home / "secret").chmod(0o640)
    with pytest.raises(EmbeddedPostgresError) as caught:
        ensure_running(home)
    assert caught.value.code == "EMBEDDED_SECRET_UNSAFE"
    assert "chmod 600" in str(caught.value) and "0640" in str(caught.value)
    assert _secret(home) not in str(caught.value)
    (home / "secret").chmod(0o600)
    assert ensure_running(home) == server


def test_lost_secret_is_refused_never_replaced(home: Path) -> None:
    server = ensure_running(home)
    _create_marker(server.url())
    secret = _secret(home)
    assert stop(home) is True
    (home / "secret").unlink()
    with pytest.raises(EmbeddedPostgresError) as caught:
        ensure_running(home, timeout=30)
    assert caught.value.code == "EMBEDDED_SECRET_MISSING"
    assert str(home / "secret") in str(caught.value) and "restore" in str(caught.value)
    assert not (home / "secret").exists()  # no new secret locks the data away for good
    assert not status(home).running
    _write_secret(home, secret)
    assert _read_marker(ensure_running(home).url()) == 42


def test_wrong_secret_is_refused_and_server_kept(home: Path) -> None:
    server = ensure_running(home)
    secret = _secret(home)
    _write_secret(home, "not-the-password")
    with pytest.raises(EmbeddedPostgresError) as caught:
        ensure_running(home, timeout=30)
    assert caught.value.code == "EMBEDDED_AUTH_FAILED"
    assert "not-the-password" not in str(caught.value)
    assert _alive(server.pid) and status(home).pid == server.pid
    _write_secret(home, secret)
    assert ensure_running(home) == server


# ---- data directories from before passwords -------------------------------------------------


def _pg(home: Path, program: str, *args: str) -> None:
    """Run a Postgres binary as the embedded server runs them (as its user, when root)."""
    pw = embedded._target_user()
    bindir = embedded._resolve_bindir(pw)
    rc, out = embedded._run([str(bindir / program), *args], pw, cwd=home, timeout=120)
    assert rc == 0, out


def _start_trusting(home: Path, port: int) -> None:
    datadir, log_file = str(home / "pgdata"), str(home / "log" / "postgres.log")
    _pg(home, "pg_ctl", "start", "-w", "-D", datadir, "-l", log_file, "-o", f"-p {port}")


@pytest.fixture(scope="module")
def made_trust_home() -> Iterator[Path]:
    """A data directory as versions before passwords made it: initdb --auth=trust, no
    secret, embedded.json without "auth"; with the marker table, stopped."""
    home = _new_home()
    try:
        pw = embedded._target_user()
        encoding = ("--encoding=UTF8", "--no-locale")  # as those versions ran initdb
        datadir, logdir = home / "pgdata", home / "log"
        for directory, mode in ((datadir, 0o700), (logdir, 0o755)):
            directory.mkdir(mode=mode)
            if pw is not None:
                os.chown(directory, pw.pw_uid, pw.pw_gid)
        _pg(home, "initdb", "-D", str(datadir), "--auth=trust", "-U", "postgres", *encoding)
        with open(datadir / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write(embedded._CONF)
        port = embedded._bindable(0)
        assert port is not None
        _start_trusting(home, port)
        with psycopg.connect(_client(port, None, dbname="postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE worker")
        _create_marker(_client(port, None))
        meta = {
            "bindir": str(embedded._resolve_bindir(pw)),
            "major_version": int((datadir / "PG_VERSION").read_text()),
            "port": port,
            "created_at": "2025-01-01T00:00:00+00:00",
        }
        (home / "embedded.json").write_text(json.dumps(meta))
        _pg(home, "pg_ctl", "stop", "-D", str(datadir), "-m", "fast", "-w")
        yield home
    finally:
        _cleanup(home)


def _trust_cluster(made: Path, home: Path, *, running: bool) -> int:
    """A copy of the trusting data directory ``made`` in ``home``, its port a free one,
    started when ``running``. Returns its port."""
    _copy_home(made, home)
    port = embedded._bindable(0)
    assert port is not None
    meta = json.loads((home / "embedded.json").read_text())
    (home / "embedded.json").write_text(json.dumps(meta | {"port": port}))
    if running:
        _start_trusting(home, port)
    return port


@pytest.mark.parametrize("running", [True, False], ids=["live", "stopped"])
def test_trust_data_directory_moves_to_the_password(
    empty_home: Path, made_trust_home: Path, running: bool
) -> None:
    home = empty_home
    port = _trust_cluster(made_trust_home, home, running=running)
    assert any(rule[-1] == "trust" for rule in _hba_rules(home))
    pid = None
    if running:
        with psycopg.connect(_client(port, None)) as conn:  # the hole being closed
            assert conn.execute("SELECT 1").fetchone() == (1,)
        pid = status(home).pid
        assert pid is not None

    with capture_logs() as logs:
        server = ensure_running(home)
    secret = _secret(home)
    assert stat.S_IMODE((home / "secret").stat().st_mode) == 0o600
    assert server.port == port
    if pid is not None:
        assert server.pid == pid  # moved while it ran, not restarted
    rules = _hba_rules(home)
    assert rules and all(rule[-1] == AUTH for rule in rules)
    assert "no password supplied" in _refusal(_client(port, None))
    assert "password authentication failed" in _refusal(_client(port, "wrong"))
    assert _read_marker(server.url()) == 42
    assert json.loads((home / "embedded.json").read_text())["auth"] == AUTH
    events = [entry["event"] for entry in logs]
    assert "embedded_postgres_pg_hba_replaced" in events
    assert secret not in repr(logs)
    assert secret not in (home / "log" / "postgres.log").read_text()

    # It stays so: the fast path, then a restart.
    assert ensure_running(home) == server
    assert stop(home) is True
    again = ensure_running(home)
    assert "no password supplied" in _refusal(_client(again.port, None))
    assert _read_marker(again.url()) == 42


def test_interrupted_trust_migration_is_finished(empty_home: Path, made_trust_home: Path) -> None:
    """The worst moment to die: the secret written and pg_hba.conf replaced, but the running
    server never reloaded it, so it still trusts everyone."""
    home = empty_home
    port = _trust_cluster(made_trust_home, home, running=True)
    _write_secret(home, "a-secret-from-the-interrupted-run")
    _write_as_server(home / "pgdata" / "pg_hba.conf", embedded._HBA.encode())
    with psycopg.connect(_client(port, None)) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)

    server = ensure_running(home)
    assert server.password == "a-secret-from-the-interrupted-run"  # kept, not replaced
    assert "no password supplied" in _refusal(_client(port, None))
    assert _read_marker(server.url()) == 42


def test_pg_hba_elsewhere_that_trusts_is_refused(empty_home: Path, made_trust_home: Path) -> None:
    home = empty_home
    _trust_cluster(made_trust_home, home, running=False)
    datadir = home / "pgdata"
    trusting = datadir / "other_hba.conf"
    _write_as_server(trusting, (datadir / "pg_hba.conf").read_bytes())
    with open(datadir / "postgresql.conf", "a", encoding="utf-8") as conf:
        conf.write(f"hba_file = '{trusting}'\n")
    with pytest.raises(EmbeddedPostgresError) as caught:
        ensure_running(home, timeout=60)
    assert caught.value.code == "EMBEDDED_AUTH_UNENFORCED"
    assert str(trusting) in str(caught.value) and "hba_file" in str(caught.value)


# ---- a damaged postmaster.pid under a live server ------------------------------------------


def _damage(pidfile: Path, how: str) -> None:
    if how == "missing":
        pidfile.unlink()
    else:
        first = pidfile.read_text().splitlines()[0] + "\n"
        _write_as_server(pidfile, b"" if how == "empty" else first.encode())


def test_proc_evidence_names_the_postmaster(home: Path) -> None:
    server = ensure_running(home)
    datadir = home / "pgdata"
    lines = (datadir / "postmaster.pid").read_text().splitlines()
    client = psycopg.connect(server.url())
    try:
        backend = client.info.backend_pid
        procs = postmaster.processes(datadir)
        assert server.pid in procs and backend in procs
        assert postmaster.find_postmaster(datadir) == server.pid
        assert postmaster.is_postmaster(server.pid, datadir)
        assert not postmaster.is_postmaster(backend, datadir)
        assert postmaster.parent(backend) == server.pid
        assert postmaster.listen_ports(server.pid) == [server.port]
        assert postmaster.listen_ports(backend) == []
        assert postmaster.orphans(datadir) == []  # its postmaster lives: nothing to signal
        key, shmid = lines[6].split()
        assert postmaster.shm_segment(server.pid) == (int(key), int(shmid))
    finally:
        client.close()


def _assert_same_pidfile(repaired: str, original: str) -> None:
    """The repaired pid file is what Postgres wrote, line for line, except that the start
    time comes from pg_postmaster_start_time(), taken a moment after the one Postgres wrote
    (pg_ctl allows it 2 s)."""
    got, want = repaired.splitlines(), original.splitlines()
    assert len(got) == len(want) == 8, (got, want)
    assert got[:2] == want[:2] and got[3:] == want[3:], (got, want)
    assert abs(int(got[2]) - int(want[2])) <= 1, (got, want)


@pytest.mark.parametrize("damage", ["empty", "first_line", "missing"])
@pytest.mark.parametrize("entry", ["ensure_running", "status", "cli_db_url"])
def test_live_server_with_damaged_pidfile_is_kept(home: Path, entry: str, damage: str) -> None:
    server = ensure_running(home)
    pidfile = home / "pgdata" / "postmaster.pid"
    original = pidfile.read_text()
    client = psycopg.connect(server.url())  # a backend, which must survive too
    try:
        _damage(pidfile, damage)
        if entry == "ensure_running":
            assert ensure_running(home, timeout=30) == server
        elif entry == "status":
            current = status(home)
            assert current.running and current.pid == server.pid
            assert current.port == server.port and current.url == server.url()
        else:
            env = {k: v for k, v in _child_env().items() if "DATABASE_URL" not in k}
            res = subprocess.run(
                [str(WORKER), "db", "url", "--role", "owner"],
                env={**env, "WORKER_HOME": str(home)},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert res.returncode == 0, res.stderr
            assert res.stdout.strip() == server.url()
            assert "embedded_postgres_pidfile_repaired" in res.stderr
            assert server.password not in res.stderr
        assert _alive(server.pid)
        assert client.execute("SELECT 1").fetchone() == (1,)
        _assert_same_pidfile(pidfile.read_text(), original)
        assert status(home).pid == server.pid
        assert ensure_running(home) == server
    finally:
        client.close()


def test_stop_with_empty_pidfile_stops_the_live_server(home: Path) -> None:
    server = ensure_running(home)
    _write_as_server(home / "pgdata" / "postmaster.pid", b"")
    assert stop(home) is True
    assert not _alive(server.pid)
    assert not status(home).running
    again = ensure_running(home)
    assert again.pid != server.pid and again.port == server.port
