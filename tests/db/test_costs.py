"""Costs and budgets (queues/costs.py, sql/queries/costs.sql) in one rolled-back
transaction, time controlled through ``now``: charges recorded with their receipts only,
the database's own checks of amounts and names, reservations under the budgets' locks,
spending by period, a dead attempt's reservation, pauses and the wake of a budget write."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from queues import admission, costs, outcomes, receipts, recovery, runs
from queues.errors import InvalidField, StaleAttempt, translate
from queues.queries import q
from queues.receipts import ClaimOutcome, Scope, StepRef
from tests import attempts

Conn = psycopg.AsyncConnection[Any]
C = costs.Charge.checked


def ref(a: attempts.Attempt, key: str, scope: Scope | None = None) -> StepRef:
    return StepRef(attempts.ORG, attempts.PLAY, scope or Scope.of_run(a.run_id), key, a.fence)


async def charge_rows(conn: Conn, run_id: Any) -> list[tuple[Any, ...]]:
    cur = await conn.execute(
        "SELECT attempt, step_key, outcome, unit, provider, amount FROM wq_charges"
        " WHERE run_id = %s ORDER BY step_key, outcome, unit, provider",
        (run_id,),
    )
    return await cur.fetchall()


async def budget(conn: Conn, **where: Any) -> costs.Budget:
    (found,) = await costs.list_budgets(conn, **where)
    return found


# ---- charges go with their receipt, once ------------------------------------------------------


async def test_a_step_is_charged_with_its_receipt_and_never_again(conn: Conn) -> None:
    a = await attempts.start(conn)
    spent = [C(1, provider="clearbit"), C("0.5", provider="clearbit"), C(2, "usd", "openai")]
    done = await receipts.record(conn, ref(a, "lookup"), result={"ok": 1}, charges=spent)
    assert done.outcome == ClaimOutcome.EXECUTE
    expected = [
        (1, "lookup", "completed", "credits", "clearbit", Decimal("1.5")),
        (1, "lookup", "completed", "usd", "openai", Decimal(2)),
    ]
    assert await charge_rows(conn, a.run_id) == expected
    # Sent again (an answer lost), replayed, or in a page: the receipt is settled, no charge.
    again = await receipts.record(conn, ref(a, "lookup"), result={"ok": 1}, charges=spent)
    assert again.outcome == ClaimOutcome.REPLAY
    page = await receipts.complete_many(
        conn,
        org=attempts.ORG,
        play=attempts.PLAY,
        scope=Scope.of_run(a.run_id),
        fence=a.fence,
        results=[("lookup", {"ok": 1})],
        charges={"lookup": [C(9)]},
    )
    assert page.already == ["lookup"]
    assert await charge_rows(conn, a.run_id) == expected


async def test_a_page_charges_only_the_rows_it_completes(conn: Conn) -> None:
    a = await attempts.start(conn)
    scope = Scope.of_run(a.run_id)
    common = {"org": attempts.ORG, "play": attempts.PLAY, "scope": scope, "fence": a.fence}
    await receipts.complete_many(conn, **common, results=[("row:1", 1)], charges={"row:1": [C(1)]})
    page = await receipts.complete_many(
        conn,
        **common,
        results=[("row:1", 1), ("row:2", 2), ("row:3", 3)],
        charges={"row:1": [C(1)], "row:2": [C(1), C(1)]},
    )
    assert page.completed == ["row:2", "row:3"] and page.already == ["row:1"]
    assert [(r[1], r[5]) for r in await charge_rows(conn, a.run_id)] == [
        ("row:1", 1),
        ("row:2", 2),
    ]
    with pytest.raises(InvalidField, match="not in the page"):
        await receipts.complete_many(
            conn, **common, results=[("row:4", 4)], charges={"row:5": [C(1)]}
        )


async def test_a_failed_step_is_charged_with_its_failure(conn: Conn) -> None:
    a = await attempts.start(conn)
    step = ref(a, "call", Scope.named("shared"))
    assert (await receipts.claim(conn, step, lease_s=60)).outcome == ClaimOutcome.EXECUTE
    await receipts.fail(conn, step, error={"type": "Timeout"}, charges=[C(3, provider="api")])
    await receipts.fail(conn, step, error={"type": "Timeout"}, charges=[C(3, provider="api")])
    assert [(r[2], r[5]) for r in await charge_rows(conn, a.run_id)] == [("failed", 3)]


async def test_a_stale_attempts_charge_is_refused_with_its_write(conn: Conn) -> None:
    a = await attempts.start(conn)
    await costs.set_budget(conn, org=attempts.ORG, limit=100)
    b = await attempts.supersede(conn, a)
    with pytest.raises(StaleAttempt):
        await receipts.record(conn, ref(a, "late"), result=1, charges=[C(5)])
    assert await charge_rows(conn, a.run_id) == []
    assert (await budget(conn, org=attempts.ORG)).spent == 0
    await receipts.record(conn, ref(b, "late"), result=1, charges=[C(5)])
    assert [(r[0], r[5]) for r in await charge_rows(conn, a.run_id)] == [(2, 5)]
    assert (await budget(conn, org=attempts.ORG)).spent == 5


# ---- the database checks what it stores ------------------------------------------------------


def _page_params(a: attempts.Attempt, **charges: Any) -> dict[str, Any]:
    return {
        "org": attempts.ORG,
        "play": attempts.PLAY,
        "scope": str(Scope.of_run(a.run_id)),
        "keys": ["k"],
        "results": ["1"],
        "now": None,
        "charge_keys": ["k"],
        "charge_units": ["credits"],
        "charge_providers": [""],
        "charge_amounts": [Decimal(1)],
        **charges,
        **a.fence.params(),
    }


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"charge_amounts": [Decimal(-1)]}, "charges.amount"),
        ({"charge_amounts": [Decimal("NaN")]}, "charges.amount"),
        ({"charge_amounts": [Decimal("Infinity")]}, "charges.amount"),
        ({"charge_amounts": [Decimal(10) ** 13]}, "charges.amount"),
        ({"charge_units": ["Credits"]}, "charges.unit"),
        ({"charge_units": [""]}, "charges.unit"),
        ({"charge_providers": ["no spaces"]}, "charges.provider"),
        ({"charge_amounts": [Decimal(1), Decimal(2)]}, "charges"),
    ],
)
async def test_the_database_refuses_bad_charges_itself(
    conn: Conn, changes: dict[str, Any], field: str
) -> None:
    a = await attempts.start(conn)
    with pytest.raises(psycopg.Error) as raised:
        async with conn.transaction():
            await conn.execute(q("receipt_complete_many"), _page_params(a, **changes))
    assert raised.value.sqlstate == "WQ010"
    mapped = translate(raised.value)
    assert isinstance(mapped, InvalidField) and mapped.field == field
    # Nothing was written: the receipt is not there, nor a charge.
    assert (
        await receipts.lookup_many(
            conn, org=attempts.ORG, play=attempts.PLAY, scope=Scope.of_run(a.run_id), keys=["k"]
        )
        == {}
    )
    assert await charge_rows(conn, a.run_id) == []


async def test_the_database_refuses_a_bad_estimate_and_a_bad_budget(conn: Conn) -> None:
    a = await attempts.start(conn)
    params = {
        "scope": "s",
        "keys": ["k"],
        "units": ["credits"],
        "amounts": [Decimal(-2)],
        "now": None,
        **a.fence.params(),
    }
    with pytest.raises(psycopg.Error) as raised:
        async with conn.transaction():
            await conn.execute(q("budget_reserve"), params)
    assert raised.value.sqlstate == "WQ010"
    with pytest.raises(psycopg.errors.CheckViolation):
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO wq_budgets (org, unit, period, limit_amount)"
                " VALUES ('o', 'credits', 'none', 'NaN')"
            )
    with pytest.raises(psycopg.errors.CheckViolation):
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO wq_charges (run_id, attempt, org, play, scope, step_key, outcome,"
                " unit, amount) VALUES (gen_random_uuid(), 1, 'o', 'p', 's', 'k', 'completed',"
                " 'credits', -1)"
            )


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: costs.Charge.checked(float("nan")), "amount"),
        (lambda: costs.Charge.checked(-1), "amount"),
        (lambda: costs.Charge.checked(True), "amount"),
        (lambda: costs.Charge.checked(1, "USD"), "unit"),
        (lambda: costs.Charge.checked(1, provider="a b"), "provider"),
        (lambda: costs.estimate_of({"credits": float("inf")}), "cost.amount"),
        (lambda: costs.RunBudget.checked({"limit": 5, "period": "week"}), "budget.period"),
    ],
)
def test_python_refuses_bad_amounts_and_names(call: Any, field: str) -> None:
    with pytest.raises(InvalidField) as raised:
        call()
    assert raised.value.field == field


# ---- reservations under the budgets' locks --------------------------------------------------


async def reserve(
    conn: Conn, a: attempts.Attempt, keys: list[str], each: float, **kw: Any
) -> costs.Reservation:
    return await costs.reserve(
        conn,
        fence=a.fence,
        scope=str(Scope.of_run(a.run_id)),
        keys=keys,
        estimate=costs.estimate_of(each),
        **kw,
    )


async def test_a_reservation_grants_what_fits_and_charges_replace_it(conn: Conn) -> None:
    a = await attempts.start(conn)
    assert (await reserve(conn, a, ["a"], 1)).budgets == 0  # no budget: nothing to check
    await costs.set_budget(conn, org=attempts.ORG, limit=10)
    got = await reserve(conn, a, ["k1", "k2", "k3", "k4"], 3)
    assert (got.granted, got.budgets) == (3, 1)
    assert got.exhausted  # a fourth key would not fit in what is left, reservations aside
    shown = await budget(conn, org=attempts.ORG)
    assert (shown.spent, shown.reserved, shown.remaining) == (0, 9, 1)
    # Sent again (its answer lost): the same keys, not twice the estimate.
    assert (await reserve(conn, a, ["k1", "k2", "k3", "k4"], 3)).granted == 3
    assert (await budget(conn, org=attempts.ORG)).reserved == 9
    await receipts.record(conn, ref(a, "k1"), result=1, charges=[C(2)])
    shown = await budget(conn, org=attempts.ORG)
    assert (shown.spent, shown.reserved) == (2, 6)
    # One at 0 fits while anything is left; what is left fits one more key at 2.
    assert (await reserve(conn, a, ["k7"], 0)).granted == 1
    assert (await reserve(conn, a, ["k5", "k6"], 2)).granted == 1
    assert (await reserve(conn, a, ["k6"], 0)).granted == 0  # nothing left
    await receipts.complete_many(
        conn,
        org=attempts.ORG,
        play=attempts.PLAY,
        scope=Scope.of_run(a.run_id),
        fence=a.fence,
        results=[("k2", 1), ("k3", 1), ("k5", 1), ("k7", 1)],
        charges={"k2": [C(3)], "k3": [C(3)], "k5": [C(2)]},
    )
    shown = await budget(conn, org=attempts.ORG)
    assert (shown.spent, shown.reserved, shown.exhausted) == (10, 0, True)
    spent = await reserve(conn, a, ["k8"], 0)
    assert (spent.granted, spent.exhausted, spent.wake_at) == (0, True, None)


async def test_a_refusal_by_reservations_in_flight_is_not_exhaustion(conn: Conn) -> None:
    one = await attempts.start(conn, worker="w1")
    two = await attempts.start(conn, worker="w2")
    await costs.set_budget(conn, org=attempts.ORG, play=attempts.PLAY, limit=10)
    assert (await reserve(conn, one, ["big"], 10)).granted == 1
    waiting = await reserve(conn, two, ["small"], 1)
    assert (waiting.granted, waiting.exhausted) == (0, False)
    await receipts.record(conn, ref(one, "big"), result=1, charges=[C(4)])
    assert (await reserve(conn, two, ["small"], 1)).granted == 1
    # Another play of the org is not counted against this play's budget.
    other = await attempts.start(conn, worker="w3", play="other")
    assert (await reserve(conn, other, ["x"], 100)).budgets == 0


async def test_a_budget_of_a_period_counts_from_0_in_the_next(conn: Conn) -> None:
    day = datetime(2030, 3, 5, 10, tzinfo=UTC)
    a = await attempts.start(conn)
    await costs.set_budget(conn, org=attempts.ORG, limit=5, period="day", now=day)
    await receipts.record(conn, ref(a, "s1"), result=1, charges=[C(5)], now=day)
    refused = await reserve(conn, a, ["s2"], 1, now=day + timedelta(hours=1))
    assert refused.exhausted and refused.wake_at == datetime(2030, 3, 6, tzinfo=UTC)
    tomorrow = day + timedelta(days=1)
    assert (await reserve(conn, a, ["s2"], 1, now=tomorrow)).granted == 1
    await receipts.record(conn, ref(a, "s2"), result=1, charges=[C(1)], now=tomorrow)
    shown = await budget(conn, org=attempts.ORG, now=tomorrow)
    assert (shown.spent, shown.period_start) == (1, datetime(2030, 3, 6, tzinfo=UTC))
    month = await costs.set_budget(conn, org=attempts.ORG, limit=5, period="month", now=day)
    assert month.spent == 0 and month.period_end == datetime(2030, 4, 1, tzinfo=UTC)


async def test_recovery_releases_a_dead_attempts_reservation(conn: Conn) -> None:
    a = await attempts.start(conn)
    await costs.set_budget(conn, run_id=a.run_id, limit=10)
    assert (await reserve(conn, a, ["k1", "k2"], 4)).granted == 2
    assert (await budget(conn, run_id=a.run_id)).reserved == 8
    report = await attempts.rescue(conn, a)
    assert report.reservations_swept == 2
    assert (await budget(conn, run_id=a.run_id)).reserved == 0
    cur = await conn.execute("SELECT count(*) FROM wq_reservations")
    assert await cur.fetchone() == (0,)
    b = await attempts.claim(conn, worker="w2", now=a.lapses_at + timedelta(minutes=10))
    assert (await reserve(conn, b, ["k1", "k2"], 5)).granted == 2


# ---- the pause and the wake ------------------------------------------------------------------


async def test_a_paused_run_sleeps_on_its_budget_and_a_raise_wakes_it(conn: Conn) -> None:
    a = await attempts.start(conn)
    await costs.set_budget(conn, org=attempts.ORG, limit=1)
    await receipts.record(conn, ref(a, "s1"), result=1, charges=[C(1)])
    refused = await reserve(conn, a, ["s2"], 1)
    assert refused.exhausted
    paused = outcomes.suspended(
        a.run_id, a.fence.attempt, wake_at=None, wait_event=costs.wait_event(refused.epoch)
    )
    status = await costs.pause(
        conn, worker_id="w1", finish_=paused, org=attempts.ORG, epoch=refused.epoch
    )
    assert status == outcomes.FinishStatus.APPLIED
    run = await runs.get(conn, a.run_id)
    assert (run.state, run.wait_reason, run.job_id) == ("sleeping", costs.BUDGET_EXHAUSTED, None)
    assert (await runs.list_runs(conn, state="sleeping"))[0].wait_reason == costs.BUDGET_EXHAUSTED
    await costs.set_budget(conn, org=attempts.ORG, limit=5)
    run = await runs.get(conn, a.run_id)
    assert run.state == "sleeping" and run.job_id is not None  # woken: its job is due now
    assert "budget_changed" in [e.kind for e in await runs.events(conn, a.run_id)]


async def test_a_budget_written_between_refusal_and_pause_hands_the_run_back(conn: Conn) -> None:
    a = await attempts.start(conn)
    await costs.set_budget(conn, org=attempts.ORG, limit=0)
    refused = await reserve(conn, a, ["s1"], 1)
    assert refused.exhausted
    await costs.set_budget(conn, org=attempts.ORG, limit=3)  # the epoch moves on
    paused = outcomes.suspended(
        a.run_id, a.fence.attempt, wake_at=None, wait_event=costs.wait_event(refused.epoch)
    )
    assert (
        await costs.pause(
            conn, worker_id="w1", finish_=paused, org=attempts.ORG, epoch=refused.epoch
        )
        is None
    )
    assert (await runs.get(conn, a.run_id)).state == "running"  # nothing written


async def test_delete_wakes_and_a_play_budget_wakes_only_its_plays_runs(conn: Conn) -> None:
    mine = await attempts.start(conn, worker="w1")
    other = await attempts.start(conn, worker="w2", play="other")
    for a in (mine, other):
        paused = outcomes.suspended(
            a.run_id, a.fence.attempt, wake_at=None, wait_event=costs.wait_event(0)
        )
        await runs.finish(conn, worker_id=a.fence.owner, finishes=[paused])
    await costs.set_budget(conn, org=attempts.ORG, play=attempts.PLAY, limit=1)
    assert (await runs.get(conn, mine.run_id)).job_id is not None
    assert (await runs.get(conn, other.run_id)).job_id is None
    await costs.set_budget(conn, org=attempts.ORG, limit=1)
    assert await costs.delete_budget(conn, org=attempts.ORG)
    assert not await costs.delete_budget(conn, org=attempts.ORG)
    assert (await runs.get(conn, other.run_id)).job_id is not None
    assert [b.scope for b in await costs.list_budgets(conn, org=attempts.ORG)] == ["play"]


# ---- a run's own budget at submit, and the reads ----------------------------------------------


async def test_a_submission_sets_its_runs_budget_and_the_database_checks_it(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    sub = admission.Submission(
        play=attempts.PLAY, release=attempts.RELEASE, org=attempts.ORG, budget=50
    )
    admitted = await admission.submit(conn, sub)
    shown = await budget(conn, run_id=admitted.run_id)
    assert (shown.scope, shown.limit_amount, shown.unit, shown.period) == (
        "run",
        50,
        "credits",
        "none",
    )
    assert await costs.list_budgets(conn, run_id=run_id) == []
    with pytest.raises(InvalidField) as raised:
        await admission.submit(
            conn, admission.Submission(play=attempts.PLAY, release=attempts.RELEASE, budget=-1)
        )
    assert raised.value.field == "budget"
    bad = {"budget": {"limit": 5, "unit": "credits", "period": "week"}}
    with pytest.raises(psycopg.Error) as direct:
        async with conn.transaction():
            await conn.execute(
                "SELECT * FROM wq_submit_with_options(gen_random_uuid(), 'o', %s, '{}', %s,"
                " %s, NULL, 0, NULL, NULL, 0, NULL, %s)",
                (
                    attempts.PLAY,
                    attempts.RELEASE,
                    f"r-{attempts.RELEASE}",
                    psycopg.types.json.Jsonb(bad),
                ),
            )
    assert direct.value.sqlstate == "WQ010"
    assert isinstance(translate(direct.value), InvalidField)


async def test_the_cost_reads_agree_with_the_charges(conn: Conn) -> None:
    at = datetime(2030, 5, 1, 12, tzinfo=UTC)
    a = await attempts.start(conn, org="acme")
    b = await attempts.start(conn, org="acme", play="other", worker="w2")
    c = await attempts.start(conn, org="zeta", worker="w3")
    spend = [
        (a, "s1", [C(1, provider="clearbit"), C(2, "usd", "openai")], at),
        (a, "s2", [C(3, provider="clearbit")], at + timedelta(days=1)),
        (b, "s1", [C(4)], at),
        (c, "s1", [C(5, provider="clearbit")], at),
    ]
    for who, key, spent, when in spend:
        step = StepRef(who.claimed.org, who.claimed.play, Scope.of_run(who.run_id), key, who.fence)
        await receipts.record(conn, step, result=1, charges=spent, now=when)
    by_run = {(x.run_id, x.unit): x.amount for x in await costs.costs(conn, by=["run"])}
    assert by_run == {
        (a.run_id, "credits"): 4,
        (a.run_id, "usd"): 2,
        (b.run_id, "credits"): 4,
        (c.run_id, "credits"): 5,
    }
    by_org = {(x.org, x.unit): x.amount for x in await costs.costs(conn, by=["org"])}
    assert by_org == {("acme", "credits"): 8, ("acme", "usd"): 2, ("zeta", "credits"): 5}
    acme = await costs.costs(conn, by=["play", "provider"], org="acme", since=at)
    assert {(x.play, x.provider, x.unit): (x.amount, x.charges) for x in acme} == {
        ("play", "clearbit", "credits"): (4, 2),
        ("play", "openai", "usd"): (2, 1),
        ("other", None, "credits"): (4, 1),
    }
    days = await costs.costs(conn, by=["day"], run_id=a.run_id, since=at + timedelta(hours=13))
    next_day = at.date() + timedelta(days=1)
    assert [(x.day, x.unit, x.amount) for x in days] == [(next_day, "credits", 3)]
    listed = await costs.charges(conn, run_id=a.run_id)
    assert sum(x.amount for x in listed if x.unit == "credits") == 4
    assert listed[0].as_dict()["amount"] == 3
    with pytest.raises(InvalidField):
        await costs.costs(conn, by=["week"])


async def test_recovery_reports_its_sweep(conn: Conn) -> None:
    report = await recovery.run_once(conn)
    assert report.counts()["reservations_swept"] == 0
