"""What a blip is, and what the absorbing transport does with one (worker.contract): a
repeatable call is sent again until answered or the outage passes its bound; a call that
is not repeatable, or an error that is not a lost connection, goes to the play at once."""

from __future__ import annotations

from typing import Any

import httpx
import psycopg
import pytest
from psycopg import errors as pg
from psycopg_pool import PoolTimeout

from queues import operations
from queues.errors import DatabaseUnreachable, StaleAttempt
from worker import contract
from worker.blips import is_blip
from worker.contract import Absorbing


@pytest.mark.parametrize(
    ("exc", "blip"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (pg.AdminShutdown("terminating connection due to administrator command"), True),
        (pg.CrashShutdown("crash"), True),
        (pg.CannotConnectNow("the database system is starting up"), True),
        (pg.ConnectionFailure("connection failure"), True),
        (pg.SerializationFailure("could not serialize"), True),
        (pg.DeadlockDetected("deadlock"), True),
        (PoolTimeout("no connection"), True),
        (DatabaseUnreachable("the gateway's database is gone"), True),
        (httpx.ConnectError("gateway restarting"), True),
        (httpx.ReadTimeout("no answer"), True),
        # Waits that would meet the same wait again, and refusals: never sent again.
        (pg.QueryCanceled("canceling statement due to statement timeout"), False),
        (pg.LockNotAvailable("lock timeout"), False),
        (pg.UniqueViolation("duplicate key"), False),
        (StaleAttempt("refused"), False),
        (RuntimeError("a bug"), False),
    ],
)
def test_what_a_blip_is(exc: BaseException, blip: bool) -> None:
    assert is_blip(exc) is blip


def test_only_the_emit_is_not_repeatable() -> None:
    assert {a for a in operations.ACTIONS if not operations.repeatable(a)} == {"runtime_event_emit"}
    assert operations.repeatable("no_such_action") is False


class Flaky:
    """A transport that fails with the given errors, in turn, then answers."""

    def __init__(self, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.calls: list[str] = []

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        self.calls.append(action)
        if self.failures:
            raise self.failures.pop(0)
        return {"answered": action}


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract, "ABSORB_FIRST_DELAY_S", 0.001)
    monkeypatch.setattr(contract, "ABSORB_MAX_DELAY_S", 0.002)


async def test_a_repeatable_call_is_sent_again_until_answered() -> None:
    inner = Flaky(pg.AdminShutdown("cut"), psycopg.OperationalError("closed"), PoolTimeout("x"))
    told: list[str] = []
    checks: list[int] = []

    async def check() -> None:
        checks.append(1)

    absorbing = Absorbing(inner, max_outage_s=30, on_absorbed=told.append, before_retry=check)
    answer = await absorbing.call("runtime_receipt_record", {"stepKey": "s", "result": 1})
    assert answer == {"answered": "runtime_receipt_record"}
    assert inner.calls == ["runtime_receipt_record"] * 4
    assert told == ["runtime_receipt_record"]
    assert absorbing.absorbed == {"runtime_receipt_record": 1}
    assert len(checks) == 3  # before each retry


async def test_an_answered_call_is_not_counted() -> None:
    absorbing = Absorbing(Flaky(), max_outage_s=30)
    await absorbing.call("runtime_now", {})
    assert not absorbing.absorbed


async def test_a_call_that_is_not_repeatable_goes_to_the_play_at_once() -> None:
    inner = Flaky(pg.AdminShutdown("cut"))
    with pytest.raises(pg.AdminShutdown):
        await Absorbing(inner, max_outage_s=30).call("runtime_event_emit", {"name": "e"})
    assert inner.calls == ["runtime_event_emit"]


async def test_an_error_that_is_not_a_blip_goes_to_the_play_at_once() -> None:
    inner = Flaky(pg.QueryCanceled("statement timeout"))
    with pytest.raises(pg.QueryCanceled):
        await Absorbing(inner, max_outage_s=30).call("runtime_receipt_record", {})
    assert len(inner.calls) == 1


async def test_an_outage_past_its_bound_ends_the_call() -> None:
    inner = Flaky(*[pg.AdminShutdown("cut")] * 10_000)
    with pytest.raises(pg.AdminShutdown):
        await Absorbing(inner, max_outage_s=0.05).call("runtime_receipt_record", {})
    assert 2 <= len(inner.calls) < 10_000
