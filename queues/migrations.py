"""The migration gate and the schema contract.

``migrate`` is the only code path that runs DDL. It applies procrastinate's schema and
ours (forward-only numbered files in ``sql/migrations/``), each file in its own
transaction, tracked in one table (``wq_migrations``), under a session advisory lock so
concurrent migrators queue up and apply each file once. The tracking row is written first
in each file's transaction, so two migrators that somehow bypassed the lock would collide
on its primary key instead of applying a file twice (graphile/worker does the same).

The *schema contract* is a version (the highest migration number) and a checksum over
every applied file. ``migrate`` records it; every other process only reads it
(``verify_contract``), memoized per (database URL, schema). A failure is never cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import threading
from dataclasses import dataclass
from importlib import resources
from typing import Any, LiteralString, cast

import psycopg

from queues.errors import MigrationFailed, SchemaContractMismatch

# pg_advisory_lock key: the first 8 bytes of sha256("wq:migrate") as a signed bigint.
MIGRATION_LOCK_KEY = int.from_bytes(hashlib.sha256(b"wq:migrate").digest()[:8], "big", signed=True)
PROCRASTINATE_ENTRY = "0000_procrastinate_schema"
_NAME = re.compile(r"^(?P<number>\d{4})_(?P<slug>[a-z0-9_]+)\.sql$")


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


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def procrastinate_schema() -> str:
    return (resources.files("procrastinate.sql") / "schema.sql").read_text(encoding="utf-8")


@functools.cache
def code_migrations() -> list[Migration]:
    """Every migration the code knows, procrastinate's schema first, in order."""
    found = [
        Migration(
            name=PROCRASTINATE_ENTRY,
            number=0,
            checksum=_sha(procrastinate_schema()),
            sql=procrastinate_schema(),
        )
    ]
    folder = resources.files("queues.sql") / "migrations"
    numbers: dict[int, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        match = _NAME.match(entry.name)
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


def contract_of(migrations: list[tuple[str, str]]) -> Contract:
    """The contract of a list of (name, checksum), in order."""
    digest = hashlib.sha256()
    version = 0
    for name, checksum in migrations:
        digest.update(f"{name}:{checksum}\n".encode())
        version = max(version, int(name[:4]))
    return Contract(version=version, checksum=digest.hexdigest()[:16])


@functools.cache
def code_contract() -> Contract:
    return contract_of([(m.name, m.checksum) for m in code_migrations()])


_TRACKING_DDL = """
CREATE TABLE IF NOT EXISTS wq_migrations (
    name        text PRIMARY KEY,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS wq_schema_contract (
    id          boolean PRIMARY KEY DEFAULT true CHECK (id),
    version     integer NOT NULL,
    checksum    text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
"""


@dataclass(frozen=True, slots=True)
class MigrateReport:
    applied: list[str]
    contract: Contract


async def _applied(conn: psycopg.AsyncConnection[Any]) -> dict[str, str] | None:
    """Applied migrations (name -> checksum), or None when the table does not exist."""
    cur = await conn.execute("SELECT to_regclass('wq_migrations') IS NOT NULL")
    row = await cur.fetchone()
    if row is None or not row[0]:
        return None
    cur = await conn.execute("SELECT name, checksum FROM wq_migrations ORDER BY name")
    return {str(name): str(checksum) for name, checksum in await cur.fetchall()}


def _check_history(applied: dict[str, str], code: list[Migration]) -> None:
    known = {m.name: m for m in code}
    for name, checksum in applied.items():
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


async def pending(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    """Names of the code's migrations the database has not applied (read-only)."""
    code = code_migrations()
    applied = await _applied(conn) or {}
    _check_history(applied, code)
    return [m.name for m in code if m.name not in applied]


async def migrate(conn: psycopg.AsyncConnection[Any]) -> MigrateReport:
    """Apply every pending migration; idempotent and safe to run concurrently.

    ``conn`` must be in autocommit mode: each file gets its own transaction.
    """
    if not conn.autocommit:
        raise MigrationFailed("migrate needs an autocommit connection", fix="set autocommit")
    code = code_migrations()
    applied_now: list[str] = []
    # Lock order: the advisory lock first, then each file's transaction. Every migrator
    # queues here, so a second one finds the first one's files applied.
    await conn.execute("SELECT pg_advisory_lock(%(key)s)", {"key": MIGRATION_LOCK_KEY})
    try:
        await conn.execute(_TRACKING_DDL)
        applied = await _applied(conn) or {}
        _check_history(applied, code)
        for migration in code:
            if migration.name in applied:
                continue
            try:
                async with conn.transaction():
                    await conn.execute(
                        "INSERT INTO wq_migrations (name, checksum) VALUES (%(n)s, %(c)s)",
                        {"n": migration.name, "c": migration.checksum},
                    )
                    # No parameters: the text is sent as is (procrastinate's schema contains %).
                    await conn.execute(cast(LiteralString, migration.sql))  # type: ignore[redundant-cast]
            except psycopg.Error as exc:
                raise MigrationFailed(
                    f"migration {migration.name!r} failed: {str(exc).strip()}",
                    fix="fix the migration file; nothing of it was applied",
                ) from exc
            applied_now.append(migration.name)
        contract = code_contract()
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
    finally:
        # A dead connection already released the lock; do not hide the original error.
        with contextlib.suppress(psycopg.OperationalError):
            await conn.execute("SELECT pg_advisory_unlock(%(key)s)", {"key": MIGRATION_LOCK_KEY})
    return MigrateReport(applied=applied_now, contract=contract)


async def read_contract(conn: psycopg.AsyncConnection[Any]) -> Contract | None:
    cur = await conn.execute("SELECT to_regclass('wq_schema_contract') IS NOT NULL")
    exists = await cur.fetchone()
    if exists is None or not exists[0]:
        return None
    cur = await conn.execute("SELECT version, checksum FROM wq_schema_contract")
    row = await cur.fetchone()
    if row is None:
        return None
    return Contract(version=int(row[0]), checksum=str(row[1]))


def mismatch_error(expected: Contract, found: Contract | None) -> SchemaContractMismatch:
    found_text = (
        "no schema (never migrated)"
        if found is None
        else f"version {found.version} (checksum {found.checksum})"
    )
    return SchemaContractMismatch(
        f"schema contract mismatch: the code expects version {expected.version} "
        f"(checksum {expected.checksum}), the database has {found_text}",
        fix="run `worker migrate` (the release step) with this code's release",
    )


_verified: set[tuple[str, str]] = set()
_verified_lock = threading.Lock()


async def verify_contract(
    conn: psycopg.AsyncConnection[Any], *, url: str, schema: str = "public"
) -> None:
    """Refuse a database that is not at the code's schema; read-only, memoized on success.

    Memoized per (database URL, schema) for the life of the process. A failure is not
    cached: the next caller verifies again and fails loudly again.
    """
    key = (url, schema)
    if key in _verified:
        return
    expected = code_contract()
    found = await read_contract(conn)
    if found != expected:
        raise mismatch_error(expected, found)
    with _verified_lock:
        _verified.add(key)


def forget_verified() -> None:
    """Drop the memo (tests, and a process that just migrated)."""
    with _verified_lock:
        _verified.clear()
