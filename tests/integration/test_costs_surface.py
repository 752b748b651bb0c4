"""What paid work cost, read where an operator looks: ``worker costs``, ``worker budgets``,
``worker runs show``, the dashboard's costs and run pages, and ``/metrics``.

Charges are made by real plays (``ctx.charge`` inside a step, recorded with its receipt);
every figure shown is checked against the sum of the rows in ``wq_charges``."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboards import logged_in, serving
from tests.e2e.test_cli_scheduler import cli
from tests.workers import eventually, fetch, run_state, running_worker, submit
from worker import metrics_http
from worker.context import RunContext
from worker.plays import Registry

registry = Registry()


@registry.play("paid")
async def paid(ctx: RunContext, params: dict[str, Any]) -> int:
    for i in range(int(params["calls"])):

        def call(i: int = i) -> int:
            ctx.charge(1, provider="clearbit")
            ctx.charge(0.25, "usd", provider="openai")
            return i

        await ctx.step(f"call-{i}", call)
    return int(params["calls"])


async def _succeeded(url: str, run_id: uuid.UUID) -> bool:
    return await run_state(url, run_id) == "succeeded"


async def _charged_runs(db_url: str) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """Three finished runs: two of org acme (plays' calls 3 and 2), one of org beta (4)."""
    async with running_worker(db_url, registry):
        first = await submit(db_url, "paid", {"calls": 3}, org="acme")
        second = await submit(db_url, "paid", {"calls": 2}, org="acme")
        third = await submit(db_url, "paid", {"calls": 4}, org="beta")
        for run_id in (first, second, third):
            await eventually(lambda run_id=run_id: _succeeded(db_url, run_id))
    return first, second, third


async def _sums(db_url: str, group: str) -> dict[tuple[Any, ...], Decimal]:
    rows = await fetch(
        db_url,
        f"SELECT {group}, unit, sum(amount) FROM wq_charges GROUP BY {group}, unit",
    )
    return {tuple(row[:-1]): row[-1] for row in rows}


async def test_costs_and_budgets_on_the_command_line(db_url: str) -> None:
    first, _, _ = await _charged_runs(db_url)
    by_org = await _sums(db_url, "org")
    assert by_org == {
        ("acme", "credits"): Decimal(5),
        ("acme", "usd"): Decimal("1.25"),
        ("beta", "credits"): Decimal(4),
        ("beta", "usd"): Decimal("1.00"),
    }

    done = await cli(db_url, "costs", "--json")
    assert done.code == 0, done.err
    shown = {(c["org"], c["unit"]): Decimal(str(c["amount"])) for c in json.loads(done.out)}
    assert shown == by_org
    text = await cli(db_url, "costs")
    assert text.out.splitlines()[0].split() == ["org", "unit", "amount", "charges"]
    assert "acme  credits  5       5" in text.out, text.out

    done = await cli(db_url, "costs", "--run", str(first), "--json")
    assert [
        (c["provider"], c["unit"], c["amount"], c["charges"]) for c in json.loads(done.out)
    ] == [
        ("clearbit", "credits", 3, 3),
        ("openai", "usd", 0.75, 3),
    ]
    done = await cli(db_url, "costs", "--org", "acme", "--by", "play,provider", "--json")
    assert {(c["play"], c["provider"], c["unit"], c["amount"]) for c in json.loads(done.out)} == {
        ("paid", "clearbit", "credits", 5),
        ("paid", "openai", "usd", 1.25),
    }
    done = await cli(db_url, "costs", "--by", "day", "--by", "org", "--since", "1d", "--json")
    assert sum(c["amount"] for c in json.loads(done.out) if c["unit"] == "credits") == 9
    future = await cli(db_url, "costs", "--since", "2999-01-01")
    assert (future.code, future.out.strip()) == (
        0,
        "no charges recorded since 2999-01-01T00:00:00+00:00",
    )

    shown_run = await cli(db_url, "runs", "show", str(first))
    assert "spent:    3 credits (clearbit 3); 0.75 usd (openai 0.75)" in shown_run.out
    as_json = json.loads((await cli(db_url, "runs", "show", str(first), "--json")).out)
    assert as_json["costs"] == [
        {"provider": "clearbit", "unit": "credits", "amount": 3, "charges": 3},
        {"provider": "openai", "unit": "usd", "amount": 0.75, "charges": 3},
    ]
    assert as_json["wait_reason"] is None

    done = await cli(
        db_url, "budgets", "set", "--org", "acme", "--limit", "100", "--period", "month"
    )
    assert done.code == 0, done.err
    assert done.out.startswith("budget org acme: 0 of 100 credits per month spent")
    done = await cli(db_url, "budgets", "set", "--run", str(first), "--limit", "2", "--unit", "usd")
    assert done.code == 0, done.err
    listed = json.loads((await cli(db_url, "budgets", "list", "--json")).out)
    assert [(b["scope"], b["unit"], b["limit_amount"], b["period"]) for b in listed] == [
        ("org", "credits", 100, "month"),
        ("run", "usd", 2, "none"),
    ]
    gone = await cli(db_url, "budgets", "delete", "--org", "acme")
    assert (gone.code, gone.out.strip()) == (0, "budget of org acme in credits deleted")
    again = await cli(db_url, "budgets", "delete", "--org", "acme")
    assert again.out.strip() == "no budget of org acme in credits: nothing deleted"
    assert len(json.loads((await cli(db_url, "budgets", "list", "--json")).out)) == 1


async def test_bad_cost_and_budget_flags_are_refused_before_anything_is_written(
    db_url: str,
) -> None:
    for args, field in (
        (("costs", "--by", "week"), "--by"),
        (("costs", "--since", "yesterday"), "--since"),
        (("costs", "--run", "nope"), "--run"),
        (("budgets", "set", "--org", "acme", "--limit", "-1"), "--limit"),
        (("budgets", "set", "--org", "acme", "--limit", "nan"), "--limit"),
        (("budgets", "set", "--org", "acme", "--limit", "5", "--unit", "Credits!"), "--unit"),
        (("budgets", "set", "--limit", "5"), "org"),
        (
            (
                "budgets",
                "set",
                "--org",
                "acme",
                "--play",
                "x",
                "--run",
                str(uuid.uuid4()),
                "--limit",
                "5",
            ),
            "play",
        ),
    ):
        done = await cli(db_url, *args)
        assert done.code != 0, args
        assert "error[FIELD_INVALID]" in done.err and field in done.err, (args, done.err)
    assert await fetch(db_url, "SELECT count(*) FROM wq_budgets") == [(0,)]


async def test_the_dashboard_shows_what_was_spent(db_url: str) -> None:
    first, _, _ = await _charged_runs(db_url)
    async with serving(db_url) as served, logged_in(served.url) as client:
        await cli(db_url, "budgets", "set", "--org", "beta", "--limit", "3", "--period", "day")
        page = await client.get("/costs")
        assert page.status_code == 200
        text = page.text
        assert text.count('<svg class="chart"') == 2
        assert "credits per day, per org" in text and "credits per day, per provider" in text
        assert "acme 5" in text and "beta 4" in text and "clearbit 9" in text
        assert "org beta" in text  # the budget, counting from when it was set
        usd = await client.get("/costs", params={"unit": "usd", "org": "acme"})
        assert "usd per day, per provider" in usd.text and "openai 1.25" in usd.text
        assert "beta" not in usd.text.split("<h2>Budgets")[0]
        bad = await client.get("/costs", params={"unit": "Not A Unit"})
        assert bad.status_code == 200 and "invalid unit" in bad.text
        run_page = await client.get(f"/runs/{first}")
        assert 'id="spent"' in run_page.text
        assert "clearbit 3 credits" in run_page.text and "openai 0.75 usd" in run_page.text


async def test_metrics_count_charges_by_org_play_provider_and_unit(db_url: str) -> None:
    await _charged_runs(db_url)
    served = metrics_http.serve(db_url, port=0)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(served.url)).text
    finally:
        served.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["wq_charged"].type == "counter"
    found = {
        (s.labels["org"], s.labels["play"], s.labels["provider"], s.labels["unit"]): s.value
        for s in families["wq_charged"].samples
        if s.name == "wq_charged_total"
    }
    expected = await _sums(db_url, "org, play, provider")
    assert found == {key: float(value) for key, value in expected.items()}
    assert found[("acme", "paid", "openai", "usd")] == 1.25
    paused = [s for s in families["wq_lane_budget_paused"].samples if s.labels["lane"] == "r-t"]
    assert [s.value for s in paused] == [0.0]


async def _paused(url: str, run_id: uuid.UUID) -> bool:
    rows = await fetch(url, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,))
    return rows == [("sleeping",)]


async def test_a_paused_run_shows_why_everywhere_and_a_raise_from_the_cli_resumes_it(
    db_url: str,
) -> None:
    done = await cli(db_url, "budgets", "set", "--org", "gamma", "--limit", "2")
    assert done.code == 0, done.err
    async with running_worker(db_url, registry):
        run_id = await submit(db_url, "paid", {"calls": 4}, org="gamma")
        await eventually(lambda: _paused(db_url, run_id))

        shown = await cli(db_url, "runs", "show", str(run_id))
        assert "paused:   BUDGET_EXHAUSTED" in shown.out, shown.out
        assert "spent:    2 credits (clearbit 2)" in shown.out, shown.out
        data = json.loads((await cli(db_url, "runs", "show", str(run_id), "--json")).out)
        assert data["wait_reason"] == "BUDGET_EXHAUSTED"
        listed = json.loads((await cli(db_url, "budgets", "list", "--json")).out)
        assert [(b["spent"], b["exhausted"]) for b in listed] == [(2, True)]

        async with serving(db_url) as served, logged_in(served.url) as client:
            page = await client.get(f"/runs/{run_id}")
            assert 'id="wait-reason">BUDGET_EXHAUSTED' in page.text
            assert "exhausted" in (await client.get("/costs")).text
        served_metrics = metrics_http.serve(db_url, port=0)
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                text = (await client.get(served_metrics.url)).text
        finally:
            served_metrics.stop()
        paused = {
            s.labels["lane"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "wq_lane_budget_paused"
            for s in f.samples
        }
        assert paused == {"r-t": 1.0}

        raised = await cli(db_url, "budgets", "set", "--org", "gamma", "--limit", "10")
        assert raised.code == 0, raised.err
        await eventually(lambda: _succeeded(db_url, run_id))
    assert await fetch(
        db_url,
        "SELECT sum(amount) FROM wq_charges WHERE run_id = %s AND unit = 'credits'",
        (run_id,),
    ) == [(Decimal(4),)]


async def test_a_paused_run_is_cancelled_as_any_sleeping_run_and_a_raise_leaves_it_so(
    db_url: str,
) -> None:
    done = await cli(db_url, "budgets", "set", "--org", "delta", "--limit", "1")
    assert done.code == 0, done.err
    async with running_worker(db_url, registry):
        run_id = await submit(db_url, "paid", {"calls": 3}, org="delta")
        await eventually(lambda: _paused(db_url, run_id))
        cancelled = await cli(db_url, "cancel", str(run_id), "--reason", "over budget")
        assert cancelled.code == 0, cancelled.err
        assert await run_state(db_url, run_id) == "cancelled"
        raised = await cli(db_url, "budgets", "set", "--org", "delta", "--limit", "100")
        assert raised.code == 0, raised.err
        shown = json.loads((await cli(db_url, "runs", "show", str(run_id), "--json")).out)
        assert (shown["state"], shown["wait_reason"]) == ("cancelled", None)
    assert await run_state(db_url, run_id) == "cancelled"
    assert await fetch(
        db_url, "SELECT count(*), sum(amount) FROM wq_charges WHERE run_id = %s", (run_id,)
    ) == [(2, Decimal("1.25"))]
