"""Configuration from the environment and the error tree.

Everything here is pure except ``translate``, which needs a real ``psycopg.Error`` carrying
a SQLSTATE: those tests raise one with ``RAISE ... USING ERRCODE`` on the session's server.
"""

from __future__ import annotations

import psycopg
import pytest

from queues import errors
from queues.errors import (
    SQLSTATE_ERRORS,
    DatabaseUnreachable,
    DatabaseUrlInvalid,
    InputError,
    InvalidField,
    WorkerError,
    did_you_mean,
    translate,
)
from worker import config

SHA = "0123456789abcdef0123456789abcdef01234567"

# ---- validate_url ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:5432/worker",
        "postgres://u:p@db.example.com/app?sslmode=require",
        "postgresql:///worker",
        "host=127.0.0.1 port=5432 dbname=worker user=postgres",
        "dbname=worker",
    ],
)
def test_validate_url_accepts_urls_and_conninfo(url: str) -> None:
    assert config.validate_url(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "host=localhost port",  # keyword without =
        "not a url",
        "postgresql://[::1/worker",  # unterminated IPv6 host
        "host='unterminated",
        "nosuchoption=1",
    ],
)
def test_validate_url_rejects_malformed(url: str) -> None:
    with pytest.raises(DatabaseUrlInvalid) as info:
        config.validate_url(url, source="WORKER_DATABASE_URL")
    exc = info.value
    assert exc.exit_code == 2
    assert exc.code == "DATABASE_URL_INVALID"
    assert isinstance(exc, InputError)
    assert exc.field == "WORKER_DATABASE_URL"
    assert "WORKER_DATABASE_URL" in str(exc)
    assert exc.fix


@pytest.mark.parametrize(
    "url", ["mysql://u@h/db", "http://h/db", "sqlite:///tmp/x.db", "postgresql+psycopg://u@h/db"]
)
def test_validate_url_rejects_other_schemes(url: str) -> None:
    with pytest.raises(DatabaseUrlInvalid) as info:
        config.validate_url(url)
    assert info.value.exit_code == 2


def test_validate_url_names_the_rejected_scheme() -> None:
    with pytest.raises(DatabaseUrlInvalid, match="scheme 'mysql'"):
        config.validate_url("mysql://u@h/db")


def test_validate_url_accepts_conninfo_with_scheme_like_value() -> None:
    url = "host=localhost application_name=svc://worker"
    assert config.validate_url(url) == url


def test_validate_url_error_never_shows_the_password() -> None:
    with pytest.raises(DatabaseUrlInvalid) as info:
        config.validate_url("postgresql://u:s3cret@[::1/worker")
    assert "s3cret" not in str(info.value)


# ---- redact -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:s3cret@db.example.com:5433/app", "postgresql://u@db.example.com:5433/app"),
        ("postgres://u:s3cret@h/app?sslmode=require", "postgresql://u@h:5432/app"),
        ("postgresql://u@h/app?password=s3cret", "postgresql://u@h:5432/app"),
        ("host=h port=6000 user=u password=s3cret dbname=d", "postgresql://u@h:6000/d"),
        ("postgresql:///app", "postgresql://localhost:5432/app"),
        ("host=localhost port", "<malformed url>"),
    ],
)
def test_redact_drops_the_password(url: str, expected: str) -> None:
    safe = config.redact(url)
    assert safe == expected
    assert "s3cret" not in safe


def test_unreachable_error_is_redacted() -> None:
    exc = config.unreachable(
        "postgresql://u:s3cret@h:1/d", OSError("connection refused\nsecond line")
    )
    assert isinstance(exc, DatabaseUnreachable)
    assert exc.exit_code == 6
    assert "s3cret" not in str(exc)
    assert "postgresql://u@h:1/d" in str(exc)
    assert "second line" not in str(exc)


# ---- environment -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "dev"),
        ({"WORKER_RELEASE": "v1.2", "VERCEL_GIT_COMMIT_SHA": SHA}, "v1.2"),
        ({"WORKER_RELEASE": " v1.2 "}, "v1.2"),
        ({"VERCEL_GIT_COMMIT_SHA": SHA}, SHA[:12]),
        ({"WORKER_RELEASE": "", "VERCEL_GIT_COMMIT_SHA": SHA}, SHA[:12]),
        ({"VERCEL_GIT_COMMIT_SHA": SHA, "GITHUB_SHA": "f" * 40}, SHA[:12]),
        ({"GITHUB_SHA": "f" * 40}, "f" * 12),
        ({"RENDER_GIT_COMMIT": "abc"}, "abc"),
    ],
)
def test_default_release_order(env: dict[str, str], expected: str) -> None:
    assert config.default_release(env) == expected


def test_default_release_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*config.RELEASE_VARIABLES, *config.COMMIT_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert config.default_release() == "dev"
    monkeypatch.setenv("VERCEL_GIT_COMMIT_SHA", SHA)
    assert config.default_release() == SHA[:12]
    monkeypatch.setenv("WORKER_RELEASE", "blue")
    assert config.default_release() == "blue"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"VERCEL": "1"}, True),
        ({"WORKER_ADMISSION_ONLY": "true"}, True),
        ({"WORKER_ADMISSION_ONLY": "yes"}, True),
        ({"WORKER_ADMISSION_ONLY": "0"}, False),
        ({"WORKER_ADMISSION_ONLY": "false"}, False),
        ({"WORKER_ADMISSION_ONLY": "FALSE"}, False),
        ({"WORKER_ADMISSION_ONLY": " off "}, False),
        # VERCEL is read as the platform sets it and as the production check reads it:
        # any non-blank value (one rule for one variable).
        ({"VERCEL": "0"}, True),
        ({"VERCEL": "false"}, True),
        ({"VERCEL": "  "}, False),
        ({"VERCEL": ""}, False),
        ({"WORKER_ADMISSION_ONLY": "false", "VERCEL": "1"}, True),
    ],
)
def test_admission_only(env: dict[str, str], expected: bool) -> None:
    assert config.admission_only(env) is expected
    if env.get("VERCEL", "").strip():  # the production check reads VERCEL the same way
        assert config.production_reason({"VERCEL": env["VERCEL"]}) is not None


def test_configured_url_prefers_worker_database_url() -> None:
    both = {"WORKER_DATABASE_URL": "dbname=a", "DATABASE_URL": "dbname=b"}
    assert config.configured_url(both) == ("dbname=a", "WORKER_DATABASE_URL")
    assert config.configured_url({"DATABASE_URL": "dbname=b"}) == ("dbname=b", "DATABASE_URL")
    assert config.configured_url({"WORKER_DATABASE_URL": "", "DATABASE_URL": ""}) is None


@pytest.mark.parametrize(
    ("purpose", "variable"),
    [
        (config.Purpose.MIGRATE, "WORKER_MIGRATE_DATABASE_URL"),
        (config.Purpose.ADMISSION, "WORKER_ADMISSION_DATABASE_URL"),
        (config.Purpose.READ, "WORKER_READER_DATABASE_URL"),
    ],
)
def test_each_purpose_has_its_own_url_and_falls_back(
    purpose: config.Purpose, variable: str
) -> None:
    env = {"WORKER_DATABASE_URL": "dbname=shared", variable: "dbname=narrow"}
    assert config.configured_url(env, purpose) == ("dbname=narrow", variable)
    # The worker purpose never takes another purpose's URL...
    assert config.configured_url(env, config.Purpose.WORKER) == (
        "dbname=shared",
        "WORKER_DATABASE_URL",
    )
    # ...and a purpose without its own URL uses the shared one.
    del env[variable]
    assert config.configured_url(env, purpose) == ("dbname=shared", "WORKER_DATABASE_URL")
    assert not config.uses_embedded(None, env)
    assert config.uses_embedded(None, {})
    assert not config.uses_embedded("dbname=x", {})


def test_resolve_url_validates_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKER_DATABASE_URL", raising=False)
    monkeypatch.setenv("DATABASE_URL", "host=localhost port")
    with pytest.raises(DatabaseUrlInvalid, match="DATABASE_URL"):
        config.resolve_url()
    with pytest.raises(DatabaseUrlInvalid, match="--database-url"):
        config.resolve_url("mysql://x")


# ---- the error tree ----------------------------------------------------------------------


def _all_error_classes() -> list[type[WorkerError]]:
    found: list[type[WorkerError]] = []
    todo: list[type[WorkerError]] = [WorkerError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == errors.__name__]


def test_error_codes_are_unique_and_upper_snake() -> None:
    classes = _all_error_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), sorted(codes)
    for code in codes:
        assert code.replace("_", "").isalnum() and code == code.upper(), code


# Refusals of what the caller asked for, outside the InputError branch (they are about a
# run or a lane the caller named): bad input too.
BAD_INPUT_OUTSIDE_INPUT_ERROR = {"RunNotFound", "RunNotRetryable"}


def test_every_error_exits_with_its_row_of_the_exit_code_table() -> None:
    for cls in _all_error_classes():
        if issubclass(cls, InputError) or cls.__name__ in BAD_INPUT_OUTSIDE_INPUT_ERROR:
            expected = errors.ExitCode.BAD_INPUT
        elif issubclass(cls, errors.DatabaseUnreachable):
            expected = errors.ExitCode.DATABASE_UNREACHABLE
        else:
            expected = errors.ExitCode.FAILED
        assert cls.exit_code == expected, cls


def test_render_and_as_dict() -> None:
    exc = InvalidField("bad thing", field="--org", rule="lower case", fix="lower it")
    assert str(exc) == "bad thing (--org: lower case) Fix: lower it"
    assert exc.as_dict() == {
        "code": "FIELD_INVALID",
        "message": "bad thing",
        "field": "--org",
        "rule": "lower case",
        "fix": "lower it",
    }
    assert str(WorkerError("plain")) == "plain"
    refined = InvalidField("x", code="FIELD_TOO_LONG")
    assert refined.code == "FIELD_TOO_LONG" and InvalidField.code == "FIELD_INVALID"


def test_did_you_mean() -> None:
    assert did_you_mean("enrich_compnay", ["enrich_company", "score_lead"]) == "enrich_company"
    assert did_you_mean("zzz", ["enrich_company"]) is None


# ---- translate (real SQLSTATEs) ----------------------------------------------------------


def test_translate_known_codes() -> None:
    assert SQLSTATE_ERRORS["WQ001"] is errors.LaneNotPrepared
    assert SQLSTATE_ERRORS["WQ002"] is errors.LaneReclaimed
    assert SQLSTATE_ERRORS["WQ003"] is errors.IdempotencyConflict
    assert SQLSTATE_ERRORS["WQ007"] is errors.LaneDraining
    assert not {"WQ004", "WQ005", "WQ006"} & set(SQLSTATE_ERRORS)  # retired, never reused
    assert all(code.startswith("WQ") and len(code) == 5 for code in SQLSTATE_ERRORS)


def test_translate_connection_failure_is_unreachable() -> None:
    with pytest.raises(psycopg.OperationalError) as info:
        psycopg.connect("postgresql://postgres@127.0.0.1:1/x", connect_timeout=2)
    mapped = translate(info.value)
    assert isinstance(mapped, DatabaseUnreachable)
    assert mapped.exit_code == 6
