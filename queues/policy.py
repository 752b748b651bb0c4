"""A lane's policy change, checked once at the edge (the CLI's flags, the dashboard's form).

``worker queues set-policy RELEASE --concurrency 8 --lease-ttl 60s ...`` and the lanes page
of the dashboard both build a :class:`PolicyChange` with :func:`parse`, by the same rules:
every value is refused with its field, the rule and a fix before anything is written. What
needs the lane's current values (the heartbeat must stay below the lease TTL) is checked by
:func:`check_against` under the lane's row lock (:func:`queues.operator.set_policy`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from queues import fields
from queues.errors import InvalidField, did_you_mean


@dataclass(frozen=True, slots=True)
class Rule:
    """How one policy value is written and bounded."""

    flag: str  # the CLI flag; the dashboard's form names its inputs after the column
    kind: str  # int | duration | fraction
    minimum: float
    maximum: float
    zero: bool = False  # a duration may be 0 (no backoff)
    help: str = ""


# Column -> rule. Bounds are generous but finite: a typo (a lease of 60d) is refused.
RULES: dict[str, Rule] = {
    "concurrency": Rule("--concurrency", "int", 1, 10_000, help="runs at once per worker"),
    "lease_ttl_s": Rule("--lease-ttl", "duration", 1.0, 86400.0, help="an attempt's lease"),
    "heartbeat_s": Rule(
        "--heartbeat", "duration", 0.1, 3600.0, help="lease renewal period, below the TTL"
    ),
    "retry_max_attempts": Rule("--max-attempts", "int", 1, 1000, help="failed attempts allowed"),
    "retry_base_s": Rule(
        "--retry-base", "duration", 0.001, 86400.0, zero=True, help="first retry's backoff"
    ),
    "retry_cap_s": Rule(
        "--retry-cap", "duration", 0.001, 7 * 86400.0, zero=True, help="longest backoff"
    ),
    "retry_jitter": Rule("--retry-jitter", "fraction", 0.0, 1.0, help="backoff jitter, 0..1"),
    "max_interruptions": Rule(
        "--max-interruptions", "int", 0, 100_000, help="interruptions before one counts"
    ),
    "retention_s": Rule(
        "--retention", "duration", 60.0, 365 * 86400.0, help="keep finished runs this long"
    ),
    "run_timeout_s": Rule(
        "--run-timeout",
        "duration",
        0.001,
        365 * 86400.0,
        zero=True,
        help="runs' default timeout from their first start (0: none)",
    ),
    "org_concurrency": Rule(
        "--org-concurrency", "int", 0, 10_000, help="running runs per org (0: no cap)"
    ),
}


@dataclass(frozen=True, slots=True)
class PolicyChange:
    """The values to change (None: keep the lane's)."""

    concurrency: int | None = None
    lease_ttl_s: float | None = None
    heartbeat_s: float | None = None
    retry_max_attempts: int | None = None
    retry_base_s: float | None = None
    retry_cap_s: float | None = None
    retry_jitter: float | None = None
    max_interruptions: int | None = None
    retention_s: float | None = None
    run_timeout_s: float | None = None
    org_concurrency: int | None = None

    def changed(self) -> dict[str, Any]:
        """The values given, by column."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _integer(value: object, rule: Rule, field: str) -> int:
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        number = int(value.strip())
    if number is None or not rule.minimum <= number <= rule.maximum:
        raise InvalidField(
            f"{field} is {fields.shown(value)}",
            field=field,
            rule=f"a whole number from {rule.minimum:g} to {rule.maximum:g} ({rule.help})",
            fix=f"pass e.g. {field} {max(int(rule.minimum), 1) * 4}",
        )
    return number


def _fraction(value: object, rule: Rule, field: str) -> float:
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or not rule.minimum <= number <= rule.maximum:
        raise InvalidField(
            f"{field} is {fields.shown(value)}",
            field=field,
            rule=f"a number from {rule.minimum:g} to {rule.maximum:g} ({rule.help})",
            fix=f"pass e.g. {field} 0.1",
        )
    return number


def parse(values: Mapping[str, object], *, names: str = "flag") -> PolicyChange:
    """A checked change from raw values keyed by column (blank or None: unchanged).

    ``names`` says how a refusal names the field: ``"flag"`` (``--lease-ttl``, the CLI) or
    ``"column"`` (``lease_ttl_s``, the dashboard's form). At least one value is required.
    """
    unknown = sorted(set(values) - set(RULES))
    if unknown:
        near = did_you_mean(unknown[0], RULES)
        raise InvalidField(
            f"unknown policy setting {unknown[0]!r}",
            field="policy",
            rule=f"one of {', '.join(RULES)}",
            fix=f"did you mean {near!r}?" if near else "name a setting of the lane's policy",
        )
    parsed: dict[str, Any] = {}
    for column, raw in values.items():
        if _blank(raw):
            continue
        rule = RULES[column]
        field = rule.flag if names == "flag" else column
        if rule.kind == "int":
            parsed[column] = _integer(raw, rule, field)
        elif rule.kind == "fraction":
            parsed[column] = _fraction(raw, rule, field)
        else:
            parsed[column] = fields.duration(
                raw.strip() if isinstance(raw, str) else raw,
                field=field,
                minimum=rule.minimum,
                maximum=rule.maximum,
                zero=rule.zero,
            )
    if not parsed:
        flags = ", ".join(rule.flag for rule in RULES.values())
        raise InvalidField(
            "no policy setting given: nothing to change",
            field="policy",
            rule="at least one setting",
            fix=f"pass one or more of {flags}",
        )
    return PolicyChange(**parsed)


def check_against(
    change: PolicyChange, *, lease_ttl_s: float, heartbeat_s: float, names: str = "flag"
) -> None:
    """The rules that involve the lane's current values: the heartbeat renews the lease
    well before it lapses, so it must stay below the lease TTL."""
    ttl = change.lease_ttl_s if change.lease_ttl_s is not None else lease_ttl_s
    beat = change.heartbeat_s if change.heartbeat_s is not None else heartbeat_s
    if beat >= ttl:
        column = "heartbeat_s" if change.heartbeat_s is not None else "lease_ttl_s"
        field = RULES[column].flag if names == "flag" else column
        raise InvalidField(
            f"the heartbeat ({fields.human_duration(beat)}) would not be below the lease TTL "
            f"({fields.human_duration(ttl)})",
            field=field,
            rule="heartbeat below the lease TTL (renewals must come before the lease lapses)",
            fix=f"raise --lease-ttl above {fields.human_duration(beat)} or lower --heartbeat "
            f"below {fields.human_duration(ttl)} (a third of the TTL is usual)",
        )
