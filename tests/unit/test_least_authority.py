"""Least authority for sandboxed plays (no database): the tokens carry the plays a play may
spawn and the rate-limit keys it may take, the receiver refuses any other (403), in-process
claims are not restricted; what a play declares is checked as it registers; the worker's
environment loses its token secret too."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from queues import authority, operations
from queues.errors import CapabilityScope, InvalidField
from worker import config
from worker.plays import MIB, Registry, Resources

SECRET = b"s" * 48
DESCRIPTOR = authority.Descriptor("acme", "parent", uuid.uuid4(), "r1")


def claims(**restricted: Any) -> authority.Claims:
    token = authority.mint_attempt(
        DESCRIPTOR, attempt=1, owner="w", secret=SECRET, **restricted
    ).executor
    return authority.verify(token, secret=SECRET)


def spawn(play: str) -> list[operations.Request]:
    return operations.parse(
        {"action": "runtime_run_spawn", "input": {"stepKey": "s", "play": play}}
    )


def take(key: str) -> list[operations.Request]:
    return operations.parse({"action": "runtime_limit_acquire", "input": {"key": key, "hold": "h"}})


def test_a_restricted_token_names_what_it_may_spawn_and_take() -> None:
    got = claims(may_spawn=["child"], may_limit=["api"])
    assert got.may_spawn == {"child"} and got.may_limit == {"api"}
    nothing = claims(may_spawn=(), may_limit=())
    assert nothing.may_spawn == frozenset() and nothing.may_limit == frozenset()
    unrestricted = claims()
    assert unrestricted.may_spawn is None and unrestricted.may_limit is None


def test_the_receiver_refuses_an_undeclared_play_or_limit_with_403() -> None:
    got = claims(may_spawn=["child"], may_limit=["api"])
    operations.authorize(spawn("child"), got)
    operations.authorize(take("api"), got)
    for requests in (spawn("trusted-play"), take("shared-quota")):
        with pytest.raises(CapabilityScope) as refused:
            operations.authorize(requests, got)
        assert refused.value.http_status == 403
        assert refused.value.message == operations.SCOPE_MESSAGE
    # One refused action refuses its whole batch.
    batch = {
        "actions": [
            {"action": "runtime_limit_acquire", "input": {"key": "api", "hold": "h"}},
            {"action": "runtime_run_spawn", "input": {"stepKey": "s", "play": "other"}},
        ]
    }
    with pytest.raises(CapabilityScope):
        operations.authorize(operations.parse(batch), got)


def test_in_process_claims_are_not_restricted() -> None:
    trusted = authority.claims_of_attempt(DESCRIPTOR, attempt=1, owner="w")
    operations.authorize(spawn("anything"), trusted)
    operations.authorize(take("anything"), trusted)


def test_a_play_declares_its_authority_as_it_registers() -> None:
    registry = Registry()

    @registry.play("boxed", sandboxed=True, may_spawn=["child"], limits=["api"])
    async def boxed(ctx: Any, params: dict[str, Any]) -> None: ...

    @registry.play("bare", sandboxed=True)
    async def bare(ctx: Any, params: dict[str, Any]) -> None: ...

    @registry.play("trusted")
    async def trusted(ctx: Any, params: dict[str, Any]) -> None: ...

    play = registry.plays["boxed"]
    assert play.may_spawn == {"child"} and play.limits == {"api"}
    assert play.resources == Resources()
    assert registry.plays["bare"].may_spawn == frozenset()  # nothing unless declared
    assert registry.plays["trusted"].may_spawn is None  # trusted code: not restricted
    with pytest.raises(InvalidField, match="not sandboxed"):
        registry.play("x", may_spawn=["child"])
    with pytest.raises(InvalidField, match="lists of names"):
        registry.play("x", sandboxed=True, may_spawn="child")
    with pytest.raises(InvalidField):
        registry.play("x", sandboxed=True, limits=["Not A Key"])


def test_resources_read_sizes_and_durations() -> None:
    got = Resources.checked({"memory": "512M", "cpu_s": "10m", "processes": 16, "tmp": "1G"})
    assert got.memory == 512 * MIB and got.cpu_s == 600 and got.processes == 16
    assert got.tmp == 1024 * MIB and got.file_size == Resources().file_size
    assert Resources.checked({"memory": None}).memory is None
    for bad in ({"memory": "12"}, {"memory": "lots"}, {"cpu_s": 0}, {"disk": "1G"}):
        with pytest.raises(InvalidField):
            Resources.checked(bad)


def test_scrub_removes_the_token_secret_as_it_says() -> None:
    env = {
        "WORKER_DATABASE_URL": "postgresql://w:pw@h/d",
        "WORKER_TOKEN_SECRET": "x" * 48,
        "DATABASE_URL": "postgresql://app:pw@h/app",
        "PATH": "/usr/bin",
    }
    removed = config.scrub_worker_urls(env)
    assert removed == ["WORKER_DATABASE_URL", "WORKER_TOKEN_SECRET"]
    assert env == {"DATABASE_URL": "postgresql://app:pw@h/app", "PATH": "/usr/bin"}
