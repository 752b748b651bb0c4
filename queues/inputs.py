"""Input rows for a submit: CSV or JSONL, checked before anything is written.

Each row becomes ``(key, row)``: the key is the row's ``key`` or ``id`` field when it has
one, else its line number. A malformed or wrongly encoded file is refused with the line.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from queues.errors import InvalidField, PayloadTooLarge

MAX_ROWS = 200_000
MAX_BYTES = 64 * 1024 * 1024
PAGE_SIZE = 1000

Row = tuple[str, dict[str, Any]]


def _refuse(path: Path, line: int, problem: str, fix: str) -> InvalidField:
    return InvalidField(
        f"{path.name}, line {line}: {problem}",
        field="--input",
        rule="UTF-8 CSV with a header row, or JSON Lines with one object per line",
        fix=fix,
    )


def _key(row: dict[str, Any], line: int) -> str:
    for name in ("key", "id"):
        value = row.get(name)
        if value not in (None, ""):
            return str(value)
    return str(line)


def read_rows(path: Path) -> list[Row]:
    """Parse a whole input file; every problem names its line."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise PayloadTooLarge(
            f"{path.name} is {size} bytes; the limit is {MAX_BYTES} bytes",
            field="--input",
            rule=f"at most {MAX_BYTES} bytes",
            fix="split the input into several runs",
        )
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _refuse(
            path, line, f"not UTF-8 (byte 0x{raw[exc.start]:02x})", "re-save the file as UTF-8"
        ) from exc
    suffix = path.suffix.lower()
    if suffix in {".jsonl", ".ndjson"}:
        rows = list(_jsonl(path, text))
    elif suffix == ".csv":
        rows = list(_csv(path, text))
    else:
        raise InvalidField(
            f"unsupported input type {path.suffix or '(none)'!r}",
            field="--input",
            rule="a .csv or .jsonl file",
            fix="rename or convert the file",
        )
    if len(rows) > MAX_ROWS:
        raise PayloadTooLarge(
            f"{path.name} has {len(rows)} rows; the limit is {MAX_ROWS}",
            field="--input",
            rule=f"at most {MAX_ROWS} rows per run",
            fix="split the input into several runs",
        )
    seen: dict[str, int] = {}
    for index, (key, _row) in enumerate(rows, start=1):
        if key in seen:
            raise InvalidField(
                f"{path.name}: row {index} repeats key {key!r} of row {seen[key]}",
                field="--input",
                rule="row keys (the key or id column) are unique",
                fix="de-duplicate the rows or drop the key column",
            )
        seen[key] = index
    return rows


def _jsonl(path: Path, text: str) -> Iterator[Row]:
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _refuse(
                path,
                line_no,
                f"invalid JSON ({exc.msg} at column {exc.colno})",
                "fix the line so it holds one JSON object",
            ) from exc
        if not isinstance(value, dict):
            raise _refuse(
                path,
                line_no,
                f"expected a JSON object, got {type(value).__name__}",
                "make each line one JSON object",
            )
        yield _key(value, line_no), value


def _csv(path: Path, text: str) -> Iterator[Row]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise _refuse(path, 1, f"malformed CSV header: {exc}", "fix the header row") from exc
    if not header or any(not name.strip() for name in header):
        raise _refuse(path, 1, "the header has an empty column name", "name every column")
    while True:
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise _refuse(
                path, reader.line_num, f"malformed CSV: {exc}", "fix the quoting on that line"
            ) from exc
        if not values:
            continue
        if len(values) != len(header):
            raise _refuse(
                path,
                reader.line_num,
                f"{len(values)} fields where the header has {len(header)}",
                "give every row as many fields as the header",
            )
        row = dict(zip(header, values, strict=True))
        yield _key(row, reader.line_num), row


def pages(rows: list[Row], size: int = PAGE_SIZE) -> list[list[Row]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]
