"""The roles `worker migrate` keeps in step with the schema: least privilege on any Postgres.

The migration owner (whoever runs ``worker migrate``) owns every object and alone runs DDL.
Three group roles get exactly what their processes need (``sql/queries/roles.sql`` says
what, object by object); a deployment grants them to its login users:

=================  ==========================================================  ==========
role               may                                                         used by
=================  ==========================================================  ==========
``wq_worker``      DML on the queue's tables, the sequences, ``wq_submit``     ``worker start``,
                                                                               ``recover``,
                                                                               operator
                                                                               actions
``wq_admission``   ``EXECUTE`` on ``wq_submit`` (SECURITY DEFINER), nothing    admission
                   else: no run, params or row is readable
``wq_reader``      ``SELECT``                                                  ``observe``,
                                                                               ``result``,
                                                                               ``metrics``
=================  ==========================================================  ==========

Grants are applied on every migrate, so a new table is covered by the migration that adds it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import psycopg

from queues.errors import MigrationFailed
from queues.queries import q


class Role(StrEnum):
    """The group roles (cluster-wide names)."""

    WORKER = "wq_worker"  # workers, recovery and operator actions: DML, no DDL
    ADMISSION = "wq_admission"  # EXECUTE on wq_submit only
    READER = "wq_reader"  # SELECT only


async def ensure(conn: psycopg.AsyncConnection[Any]) -> None:
    """Create the roles that are missing and grant each what it needs; idempotent.

    A migrator without CREATEROLE still works once an administrator has created the roles
    (``CREATE ROLE wq_worker NOLOGIN``, ...): then only the grants run.
    """
    cur = await conn.execute(q("roles_present"))
    present = {str(row[0]) for row in await cur.fetchall()}
    if present != {role.value for role in Role}:
        try:
            async with conn.transaction():
                await conn.execute(q("roles_ensure"))
        except psycopg.errors.InsufficientPrivilege as exc:
            missing = ", ".join(sorted({r.value for r in Role} - present))
            raise MigrationFailed(
                f"the roles {missing} do not exist and this user may not create them",
                field="roles",
                rule="worker migrate creates its roles (CREATEROLE) or finds them made",
                fix=f"as an administrator: CREATE ROLE <name> NOLOGIN for each of {missing}; "
                "or run `worker migrate` as a user with CREATEROLE",
            ) from exc
    async with conn.transaction():
        await conn.execute(q("roles_grant"))
