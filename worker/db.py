"""Connections for the process layer: one place that turns a failed connect into an error."""

from __future__ import annotations

import psycopg
from psycopg.rows import TupleRow

from worker.config import unreachable

CONNECT_TIMEOUT_S = 5


async def connect(url: str, *, autocommit: bool = False) -> psycopg.AsyncConnection[TupleRow]:
    try:
        return await psycopg.AsyncConnection.connect(
            url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_S
        )
    except psycopg.OperationalError as exc:
        raise unreachable(url, exc) from exc
