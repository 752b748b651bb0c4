"""A throwaway Postgres failover pair for tests: a primary and a streaming standby.

The primary is an embedded server (:mod:`worker.embedded`, the project's own Postgres);
the standby is a copy made with ``pg_basebackup -R`` (it streams from the primary as
``application_name=standby``), started on a port of its own by the same binaries and the
same user (Postgres refuses root: as root both run as ``$WORKER_PG_USER``, ``postgres``).
With ``synchronous`` the primary names it in ``synchronous_standby_names``, so a commit
is acknowledged only once the standby has it; without, replication is asynchronous.

:meth:`Pair.kill_primary` SIGKILLs the primary's postmaster (its backends notice and exit;
any that linger are killed), :meth:`Pair.promote` runs ``pg_ctl promote`` on the standby,
and :meth:`Pair.close` stops and removes everything, whatever state the test left. Every
process of the pair carries the test session's mark (tests/leftovers.py). Its data
directories go under tests/scratch.py's root, as do the embedded homes of
tests/e2e/test_embedded.py and tests/e2e/test_cli_foundation.py.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from queues import migrations
from tests.scratch import scratch
from worker import embedded, postmaster

STANDBY = "standby"  # its application_name, as synchronous_standby_names names it


def _server_user() -> pwd.struct_passwd | None:
    """The user Postgres runs as (None: this user; as root, never root)."""
    if os.geteuid() != 0:
        return None
    return pwd.getpwnam(os.environ.get("WORKER_PG_USER", "postgres"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pair:
    """A primary, its standby, and the URLs a client of either reaches them by."""

    home: Path  # the primary's embedded home (its data directory is home/pgdata)
    standby_dir: Path
    standby_log: Path
    primary_port: int
    standby_port: int
    password: str
    bindir: Path
    user: pwd.struct_passwd | None
    dbname: str
    primary_pid: int = 0

    @property
    def primary_dir(self) -> Path:
        return self.home / "pgdata"

    def url(self, port: int | None = None, *, dbname: str | None = None) -> str:
        """The superuser's URL: of one server (``port``), or the multi-host URL every
        process of a failover setup uses (both servers, the one that takes writes)."""
        if port is not None:
            hosts, ports, attrs = "127.0.0.1", str(port), {}
        else:
            hosts = "127.0.0.1,127.0.0.1"
            ports = f"{self.primary_port},{self.standby_port}"
            attrs = {"target_session_attrs": "read-write"}
        return make_conninfo(
            host=hosts,
            port=ports,
            dbname=dbname or self.dbname,
            user=embedded.SUPERUSER,
            password=self.password,
            **attrs,
        )

    def _run(self, program: str, *args: str, timeout: float = 60) -> str:
        env = {
            "PATH": "/usr/bin:/bin",
            "LC_ALL": "C",
            "PGPASSWORD": self.password,
            "HOME": self.user.pw_dir if self.user else os.environ.get("HOME", "/"),
        }
        env.update({k: v for k, v in os.environ.items() if k.startswith("WORKER_TEST_")})
        done = subprocess.run(
            [str(self.bindir / program), *args],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
            user=self.user.pw_uid if self.user else None,
            group=self.user.pw_gid if self.user else None,
        )
        if done.returncode != 0:
            raise AssertionError(f"{program} {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def wait_streaming(self, *, synchronous: bool, timeout: float = 30) -> None:
        """Until the primary sees the standby streaming (and, if asked, synchronous)."""
        deadline = time.monotonic() + timeout
        want = "sync" if synchronous else "async"
        with psycopg.connect(self.url(self.primary_port), autocommit=True) as conn:
            while True:
                row = conn.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (STANDBY,),
                ).fetchone()
                if row is not None and row[0] == "streaming" and row[1] == want:
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"the standby is not streaming ({want}): {row}")
                time.sleep(0.05)

    def caught_up(self, timeout: float = 30) -> None:
        """Until the standby has replayed everything the primary wrote so far."""
        with psycopg.connect(self.url(self.primary_port), autocommit=True) as primary:
            (lsn,) = primary.execute("SELECT pg_current_wal_lsn()::text").fetchone() or ("",)
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.url(self.standby_port), autocommit=True) as standby:
            while True:
                (behind,) = standby.execute(
                    "SELECT pg_last_wal_replay_lsn() < %s::pg_lsn", (lsn,)
                ).fetchone() or (True,)
                if not behind:
                    return
                if time.monotonic() > deadline:
                    raise AssertionError("the standby did not catch up")
                time.sleep(0.05)

    def cut_off_standby(self, timeout: float = 30) -> None:
        """Stop the standby's streaming (its ``primary_conninfo`` emptied): from now on it
        receives nothing the primary writes, as a standby that lags behind does not."""
        with psycopg.connect(self.url(self.standby_port), autocommit=True) as standby:
            standby.execute("ALTER SYSTEM SET primary_conninfo = ''")
            standby.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.url(self.primary_port), autocommit=True) as primary:
            while primary.execute(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = %s", (STANDBY,)
            ).fetchone():
                if time.monotonic() > deadline:
                    raise AssertionError("the standby still streams")
                time.sleep(0.05)

    def kill_primary(self) -> float:
        """SIGKILL the primary's postmaster (a host that died); returns when (time.time()).
        Its backends exit once they notice; returns after they are gone."""
        os.kill(self.primary_pid, signal.SIGKILL)
        killed = time.time()
        deadline = time.monotonic() + 10
        while postmaster.processes(self.primary_dir):
            if time.monotonic() > deadline:
                _kill(list(postmaster.processes(self.primary_dir)))
                break
            time.sleep(0.02)
        return killed

    def promote(self) -> None:
        self._run("pg_ctl", "promote", "-D", str(self.standby_dir), "-w", "-t", "30")

    def close(self) -> None:
        """Stop both servers (immediate), whatever state they are in, and remove them."""
        for datadir in (self.standby_dir, self.primary_dir):
            with contextlib.suppress(Exception):
                live = postmaster.find_postmaster(datadir)
                if live is not None:
                    os.kill(live, signal.SIGQUIT)
            deadline = time.monotonic() + 10
            while postmaster.processes(datadir) and time.monotonic() < deadline:
                time.sleep(0.05)
            _kill(list(postmaster.processes(datadir)))
        shutil.rmtree(self.home.parent, ignore_errors=True)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def failover_pair(*, synchronous: bool, dbname: str = "ha") -> AsyncIterator[Pair]:
    """A migrated database ``dbname`` on a primary with a streaming standby; see the
    module. Everything is stopped and removed on the way out. (Its setup blocks the event
    loop: nothing else runs yet.)"""
    root = Path(tempfile.mkdtemp(prefix="failover-", dir=scratch()))
    root.chmod(0o755)
    home = root / "primary"
    home.mkdir(mode=0o755)
    pair: Pair | None = None
    try:
        server = embedded.ensure_running(home)
        with psycopg.connect(server.url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {dbname}")
        async with await psycopg.AsyncConnection.connect(
            server.url(dbname), autocommit=True
        ) as conn:
            await migrations.migrate(conn)  # the real migration runner
        user = _server_user()
        standby_root = root / "standby"
        standby_root.mkdir(mode=0o755)
        pair = Pair(
            home=home,
            standby_dir=standby_root / "pgdata",
            standby_log=standby_root / "postgres.log",
            primary_port=server.port,
            standby_port=_free_port(),
            password=server.password,
            bindir=server.bindir,
            user=user,
            dbname=dbname,
            primary_pid=server.pid,
        )
        if user is not None:
            os.chown(standby_root, user.pw_uid, user.pw_gid)
        pair._run(
            "pg_basebackup",
            "-d",
            make_conninfo(
                host="127.0.0.1",
                port=str(server.port),
                user=embedded.SUPERUSER,
                application_name=STANDBY,
            ),
            "-D",
            str(pair.standby_dir),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
        )
        pair._run(
            "pg_ctl",
            "start",
            "-D",
            str(pair.standby_dir),
            "-l",
            str(pair.standby_log),
            "-o",
            f"-p {pair.standby_port}",
            "-w",
            "-t",
            "30",
        )
        pair.wait_streaming(synchronous=False)
        if synchronous:
            with psycopg.connect(pair.url(pair.primary_port), autocommit=True) as conn:
                conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY}'")
                conn.execute("SELECT pg_reload_conf()")
            pair.wait_streaming(synchronous=True)
        yield pair
    finally:
        if pair is not None:
            pair.close()
        else:
            with contextlib.suppress(Exception):
                embedded.stop(home, mode="immediate")
            shutil.rmtree(root, ignore_errors=True)
