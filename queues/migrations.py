"""The migration gate and the schema contract.

``migrate`` is the only code path that runs DDL. It moves two chains forward, each file in
its own transaction, under one session advisory lock (concurrent migrators queue up and
apply each file once). The lock needs a session: each step checks that it runs on the
lock holder's backend and refuses (``MIGRATION_NEEDS_SESSION``) when a transaction-mode
pooler moved it elsewhere. The tracking row is written first in each file's transaction, so
two migrators that somehow bypassed the lock would collide on its primary key instead of
applying a file twice (graphile/worker does the same).

1. **procrastinate's schema.** procrastinate ships ``schema.sql`` (its whole schema at the
   installed version) and delta migrations, ``procrastinate/sql/migrations/
   XX.YY.ZZ_NN_slug.sql``, applied in (version, serial) order; since 3.0 most come in a
   ``_01_pre_`` part and a ``_50_post_`` part. ``procrastinate schema --apply`` only loads
   ``schema.sql`` and its docs leave the tracking of applied deltas to the user, so we own
   the chain: ``wq_procrastinate_migrations`` has a row per procrastinate migration the
   database has, and the database's procrastinate *schema version* is the greatest one. An
   empty database gets the installed ``schema.sql``, recorded at the installed version's
   latest migration; afterwards every installed migration newer than the recorded version
   is applied, in order. ``future_migrations/`` holds files procrastinate has not released
   into its chain: they are never applied. An installed procrastinate older than the
   database's version is refused (``ProcrastinateTooOld``): a schema never moves back.
   procrastinate's files are never checksummed: we do not own them, and their bytes change
   without the schema changing (3.10 rewrote ``03.04.00_50_post_...`` without the
   ``public.`` qualifiers 3.5 had; 3.10's ``schema.sql`` wraps ``CREATE EXTENSION`` in a
   ``DO`` block).
2. **ours**: forward-only numbered files in ``sql/migrations/``, tracked in
   ``wq_migrations`` with their checksum; an edited or unknown file is refused.

Releases before this one loaded procrastinate's ``schema.sql`` as a checksummed migration
``0000_procrastinate_schema`` of ours. Such a database is recorded once at
:data:`LEGACY_PROCRASTINATE_VERSION` (those releases required ``procrastinate>=3.5,<4``,
and every release from 3.4.0 to 3.10.x ends its chain at that migration); its old row stays
in ``wq_migrations`` and is no longer checked, so the previous release still reads its own
history after a rollback.

The *schema contract* is a version (our highest migration number) and a checksum over our
files (name and checksum) and procrastinate's schema version (a migration name, never file
bytes). ``migrate`` records it; every other process only reads it (``verify_contract``),
memoized per (database URL, schema). A failure is never cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, LiteralString, cast

import psycopg

from queues import roles
from queues.errors import MigrationFailed, ProcrastinateTooOld, SchemaContractMismatch

# pg_advisory_lock key: the first 8 bytes of sha256("wq:migrate") as a signed bigint.
MIGRATION_LOCK_KEY = int.from_bytes(hashlib.sha256(b"wq:migrate").digest()[:8], "big", signed=True)
LEGACY_PROCRASTINATE_ENTRY = "0000_procrastinate_schema"
LEGACY_PROCRASTINATE_VERSION = "03.04.00_50_post_add_retry_failed_job_procedure"
# How procrastinate's steps are named in `worker migrate` reports and `--check` lists.
PROCRASTINATE_PREFIX = "procrastinate/"
# Our migration that re-creates some of procrastinate's triggers (wq_transport_fit): once a
# database has it, every procrastinate migration applied to it is followed, in the same
# transaction, by that call again: a delta may re-create one of those triggers.
FIT_MIGRATION = "0026_notify_once_per_statement"
_FIT_SQL = "\n;\nSELECT wq_transport_fit();\n"
_OURS = re.compile(r"^(?P<number>\d{4})_(?P<slug>[a-z0-9_]+)\.sql$")
_THEIRS = re.compile(r"^(?P<x>\d{2})\.(?P<y>\d{2})\.(?P<z>\d{2})_(?P<serial>\d{2})_\w+$")
_UPGRADE_FIX = (
    "install the procrastinate this database was migrated with (within the range "
    "pyproject.toml pins), or deploy the release that migrated it; a schema never moves back"
)


@dataclass(frozen=True, slots=True)
class Migration:
    name: str  # e.g. 0001_create_lanes_runs
    number: int
    checksum: str
    sql: str


@dataclass(frozen=True, slots=True)
class Contract:
    version: int
    checksum: str


Key = tuple[int, int, int, int]


def procrastinate_key(name: str) -> Key:
    """The (x, y, z, serial) order of a procrastinate migration name."""
    match = _THEIRS.match(name)
    if match is None:
        raise SchemaContractMismatch(
            f"{name!r} is not a procrastinate migration name",
            field="procrastinate migration",
            rule="XX.YY.ZZ_NN_slug, e.g. 03.04.00_50_post_add_retry_failed_job_procedure",
            fix="correct or delete the row in wq_procrastinate_migrations",
        )
    return (int(match["x"]), int(match["y"]), int(match["z"]), int(match["serial"]))


@dataclass(frozen=True, slots=True)
class ProcrastinateMigration:
    name: str  # the file name without .sql, e.g. 03.01.00_01_pre_add_heartbeat
    key: Key
    path: Traversable = field(compare=False)  # identity is the name; not every path hashes

    def sql(self) -> str:
        return self.path.read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class ProcrastinateChain:
    """What a procrastinate release offers: its ``schema.sql`` and its delta migrations."""

    package: str  # its package version, recorded for people (e.g. "3.10.0")
    migrations: tuple[ProcrastinateMigration, ...]  # in apply order
    schema_sql: Callable[[], str]  # read only when an empty database needs it

    @property
    def version(self) -> str:
        """The schema version: the latest migration its ``schema.sql`` includes."""
        return self.migrations[-1].name

    @property
    def key(self) -> Key:
        return self.migrations[-1].key


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def procrastinate_schema() -> str:
    """The installed ``schema.sql`` (the one place that reads it)."""
    return (resources.files("procrastinate.sql") / "schema.sql").read_text(encoding="utf-8")


def _installed_schema() -> str:
    return procrastinate_schema()  # looked up at call time, so a test can substitute it


@functools.cache
def installed_procrastinate() -> ProcrastinateChain:
    """The installed procrastinate's chain (file names only: no file is read here)."""
    folder = resources.files("procrastinate.sql") / "migrations"
    found: dict[Key, ProcrastinateMigration] = {}
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        name = entry.name[:-4]
        if _THEIRS.match(name) is None:
            raise MigrationFailed(
                f"the installed procrastinate ships a migration {entry.name!r} this code "
                "cannot order",
                field="procrastinate/sql/migrations",
                rule="XX.YY.ZZ_NN_slug.sql",
                fix="install a procrastinate within the range pyproject.toml pins",
            )
        key = procrastinate_key(name)
        if key in found:
            raise MigrationFailed(
                f"the installed procrastinate ships {found[key].name!r} and {name!r} "
                "at one position",
                fix="install a procrastinate within the range pyproject.toml pins",
            )
        found[key] = ProcrastinateMigration(name=name, key=key, path=entry)
    if not found:
        raise MigrationFailed(
            "the installed procrastinate ships no migrations",
            fix="reinstall procrastinate within the range pyproject.toml pins",
        )
    return ProcrastinateChain(
        package=importlib.metadata.version("procrastinate"),
        migrations=tuple(found[key] for key in sorted(found)),
        schema_sql=_installed_schema,
    )


@functools.cache
def code_migrations() -> list[Migration]:
    """Our migrations, in order."""
    found: list[Migration] = []
    folder = resources.files("queues.sql") / "migrations"
    numbers: dict[int, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        match = _OURS.match(entry.name)
        if match is None:
            raise MigrationFailed(
                f"migration file {entry.name!r} is misnamed",
                field="sql/migrations",
                rule="NNNN_verb_object.sql (four digits, lower-case snake case)",
                fix="rename the file",
            )
        number = int(match["number"])
        if number in numbers:
            raise MigrationFailed(
                f"migrations {numbers[number]!r} and {entry.name!r} share number {number}",
                fix="give each migration its own number",
            )
        numbers[number] = entry.name
        text = entry.read_text(encoding="utf-8")
        found.append(Migration(name=entry.name[:-4], number=number, checksum=_sha(text), sql=text))
    return found


def contract_of(migrations: list[tuple[str, str]], procrastinate_version: str) -> Contract:
    """The contract of our (name, checksum) list, in order, on a procrastinate version."""
    digest = hashlib.sha256(f"procrastinate:{procrastinate_version}\n".encode())
    version = 0
    for name, checksum in migrations:
        digest.update(f"{name}:{checksum}\n".encode())
        version = max(version, int(name[:4]))
    return Contract(version=version, checksum=digest.hexdigest()[:16])


@functools.cache
def code_contract(procrastinate: ProcrastinateChain | None = None) -> Contract:
    """The contract this code expects (on the installed procrastinate by default)."""
    chain = procrastinate or installed_procrastinate()
    return contract_of([(m.name, m.checksum) for m in code_migrations()], chain.version)


_TRACKING_DDL = """
CREATE TABLE IF NOT EXISTS wq_migrations (
    name        text PRIMARY KEY,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS wq_procrastinate_migrations (
    name        text PRIMARY KEY,   -- a procrastinate migration, e.g. 03.01.00_01_pre_add_heartbeat
    applied_as  text NOT NULL CHECK (applied_as IN ('schema', 'migration', 'recorded')),
    package     text,               -- the procrastinate that applied it (NULL: recorded)
    applied_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS wq_schema_contract (
    id          boolean PRIMARY KEY DEFAULT true CHECK (id),
    version     integer NOT NULL,
    checksum    text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
"""
# applied_as: 'schema'    procrastinate's schema.sql, which includes every migration up to name;
#             'migration' the delta file of that name;
#             'recorded'  the version of a schema an earlier release loaded (no SQL run).


@dataclass(frozen=True, slots=True)
class MigrateReport:
    applied: list[str]
    contract: Contract
    procrastinate_version: str


@dataclass(frozen=True, slots=True)
class _Step:
    """One transaction of ``migrate``: the tracking row first, then the SQL (if any)."""

    name: str
    track: LiteralString
    params: dict[str, Any]
    sql: Callable[[], str] | None
    fix: str


_TRACK_OURS: LiteralString = "INSERT INTO wq_migrations (name, checksum) VALUES (%(n)s, %(c)s)"
_TRACK_THEIRS: LiteralString = (
    "INSERT INTO wq_procrastinate_migrations (name, applied_as, package) "
    "VALUES (%(n)s, %(as)s, %(p)s)"
)
_THEIR_FIX = (
    "nothing of it was applied; it is procrastinate's own file: read procrastinate's "
    "release notes for it, then run `worker migrate` again"
)


@dataclass(frozen=True, slots=True)
class _State:
    ours: dict[str, str]  # name -> checksum
    theirs: list[str]  # recorded procrastinate migrations
    procrastinate_tables: bool


async def _exists(conn: psycopg.AsyncConnection[Any], table: str) -> bool:
    cur = await conn.execute("SELECT to_regclass(%(t)s) IS NOT NULL", {"t": table})
    row = await cur.fetchone()
    return bool(row and row[0])


async def _state(conn: psycopg.AsyncConnection[Any]) -> _State:
    ours: dict[str, str] = {}
    if await _exists(conn, "wq_migrations"):
        cur = await conn.execute("SELECT name, checksum FROM wq_migrations ORDER BY name")
        ours = {str(name): str(checksum) for name, checksum in await cur.fetchall()}
    theirs: list[str] = []
    if await _exists(conn, "wq_procrastinate_migrations"):
        cur = await conn.execute("SELECT name FROM wq_procrastinate_migrations")
        theirs = [str(name) for (name,) in await cur.fetchall()]
    return _State(ours, theirs, await _exists(conn, "procrastinate_jobs"))


def _recorded_version(state: _State) -> str | None:
    """The database's procrastinate schema version, or None when it has none recorded."""
    if state.theirs:
        return max(state.theirs, key=procrastinate_key)
    if LEGACY_PROCRASTINATE_ENTRY in state.ours:
        return LEGACY_PROCRASTINATE_VERSION
    return None


def too_old(recorded: str, chain: ProcrastinateChain) -> ProcrastinateTooOld:
    return ProcrastinateTooOld(
        f"the database's procrastinate schema is at {recorded}, newer than the installed "
        f"procrastinate {chain.package} knows (its latest migration is {chain.version})",
        field="procrastinate",
        rule="the installed procrastinate must know the database's procrastinate schema",
        fix=_UPGRADE_FIX,
    )


def _check_history(applied: dict[str, str], code: list[Migration]) -> None:
    known = {m.name: m for m in code}
    for name, checksum in applied.items():
        if name == LEGACY_PROCRASTINATE_ENTRY:
            continue  # an earlier release's record of procrastinate's file: not ours to check
        migration = known.get(name)
        if migration is None:
            raise SchemaContractMismatch(
                f"the database has migration {name!r} that this code does not know",
                fix="deploy the code that matches this database (a newer release migrated it)",
            )
        if migration.checksum != checksum:
            raise SchemaContractMismatch(
                f"migration {name!r} was edited after it was applied "
                f"(applied checksum {checksum[:12]}, file {migration.checksum[:12]})",
                fix="migrations are forward-only: restore the file and add a new migration",
            )


def _then_fit(sql: Callable[[], str]) -> str:
    """A procrastinate migration's text, then our fit of its triggers (FIT_MIGRATION)."""
    return sql() + _FIT_SQL


def _plan(state: _State, chain: ProcrastinateChain, code: list[Migration]) -> list[_Step]:
    """Every step that would bring the database to this code's schema, in order.

    Refuses (before anything runs) a database this code must not touch: one that has a
    migration of ours edited or unknown, or a newer procrastinate schema than installed.
    """
    _check_history(state.ours, code)
    steps: list[_Step] = []
    recorded = _recorded_version(state)
    if recorded is None:
        if state.procrastinate_tables:
            raise SchemaContractMismatch(
                "procrastinate's tables exist but no procrastinate schema version is "
                "recorded (this database was not set up by `worker migrate`)",
                fix="migrate an empty database, or drop procrastinate's objects first",
            )
        steps.append(
            _Step(
                name=f"{PROCRASTINATE_PREFIX}schema.sql@{chain.version}",
                track=_TRACK_THEIRS,
                params={"n": chain.version, "as": "schema", "p": chain.package},
                sql=chain.schema_sql,
                fix=_THEIR_FIX,
            )
        )
    else:
        if procrastinate_key(recorded) > chain.key:
            raise too_old(recorded, chain)
        if not state.theirs:  # an earlier release's 0000_procrastinate_schema
            steps.append(
                _Step(
                    name=f"{PROCRASTINATE_PREFIX}recorded@{recorded}",
                    track=_TRACK_THEIRS,
                    params={"n": recorded, "as": "recorded", "p": None},
                    sql=None,
                    fix="nothing was recorded; run `worker migrate` again",
                )
            )
        fitted = FIT_MIGRATION in state.ours
        steps.extend(
            _Step(
                name=f"{PROCRASTINATE_PREFIX}{m.name}",
                track=_TRACK_THEIRS,
                params={"n": m.name, "as": "migration", "p": chain.package},
                sql=functools.partial(_then_fit, m.sql) if fitted else m.sql,
                fix=_THEIR_FIX,
            )
            for m in chain.migrations
            if m.key > procrastinate_key(recorded)
        )
    steps.extend(
        _Step(
            name=m.name,
            track=_TRACK_OURS,
            params={"n": m.name, "c": m.checksum},
            sql=functools.partial(str, m.sql),
            fix="fix the migration file; nothing of it was applied",
        )
        for m in code
        if m.name not in state.ours
    )
    return steps


async def pending(
    conn: psycopg.AsyncConnection[Any], *, procrastinate: ProcrastinateChain | None = None
) -> list[str]:
    """What ``migrate`` would apply, in order (read-only); refuses what ``migrate`` refuses."""
    chain = procrastinate or installed_procrastinate()
    return [s.name for s in _plan(await _state(conn), chain, code_migrations())]


async def migrate(
    conn: psycopg.AsyncConnection[Any], *, procrastinate: ProcrastinateChain | None = None
) -> MigrateReport:
    """Apply every pending step; idempotent and safe to run concurrently.

    ``conn`` must be in autocommit mode: each file gets its own transaction.
    ``procrastinate`` is the chain to migrate to (the installed one by default).
    """
    if not conn.autocommit:
        raise MigrationFailed("migrate needs an autocommit connection", fix="set autocommit")
    chain = procrastinate or installed_procrastinate()
    applied_now: list[str] = []
    # Lock order: the advisory lock first, then each file's transaction. Every migrator
    # queues here, so a second one finds the first one's files applied.
    cur = await conn.execute(
        "SELECT pg_advisory_lock(%(key)s), pg_backend_pid()", {"key": MIGRATION_LOCK_KEY}
    )
    row = await cur.fetchone()
    assert row is not None
    holder = int(row[1])
    try:
        # The refusals come before any DDL, the tracking tables included.
        await _same_session(conn, holder)
        steps = _plan(await _state(conn), chain, code_migrations())
        await conn.execute(_TRACKING_DDL)
        for step in steps:
            try:
                async with conn.transaction():
                    await _same_session(conn, holder)
                    await conn.execute(step.track, step.params)
                    if step.sql is not None:
                        # No parameters: the text is sent as is (procrastinate's has %).
                        await conn.execute(cast(LiteralString, step.sql()))  # type: ignore[redundant-cast]
            except psycopg.Error as exc:
                raise MigrationFailed(
                    f"migration {step.name!r} failed: {str(exc).strip()}", fix=step.fix
                ) from exc
            applied_now.append(step.name)
        contract = code_contract(procrastinate)
        await _same_session(conn, holder)
        await conn.execute(
            """
            INSERT INTO wq_schema_contract (id, version, checksum) VALUES (true, %(v)s, %(c)s)
            ON CONFLICT (id) DO UPDATE
               SET version = excluded.version, checksum = excluded.checksum, updated_at = now()
             WHERE (wq_schema_contract.version, wq_schema_contract.checksum)
                   IS DISTINCT FROM (excluded.version, excluded.checksum)
            """,
            {"v": contract.version, "c": contract.checksum},
        )
        # The roles and their grants, kept in step with the schema on every migrate.
        await roles.ensure(conn)
    finally:
        # A dead connection already released the lock; do not hide the original error.
        with contextlib.suppress(psycopg.OperationalError):
            await conn.execute("SELECT pg_advisory_unlock(%(key)s)", {"key": MIGRATION_LOCK_KEY})
    return MigrateReport(
        applied=applied_now, contract=contract, procrastinate_version=chain.version
    )


async def _same_session(conn: psycopg.AsyncConnection[Any], holder: int) -> None:
    """Refuse to go on unless this statement runs in the session that holds the migration
    lock: through a transaction-mode pooler (PgBouncer) each transaction may run on
    another server connection, where the session lock means nothing.

    The lock stays with the server connection that took it; an idle one (the pooler's,
    between transactions) is closed so the lock goes with it, and the pooler opens another.
    """
    cur = await conn.execute("SELECT pg_backend_pid()")
    row = await cur.fetchone()
    if row is not None and int(row[0]) == holder:
        return
    cur = await conn.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE pid = %(pid)s AND state = 'idle'",
        {"pid": holder},
    )
    released = await cur.fetchone()
    raise MigrationFailed(
        "the migration gate lost its session: its statements reached another server "
        "connection than the one holding its lock (a transaction-mode pooler such as "
        "PgBouncer sits between it and Postgres); nothing was applied after that"
        + ("" if released and released[0] else f" (the lock may stay held by pid {holder})"),
        field="WORKER_MIGRATE_DATABASE_URL",
        rule="the migration gate takes a session advisory lock: it needs a direct "
        "connection or a session-mode pool",
        fix="point WORKER_MIGRATE_DATABASE_URL at Postgres itself (or a session-mode pool) "
        "and run `worker migrate` again",
        code="MIGRATION_NEEDS_SESSION",
    )


async def read_contract(conn: psycopg.AsyncConnection[Any]) -> Contract | None:
    if not await _exists(conn, "wq_schema_contract"):
        return None
    cur = await conn.execute("SELECT version, checksum FROM wq_schema_contract")
    row = await cur.fetchone()
    if row is None:
        return None
    return Contract(version=int(row[0]), checksum=str(row[1]))


async def read_procrastinate_version(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """The database's recorded procrastinate schema version, or None (read-only)."""
    return _recorded_version(await _state(conn))


def mismatch_error(
    expected: Contract,
    found: Contract | None,
    *,
    procrastinate: str | None = None,
    database_procrastinate: str | None = None,
) -> SchemaContractMismatch:
    found_text = (
        "no schema (never migrated)"
        if found is None
        else f"version {found.version} (checksum {found.checksum})"
    )
    detail = ""
    if procrastinate is not None and database_procrastinate != procrastinate:
        detail = (
            f"; procrastinate schema: the code's {procrastinate}, the database's "
            f"{database_procrastinate or 'none'}"
        )
    return SchemaContractMismatch(
        f"schema contract mismatch: the code expects version {expected.version} "
        f"(checksum {expected.checksum}), the database has {found_text}{detail}",
        fix="run `worker migrate` (the release step) with this code's release",
    )


async def verify_contract(conn: psycopg.AsyncConnection[Any], *, schema: str = "public") -> None:
    """Refuse a database that is not at the code's schema (read-only, one query or two).

    A database whose procrastinate schema is newer than the installed procrastinate is
    refused as such (``ProcrastinateTooOld``): migrating cannot fix that, upgrading
    procrastinate can. A caller that checks often keeps a :class:`VerifiedSchema`.
    """
    expected = code_contract()
    found = await read_contract(conn)
    if found != expected:
        chain = installed_procrastinate()
        recorded = await read_procrastinate_version(conn)
        if recorded is not None and procrastinate_key(recorded) > chain.key:
            raise too_old(recorded, chain)
        raise mismatch_error(
            expected, found, procrastinate=chain.version, database_procrastinate=recorded
        )


class VerifiedSchema:
    """The contract check, memoized on success by the object its owner keeps (one per
    database: an admitter, a worker). A failure is not kept: the next call checks again
    and fails loudly again."""

    def __init__(self, *, schema: str = "public") -> None:
        self.schema = schema
        self._ok = False

    async def verify(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if self._ok:
            return
        await verify_contract(conn, schema=self.schema)
        self._ok = True

    def forget(self) -> None:
        """Check again next time (after a migration, say)."""
        self._ok = False
