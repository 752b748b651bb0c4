"""The named-query loader: every malformed file is refused, every real file loads."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from queues import queries
from queues.queries import QueryFileError, parse

GOOD = """\
-- A file-level comment before the first header is fine.

-- name: thing_get :one
-- One thing by id.
SELECT id, name FROM things WHERE id = %(id)s;

-- name: thing_list :many
-- Every thing, newest first.
SELECT id, name FROM things ORDER BY id DESC LIMIT %(limit)s;

-- name: thing_touch :exec
-- Bump a thing's timestamp; a literal %% is fine.
UPDATE things SET note = '100%%' WHERE id = %(id)s;
"""


def test_parse_good_file() -> None:
    found = parse(GOOD, "good.sql")
    assert [(q.name, q.kind) for q in found] == [
        ("thing_get", "one"),
        ("thing_list", "many"),
        ("thing_touch", "exec"),
    ]
    assert found[0].purpose == "One thing by id."
    assert found[0].sql == "SELECT id, name FROM things WHERE id = %(id)s;"
    assert found[1].sql.endswith("LIMIT %(limit)s;")
    assert all(q.source == "good.sql" for q in found)


@pytest.mark.parametrize(
    "header",
    [
        "-- name: Thing_get :one",  # upper case
        "-- name: thing-get :one",  # dash
        "-- name: thing_get :all",  # unknown kind
        "-- name: thing_get",  # no kind
        "-- name:thing_get :one",  # no space
        "-- name: 1thing :one",  # leading digit
    ],
)
def test_malformed_header_is_refused(header: str) -> None:
    with pytest.raises(QueryFileError, match="malformed header"):
        parse(f"{header}\n-- Purpose.\nSELECT 1;\n", "bad.sql")


def test_missing_purpose_comment_is_refused() -> None:
    with pytest.raises(QueryFileError, match="purpose comment"):
        parse("-- name: thing_get :one\nSELECT 1;\n", "bad.sql")


def test_header_followed_by_header_is_missing_purpose() -> None:
    text = "-- name: a_one :one\n-- name: b_one :one\n-- B.\nSELECT 1;\n"
    with pytest.raises(QueryFileError, match="'a_one' needs a one-line purpose"):
        parse(text, "bad.sql")


def test_header_at_end_of_file_is_missing_purpose() -> None:
    with pytest.raises(QueryFileError, match="purpose comment"):
        parse("-- name: thing_get :one", "bad.sql")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM things WHERE id = %s;",
        "SELECT %(a)s, %s;",
        "UPDATE things SET n = %s WHERE id = %(id)s;",
    ],
)
def test_positional_parameter_is_refused(sql: str) -> None:
    with pytest.raises(QueryFileError, match="uses %s"):
        parse(f"-- name: thing_get :one\n-- Purpose.\n{sql}\n", "bad.sql")


def test_escaped_percent_is_not_positional() -> None:
    (query,) = parse("-- name: pct :one\n-- Purpose.\nSELECT '%%s' AS literal;\n", "ok.sql")
    assert query.sql == "SELECT '%%s' AS literal;"


def test_sql_before_first_header_is_refused() -> None:
    text = "SELECT 1;\n-- name: thing_get :one\n-- Purpose.\nSELECT 2;\n"
    with pytest.raises(QueryFileError, match=r"bad\.sql:1: SQL before the first"):
        parse(text, "bad.sql")


def test_query_without_sql_is_refused() -> None:
    text = "-- name: a_one :one\n-- A.\n\n-- name: b_one :one\n-- B.\nSELECT 1;\n"
    with pytest.raises(QueryFileError, match="'a_one' has no SQL"):
        parse(text, "bad.sql")


def _fake_package(monkeypatch: pytest.MonkeyPatch, root: Path, files: dict[str, str]) -> None:
    folder = root / "queries"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    monkeypatch.setattr(queries, "resources", types.SimpleNamespace(files=lambda _pkg: root))


def test_load_refuses_duplicate_names_across_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    one = "-- name: thing_get :one\n-- First.\nSELECT 1;\n"
    two = "-- name: thing_get :one\n-- Second.\nSELECT 2;\n"
    _fake_package(monkeypatch, tmp_path, {"a.sql": one, "b.sql": two, "notes.txt": "x"})
    with pytest.raises(QueryFileError, match=r"'thing_get' defined twice: .*a\.sql and .*b\.sql"):
        queries.load()


def test_load_refuses_duplicate_names_in_one_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    text = "-- name: thing_get :one\n-- A.\nSELECT 1;\n-- name: thing_get :many\n-- B.\nSELECT 2;\n"
    _fake_package(monkeypatch, tmp_path, {"a.sql": text})
    with pytest.raises(QueryFileError, match="defined twice"):
        queries.load()


def test_load_reads_only_sql_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_package(
        monkeypatch,
        tmp_path,
        {"a.sql": "-- name: thing_get :one\n-- A.\nSELECT 1;\n", "README.md": "SELECT 2;"},
    )
    assert list(queries.load()) == ["thing_get"]


def test_every_real_query_file_loads_with_a_purpose() -> None:
    loaded = queries.load()
    assert loaded, "no queries found in sql/queries"
    assert loaded.keys() == queries.QUERIES.keys()
    sources = {q.source for q in loaded.values()}
    real_files = {
        f"sql/queries/{p.name}"
        for p in (Path(queries.__file__).resolve().parents[1] / "sql" / "queries").glob("*.sql")
    }
    assert sources == real_files  # every file contributes at least one query
    for name, query in loaded.items():
        assert query.name == name
        assert query.kind in {"one", "many", "exec"}
        assert len(query.purpose) >= 5, f"{name} has no real purpose: {query.purpose!r}"
        assert query.sql.strip(), name
        assert queries.q(name) == query.sql


def test_compact_drops_comments_and_indentation_and_keeps_quoted_text() -> None:
    text = (
        "-- name: thing_get :one\n-- Purpose.\n"
        "SELECT 'a -- b''c' AS x,  -- the label\n"
        '       "odd--name",\n'
        "\n"
        "       $body$ -- inside a dollar quote\n  stays $body$ AS y\n"
        "  FROM things  -- trailing\n"
        " WHERE id = %(id)s;\n"
    )
    (query,) = parse(text, "ok.sql")
    assert query.sql == (
        "SELECT 'a -- b''c' AS x,\n"
        '"odd--name",\n'
        "$body$ -- inside a dollar quote\n  stays $body$ AS y\n"
        "FROM things\n"
        "WHERE id = %(id)s;"
    )


@pytest.mark.parametrize(
    ("sql", "match"),
    [
        ("SELECT E'it\\'s';", r"E'\.\.\.' string"),
        ("SELECT 'open;", "unterminated '"),
        ("SELECT $x$ open;", r"unterminated \$x\$"),
    ],
)
def test_compact_refuses_what_it_cannot_read(sql: str, match: str) -> None:
    with pytest.raises(QueryFileError, match=match):
        parse(f"-- name: thing_get :one\n-- Purpose.\n{sql}\n", "bad.sql")


def test_every_query_fits_the_drivers_parse_cache() -> None:
    """psycopg parses a query's placeholders once per text only up to this length; a longer
    statement is parsed again on every call (the claim and the finish run many times a
    second). A query that grows past it should be shortened or split, knowingly."""
    from psycopg import _queries

    longest = max(queries.QUERIES.values(), key=lambda q: len(q.sql.encode()))
    assert len(longest.sql.encode()) <= _queries.MAX_CACHED_STATEMENT_LENGTH, longest.name
