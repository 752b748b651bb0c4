"""Field rules, in one place: names, keys, limits and JSON bounds for every entry point.

The CLI, the Python API and the gateway check input with these functions before anything is
written, and each rule lives here once (a second copy is a bug waiting to disagree). Text
fields refuse control characters, NUL and invalid Unicode (lone surrogates); JSON values
are refused when they are not JSON (NaN, objects), nest deeper than :data:`MAX_JSON_DEPTH`,
or are larger than their limit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeAlias

from queues.errors import InvalidField, PayloadTooLarge, did_you_mean

# ---- limits (each used by every entry point) ---------------------------------------------

MAX_ORG = 100
MAX_PLAY = 100
MAX_IDEMPOTENCY_KEY = 200
MAX_EVENT_NAME = 200
MAX_SHEET_NAME = 200
MAX_ROW_KEY = 512  # a sheet row's key, and a step key (a name plus its ordinal suffix)
MAX_STEP_NAME = 200  # a step name or a scope name
MAX_PARAMS_BYTES = 256 * 1024
MAX_PAYLOAD_BYTES = 256 * 1024
MAX_RESULT_BYTES = 64 * 1024 * 1024  # a step's result or error; anything larger is a bug
MAX_JSON_DEPTH = 64
PAGE_ROWS = 1000  # input rows per stored page (what ctx.input_pages() yields)
MAX_PAGE_KEYS = 5000  # keys one write statement takes (bounds its locks and WAL); chunk above

JSON: TypeAlias = bool | int | float | str | Sequence["JSON"] | Mapping[str, "JSON"] | None

MAX_RELEASE = 38  # the lane name (r-<release>) stays a short procrastinate queue name
MAX_AUTHORITY_BYTES = 64 * 1024  # a run's authority: its descriptor, metadata, trace context
# The longest integer a JSON value may hold: Python reads no longer one back (its default
# int_max_str_digits), so a worker could not load a run that carried one.
MAX_JSON_INTEGER_DIGITS = 4300

PLAY_NAME = re.compile(r"[a-z][a-z0-9_.-]*")  # up to MAX_PLAY characters: the text rule
RELEASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

# The characters no text field may hold: the control (Cc) and format (Cf) characters of
# Unicode 14.0, except U+200D ZERO WIDTH JOINER (emoji sequences need it). One table, read
# by these rules and, as a regular expression, by the database's (wq_field_rules(),
# migration 0036), so a Python of another Unicode version refuses exactly the same text.
CONTROL_RANGES: tuple[tuple[int, int], ...] = (
    (0x0, 0x1F), (0x7F, 0x9F), (0xAD, 0xAD), (0x600, 0x605), (0x61C, 0x61C), (0x6DD, 0x6DD),
    (0x70F, 0x70F), (0x890, 0x891), (0x8E2, 0x8E2), (0x180E, 0x180E), (0x200B, 0x200C),
    (0x200E, 0x200F), (0x202A, 0x202E), (0x2060, 0x2064), (0x2066, 0x206F), (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x13438),
    (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F),
)  # fmt: skip
# The first character a text field may not hold: a lone surrogate or one of the above.
_UNPRINTABLE = re.compile(
    r"[\ud800-\udfff" + "".join(rf"\U{low:08x}-\U{high:08x}" for low, high in CONTROL_RANGES) + "]"
)

# The database measures a JSON value by the bytes of the jsonb it stores, not by its compact
# text: it takes up to 6 times the bytes for the same value (12 bytes for a one-digit number
# in an array, 2 as text), so the database's ceiling is this many times the limit of the
# text, and a value these rules accept always fits.
STORED_FACTOR = 6

# A NUL escape that is not itself escaped ("\\u0000" is text, "\u0000" is U+0000): jsonb
# refuses U+0000, so it is refused first with a message that names the field.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# Compact JSON as jsonb stores it (no NaN, UTF-8 as is); one encoder, made once.
_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def text(
    value: object,
    *,
    field: str,
    max_len: int,
    what: str | None = None,
    fix: str | None = None,
) -> str:
    """A non-empty, printable, valid Unicode string of at most ``max_len`` characters."""
    name = what or field
    if not isinstance(value, str) or not value:
        raise InvalidField(
            f"{name} is {shown(value)}",
            field=field,
            rule=f"a non-empty string of at most {max_len} characters",
            fix=fix or f"pass a {name}",
        )
    if len(value) > max_len:
        raise InvalidField(
            f"{name} is {len(value)} characters long",
            field=field,
            rule=f"at most {max_len} characters",
            fix=fix or f"shorten the {name}",
        )
    bad = _bad_character(value)
    if bad is not None:
        raise InvalidField(
            f"{name} contains {bad}",
            field=field,
            rule="printable text: no control characters, no NUL, valid Unicode",
            fix=fix or f"remove it from the {name}",
        )
    return value


def _bad_character(value: str) -> str | None:
    if value.isascii() and value.isprintable():
        return None  # the common case, checked in C: no control character, NUL or surrogate
    found = _UNPRINTABLE.search(value)
    if found is None:
        return None
    index, code = found.start(), ord(found[0])
    if 0xD800 <= code <= 0xDFFF:
        return f"an invalid character (a lone surrogate, U+{code:04X}) at {index}"
    if code == 0:
        return f"a NUL character at {index}"
    return f"a control character (U+{code:04X}) at {index}"


def shown(value: object) -> str:
    """A value as quoted in a message: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def play_name(value: object, *, field: str = "play") -> str:
    name = text(value, field=field, max_len=MAX_PLAY, what="play name")
    if not PLAY_NAME.fullmatch(name):
        raise InvalidField(
            f"invalid play name {shown(name)}",
            field=field,
            rule="lower-case letters, digits, '.', '_' or '-', starting with a letter, "
            f"up to {MAX_PLAY} characters",
            fix="use the name the play was registered with",
        )
    return name


class Release(str):
    """A release name, checked once: ``Release(value)`` refuses a bad name, and every later
    check of a ``Release`` (the lane's name, admission, the CLI) is free."""

    __slots__ = ()

    def __new__(cls, value: object, *, field: str = "release") -> Release:
        if isinstance(value, Release):
            return value
        if not isinstance(value, str) or not value:
            raise InvalidField(
                "the release is empty" if value == "" else f"the release is {shown(value)}",
                field=field,
                rule="a short identifier: letters, digits, '.', '_' or '-'",
                fix="pass --release (e.g. a short git sha or v42) or set WORKER_RELEASE",
            )
        if len(value) > MAX_RELEASE or not RELEASE_NAME.fullmatch(value):
            raise InvalidField(
                f"invalid release name {shown(value)}",
                field=field,
                rule=f"1 to {MAX_RELEASE} characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
                fix="use a short git sha (12 characters) or a version like v42",
            )
        return super().__new__(cls, value)


def org(value: object, *, field: str = "org") -> str:
    return text(value, field=field, max_len=MAX_ORG, what="org", fix="pass a short identifier")


def idempotency_key(value: object, *, field: str = "idempotency_key") -> str | None:
    if value is None:
        return None
    return text(
        value,
        field=field,
        max_len=MAX_IDEMPOTENCY_KEY,
        what="idempotency key",
        fix="use a delivery id or a request id",
    )


def event_name(value: object, *, field: str = "event") -> str:
    return text(
        value,
        field=field,
        max_len=MAX_EVENT_NAME,
        what="event name",
        fix="use a short name such as 'payment-received' or 'order:42:paid'",
    )


# ---- durations ---------------------------------------------------------------------------

_DURATION = re.compile(r"\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)?\s*")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(
    value: object,
    *,
    field: str,
    minimum: float = 0.0,
    maximum: float = 365 * 86400.0,
    zero: bool = False,
) -> float:
    """Seconds from ``60s``, ``5m``, ``1h``, ``500ms``, ``7d`` or a number of seconds.

    Every time flag and setting goes through this one rule: finite, positive (or zero when
    ``zero``), within ``[minimum, maximum]``; ``nan``, ``inf`` and negative values are
    refused with the field named."""
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if match:
            seconds = float(match["n"]) * _UNIT_S[match["unit"] or "s"]
    ok = (
        seconds is not None
        and math.isfinite(seconds)
        and (seconds > 0 or (zero and seconds == 0))
        and (seconds == 0 or minimum <= seconds <= maximum)
    )
    if not ok:
        if minimum:
            bounds = f"{'0, or ' if zero else ''}from {human_duration(minimum)}"
        else:
            bounds = "from 0" if zero else "above 0"
        raise InvalidField(
            f"invalid duration {shown(value)}",
            field=field,
            rule=f"a duration {bounds} to {human_duration(maximum)}: a number with an "
            "optional unit, ms, s (the default), m, h or d",
            fix=f"pass e.g. {field} 60s, {field} 5m or {field} 1h",
        )
    assert seconds is not None
    return seconds


def human_duration(seconds: float) -> str:
    """``90`` -> ``90s``, ``3600`` -> ``1h``, ``604800`` -> ``7d``: how a duration is shown."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


# ---- JSON --------------------------------------------------------------------------------


def depth(value: object, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply ``value`` nests (iteratively: a hostile value cannot overflow the stack);
    stops counting past ``limit``."""
    deepest = 0
    todo: list[tuple[object, int]] = [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list | tuple):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            todo.extend((child, level + 1) for child in children)
    return deepest


def encode(
    value: object,
    *,
    field: str,
    max_bytes: int,
    what: str | None = None,
    fix: str = "convert the value to plain JSON types",
) -> str:
    """``value`` as compact JSON text, within the size and depth limits, storable in jsonb
    (no NaN, no NUL, no lone surrogate); every refusal names the field and the rule."""
    name = what or field
    try:
        encoded = _ENCODER.encode(value)
    except RecursionError as exc:  # far deeper than the limit: the encoder's own bound
        raise _too_deep(name, field, "nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except (TypeError, ValueError) as exc:
        raise InvalidField(
            f"{name} is not JSON: {exc}",
            field=field,
            rule="JSON values only (object, array, string, finite number, bool, null)",
            fix=fix,
        ) from exc
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidField(
            f"{name} contains an invalid character (a lone surrogate)",
            field=field,
            rule="strings must be valid Unicode",
            fix="decode bytes with errors='replace' before sending them",
        ) from exc
    # Each level opens a bracket, so a text with few brackets cannot nest too deep; only
    # one with more (some may sit inside strings) is walked.
    if encoded.count("[") + encoded.count("{") > MAX_JSON_DEPTH and depth(value) > MAX_JSON_DEPTH:
        raise _too_deep(name, field, "nests deeper than {MAX_JSON_DEPTH} levels")
    if _NUL_ESCAPE.search(encoded):
        raise InvalidField(
            f"{name} contains a NUL character",
            field=field,
            rule="Postgres jsonb cannot store U+0000",
            fix="strip or replace NUL characters",
        )
    if size > max_bytes:
        raise PayloadTooLarge(
            f"{name} is {size} bytes of JSON; the limit is {max_bytes}",
            field=field,
            rule=f"at most {max_bytes} bytes of JSON",
            fix="pass large inputs as sheet rows (--input) instead",
        )
    return encoded


def _too_deep(name: str, field: str, problem: str) -> InvalidField:
    return InvalidField(
        f"{name} {problem.format(MAX_JSON_DEPTH=MAX_JSON_DEPTH)}",
        field=field,
        rule=f"JSON nested at most {MAX_JSON_DEPTH} levels deep",
        fix="flatten the value",
    )


def decode(text_value: str, *, field: str, what: str | None = None) -> Any:
    """Parse JSON text from a user (a flag, a file, a body): never a traceback."""
    name = what or field
    try:
        value = json.loads(text_value)
    except RecursionError:
        raise _too_deep(name, field, "nests too deeply to parse") from None
    except json.JSONDecodeError as exc:
        raise InvalidField(
            f"{name} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            field=field,
            rule="JSON",
            fix="fix the JSON (quote keys and strings)",
        ) from exc
    if depth(value) > MAX_JSON_DEPTH:
        raise _too_deep(name, field, "nests deeper than {MAX_JSON_DEPTH} levels")
    return value


# ---- per-run options (admission: Python, CLI, a play's child runs) -------------------------

MAX_ATTEMPTS = 1000  # a run's (or a lane's) maximum of failed attempts
MAX_META_BYTES = 8 * 1024  # a run's metadata: small, shown in `runs show`
MAX_RUN_TIMEOUT_S = 365 * 86400.0
MIN_RUN_TIMEOUT_S = 0.001
PRIORITY_RANGE = (-1_000_000, 1_000_000)
RETRY_KINDS = ("none", "fixed", "exponential")
RETRY_BOUNDS = {  # a retry policy's numbers (the database checks the same bounds)
    "base_s": (0.0, 86400.0),
    "factor": (1.0, 100.0),
    "cap_s": (0.0, 7 * 86400.0),
    "jitter": (0.0, 1.0),
}


def whole_number(
    value: object, *, field: str, minimum: int, maximum: int, what: str = "", example: int = 3
) -> int:
    """An integer within ``[minimum, maximum]`` (a bool is not one; text of digits is)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,12}\s*", value):
        number = int(value)
    if number is None or not minimum <= number <= maximum:
        raise InvalidField(
            f"{what or field} is {shown(value)}",
            field=field,
            rule=f"a whole number from {minimum} to {maximum}",
            fix=f"pass e.g. {field} {example}",
        )
    return number


def max_attempts(value: object, *, field: str = "max_attempts") -> int:
    """A maximum of failed attempts: 1 (no retry) to :data:`MAX_ATTEMPTS`."""
    return whole_number(
        value, field=field, minimum=1, maximum=MAX_ATTEMPTS, what="max attempts", example=3
    )


def priority(value: object, *, field: str = "priority") -> int:
    """A run's priority: higher runs first within its lane."""
    low, high = PRIORITY_RANGE
    return whole_number(value, field=field, minimum=low, maximum=high, example=10)


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


@dataclass(frozen=True, slots=True)
class Retry:
    """A run's retry policy: ``none`` (a failure is final), ``fixed`` (every retry after
    ``base_s``) or ``exponential`` (``base_s * factor^(n-1)``, capped at ``cap_s``); each
    delay moves by up to +-``jitter`` of itself. Written ``none``, ``fixed:30s`` or
    ``exponential:base=2s,factor=2,cap=5m,jitter=0.1`` (:func:`retry` parses it)."""

    kind: str = "exponential"
    base_s: float = 2.0
    factor: float = 2.0
    cap_s: float = 300.0
    jitter: float = 0.1

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "base_s": self.base_s,
            "factor": self.factor,
            "cap_s": self.cap_s,
            "jitter": self.jitter,
        }

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        parts = [f"base={human_duration(self.base_s)}"]
        if self.kind == "exponential":
            parts += [f"factor={self.factor:g}", f"cap={human_duration(self.cap_s)}"]
        parts.append(f"jitter={self.jitter:g}")
        return f"{self.kind}:{','.join(parts)}"


_RETRY_NAMES = {"base": "base_s", "factor": "factor", "cap": "cap_s", "jitter": "jitter"}
_RETRY_RULE = (
    "none, fixed:DURATION or exponential:base=DURATION,factor=N,cap=DURATION,jitter=F "
    "(each part optional; base 0 to 1d, factor 1 to 100, cap up to 7d, jitter 0 to 1)"
)


def retry(value: object, *, field: str = "retry") -> Retry:
    """A retry policy from its text (``--retry``), a mapping of its parts, or a
    :class:`Retry`; every number within its bounds."""
    if isinstance(value, Retry):
        parts: dict[str, Any] = value.as_json()
    elif isinstance(value, Mapping):
        parts = dict(value)
    elif isinstance(value, str) and value.strip():
        kind, _, rest = value.strip().partition(":")
        parts = {"kind": kind.strip().lower()}
        items = [p.strip() for p in rest.split(",") if p.strip()] if rest else []
        for index, item in enumerate(items):
            name, sep, raw = item.partition("=")
            if not sep and index == 0:  # fixed:30s, exponential:2s: the base
                name, raw = "base", item
            column = _RETRY_NAMES.get(name.strip().lower())
            if column is None:
                raise InvalidField(
                    f"{field} has an unknown part {shown(item)}",
                    field=field,
                    rule=_RETRY_RULE,
                    fix=f"pass e.g. {field} exponential:base=2s,factor=2,cap=5m",
                )
            parts[column] = raw.strip()
    else:
        raise InvalidField(
            f"{field} is {shown(value)}",
            field=field,
            rule=_RETRY_RULE,
            fix=f"pass e.g. {field} fixed:30s",
        )
    unknown = sorted(set(parts) - {"kind", *_RETRY_NAMES.values()})
    kind = parts.get("kind", "exponential")
    if unknown or kind not in RETRY_KINDS:
        near = did_you_mean(str(kind), RETRY_KINDS) if kind not in RETRY_KINDS else None
        problem = f"has unknown parts {', '.join(unknown)}" if unknown else f"kind is {shown(kind)}"
        raise InvalidField(
            f"{field} {problem}" + (f"; did you mean {near!r}?" if near else ""),
            field=field,
            rule=_RETRY_RULE,
            fix=f"pass e.g. {field} exponential:base=2s,factor=2,cap=5m",
        )
    if kind == "none":
        return Retry(kind="none", base_s=0.0, factor=1.0, cap_s=0.0, jitter=0.0)
    numbers: dict[str, float] = {}
    for column, (low, high) in RETRY_BOUNDS.items():
        if column not in parts:
            continue
        raw = parts[column]
        if column in ("base_s", "cap_s") and isinstance(raw, str):
            number: float | None = duration(raw, field=f"{field} {column[:-2]}", zero=True)
        else:
            number = _number(raw)
        if number is None or not math.isfinite(number) or not low <= number <= high:
            raise InvalidField(
                f"{field} {column} is {shown(raw)}",
                field=field,
                rule=_RETRY_RULE,
                fix=f"pass a {column} from {low:g} to {high:g}",
            )
        numbers[column] = number
    default = Retry(kind=kind)
    base = numbers.get("base_s", default.base_s)
    cap = numbers.get("cap_s", max(default.cap_s, base))
    if kind == "fixed":
        cap = base
    if cap < base:
        raise InvalidField(
            f"{field} cap ({human_duration(cap)}) is below its base ({human_duration(base)})",
            field=field,
            rule="cap at least base",
            fix="raise cap or lower base",
        )
    return Retry(
        kind=kind,
        base_s=base,
        factor=numbers.get("factor", default.factor if kind == "exponential" else 1.0),
        cap_s=cap,
        jitter=numbers.get("jitter", default.jitter),
    )


def run_timeout(value: object, *, field: str = "timeout") -> float:
    """A run's timeout in seconds (a number, a duration text, or a ``timedelta``), counted
    from its first start over every attempt, sleep and wait."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    return duration(value, field=field, minimum=MIN_RUN_TIMEOUT_S, maximum=MAX_RUN_TIMEOUT_S)


def start_by(value: object, *, field: str = "start_by", now: datetime | None = None) -> datetime:
    """A claim deadline: a timezone-aware datetime, an ISO 8601 time with its offset, or a
    duration from ``now`` (``10m``, a ``timedelta``, seconds)."""
    moment: datetime | None = None
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str) and not _DURATION.fullmatch(value):
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            moment = None
    else:
        after = run_timeout(value, field=field) if value is not None else None
        if after is not None:
            moment = (now or datetime.now(UTC)) + timedelta(seconds=after)
    if moment is None or moment.tzinfo is None:
        raise InvalidField(
            f"{field} is {shown(value)}",
            field=field,
            rule="a time with its offset (2030-01-01T09:00:00+00:00) or a duration from now "
            "(10m, 2h)",
            fix=f"pass e.g. {field} 10m",
        )
    return moment


def meta(value: object, *, field: str = "meta") -> dict[str, Any]:
    """A run's metadata: a JSON object of at most :data:`MAX_META_BYTES`."""
    if not isinstance(value, Mapping):
        raise InvalidField(
            f"{field} must be a JSON object, got {type(value).__name__}",
            field=field,
            rule='a small JSON object such as {"trace": "abc"}',
            fix="wrap the value in an object",
        )
    encode(value, field=field, max_bytes=MAX_META_BYTES, fix="keep metadata small: ids, not data")
    return dict(value)


def stored_ceiling(max_bytes: int) -> int:
    """The database's ceiling on the jsonb it stores for a value of at most ``max_bytes`` of
    compact JSON text (:data:`STORED_FACTOR`)."""
    return max_bytes * STORED_FACTOR


def sql_control_class() -> str:
    """:data:`CONTROL_RANGES` as a Postgres regular expression: a bracket of ``\\u`` escapes
    (a Postgres text cannot hold NUL, so it starts at U+0001)."""

    def escape(code: int) -> str:
        return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"

    parts = []
    for first, high in CONTROL_RANGES:
        low = max(first, 1)
        parts.append(escape(low) if low == high else f"{escape(low)}-{escape(high)}")
    return "[" + "".join(parts) + "]"


# ---- rate limits and schedules ---------------------------------------------------------------

LIMIT_KEY = re.compile(r"[a-z0-9][a-z0-9_.:-]{0,99}")
SCHEDULE_NAME = LIMIT_KEY
_RATE = re.compile(r"\s*(?P<n>\d+(?:\.\d+)?)\s*/\s*(?P<unit>ms|s|m|h|d)\s*")
MAX_RATE_PER_S = 1_000_000.0


def limit_key(value: object, *, field: str = "KEY") -> str:
    key = text(value, field=field, max_len=100, what="limit key")
    if not LIMIT_KEY.fullmatch(key):
        raise InvalidField(
            f"invalid limit key {shown(key)}",
            field=field,
            rule="lower-case letters, digits, '.', '_', ':' or '-', starting with a letter or "
            "digit, up to 100 characters",
            fix="use a name such as clearbit or plan:pro",
        )
    return key


def rate(value: object, *, field: str = "--rate") -> tuple[float, str]:
    """A rate as (permits per second, its text): ``10/s``, ``600/m``, ``5/h``, ``100/d``."""
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    per_s = None
    if match:
        per_s = float(match["n"]) / _UNIT_S[match["unit"]]
    if per_s is None or not math.isfinite(per_s) or not 0 < per_s <= MAX_RATE_PER_S:
        raise InvalidField(
            f"invalid rate {shown(value)}",
            field=field,
            rule="COUNT/UNIT with a unit of s, m, h or d (10/s, 600/m), above 0",
            fix=f"pass e.g. {field} 10/s",
        )
    assert match is not None
    return per_s, f"{match['n']}/{match['unit']}"


def schedule_name(value: object, *, field: str = "NAME") -> str:
    name = text(value, field=field, max_len=100, what="schedule name")
    if not SCHEDULE_NAME.fullmatch(name):
        raise InvalidField(
            f"invalid schedule name {shown(name)}",
            field=field,
            rule="lower-case letters, digits, '.', '_', ':' or '-', starting with a letter or "
            "digit, up to 100 characters",
            fix="use a name such as hourly-digest",
        )
    return name


def cron(value: object, *, field: str = "--cron") -> str:
    """A cron expression in UTC: 5 fields (minute hour day month weekday), or 6 with the
    seconds first (``*/10 * * * * *``: every ten seconds)."""
    from croniter import croniter  # a dependency of procrastinate's periodic tasks too

    expr = text(value, field=field, max_len=200, what="cron expression").strip()
    count = len(expr.split())
    ok = count in (5, 6) and croniter.is_valid(expr, second_at_beginning=count == 6)
    if not ok:
        raise InvalidField(
            f"invalid cron expression {shown(expr)}",
            field=field,
            rule="5 fields (minute hour day month weekday, UTC), or 6 with the seconds first",
            fix=f"pass e.g. {field} '0 * * * *' (hourly)",
        )
    return expr


def every(value: object, *, field: str = "--every") -> float:
    """A schedule's fixed interval: 1 s to 1 year; ticks fall on multiples of it (UTC)."""
    return duration(value, field=field, minimum=1.0, maximum=365 * 86400.0)
