"""What a worker cannot use of a claimed run's row, decided without a database: the row is
named for what makes it unusable, and JSON the process cannot read is kept as such
instead of failing the claim that met it. And the characters no text field may hold are
one table, the same whatever Unicode version the running Python has."""

from __future__ import annotations

import unicodedata
import uuid
from typing import Any

import pytest

from queues import fields, runs
from queues.errors import InvalidField
from tests.claimed import claimed


def test_a_row_as_admission_writes_it_is_usable() -> None:
    assert runs.unusable(claimed()) is None
    assert runs.unusable(claimed(authority=None, meta={"trace": "x"})) is None
    # `worker queues adopt` moves a run to another release and keeps its authority.
    assert runs.unusable(claimed(release="v2", lane="r-v2")) is None


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"params": [1, 2]}, "params"),
        ({"params": "limit=10"}, "params"),
        ({"params": None}, "params"),
        ({"authority": [1]}, "authority"),
        ({"authority": {"org": "someone-else"}}, "authority names org"),
        ({"authority": {"run": str(uuid.uuid4())}}, "authority names run"),
        ({"authority": {"capabilities": "run.spawn"}}, "capabilities"),
        ({"authority": {"capabilities": [["run.spawn"]]}}, "capabilities"),
        ({"meta": ["note"]}, "meta"),
        ({"org": ""}, "org"),
        ({"play": None}, "play"),
        ({"params": runs.Unreadable("RecursionError: too deep")}, "params cannot be read"),
        ({"wake_payload": runs.Unreadable("ValueError: 5000 digits")}, "wake_payload"),
    ],
)
def test_a_row_no_worker_can_use_is_named_for_why(changes: dict[str, Any], named: str) -> None:
    problem = runs.unusable(claimed(**changes))
    assert problem is not None and named in problem


def test_json_the_process_cannot_read_is_kept_as_unreadable() -> None:
    deep = b"[" * 5000 + b"]" * 5000
    long_integer = b'{"n": 1' + b"0" * 5000 + b"}"
    for text in (deep, long_integer):
        assert isinstance(runs._loads_or_unreadable(text), runs.Unreadable)
    assert runs._loads_or_unreadable(b'{"a": [1]}') == {"a": [1]}


def test_the_control_table_is_unicode_14s_control_and_format_characters() -> None:
    table = {c for low, high in fields.CONTROL_RANGES for c in range(low, high + 1)}
    assert 0x200D not in table  # a joiner holds emoji sequences together: text
    # Categories of assigned characters do not change: whatever the Unicode version,
    # every character of the table is a control or a format character.
    assert all(unicodedata.category(chr(c)) in ("Cc", "Cf") for c in table)
    if unicodedata.unidata_version == "14.0.0":
        unicode = {
            c
            for c in range(0x110000)
            if unicodedata.category(chr(c)) in ("Cc", "Cf") and c != 0x200D
        }
        assert table == unicode
    # What the rules refuse is the table (and lone surrogates), checked in one place.
    for c in (0x1B, 0x7F, 0x200B, 0x202E, 0xE0001):
        with pytest.raises(InvalidField, match="control character"):
            fields.org(f"ac{chr(c)}me")
    assert fields.org("ac\u200dme") == "ac\u200dme"
