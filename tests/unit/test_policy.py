"""A lane's policy change is checked at the edge, with the field, the rule and a fix."""

from __future__ import annotations

import pytest

from queues import policy
from queues.errors import InvalidField


def test_parse_reads_flags_in_their_units() -> None:
    change = policy.parse(
        {
            "concurrency": "8",
            "lease_ttl_s": "90s",
            "heartbeat_s": "10s",
            "retry_max_attempts": "3",
            "retry_base_s": "0",
            "retry_cap_s": "5m",
            "retry_jitter": "0.25",
            "max_interruptions": "0",
            "retention_s": "7d",
        }
    )
    assert change.changed() == {
        "concurrency": 8,
        "lease_ttl_s": 90.0,
        "heartbeat_s": 10.0,
        "retry_max_attempts": 3,
        "retry_base_s": 0.0,
        "retry_cap_s": 300.0,
        "retry_jitter": 0.25,
        "max_interruptions": 0,
        "retention_s": 7 * 86400.0,
    }


def test_blank_values_are_left_unchanged() -> None:
    change = policy.parse({"concurrency": "4", "lease_ttl_s": "", "retention_s": None})
    assert change.changed() == {"concurrency": 4}


@pytest.mark.parametrize(
    ("column", "value", "flag"),
    [
        ("concurrency", "0", "--concurrency"),
        ("concurrency", "many", "--concurrency"),
        ("concurrency", "2.5", "--concurrency"),
        ("lease_ttl_s", "-5s", "--lease-ttl"),
        ("lease_ttl_s", "nan", "--lease-ttl"),
        ("lease_ttl_s", "60d", "--lease-ttl"),
        ("retry_max_attempts", "0", "--max-attempts"),
        ("retry_jitter", "1.5", "--retry-jitter"),
        ("retry_jitter", "inf", "--retry-jitter"),
        ("retention_s", "10s", "--retention"),
    ],
)
def test_bad_values_name_the_field_the_rule_and_a_fix(column: str, value: str, flag: str) -> None:
    with pytest.raises(InvalidField) as raised:
        policy.parse({column: value})
    assert raised.value.field == flag
    assert raised.value.rule and raised.value.fix
    assert raised.value.exit_code == 2


def test_the_dashboard_names_fields_by_column() -> None:
    with pytest.raises(InvalidField) as raised:
        policy.parse({"lease_ttl_s": "soon"}, names="column")
    assert raised.value.field == "lease_ttl_s"


def test_nothing_to_change_is_refused() -> None:
    with pytest.raises(InvalidField) as raised:
        policy.parse({"concurrency": "", "lease_ttl_s": None})
    assert "--concurrency" in (raised.value.fix or "")


def test_an_unknown_setting_suggests_the_nearest() -> None:
    with pytest.raises(InvalidField) as raised:
        policy.parse({"concurency": "3"})
    assert "concurrency" in (raised.value.fix or "")


def test_the_heartbeat_must_stay_below_the_lease_ttl() -> None:
    policy.check_against(policy.PolicyChange(lease_ttl_s=60.0), lease_ttl_s=30, heartbeat_s=5)
    with pytest.raises(InvalidField) as raised:
        policy.check_against(policy.PolicyChange(lease_ttl_s=4.0), lease_ttl_s=30, heartbeat_s=5)
    assert raised.value.field == "--lease-ttl"
    with pytest.raises(InvalidField) as raised:
        policy.check_against(policy.PolicyChange(heartbeat_s=30.0), lease_ttl_s=30, heartbeat_s=5)
    assert raised.value.field == "--heartbeat"
