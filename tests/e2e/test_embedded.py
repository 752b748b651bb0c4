"""End-to-end tests of the embedded Postgres: real initdb, real postmasters, real kill -9."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from worker.embedded import EmbeddedPostgresError, default_home, ensure_running, status, stop

REPO = Path(__file__).resolve().parents[2]
CHILD = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from worker.embedded import ensure_running\n"
    "s = ensure_running(Path(sys.argv[1]))\n"
    "print('RESULT ' + json.dumps({'pid': s.pid, 'port': s.port}))\n"
)


def _new_home() -> Path:
    path = Path(tempfile.mkdtemp(prefix="worker-embedded-", dir="/tmp"))
    path.chmod(0o755)
    return path


def _cleanup(path: Path) -> None:
    with contextlib.suppress(Exception):
        stop(path, mode="immediate")
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def home() -> Iterator[Path]:
    path = _new_home()
    try:
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


def test_first_start_reuse_and_persistence(home: Path) -> None:
    started = time.perf_counter()
    server = ensure_running(home)
    first_start = time.perf_counter() - started
    assert first_start < 30
    assert server.url() == f"postgresql://postgres@127.0.0.1:{server.port}/worker"
    assert server.datadir == home / "pgdata"
    assert (home / "pgdata" / "PG_VERSION").read_text().strip() == str(server.major_version)
    with psycopg.connect(server.url()) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    _create_marker(server.url())

    started = time.perf_counter()
    assert ensure_running(home) == server
    assert time.perf_counter() - started < 1.0

    current = status(home)
    assert current.running and current.pid == server.pid and current.port == server.port
    assert current.url == server.url() and current.major_version == server.major_version
    meta = json.loads((home / "embedded.json").read_text())
    assert meta["port"] == server.port and meta["major_version"] == server.major_version
    assert meta["bindir"] == str(server.bindir) and meta["created_at"]

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


def test_concurrent_first_start_shares_one_server(home: Path) -> None:
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
