"""The error tree's database boundary: our custom SQLSTATEs raised by real Postgres map onto
the tree, and other database errors are left alone (needs a server, so not in unit/)."""

from __future__ import annotations

import psycopg
import pytest

from queues.errors import SQLSTATE_ERRORS, translate


def _raise_sqlstate(url: str, sqlstate: str, hint: str | None) -> psycopg.Error:
    using = f"ERRCODE = '{sqlstate}'" + (f", HINT = '{hint}'" if hint else "")
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            conn.execute(
                f"DO $$ BEGIN RAISE EXCEPTION 'boom %', 42 USING {using}; END $$"  # type: ignore[arg-type]
            )
        except psycopg.Error as exc:
            return exc
    raise AssertionError("the DO block did not raise")


@pytest.mark.parametrize("sqlstate", sorted(SQLSTATE_ERRORS))
def test_translate_maps_custom_sqlstates(pg_admin_url: str, sqlstate: str) -> None:
    exc = _raise_sqlstate(pg_admin_url, sqlstate, "do the thing")
    assert exc.diag.sqlstate == sqlstate
    mapped = translate(exc)
    assert type(mapped) is SQLSTATE_ERRORS[sqlstate]
    assert mapped.message == "boom 42"
    assert mapped.fix == "do the thing"


def test_translate_leaves_other_errors_alone(pg_admin_url: str) -> None:
    exc = _raise_sqlstate(pg_admin_url, "22012", None)  # division_by_zero
    assert translate(exc) is None
    # An OperationalError that is not a lost connection (an index row too large) is the
    # database refusing a statement, never "the database is unreachable".
    limit = _raise_sqlstate(pg_admin_url, "54000", None)
    assert isinstance(limit, psycopg.OperationalError)
    assert translate(limit) is None
