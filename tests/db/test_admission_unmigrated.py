"""Admission-only mode skips the contract check, so a database that was never migrated
must still fail with the schema error and its fix, not a raw database error."""

from __future__ import annotations

import os

import psycopg
import pytest

from queues import admission
from queues.errors import SchemaContractMismatch
from tests.conftest import drop_database, with_dbname


async def test_admission_only_submit_on_an_unmigrated_database_names_the_fix(
    pg_admin_url: str,
) -> None:
    name = f"wq_unmigrated_{os.getpid()}"
    async with await psycopg.AsyncConnection.connect(pg_admin_url, autocommit=True) as admin:
        await admin.execute(f"DROP DATABASE IF EXISTS {name}")
        await admin.execute(f"CREATE DATABASE {name}")
    url = with_dbname(pg_admin_url, name)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            with pytest.raises(SchemaContractMismatch, match="worker migrate"):
                await admission.Admitter(admission_only=True).submit(
                    conn, admission.Submission(play="noop", release="x")
                )
    finally:
        await drop_database(pg_admin_url, name)
