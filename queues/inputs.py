"""Input rows for a submit: CSV or JSONL, streamed, checked before anything is written.

Each row becomes ``(key, row)``: the key is the row's ``key`` or ``id`` field when it has
one, else its line number. The file is read line by line and packed into pages of JSON text
as it goes, so memory stays bounded by the pages (never the parsed file), and the limits
(size, rows, keys) are checked while reading: a file over a limit is refused at the first
row past it. A non-regular file (a device, a pipe, ``/proc``) is refused before any read.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from queues import fields
from queues.errors import InvalidField, PayloadTooLarge

MAX_ROWS = 200_000
MAX_BYTES = 64 * 1024 * 1024
PAGE_SIZE = fields.PAGE_ROWS

Row = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class InputPages:
    """A run's input rows as stored: pages of JSON text (``[[key, row], ...]``), their row
    count, and a digest of the pages (a reused idempotency key with other rows conflicts)."""

    pages: tuple[str, ...]
    count: int
    digest: str | None

    @classmethod
    def of(cls, rows: Iterable[tuple[str, Any]], *, page_size: int = PAGE_SIZE) -> InputPages:
        """Pages of rows already in memory (the Python API)."""
        builder = _Pages(page_size)
        for key, row in rows:
            builder.add(str(key), row)
        return builder.done()


class _Pages:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: list[str] = []
        self.current: list[list[Any]] = []
        self.count = 0
        self.digest = hashlib.sha256()

    def add(self, key: str, row: Any) -> None:
        self.current.append([key, row])
        self.count += 1
        if len(self.current) >= self.page_size:
            self.flush()

    def flush(self) -> None:
        if not self.current:
            return
        page = fields.encode(self.current, field="--input", max_bytes=MAX_BYTES, what="a page")
        self.digest.update(page.encode())
        self.pages.append(page)
        self.current = []

    def done(self) -> InputPages:
        self.flush()
        if not self.count:
            return InputPages((), 0, None)
        return InputPages(tuple(self.pages), self.count, self.digest.hexdigest())


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


def read_pages(path: Path, *, max_rows: int = MAX_ROWS) -> InputPages:
    """Stream an input file into pages; every problem names its line."""
    suffix = path.suffix.lower()
    if suffix not in {".jsonl", ".ndjson", ".csv"}:
        raise InvalidField(
            f"unsupported input type {path.suffix or '(none)'!r}",
            field="--input",
            rule="a .csv or .jsonl file",
            fix="rename or convert the file",
        )
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, after the type check
    except OSError as exc:
        raise InvalidField(
            f"cannot open {path}: {exc.strerror}",
            field="--input",
            rule="a readable file",
            fix="check the path and its permissions",
        ) from exc
    with fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidField(
                f"{path} is not a regular file",
                field="--input",
                rule="a regular file (not a device, a pipe or a directory)",
                fix="write the rows to a file first",
            )
        if info.st_size > MAX_BYTES:
            raise _too_large(path, info.st_size)
        builder = _Pages(PAGE_SIZE)
        seen: dict[str, int] = {}
        rows = _jsonl(path, fh) if suffix in {".jsonl", ".ndjson"} else _csv(path, fh)
        try:
            for key, row in rows:
                index = builder.count + 1
                if index > max_rows:
                    raise PayloadTooLarge(
                        f"{path.name} has more than {max_rows} rows",
                        field="--input",
                        rule=f"at most {max_rows} rows per run",
                        fix="split the input into several runs",
                    )
                fields.text(key, field="--input", max_len=fields.MAX_ROW_KEY, what="a row key")
                if key in seen:
                    raise InvalidField(
                        f"{path.name}: row {index} repeats key {key!r} of row {seen[key]}",
                        field="--input",
                        rule="row keys (the key or id column) are unique",
                        fix="de-duplicate the rows or drop the key column",
                    )
                seen[key] = index
                builder.add(key, row)
        except OSError as exc:  # a file that cannot be read to its end (/proc, a bad disk)
            raise InvalidField(
                f"cannot read {path}: {exc.strerror or exc}",
                field="--input",
                rule="a readable regular file",
                fix="copy the rows to an ordinary file first",
            ) from exc
        pages = builder.done()
    if not pages.count:
        raise InvalidField(
            f"{path.name} holds no rows",
            field="--input",
            rule="at least one row",
            fix="pass a file with rows, or submit without --input",
        )
    return pages


def read_rows(path: Path, *, max_rows: int = MAX_ROWS) -> list[Row]:
    """The rows of a (small) input file in memory; prefer :func:`read_pages` for a submit."""
    pages = read_pages(path, max_rows=max_rows)
    return [(str(key), row) for page in pages.pages for key, row in json.loads(page)]


def _too_large(path: Path, size: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{path.name} is more than {MAX_BYTES} bytes"
        if size < 0
        else f"{path.name} is {size} bytes; the limit is {MAX_BYTES} bytes",
        field="--input",
        rule=f"at most {MAX_BYTES} bytes",
        fix="split the input into several runs",
    )


def _lines(path: Path, fh: IO[bytes]) -> Iterator[tuple[int, str]]:
    """Decoded lines with their numbers, the size limit checked as bytes are read."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    read = 0
    for line_no, raw in enumerate(fh, start=1):
        read += len(raw)
        if read > MAX_BYTES:
            raise _too_large(path, -1)
        try:
            yield line_no, decoder.decode(raw)
        except UnicodeDecodeError as exc:
            raise _refuse(
                path,
                line_no,
                f"not UTF-8 (byte 0x{raw[exc.start]:02x})",
                "re-save the file as UTF-8",
            ) from exc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _jsonl(path: Path, fh: IO[bytes]) -> Iterator[Row]:
    for line_no, line in _lines(path, fh):
        if not line.strip():
            continue
        try:
            value = json.loads(line, parse_constant=_reject_constant)
        except RecursionError:
            raise _refuse(
                path, line_no, "nests too deeply", f"nest at most {fields.MAX_JSON_DEPTH} levels"
            ) from None
        except ValueError as exc:
            raise _refuse(
                path, line_no, f"invalid JSON ({exc})", "fix the line so it holds one JSON object"
            ) from exc
        if not isinstance(value, dict):
            raise _refuse(
                path,
                line_no,
                f"expected a JSON object, got {type(value).__name__}",
                "make each line one JSON object",
            )
        if fields.depth(value) > fields.MAX_JSON_DEPTH:
            raise _refuse(
                path, line_no, "nests too deeply", f"nest at most {fields.MAX_JSON_DEPTH} levels"
            )
        yield _key(value, line_no), value


def _csv(path: Path, fh: IO[bytes]) -> Iterator[Row]:
    lines = _lines(path, fh)
    current = [0]  # the line the reader is at (a record may span lines)

    def records() -> Iterator[str]:
        for line_no, line in lines:
            current[0] = line_no
            yield line

    reader = csv.reader(records(), strict=True)
    try:
        header = next(reader)
    except StopIteration:
        raise _refuse(path, 1, "the file is empty", "add a header row and rows") from None
    except csv.Error as exc:
        raise _refuse(path, 1, f"malformed CSV header: {exc}", "fix the header row") from exc
    if not header or any(not name.strip() for name in header):
        raise _refuse(path, 1, "the header has an empty column name", "name every column")
    doubled = sorted({name for name in header if header.count(name) > 1})
    if doubled:
        raise _refuse(
            path,
            1,
            f"the header repeats column(s) {', '.join(map(repr, doubled))}",
            "give every column its own name",
        )
    while True:
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise _refuse(
                path, current[0], f"malformed CSV: {exc}", "fix the quoting on that line"
            ) from exc
        if not values:
            continue
        if len(values) != len(header):
            raise _refuse(
                path,
                current[0],
                f"{len(values)} fields where the header has {len(header)}",
                "give every row as many fields as the header",
            )
        row = dict(zip(header, values, strict=True))
        yield _key(row, reader.line_num), row
