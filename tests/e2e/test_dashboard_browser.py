"""The dashboard in a real headless browser (Playwright driving Debian's chromium).

A worker runs the demo's plays in this process; the dashboard reads as a wq_reader login
and acts as a wq_worker login. The browser logs in, loads the runs page, opens a demo run
and sees its progress, opens a failed run and sees its traceback (and retries it), cancels
a live demo run from its page, and visits the lanes, metrics and costs pages. A screenshot of
every page is saved outside the source tree, under ``$WORKER_TEST_ARTIFACTS/dashboard`` (by
default the temporary directory's ``worker-test-artifacts``), and the paths printed.

Chromium is required, never skipped: `scripts/install-test-deps` installs Debian's package.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import psycopg
from playwright.async_api import Dialog, Page, async_playwright

from queues import admission, inputs, lanes, operator, policy
from tests import ledgers
from tests.dashboards import SECRET, serving
from tests.workers import eventually, fetch, run_state, running_worker
from worker.context import RunContext
from worker.demo import demo_plays, sample_path
from worker.plays import Registry

ARTIFACTS = (
    Path(
        os.environ.get("WORKER_TEST_ARTIFACTS")
        or Path(tempfile.gettempdir()) / "worker-test-artifacts"
    )
    / "dashboard"
)
RELEASE = "demo"
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-background-networking",  # the machine has no network: no lookups at start
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

failing = Registry()


def _parse_score(row: dict[str, Any]) -> int:
    return int(row["score"])  # the upstream API answered without a score


@failing.play("explode")
async def explode(ctx: RunContext, params: dict[str, Any]) -> None:
    fetched = await ctx.step("fetch", lambda: {"rows": 3})
    _parse_score(fetched)


@failing.play("paid")
async def paid(ctx: RunContext, params: dict[str, Any]) -> None:
    for i in range(3):

        def call(i: int = i) -> int:
            ctx.charge(2, provider="clearbit")
            return i

        await ctx.step(f"call-{i}", call)


registry = demo_plays.merged(failing)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium is missing: run `bash scripts/install-test-deps`"
    return found


async def _admit(url: str, play: str, params: dict[str, Any], rows: int = 0) -> uuid.UUID:
    sample = inputs.read_rows(sample_path())[:rows] if rows else None
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit(
            conn, admission.Submission(play=play, params=params, release=RELEASE), inputs=sample
        )
    return admitted.run_id


async def _state_in(url: str, run_id: uuid.UUID, *states: str) -> str | None:
    state = await run_state(url, run_id)
    return state if state in states else None


async def _rows_done(url: str, run_id: uuid.UUID) -> int:
    rows = await fetch(url, "SELECT rows_done FROM wq_runs WHERE id = %s", (run_id,))
    return int(rows[0][0])


async def shot(page: Page, name: str, taken: list[Path]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    taken.append(path)


async def test_the_dashboard_in_a_browser(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
        once = policy.parse({"retry_max_attempts": "1"})
        await operator.set_policy(conn, RELEASE, once, actor="cli:test")
    taken: list[Path] = []
    async with running_worker(db_url, registry, release=RELEASE, concurrency=4):
        done = await _admit(db_url, "enrich", {"page_delay_s": 0}, rows=200)
        broken = await _admit(db_url, "explode", {})
        paying = await _admit(db_url, "paid", {})
        assert await eventually(lambda: _state_in(db_url, done, "succeeded")) == "succeeded"
        assert await eventually(lambda: _state_in(db_url, broken, "failed")) == "failed"
        assert await eventually(lambda: _state_in(db_url, paying, "succeeded")) == "succeeded"
        live = await _admit(db_url, "enrich", {"page_delay_s": 10}, rows=3000)
        await eventually(lambda: _rows_done(db_url, live), timeout=20)
        async with serving(db_url) as served, async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                await _drive(page, served.url, db_url, done, broken, live, taken)
            finally:
                await browser.close()
    for path in taken:
        print(f"screenshot: {path}")
    assert len(taken) == 8 and all(p.stat().st_size > 10_000 for p in taken)


async def _drive(
    page: Page,
    base: str,
    url: str,
    done: uuid.UUID,
    broken: uuid.UUID,
    live: uuid.UUID,
    taken: list[Path],
) -> None:
    dialogs: list[str] = []

    async def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        await dialog.accept()

    page.on("dialog", accept)

    # Log in: the runs page sends us to the login form first.
    await page.goto(f"{base}/runs")
    assert "/login" in page.url
    await shot(page, "1-login", taken)
    await page.fill("input[name=name]", "alice")
    await page.fill("input[name=secret]", SECRET)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{base}/runs")

    # The runs page lists the three runs.
    table = page.locator("table.runs")
    for run_id in (done, broken, live):
        await table.locator(f"a[href='/runs/{run_id}']").wait_for()
    assert "alice" in await page.inner_text("header")
    await shot(page, "2-runs", taken)

    # A finished demo run: its progress, sheet and steps.
    await page.click(f"a[href='/runs/{done}']")
    await page.wait_for_url(f"{base}/runs/{done}")
    body = " ".join((await page.inner_text("main")).split())
    assert "200 of 200 rows done" in body
    assert "succeeded" in await page.inner_text("h1")
    assert "run_succeeded" in body and "attempt_started" in body
    await shot(page, "3-run-succeeded", taken)

    # A failed run: its error and the traceback, then a retry from the page.
    await page.goto(f"{base}/runs/{broken}")
    stack = await page.inner_text("#traceback")
    assert "Traceback (most recent call last)" in stack
    assert "_parse_score" in stack and "KeyError: 'score'" in stack
    await shot(page, "4-run-failed-traceback", taken)
    await page.click("#retry-run")
    await page.wait_for_selector(".flash.notice")
    assert "requeued" in await page.inner_text(".flash.notice")
    retried = await ledgers.events(url, broken, "run_retried")
    assert [e.data["by"] for e in retried] == ["dashboard:alice"]

    # A live demo run: its progress, then a cancel from the page cancels it.
    await page.goto(f"{base}/runs/{live}")
    progress = " ".join((await page.inner_text(".progress")).split())
    assert "of 3000 rows done" in progress
    await page.fill("#live-run input[name=reason]", "wrong list")
    await page.click("#cancel-run")
    await page.wait_for_selector(".flash.notice")
    assert await eventually(lambda: _state_in(url, live, "cancelled"), timeout=30)
    await page.wait_for_selector("h1 .state-cancelled", timeout=15_000)  # the live refresh
    assert any("Cancel this run" in message for message in dialogs)
    cancelled = await ledgers.events(url, live, "cancel_requested")
    assert [(e.data["by"], e.data["reason"]) for e in cancelled] == [
        ("dashboard:alice", "wrong list")
    ]
    await shot(page, "5-run-cancelled", taken)

    # Lanes: state, numbers, policy, the audit of what alice did.
    await page.click("nav a[href='/lanes']")
    await page.wait_for_url(f"{base}/lanes")
    lanes_text = await page.inner_text("main")
    assert "r-demo" in lanes_text and "dashboard:alice" in lanes_text
    await shot(page, "6-lanes", taken)

    # Metrics: the numbers of `worker metrics` and the chart of the last hour.
    await page.click("nav a[href='/stats']")
    await page.wait_for_url(f"{base}/stats")
    await page.wait_for_selector("svg.chart rect.ok")
    await page.wait_for_selector("svg.chart rect.bad")
    assert "runs admitted" in await page.inner_text("main")
    await shot(page, "7-metrics", taken)

    # Costs: each day's spend per org and per provider, drawn under the page's CSP.
    await page.click("nav a[href='/costs']")
    await page.wait_for_url(f"{base}/costs")
    await page.wait_for_selector("svg.chart rect.s0")
    costs_text = await page.inner_text("main")
    assert "credits per day, per provider" in costs_text and "clearbit 6" in costs_text
    await shot(page, "8-costs", taken)
