"""What a batch admission encodes per run, checked against the one-run rules it shortcuts."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from queues import fields
from queues.authority import EXECUTOR_CAPABILITIES, Descriptor
from queues.errors import InvalidField


def test_stored_texts_are_what_each_run_stores_alone() -> None:
    """Per run: the submitter's metadata, then the descriptor over it (its "run" wins over
    one in the metadata), whatever mix of orgs, plays and releases the batch holds."""
    extra: dict[str, Any] = {
        "run": "not-this-one",
        "trace": {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
        "who": 'quote " backslash \\ brace } comma , é',
    }
    triples = [
        ("acme", "enrich", "r1"),
        ("acme", "enrich", "r1"),
        ("globex", "enrich", "r1"),
        ("acme", "sync-crm", "r2"),
    ]
    ids = [uuid.uuid4() for _ in triples]
    texts = Descriptor.stored_texts(triples, ids, extra)
    for (org, play, release), run_id, text in zip(triples, ids, texts, strict=True):
        alone = extra | Descriptor(org, play, run_id, release).as_json()
        assert json.loads(text) == alone
        assert Descriptor.from_json(run_id, json.loads(text)) == Descriptor(
            org, play, run_id, release, EXECUTOR_CAPABILITIES
        )
    assert Descriptor.stored_texts([], [], extra) == []
    with pytest.raises(ValueError):  # an id per run, never a silent truncation
        Descriptor.stored_texts(triples, ids[:2], extra)


@pytest.mark.parametrize(
    "value",
    [
        {"x": "[" * 500 + "{" * 500},  # brackets inside a string are not nesting
        {"a": [[[]]], "b": [{}] * 200},  # many brackets, shallow
        json.loads("[" * fields.MAX_JSON_DEPTH + "]" * fields.MAX_JSON_DEPTH),
    ],
    ids=["brackets-in-strings", "wide", "at-the-limit"],
)
def test_encode_takes_shallow_values_whatever_their_brackets(value: Any) -> None:
    assert json.loads(fields.encode(value, field="params", max_bytes=1 << 20)) == value


@pytest.mark.parametrize("levels", [fields.MAX_JSON_DEPTH + 1, 300, 100_000])
def test_encode_refuses_values_nested_past_the_limit(levels: int) -> None:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    with pytest.raises(InvalidField) as refused:
        fields.encode(value, field="params", max_bytes=1 << 30)
    assert refused.value.field == "params"
    assert f"nests deeper than {fields.MAX_JSON_DEPTH} levels" in str(refused.value)


def test_encode_refuses_a_cycle_as_not_json() -> None:
    value: dict[str, Any] = {}
    value["self"] = value
    with pytest.raises(InvalidField) as refused:
        fields.encode(value, field="params", max_bytes=1 << 20)
    assert "not JSON" in str(refused.value)
