"""The dashboard's login secret, sessions and guards, without a server."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from queues.errors import InvalidField
from worker.dashboard import auth


def test_a_development_secret_is_generated_once_and_kept_private(tmp_path: Path) -> None:
    secret, source = auth.resolve_secret(home=tmp_path, env={})
    path = tmp_path / auth.SECRET_FILE
    assert source == str(path) and len(secret) >= auth.MIN_SECRET
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.resolve_secret(home=tmp_path, env={}) == (secret, source)


def test_a_readable_secret_file_is_refused(tmp_path: Path) -> None:
    auth.resolve_secret(home=tmp_path, env={})
    os.chmod(tmp_path / auth.SECRET_FILE, 0o644)
    with pytest.raises(InvalidField, match="not private"):
        auth.resolve_secret(home=tmp_path, env={})


def test_the_variable_wins_and_must_be_long_enough(tmp_path: Path) -> None:
    given = "s" * auth.MIN_SECRET
    assert auth.resolve_secret(home=tmp_path, env={auth.SECRET_VARIABLE: given}) == (
        given,
        auth.SECRET_VARIABLE,
    )
    assert not (tmp_path / auth.SECRET_FILE).exists()
    with pytest.raises(InvalidField) as raised:
        auth.resolve_secret(home=tmp_path, env={auth.SECRET_VARIABLE: "short"})
    assert raised.value.field == auth.SECRET_VARIABLE


def test_production_never_generates_a_secret(tmp_path: Path) -> None:
    with pytest.raises(InvalidField, match="production"):
        auth.resolve_secret(home=tmp_path, env={"WORKER_ENV": "production"})
    assert not (tmp_path / auth.SECRET_FILE).exists()


def test_sessions_are_signed_and_expire() -> None:
    sessions = auth.Sessions("a long enough secret value")
    token, session = sessions.issue("alice")
    read = sessions.read(token)
    assert read is not None and (read.user, read.csrf) == (session.user, session.csrf)
    assert read.actor == "dashboard:alice"
    assert sessions.read(token + "x") is None
    assert auth.Sessions("another secret entirely!!").read(token) is None
    expired, _ = sessions.issue("alice", now=1_000_000.0)
    assert sessions.read(expired) is None
    assert sessions.secret_matches("a long enough secret value")
    assert not sessions.secret_matches("a long enough secret valuE")


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/runs/x?state=failed", "/runs/x?state=failed"),
        ("//evil.test/x", "/runs"),
        ("https://evil.test", "/runs"),
        ("/\\evil.test", "/runs"),
        (None, "/runs"),
    ],
)
def test_login_only_sends_you_to_a_local_page(target: str | None, expected: str) -> None:
    assert auth.safe_next(target) == expected


def test_names_are_short_and_plain() -> None:
    assert auth.check_name(" alice ") == "alice"
    assert auth.check_name("a.b@c-d+e") == "a.b@c-d+e"
    for bad in ("", "-x", "a b", "x" * 65, "<script>"):
        assert auth.check_name(bad) is None


def test_a_session_ends_at_logout_however_well_signed_its_cookie() -> None:
    sessions = auth.Sessions("a long enough secret value")
    token, session = sessions.issue("alice")
    other, _ = sessions.issue("bob")
    read = sessions.read(token)
    assert read is not None and (read.user, read.id) == ("alice", session.id)
    sessions.revoke(session)
    assert sessions.read(token) is None  # the cookie is intact; its session is gone
    assert sessions.read(other) is not None  # bob's is another session
    # Another process (a restarted dashboard) signs with the same key but holds none.
    assert auth.Sessions("a long enough secret value").read(other) is None


def test_the_sessions_held_are_bounded_and_the_oldest_ends_first() -> None:
    sessions = auth.Sessions("a long enough secret value", max_live=3)
    tokens = [sessions.issue(f"u{i}")[0] for i in range(5)]
    assert sessions.live == 3
    assert [sessions.read(t) is not None for t in tokens] == [False, False, True, True, True]


def test_logins_are_throttled_per_client_and_overall_and_a_success_gives_back() -> None:
    now = [0.0]
    throttle = auth.LoginThrottle(
        burst=3, refill_s=10.0, burst_all=5, refill_all_s=2.0, clock=lambda: now[0]
    )
    assert [throttle.take("a") for _ in range(3)] == [None, None, None]
    wait = throttle.take("a")
    assert wait is not None and 9.9 < wait <= 10.0  # one token back in 10 s
    throttle.give_back("a")  # the last attempt succeeded: it does not count
    assert throttle.take("a") is None
    assert throttle.take("b") is None
    everyone = throttle.take("c")  # 5 taken by all clients together, 1 given back
    assert everyone is None
    blocked = throttle.take("d")
    assert blocked is not None and 1.9 < blocked <= 2.0  # the shared bucket is empty
    now[0] += 2.0
    assert throttle.take("d") is None  # one token refilled for everyone
