"""The real-Postgres test harness.

One throwaway Postgres per test session (or the server named by ``WORKER_TEST_DATABASE_URL``),
a template database built once with the real migration runner, and per test either

- ``conn``: a connection inside one transaction that is rolled back (fast, the default), or
- ``db_url``: a fresh clone of the template (for commits, several connections,
  LISTEN/NOTIFY, a worker in-process or a subprocess), or
- ``empty_db``: a factory of never-migrated databases (for the migration gate itself).

A server leaked by an earlier, killed run is swept at session start, and so is every process
a killed session left; a process this session leaves running fails it (tests/leftovers.py).
A missing database is a failure, never a skip.
"""

from __future__ import annotations

import asyncio
import compileall
import concurrent.futures
import contextlib
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from queues import migrations
from tests import leftovers, scratch
from worker import embedded

SWEEP_ROOT = scratch.ROOT  # in RAM when there is room (tests/scratch.py)
# One template per session: under pytest -n, sessions may share a server
# (WORKER_TEST_DATABASE_URL), and each builds its own.
TEMPLATE = f"wq_template_{os.getpid()}"
_counter = itertools.count()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A server home whose owner file is missing is another session's being made (pytest -n
# runs several sessions at once) unless it is older than this.
UNOWNED_GRACE_S = 300.0


def _sweep_leaked() -> None:
    """Stop and remove test servers whose owning pytest process is gone."""
    if not SWEEP_ROOT.exists():
        return
    for home in SWEEP_ROOT.iterdir():
        owner = home / "owner.pid"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _pid_alive(pid):
            continue
        if not pid and _age_s(home) < UNOWNED_GRACE_S:
            continue
        with contextlib.suppress(Exception):  # best effort on a leftover directory
            embedded.stop(home, mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def with_dbname(url: str, dbname: str) -> str:
    params = conninfo_to_dict(url)
    params["dbname"] = dbname
    return make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """A superuser URL on a server this session may create databases on."""
    given = os.environ.get("WORKER_TEST_DATABASE_URL")
    if given:
        yield given
        return
    _sweep_leaked()
    home = Path(tempfile.mkdtemp(prefix="run-", dir=scratch.scratch()))
    home.chmod(0o755)
    (home / "owner.pid").write_text(str(os.getpid()))
    server = embedded.ensure_running(home)
    try:
        yield server.url("postgres")
    finally:
        embedded.stop(home, mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


async def _migrate_template(admin_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as admin:
        await admin.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {TEMPLATE}")
    url = with_dbname(admin_url, TEMPLATE)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrations.migrate(conn)


@pytest.fixture(scope="session")
def template_url(pg_admin_url: str) -> Iterator[str]:
    asyncio.run(_migrate_template(pg_admin_url))
    yield with_dbname(pg_admin_url, TEMPLATE)
    with contextlib.suppress(psycopg.Error):  # a server the session shares keeps no copy
        asyncio.run(drop_database(pg_admin_url, TEMPLATE))


async def clone_database(admin_url: str, name: str) -> str:
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as admin:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    return with_dbname(admin_url, name)


async def drop_database(admin_url: str, name: str) -> None:
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as admin:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Clones:
    """Clones of the template made one test ahead, and dropped after their test, on a
    thread of their own: a test waits for neither (a clone and its drop cost a few tenths
    of a second on a loaded server, and most tests that commit take one)."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="clones")
        self.next: concurrent.futures.Future[str] = self.pool.submit(self._make)

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.Connection.connect(self.admin_url, autocommit=True)

    def _make(self) -> str:
        name = f"wq_test_{os.getpid()}_{next(_counter)}"
        with self._admin() as admin:
            admin.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        return name

    def _drop(self, name: str) -> None:
        with self._admin() as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    async def take(self) -> str:
        """A clone no test has used; the next one is started at once."""
        name = await asyncio.wrap_future(self.next)
        self.next = self.pool.submit(self._make)
        return name

    def give_back(self, name: str) -> None:
        self.pool.submit(self._drop, name)

    def close(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self._drop(self.next.result())
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def clones(pg_admin_url: str, template_url: str) -> Iterator[Clones]:
    made = Clones(pg_admin_url)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
async def db_url(pg_admin_url: str, clones: Clones) -> AsyncIterator[str]:
    """A fresh clone of the migrated template, dropped after the test."""
    name = await clones.take()
    try:
        yield with_dbname(pg_admin_url, name)
    finally:
        clones.give_back(name)


@pytest.fixture
async def empty_db(pg_admin_url: str) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """A factory of brand-new, never-migrated databases, all dropped after the test."""
    made: list[str] = []

    async def make() -> str:
        name = f"wq_empty_{os.getpid()}_{next(_counter)}"
        async with await psycopg.AsyncConnection.connect(pg_admin_url, autocommit=True) as a:
            await a.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            await a.execute(f"CREATE DATABASE {name}")
        made.append(name)
        return with_dbname(pg_admin_url, name)

    try:
        yield make
    finally:
        for name in made:
            await drop_database(pg_admin_url, name)


@pytest.fixture(scope="session")
def shared_url(pg_admin_url: str, template_url: str) -> str:
    """One clone shared by rolled-back-transaction tests."""
    return asyncio.run(clone_database(pg_admin_url, f"wq_shared_{os.getpid()}"))


@pytest.fixture
async def conn(shared_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection in one transaction that is rolled back after the test. The transaction
    is opened here, so a function's own ``conn.transaction()`` is a savepoint of it and
    never commits into the shared database."""
    connection = await psycopg.AsyncConnection.connect(shared_url)
    await connection.execute("SELECT 1")
    try:
        yield connection  # type: ignore[misc]
    finally:
        await connection.rollback()
        await connection.close()


# ---- order: the long tests first, one share per process ---------------------------------------

# `pytest -n N --dist worksteal` gives each process one contiguous slice of the collection
# (xdist's WorkStealingScheduling: the first len // N tests, then the next, ...), and an
# idle process takes the second half of the longest queue. A long scenario (marked slow)
# left at the end of a queue runs alone while the others idle, so each slice starts with
# its share of the slow tests; then subprocess and multi-connection tests, and the
# millisecond ones last, which an idle process steals. Within a directory the order stays
# pytest's.
FIRST_TO_LAST = ("e2e", "integration", "docs", "db", "unit")


def _rank(item: pytest.Item) -> int:
    parts = Path(str(item.path)).parts
    for i, directory in enumerate(FIRST_TO_LAST):
        if directory in parts:
            return i
    return len(FIRST_TO_LAST)


def _slice_sizes(total: int, processes: int) -> list[int]:
    """The sizes of the slices xdist's work stealing hands out first, in process order."""
    sizes, left = [], total
    for i in range(processes):
        sizes.append(left // (processes - i))
        left -= sizes[-1]
    return sizes


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    ordered = sorted(items, key=_rank)  # stable
    processes = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    slow = [item for item in ordered if item.get_closest_marker("slow")]
    rest = iter([item for item in ordered if not item.get_closest_marker("slow")])
    shares: list[list[pytest.Item]] = [slow[i::processes] for i in range(processes)]
    for share, size in zip(shares, _slice_sizes(len(items), processes), strict=True):
        share.extend(itertools.islice(rest, max(0, size - len(share))))
    shares[-1].extend(rest)
    items[:] = [item for share in shares for item in share]


# ---- CI: a skip is a failure -----------------------------------------------------------------

# In CI (the CI variable set, as `.ci/run` runs), a test that skips itself, because its
# mechanism (root, network namespaces, a binary) is missing, fails with its reason: CI
# must run every test it claims to run. Outside CI a skip stays a skip.
IN_CI = bool(os.environ.get("CI", "").strip())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run it: {reason}"


# ---- nothing left behind ----------------------------------------------------------------------


def pytest_sessionstart(session: pytest.Session) -> None:
    """Mark this session's processes; kill those of sessions that are gone."""
    for orphan in leftovers.sweep_orphans():
        print(f"killed a process left by a killed test session: {orphan.pid} {orphan.command}")
    os.environ[leftovers.MARK] = leftovers.session_mark()
    if sys.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:
        # Where bytecode is never written (PYTHONDONTWRITEBYTECODE, common in containers),
        # every worker, CLI and sandbox process the tests start would compile the project's
        # modules again; written once here, each of them reads them.
        root = Path(__file__).resolve().parents[1]
        for package in ("worker", "queues", "tests", "bench"):
            compileall.compile_dir(root / package, quiet=1, workers=0)


@pytest.hookimpl(trylast=True)  # after pytest's own, which tears the session's fixtures down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    grace = float(os.environ.get("WORKER_TEST_LEFTOVER_GRACE_S") or 15)
    left = leftovers.left_behind(os.environ[leftovers.MARK], grace_s=grace)
    if left:
        names = "\n".join(f"  {m.pid} {m.command}" for m in left)
        session.config.get_terminal_writer().line(
            f"the session left {len(left)} process(es) running (killed now):\n{names}",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
