"""The gateway's bounds without a server: the body's default limit derived from the field
limits, the body's depth and numbers, a type for every action field, and the servers'
limits read from their variables."""

from __future__ import annotations

import json

import pytest

from queues import fields, operations
from queues.errors import InvalidField
from worker import gateway, serving


def test_the_body_limit_fits_the_largest_legal_step_result() -> None:
    assert operations.MAX_BODY_BYTES == fields.MAX_RESULT_BYTES + operations.ENVELOPE_BYTES
    assert gateway.default_limits().max_body_bytes == operations.MAX_BODY_BYTES
    assert operations.MAX_BODY_DEPTH == fields.MAX_JSON_DEPTH + operations.ENVELOPE_DEPTH


def test_every_field_of_every_action_has_a_type() -> None:
    defined = {name for action in operations.ACTIONS.values() for name in action.fields}
    assert defined == set(operations.FIELD_TYPES)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # far deeper than the parser's own recursion
        b'{"a":' * (operations.MAX_BODY_DEPTH + 1) + b"1" + b"}" * (operations.MAX_BODY_DEPTH + 1),
        b'{"leaseSeconds": NaN}',
        b'{"leaseSeconds": 1e400}',  # out of a float's range: it would read as infinity
        b"\xff\xfe\xfa",
        b"1" * 5000,  # longer than Python reads an integer
        b"",
    ],
)
def test_a_body_that_is_not_bounded_json_is_refused_as_input(raw: bytes) -> None:
    with pytest.raises(InvalidField) as raised:
        operations.decode(raw)
    assert raised.value.http_status == 400 and raised.value.field == "body"


def test_a_value_as_deep_as_the_fields_allow_fits_in_its_envelope() -> None:
    value: object = 1
    for _ in range(fields.MAX_JSON_DEPTH):
        value = [value]
    body = {"actions": [{"action": "a", "input": {"results": [["k", value]]}}]}
    assert operations.decode(json.dumps(body).encode()) == body


def test_from_env_reads_each_limit_and_refuses_nonsense() -> None:
    env = {
        "WORKER_HTTP_REQUEST_TIMEOUT_S": "2.5",
        "WORKER_HTTP_CONNECTIONS_PER_CLIENT": "7",
        "WORKER_HTTP_MAX_CONNECTIONS": "50",
        gateway.BODY_VARIABLE: "4096",
    }
    limits = serving.Limits.from_env(
        max_body_bytes=1 << 20, body_variable=gateway.BODY_VARIABLE, env=env
    )
    assert limits == serving.Limits(
        max_body_bytes=4096,
        request_timeout_s=2.5,
        max_connections_per_client=7,
        max_connections=50,
    )
    assert serving.Limits.from_env(max_body_bytes=10, env={}).request_timeout_s <= 30
    for variable, value in (
        ("WORKER_HTTP_REQUEST_TIMEOUT_S", "0"),
        ("WORKER_HTTP_CONNECTIONS_PER_CLIENT", "many"),
        ("WORKER_HTTP_MAX_CONNECTIONS", "1.5"),
        (gateway.BODY_VARIABLE, "-1"),
    ):
        with pytest.raises(InvalidField) as raised:
            serving.Limits.from_env(
                max_body_bytes=10, body_variable=gateway.BODY_VARIABLE, env={variable: value}
            )
        assert raised.value.field == variable
