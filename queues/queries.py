"""Named SQL queries, read from ``sql/queries/*.sql`` at import.

Each query starts with a header in the sqlc/procrastinate style::

    -- name: run_claim :many
    -- Start a new attempt on queued runs; fenced by state.
    SELECT ...

The kind after the name says how many rows the query returns (``:one``, ``:many``,
``:exec``). Parameters are named only (``%(name)s``). A duplicate or malformed name fails
at import, so a broken file can never reach a running worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, LiteralString, TypeVar, cast

import psycopg
from psycopg import pq
from psycopg.rows import BaseRowFactory, RowMaker, class_row
from psycopg.types.json import Jsonb

T = TypeVar("T")

_HEADER = re.compile(r"^-- name: (?P<name>[a-z][a-z0-9_]*) :(?P<kind>one|many|exec)\s*$")
_POSITIONAL = re.compile(r"(?<!%)(?:%%)*%s")


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    kind: Literal["one", "many", "exec"]
    purpose: str
    sql: str  # a LiteralString for psycopg: it only ever comes from our files
    source: str


class QueryFileError(ValueError):
    """A malformed query file; raised at import time."""


# What ends plain text: a comment, a line's end, or the opening quote of quoted text.
_TOKEN = re.compile(r"--[^\n]*|\n|'|\"|\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$")


def compact(sql: str, where: str = "query") -> str:
    """The statement as sent: its comments, indentation and blank lines left out; quoted
    text ('...', "...", $tag$...$tag$) kept as written.

    The files are commented for readers; the server and the driver need none of it. psycopg
    caches its parse of a query's text (finding the placeholders) only for texts of up to
    4 KiB, and with their comments the claim and finish statements, sent many times a second
    by every worker, were longer, so each call parsed them again. A string with backslash
    escapes (E'...') is refused: its quotes cannot be told apart here, and no query needs
    one."""
    lines: list[str] = []
    line: list[str] = []
    at = 0
    while (token := _TOKEN.search(sql, at)) is not None:
        start, kind = token.start(), token.group(0)
        line.append(sql[at:start])
        at = token.end()
        if kind == "\n":
            if text := "".join(line).strip():
                lines.append(text)
            line = []
        elif not kind.startswith("--"):  # a comment runs to its line's end: dropped
            escapes = kind == "'" and sql[start - 1 : start] in ("e", "E")
            if escapes and not sql[start - 2 : start - 1].isalnum():
                raise QueryFileError(f"{where}: an E'...' string; write it without escapes")
            end = sql.find(kind, at)
            if end < 0:
                raise QueryFileError(f"{where}: unterminated {kind}")
            at = end + len(kind)
            line.append(sql[start:at])
    line.append(sql[at:])
    if text := "".join(line).strip():
        lines.append(text)
    return "\n".join(lines)


def parse(text: str, source: str) -> list[Query]:
    queries: list[Query] = []
    current: dict[str, str] | None = None
    body: list[str] = []

    def flush() -> None:
        if current is None:
            return
        sql = compact("\n".join(body), f"{source}: query {current['name']!r}")
        if not sql:
            raise QueryFileError(f"{source}: query {current['name']!r} has no SQL")
        if _POSITIONAL.search(sql):
            raise QueryFileError(f"{source}: query {current['name']!r} uses %s; name it")
        queries.append(
            Query(
                name=current["name"],
                kind=cast(Literal["one", "many", "exec"], current["kind"]),
                purpose=current["purpose"],
                sql=sql,
                source=source,
            )
        )

    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("-- name:"):
            match = _HEADER.match(line)
            if match is None:
                raise QueryFileError(f"{source}:{i + 1}: malformed header {line!r}")
            flush()
            purpose_line = lines[i + 1] if i + 1 < len(lines) else ""
            if not purpose_line.startswith("-- ") or purpose_line.startswith("-- name:"):
                raise QueryFileError(
                    f"{source}:{i + 2}: query {match['name']!r} needs a one-line purpose comment"
                )
            current = {
                "name": match["name"],
                "kind": match["kind"],
                "purpose": purpose_line[3:].strip(),
            }
            body = []
            i += 2
            continue
        if current is not None:
            body.append(line)
        elif line.strip() and not line.startswith("--"):
            raise QueryFileError(f"{source}:{i + 1}: SQL before the first '-- name:' header")
        i += 1
    flush()
    return queries


def load() -> dict[str, Query]:
    found: dict[str, Query] = {}
    folder = resources.files("queues.sql") / "queries"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for query in parse(entry.read_text(encoding="utf-8"), f"sql/queries/{entry.name}"):
            if query.name in found:
                raise QueryFileError(
                    f"query {query.name!r} defined twice: {found[query.name].source} "
                    f"and {query.source}"
                )
            found[query.name] = query
    return found


QUERIES = load()


def q(name: str) -> LiteralString:
    """The SQL text of a named query (read from our own files, so literal)."""
    return cast(LiteralString, QUERIES[name].sql)  # type: ignore[redundant-cast]


def own_transaction(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether a statement sent on ``conn`` now is a transaction of its own: the connection
    is autocommit and outside any transaction, so the server commits it as it answers."""
    return bool(conn.autocommit) and conn.info.transaction_status == pq.TransactionStatus.IDLE


def one_statement(conn: psycopg.AsyncConnection[Any]) -> AbstractAsyncContextManager[Any]:
    """Where a write of one statement runs: as its own transaction on an idle autocommit
    connection (one round trip; no BEGIN and COMMIT around it, so a process paused between
    them cannot keep the rows it locked), else in a transaction of the caller's (a
    savepoint there: a failure leaves the caller's transaction usable)."""
    return contextlib.nullcontext() if own_transaction(conn) else conn.transaction()


def json_text(text: str) -> Jsonb:
    """A jsonb parameter from JSON text already encoded and checked (queues.fields.encode):
    sent as it is, not encoded again."""
    return Jsonb(text, dumps=_as_is)


def _as_is(text: str) -> str:
    return text


def fields_row(cls: type[T]) -> BaseRowFactory[T]:
    """psycopg's ``class_row`` for a dataclass, without a mapping per row: when a result's
    columns are the dataclass's fields in their order (checked once per result), each row
    is made from its values by position; otherwise by name, as ``class_row`` makes it (a
    column added or moved costs speed, never a wrong field)."""
    names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    by_name = class_row(cls)

    def factory(cursor: Any) -> RowMaker[T]:
        description = cursor.description
        if description is None or tuple(c.name for c in description) != names:
            return by_name(cursor)

        def by_position(values: Sequence[Any]) -> T:
            return cls(*values)

        return by_position

    return factory
