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
bytes). ``migrate`` records the database's; every other process only reads it
(``verify_contract``), memoized per (database URL, schema). A failure is never cached.

**The contract is a window** (docs/design.md, "The schema window"). Every file of ours
says its kind on its first line: ``-- kind: expand`` (additive: every older release in the
window keeps working) or ``-- kind: contract`` (removes or changes what an older release
uses); the files up to :data:`LAST_UNKINDED` shipped before the line existed and count as
expand steps of the first release. The database records, beside its contract, its
compatibility *floor*: the oldest release schema it still serves, raised only by a contract
step (to the step's own number; procrastinate's ``post`` migrations are contract steps too,
and raise it to the migrating code's version). Code whose schema is ``V`` runs against a
database that has every migration of the code up to its last non-contract one (a release's
trailing contract steps are post-deploy steps its own code does not need) and whose floor
is at most ``V``; a database at a newer release's schema is normal. A contract step waits
(:func:`contract_blockers`) while a lane of an older release has unfinished runs or live
workers, unless an operator forces it (audited in ``wq_operator_actions``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, LiteralString, cast

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from queues import roles, server
from queues.errors import (
    ContractBlockedByLanes,
    MigrationFailed,
    ProcrastinateTooOld,
    SchemaContractMismatch,
    SchemaWindowClosed,
)
from queues.queries import q

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
# The last file shipped before migrations said their kind: it and every file before it
# keep their checksums and count as expand steps (the schema of the first release).
LAST_UNKINDED = 33
EXPAND = "expand"
CONTRACT = "contract"
KINDS = (EXPAND, CONTRACT)
_KIND_LINE = re.compile(r"^--\s*kind:\s*(?P<kind>\S*)\s*$")
# What an expand step must not do: each removes or changes something an older release may
# read, write or call. (A new version of a function gets a new name; DROP TRIGGER, DROP
# INDEX and DROP CONSTRAINT only relax or rebuild, and are allowed.)
_DESTRUCTIVE = re.compile(
    r"\b(DROP\s+(TABLE|COLUMN|FUNCTION|PROCEDURE|VIEW|TYPE|SCHEMA|SEQUENCE)"
    r"|RENAME\s+(TO|COLUMN|CONSTRAINT)|ALTER\s+COLUMN\s+\S+\s+(SET\s+DATA\s+)?TYPE"
    r"|SET\s+NOT\s+NULL)\b",
    re.IGNORECASE,
)
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
    kind: str = EXPAND  # expand | contract (the first line of the file says which)


@dataclass(frozen=True, slots=True)
class Contract:
    version: int
    checksum: str


@dataclass(frozen=True, slots=True)
class CodeSchema:
    """What a release's code needs of a database."""

    version: int  # its highest migration number: its place in the window
    requires: int  # its last non-contract migration: every one up to it must be applied


@dataclass(frozen=True, slots=True)
class Recorded:
    """What ``migrate`` recorded in ``wq_schema_contract``."""

    contract: Contract
    floor: int = 0  # the oldest release schema the database still serves
    floor_migration: str | None = None  # the contract step that raised the floor
    floor_release: str | None = None  # the release whose migrate applied that step
    release: str | None = None  # the release whose migrate last recorded the contract


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
        package=installed_version("procrastinate"),
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
        found.append(
            Migration(
                name=entry.name[:-4],
                number=number,
                checksum=_sha(text),
                sql=text,
                kind=kind_of(entry.name, text, number),
            )
        )
    return found


def kind_of(file: str, text: str, number: int) -> str:
    """The kind a migration file declares on its first line (refused when it is missing,
    unknown, or an expand step that removes or changes something)."""
    first = text.split("\n", 1)[0].strip()
    match = _KIND_LINE.match(first)
    if match is None:
        if number <= LAST_UNKINDED:
            return EXPAND
        raise MigrationFailed(
            f"migration {file!r} does not say its kind on its first line",
            field=f"sql/migrations/{file}",
            rule="the first line is `-- kind: expand` (additive: every older release in "
            "the window keeps working) or `-- kind: contract` (removes or changes what an "
            "older release reads, writes or calls)",
            fix="add the line; nothing was applied",
        )
    kind = match["kind"].lower()
    if kind not in KINDS:
        raise MigrationFailed(
            f"migration {file!r} declares an unknown kind {match['kind']!r}",
            field=f"sql/migrations/{file}",
            rule="`-- kind: expand` or `-- kind: contract`",
            fix="correct the first line; nothing was applied",
        )
    if kind == EXPAND:
        body = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
        found = _DESTRUCTIVE.search(body)
        if found is not None:
            raise MigrationFailed(
                f"expand migration {file!r} has {' '.join(found[0].split()).upper()!r}, "
                "which removes or changes what an older release may use",
                field=f"sql/migrations/{file}",
                rule="an expand step only adds (a table, a nullable or defaulted column, an "
                "index, a function or a new version of one under a new name)",
                fix="make the change additive, or move the removal into a contract "
                "migration of a later release; nothing was applied",
            )
    return kind


def schema_of(code: list[Migration]) -> CodeSchema:
    """What code with these migrations needs of a database (see the module docstring)."""
    version = max((m.number for m in code), default=0)
    requires = max((m.number for m in code if m.kind != CONTRACT), default=0)
    return CodeSchema(version=version, requires=requires)


@functools.cache
def code_schema() -> CodeSchema:
    """What this code needs of a database."""
    return schema_of(code_migrations())


@functools.cache
def code_release() -> str:
    """This code's release (its package version), as the database records it."""
    return installed_version("worker")


def installed_version(package: str) -> str:
    """An installed distribution's version, else ``unknown``. Imported here, not at the
    module's top: reading the metadata machinery costs every command's start."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def _number(name: str) -> int | None:
    """The number of a migration name of ours (None for a name that is not one)."""
    head = name[:4]
    return int(head) if head.isdigit() and name[4:5] == "_" else None


def is_pre(name: str) -> bool:
    """Whether a procrastinate migration is a ``pre`` step (additive by procrastinate's
    own rule: applied before the code that needs it is deployed). Every other one (its
    ``post`` steps, and the unsplit ones of its older releases) is a contract step."""
    return "_pre_" in name


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

# The schema window's bookkeeping, added in place (an older release's migrate writes only
# the columns it knows; these have defaults). Run only while a column is missing: ALTER
# TABLE locks the table even when there is nothing to add.
_WINDOW_DDL = """
ALTER TABLE wq_migrations
    ADD COLUMN IF NOT EXISTS kind text,         -- expand | contract (NULL: before kinds)
    ADD COLUMN IF NOT EXISTS release text;      -- the release whose migrate applied it
ALTER TABLE wq_schema_contract
    ADD COLUMN IF NOT EXISTS floor integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS floor_migration text,
    ADD COLUMN IF NOT EXISTS floor_release text,
    ADD COLUMN IF NOT EXISTS release text;
"""
_WINDOW_DDL_NEEDED: LiteralString = (
    "SELECT count(*) < 2 FROM pg_attribute"
    " WHERE (attrelid, attname) IN (('wq_migrations'::regclass, 'release'),"
    "                               ('wq_schema_contract'::regclass, 'release'))"
    " AND NOT attisdropped"
)


@dataclass(frozen=True, slots=True)
class Blocker:
    """A lane that a contract step waits for: it holds unfinished runs of a release older
    than the step (not reclaimed), or live workers of such a release serve it."""

    lane: str
    release: str
    schema_version: int | None  # the schema of the release that prepared it (None: unknown)
    unfinished: int
    live_workers: int

    def describe(self) -> str:
        what = []
        if self.unfinished:
            what.append(f"{self.unfinished} unfinished run(s)")
        if self.live_workers:
            what.append(f"{self.live_workers} live worker(s)")
        schema = (
            "unknown schema" if self.schema_version is None else f"schema {self.schema_version}"
        )
        return f"{self.lane} ({schema}: {', '.join(what)})"


@dataclass(frozen=True, slots=True)
class MigrateReport:
    applied: list[str]
    contract: Contract
    procrastinate_version: str
    deferred: list[str] = field(default_factory=list)  # contract steps waiting for lanes
    blocked_by: list[Blocker] = field(default_factory=list)
    newer: list[str] = field(default_factory=list)  # a newer release's migrations
    newer_release: str | None = None  # the release that recorded the database's contract
    forced: bool = False  # a contract step was applied over its blockers


@dataclass(frozen=True, slots=True)
class PlannedStep:
    name: str
    kind: str
    blocked_by: list[Blocker]  # only on the first contract step (the later ones wait too)


@dataclass(frozen=True, slots=True)
class Plan:
    """What ``migrate`` would do now (read-only), for ``worker migrate --check``."""

    steps: list[PlannedStep]
    newer: list[str]
    recorded: Recorded | None


@dataclass(frozen=True, slots=True)
class _Step:
    """One transaction of ``migrate``: the tracking row first, then the SQL (if any)."""

    name: str
    track: LiteralString
    params: dict[str, Any]
    sql: Callable[[], str] | None
    fix: str
    kind: str = EXPAND
    floor: int = 0  # a contract step raises the floor to this (0: not a contract step)


_TRACK_OURS: LiteralString = (
    "INSERT INTO wq_migrations (name, checksum, kind, release) VALUES (%(n)s, %(c)s, %(k)s, %(r)s)"
)
_TRACK_THEIRS: LiteralString = (
    "INSERT INTO wq_procrastinate_migrations (name, applied_as, package) "
    "VALUES (%(n)s, %(as)s, %(p)s)"
)
_THEIR_FIX = (
    "nothing of it was applied; it is procrastinate's own file: read procrastinate's "
    "release notes for it, then run `worker migrate` again"
)
# A contract step raises the floor in its own transaction (the record's version and
# checksum are set at the end of the run; a fresh record gets placeholders until then).
_RAISE_FLOOR: LiteralString = """
INSERT INTO wq_schema_contract (id, version, checksum, floor, floor_migration, floor_release)
VALUES (true, 0, '', %(floor)s, %(migration)s, %(release)s)
ON CONFLICT (id) DO UPDATE
   SET floor = excluded.floor, floor_migration = excluded.floor_migration,
       floor_release = excluded.floor_release, updated_at = now()
 WHERE wq_schema_contract.floor < excluded.floor
"""
_AUDIT_FORCE: LiteralString = (
    "INSERT INTO wq_operator_actions (actor, action, data)"
    " VALUES (%(actor)s, 'migrate_contract_forced', %(data)s)"
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


async def _history(conn: psycopg.AsyncConnection[Any]) -> _State:
    """The history of a database that has a contract record (so the tracking tables
    exist), in one statement: the check of a process inside the window reads it once."""
    cur = await conn.execute(
        "SELECT (SELECT coalesce(jsonb_object_agg(name, checksum), '{}') FROM wq_migrations),"
        " (SELECT coalesce(array_agg(name), '{}') FROM wq_procrastinate_migrations)"
    )
    row = await cur.fetchone()
    assert row is not None
    ours = {str(name): str(checksum) for name, checksum in sorted(row[0].items())}
    return _State(ours, [str(name) for name in row[1]], procrastinate_tables=True)


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


def _check_history(applied: dict[str, str], code: list[Migration]) -> list[str]:
    """Refuse a history that disagrees with the code's (an edited file, or an unknown one
    among the code's own numbers); return the migrations of a newer release, in order."""
    known = {m.name: m for m in code}
    top = max((m.number for m in code), default=0)
    newer: list[str] = []
    for name, checksum in applied.items():
        if name == LEGACY_PROCRASTINATE_ENTRY:
            continue  # an earlier release's record of procrastinate's file: not ours to check
        migration = known.get(name)
        if migration is None:
            number = _number(name)
            if number is not None and number > top:
                newer.append(name)
                continue
            raise SchemaContractMismatch(
                f"the database has migration {name!r} that this code does not know, among "
                f"this code's own numbers (up to {top})",
                fix="deploy the code that matches this database: its history and this "
                "code's disagree",
            )
        if migration.checksum != checksum:
            raise SchemaContractMismatch(
                f"migration {name!r} was edited after it was applied "
                f"(applied checksum {checksum[:12]}, file {migration.checksum[:12]})",
                fix="migrations are forward-only: restore the file and add a new migration",
            )
    return sorted(newer)


def _then_fit(sql: Callable[[], str]) -> str:
    """A procrastinate migration's text, then our fit of its triggers (FIT_MIGRATION)."""
    return sql() + _FIT_SQL


def _plan(state: _State, chain: ProcrastinateChain, code: list[Migration]) -> list[_Step]:
    """Every step that would bring the database to this code's schema, in order.

    Refuses (before anything runs) a database this code must not touch: one that has a
    migration of ours edited or unknown, or a newer procrastinate schema than installed.
    A procrastinate delta applied to a database that has one already is a contract step
    unless it is a ``pre`` step; it raises the floor to this code's version.
    """
    _check_history(state.ours, code)
    steps: list[_Step] = []
    recorded = _recorded_version(state)
    version = schema_of(code).version
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
            beyond = [n for n in state.theirs if procrastinate_key(n) > chain.key]
            if not beyond or not all(is_pre(n) for n in beyond):
                raise too_old(recorded, chain)
            # A newer procrastinate's pre steps: inside the window, nothing to apply.
            recorded = chain.version
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
        for m in chain.migrations:
            if m.key <= procrastinate_key(recorded):
                continue
            contract = not is_pre(m.name)
            steps.append(
                _Step(
                    name=f"{PROCRASTINATE_PREFIX}{m.name}",
                    track=_TRACK_THEIRS,
                    params={"n": m.name, "as": "migration", "p": chain.package},
                    sql=functools.partial(_then_fit, m.sql) if fitted else m.sql,
                    fix=_THEIR_FIX,
                    kind=CONTRACT if contract else EXPAND,
                    floor=version if contract else 0,
                )
            )
    steps.extend(
        _Step(
            name=m.name,
            track=_TRACK_OURS,
            params={"n": m.name, "c": m.checksum, "k": m.kind, "r": code_release()},
            sql=functools.partial(str, m.sql),
            fix="fix the migration file; nothing of it was applied",
            kind=m.kind,
            floor=m.number if m.kind == CONTRACT else 0,
        )
        for m in code
        if m.name not in state.ours
    )
    return steps


async def contract_blockers(conn: psycopg.AsyncConnection[Any], *, below: int) -> list[Blocker]:
    """The lanes a contract step that raises the floor to ``below`` waits for (read-only).

    A database from before the window (no ``schema_version`` columns yet) counts every lane
    and worker as older than any contract step.
    """
    if not await _exists(conn, "wq_lanes") or not await _exists(conn, "wq_workers"):
        return []
    async with conn.cursor(row_factory=class_row(Blocker)) as cur:
        await cur.execute(q("lane_contract_blockers"), {"below": below})
        return await cur.fetchall()


def blocked_error(step: str, blockers: list[Blocker], waiting: list[str]) -> ContractBlockedByLanes:
    behind = (
        f"; {', '.join(waiting)} come(s) after it and cannot be applied first" if waiting else ""
    )
    return ContractBlockedByLanes(
        f"contract migration {step!r} waits for lanes of older releases: "
        f"{'; '.join(b.describe() for b in blockers)}{behind}. Nothing of it was applied",
        field=step,
        rule="a contract step waits until no lane of an older release has unfinished runs "
        "or live workers (they may use what it removes)",
        fix="let those lanes finish (`worker queues drain RELEASE`, then stop their workers "
        "when `worker queues list` shows them empty), move their runs to a newer release "
        "(`worker queues adopt OLD NEW`), or reclaim them (`worker queues reclaim`); then "
        "run `worker migrate` again. An operator may override with `worker migrate "
        "--contract --force --reason TEXT` (audited)",
    )


def window_closed(recorded: Recorded, schema: CodeSchema | None = None) -> SchemaWindowClosed:
    schema = schema or code_schema()
    newer = f", release {recorded.release}" if recorded.release else ""
    by = f" (applied by release {recorded.floor_release})" if recorded.floor_release else ""
    return SchemaWindowClosed(
        f"the database is at a newer release's schema (version {recorded.contract.version}"
        f"{newer}); its contract migration {recorded.floor_migration or '?'!r}{by} raised "
        f"the compatibility floor to {recorded.floor}, above this release's schema "
        f"({schema.version}, release {code_release()}): this release can no longer run here",
        field="schema floor",
        rule="a release runs against a database whose floor is at or below its schema",
        fix="admit and run with a release at or above the floor; move this release's "
        "unfinished runs there with `worker queues adopt`. Migrating with this release "
        "cannot help: the database is newer than its code",
    )


async def _where(
    conn: psycopg.AsyncConnection[Any], code: list[Migration]
) -> tuple[_State, Recorded | None, list[str]]:
    """The database's history and record, and the migrations of a newer release it has;
    refuses a history that disagrees with the code's, and a window closed on the code."""
    state = await _state(conn)
    recorded = await read_recorded(conn)
    newer = _check_history(state.ours, code)
    if newer and recorded is not None and recorded.floor > schema_of(code).version:
        raise window_closed(recorded, schema_of(code))
    return state, recorded, newer


async def plan(
    conn: psycopg.AsyncConnection[Any],
    *,
    procrastinate: ProcrastinateChain | None = None,
    code: list[Migration] | None = None,
) -> Plan:
    """What ``migrate`` would do now, with what blocks each contract step (read-only);
    refuses what ``migrate`` refuses. ``code``: the migrations to plan for (this code's
    by default)."""
    chain = procrastinate or installed_procrastinate()
    code = code_migrations() if code is None else code
    await server.require_supported(conn)
    state, recorded, newer = await _where(conn, code)
    if newer:
        return Plan(steps=[], newer=newer, recorded=recorded)
    steps: list[PlannedStep] = []
    for step in _plan(state, chain, code):
        blockers: list[Blocker] = []
        if step.kind == CONTRACT:  # each against its own floor
            blockers = await contract_blockers(conn, below=step.floor)
        steps.append(PlannedStep(name=step.name, kind=step.kind, blocked_by=blockers))
    return Plan(steps=steps, newer=[], recorded=recorded)


async def pending(
    conn: psycopg.AsyncConnection[Any], *, procrastinate: ProcrastinateChain | None = None
) -> list[str]:
    """What ``migrate`` would apply, in order (read-only); refuses what ``migrate`` refuses."""
    return [s.name for s in (await plan(conn, procrastinate=procrastinate)).steps]


async def migrate(
    conn: psycopg.AsyncConnection[Any],
    *,
    procrastinate: ProcrastinateChain | None = None,
    contract: bool = False,
    force: bool = False,
    actor: str = "migrate",
    reason: str | None = None,
    code: list[Migration] | None = None,
) -> MigrateReport:
    """Apply every pending step; idempotent and safe to run concurrently.

    ``conn`` must be in autocommit mode: each file gets its own transaction.
    ``procrastinate`` is the chain to migrate to (the installed one by default), ``code``
    our migrations to bring it to (this code's by default).

    A contract step that lanes of older releases still need is deferred: the steps before
    it are applied and the report lists it (``deferred``, ``blocked_by``). It is refused
    instead (``ContractBlockedByLanes``, before anything is applied) when ``contract`` asks
    for the contract steps, or when a non-contract step comes after it (this code needs
    that one). ``force`` applies it over its blockers and records who and why
    (``wq_operator_actions``). Run by a release older than the database, ``migrate``
    applies nothing inside the window and refuses outside it (``SchemaWindowClosed``).
    """
    if not conn.autocommit:
        raise MigrationFailed("migrate needs an autocommit connection", fix="set autocommit")
    await server.require_supported(conn)
    if force and not (reason and reason.strip()):
        raise MigrationFailed(
            "a forced contract step needs a reason",
            field="reason",
            rule="an operator's override is audited with who and why",
            fix="say why the lanes may lose what the step removes",
        )
    chain = procrastinate or installed_procrastinate()
    code = code_migrations() if code is None else code
    applied_now: list[str] = []
    deferred: list[str] = []
    blocked: list[Blocker] = []
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
        state, recorded, newer = await _where(conn, code)
        if newer:
            # A newer release migrated this database: nothing of this code is pending.
            assert recorded is not None
            return MigrateReport(
                applied=[],
                contract=recorded.contract,
                procrastinate_version=_recorded_version(state) or chain.version,
                newer=newer,
                newer_release=recorded.release,
            )
        steps = _plan(state, chain, code)
        await conn.execute(_TRACKING_DDL)
        cur = await conn.execute(_WINDOW_DDL_NEEDED)
        needed = await cur.fetchone()
        if needed is not None and needed[0]:
            await conn.execute(_WINDOW_DDL)
        # Each contract step against its own floor: a lane prepared between two pending
        # contract steps' floors blocks the later one only. The steps before the first
        # blocked one are applied; it and every step after it wait.
        # Forced, every contract step goes over its blockers (reported, and audited by
        # _hold_contract).
        for first, step in enumerate(steps):
            if step.kind != CONTRACT:
                continue
            blockers = await contract_blockers(conn, below=step.floor)
            blocked += [b for b in blockers if b not in blocked]
            if blockers and not force:
                waiting = [s.name for s in steps[first + 1 :] if s.kind != CONTRACT]
                if waiting or contract:
                    raise blocked_error(step.name, blockers, waiting)
                deferred = [s.name for s in steps[first:]]
                steps = steps[:first]
                break
        for step in steps:
            try:
                async with conn.transaction():
                    await _same_session(conn, holder)
                    await conn.execute(step.track, step.params)
                    if step.floor:
                        await _hold_contract(conn, step, force=force, actor=actor, reason=reason)
                    if step.sql is not None:
                        # No parameters: the text is sent as is (procrastinate's has %).
                        await conn.execute(cast(LiteralString, step.sql()))  # type: ignore[redundant-cast]
                    if step.floor:
                        await conn.execute(
                            _RAISE_FLOOR,
                            {
                                "floor": step.floor,
                                "migration": step.name,
                                "release": code_release(),
                            },
                        )
            except psycopg.Error as exc:
                raise MigrationFailed(
                    f"migration {step.name!r} failed: {str(exc).strip()}", fix=step.fix
                ) from exc
            applied_now.append(step.name)
        after = await _state(conn)
        found = contract_of(
            [(n, c) for n, c in after.ours.items() if n != LEGACY_PROCRASTINATE_ENTRY],
            _recorded_version(after) or chain.version,
        )
        await _same_session(conn, holder)
        database_procrastinate = _recorded_version(after)
        ahead = database_procrastinate is not None and (
            procrastinate_key(database_procrastinate) > chain.key
        )
        # Unchanged, or a newer release's record (its procrastinate is ahead): it stays as
        # that release wrote it.
        kept = recorded is not None and (ahead or recorded.contract == found)
        if applied_now or not kept:
            await _record(conn, found)
        # The roles and their grants, kept in step with the schema on every migrate.
        await roles.ensure(conn)
    finally:
        # A dead connection already released the lock; do not hide the original error.
        with contextlib.suppress(psycopg.OperationalError):
            await conn.execute("SELECT pg_advisory_unlock(%(key)s)", {"key": MIGRATION_LOCK_KEY})
    return MigrateReport(
        applied=applied_now,
        contract=found,
        procrastinate_version=_recorded_version(after) or chain.version,
        deferred=deferred,
        blocked_by=blocked if (deferred or force) else [],
        forced=bool(force and blocked),
    )


async def _record(conn: psycopg.AsyncConnection[Any], found: Contract) -> None:
    """Record the database's contract, and the release whose migrate wrote it."""
    await conn.execute(
        """
            INSERT INTO wq_schema_contract (id, version, checksum, release)
            VALUES (true, %(v)s, %(c)s, %(r)s)
            ON CONFLICT (id) DO UPDATE
               SET version = excluded.version, checksum = excluded.checksum,
                   release = excluded.release, updated_at = now()
             WHERE (wq_schema_contract.version, wq_schema_contract.checksum,
                    wq_schema_contract.release)
                   IS DISTINCT FROM (excluded.version, excluded.checksum, excluded.release)
            """,
        {"v": found.version, "c": found.checksum, "r": code_release()},
    )


async def _hold_contract(
    conn: psycopg.AsyncConnection[Any],
    step: _Step,
    *,
    force: bool,
    actor: str,
    reason: str | None,
) -> None:
    """In a contract step's transaction: keep workers from registering until it commits
    (a worker of an older release that registers after it is refused by the floor, in
    the database), look for blockers again, refuse or audit them, and retire the lanes
    below the new floor: no worker of theirs may start any more, so an admission to one
    (an old serverless deployment still admitting) is refused (``LANE_RECLAIMED``)
    instead of admitting a run nobody can execute."""
    if await _exists(conn, "wq_workers"):
        await conn.execute("LOCK TABLE wq_workers IN SHARE MODE")
    blockers = await contract_blockers(conn, below=step.floor)
    if blockers and not force:
        raise blocked_error(step.name, blockers, [])
    if await _exists(conn, "wq_lanes"):
        await conn.execute(
            q("lane_retire_below_floor"),
            {"below": step.floor, "actor": actor, "migration": step.name},
        )
    if not blockers:
        return
    await conn.execute(
        _AUDIT_FORCE,
        {
            "actor": actor,
            "data": Jsonb(
                {
                    "migration": step.name,
                    "floor": step.floor,
                    "release": code_release(),
                    "reason": reason,
                    "blocked_by": [b.describe() for b in blockers],
                }
            ),
        },
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
    recorded = await read_recorded(conn)
    return None if recorded is None else recorded.contract


async def read_recorded(conn: psycopg.AsyncConnection[Any]) -> Recorded | None:
    """The database's record of its contract and floor (one query; None: never migrated).

    Read as JSON, so a record written before the window (no floor columns) reads too.
    """
    if not await _exists(conn, "wq_schema_contract"):
        return None
    cur = await conn.execute("SELECT to_jsonb(c) FROM wq_schema_contract c")
    row = await cur.fetchone()
    if row is None:
        return None
    data: dict[str, Any] = row[0]
    return Recorded(
        contract=Contract(version=int(data["version"]), checksum=str(data["checksum"])),
        floor=int(data.get("floor") or 0),
        floor_migration=data.get("floor_migration"),
        floor_release=data.get("floor_release"),
        release=data.get("release"),
    )


async def read_procrastinate_version(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """The database's recorded procrastinate schema version, or None (read-only)."""
    return _recorded_version(await _state(conn))


def mismatch_error(
    expected: Contract,
    found: Contract | None,
    *,
    procrastinate: str | None = None,
    database_procrastinate: str | None = None,
    missing: list[str] | None = None,
) -> SchemaContractMismatch:
    found_text = (
        "no schema (never migrated)"
        if found is None
        else f"version {found.version} (checksum {found.checksum})"
    )
    detail = ""
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        detail = f"; it lacks {shown}"
    if procrastinate is not None and database_procrastinate != procrastinate:
        detail += (
            f"; procrastinate schema: the code's {procrastinate}, the database's "
            f"{database_procrastinate or 'none'}"
        )
    return SchemaContractMismatch(
        f"schema contract mismatch: the code expects version {expected.version} "
        f"(checksum {expected.checksum}), the database has {found_text}{detail}",
        fix="run `worker migrate` (the release step) with this code's release",
    )


async def verify_contract(conn: psycopg.AsyncConnection[Any], *, schema: str = "public") -> None:
    """Refuse a database this code cannot run against (read-only).

    One query when the database is at exactly this code's schema; otherwise the history
    is read too, once, and the window decides: a database at a newer release's schema
    whose floor is at or below this code's is accepted; one whose floor is above it is
    refused (``SchemaWindowClosed``, naming the step and release that raised it); one that
    lacks a migration this code needs is refused as behind (migrate). A database whose
    procrastinate schema has a contract step the installed procrastinate does not know is
    refused as such (``ProcrastinateTooOld``); its ``pre`` steps are inside the window. A
    caller that checks often keeps a :class:`VerifiedSchema`.
    """
    expected = code_contract()
    recorded = await read_recorded(conn)
    if recorded is not None and recorded.contract == expected:
        return
    chain = installed_procrastinate()
    if recorded is None:
        raise mismatch_error(expected, None, procrastinate=chain.version)
    state = await _history(conn)
    _check_history(state.ours, code_migrations())
    if recorded.floor > code_schema().version:
        raise window_closed(recorded)
    database_procrastinate = _recorded_version(state)
    requires = code_schema().requires
    missing = [
        m.name for m in code_migrations() if m.number <= requires and m.name not in state.ours
    ]
    # The installed procrastinate's steps the database lacks: its post (contract) steps
    # may wait, as ours do; a missing pre step means the database is behind.
    lacking = (
        [m.name for m in chain.migrations if m.key > procrastinate_key(database_procrastinate)]
        if database_procrastinate is not None
        else []
    )
    if missing or database_procrastinate is None or any(is_pre(n) for n in lacking):
        raise mismatch_error(
            expected,
            recorded.contract,
            procrastinate=chain.version,
            database_procrastinate=database_procrastinate,
            missing=missing,
        )
    beyond = [n for n in state.theirs if procrastinate_key(n) > chain.key]
    if procrastinate_key(database_procrastinate) > chain.key and (
        not state.theirs or not all(is_pre(n) for n in beyond)
    ):
        raise too_old(database_procrastinate, chain)


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
