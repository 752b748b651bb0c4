"""The fairness scenario through a real worker: org A holds 10,000 queued runs, org B submits
100, and B gets its share of the slots: from B's admission to B's last start, the worker
starts about as many of A's runs as of B's, never A's backlog first.

The lane is a fair lane: a per-org cap of half the worker's slots (``--org-concurrency``),
and the claim's interleaving (the org with the fewest runs in flight first). Without a cap
the interleaving alone gives B an equal share of the slots too. The share is counted in
starts, not timed: how long B waits depends on the machine's load (speed is measured in
``bench/``), the order of the claims does not. B's median wait, alone and behind A, is
printed for the README's figures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from queues import admission, lanes
from tests.apps.scheduling import DDL, URL_ENV, registry
from tests.workers import eventually, fetch, running_worker

RELEASE = "fair"
LANE = lanes.lane_name(RELEASE)
SLOTS = 8
RUN_S = 0.05


@pytest.fixture
async def url(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(DDL)
        await lanes.prepare(conn, RELEASE)
    monkeypatch.setenv(URL_ENV, db_url)
    return db_url


async def admit(url: str, org: str, n: int) -> None:
    """``n`` runs of ``org`` in one statement, each through the real admission function."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            "SELECT count(*) FROM (SELECT wq_submit(gen_random_uuid(), %(org)s, 'quick',"
            " %(params)s::jsonb, %(release)s, %(lane)s, NULL, 0, '{}'::jsonb, NULL, 0, NULL)"
            " FROM generate_series(1, %(n)s)) s",
            {
                "org": org,
                "params": f'{{"seconds": {RUN_S}}}',
                "release": RELEASE,
                "lane": LANE,
                "n": n,
            },
        )


async def admit_backlog(url: str, org: str, n: int) -> None:
    """``n`` runs of ``org`` in one batch admission (:func:`queues.admission.submit_many`,
    at most its largest batch): queued runs and jobs as :func:`admit` makes them (each
    also carrying its authority descriptor, as the Python admission API records it), in
    set-wise writes instead of an admission function call per run, a fraction of the time
    for A's backlog."""
    assert n <= admission.MAX_BATCH
    batch = [
        admission.Submission(play="quick", params={"seconds": RUN_S}, release=RELEASE, org=org)
        for _ in range(n)
    ]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await admission.submit_many(conn, batch)


async def waits(url: str, org: str, since: Any) -> list[float] | None:
    """The waits of ``org``'s runs admitted since ``since``, once all of them started."""
    rows = await fetch(
        url,
        "SELECT extract(epoch FROM started_at - created_at) FROM wq_runs"
        " WHERE org = %s AND created_at >= %s",
        (org, since),
    )
    if any(w is None for (w,) in rows):
        return None
    return [float(w) for (w,) in rows]


async def clock(url: str) -> Any:
    return (await fetch(url, "SELECT clock_timestamp()"))[0][0]


async def starts_while_b_waits(url: str, since: Any) -> tuple[int, int]:
    """The runs of A and of B started from B's admission (``since``) to B's last start."""
    ((of_a, of_b),) = await fetch(
        url,
        "SELECT count(*) FILTER (WHERE r.org = 'a'), count(*) FILTER (WHERE r.org = 'b')"
        "  FROM wq_runs r,"
        "       (SELECT max(started_at) AS last FROM wq_runs"
        "         WHERE org = 'b' AND created_at >= %(since)s) b"
        " WHERE r.started_at >= %(since)s AND r.started_at <= b.last",
        {"since": since},
    )
    return int(of_a), int(of_b)


@dataclass(frozen=True)
class Outcome:
    idle_wait_s: float  # B's median wait alone
    wait_s: float  # B's median wait behind A's backlog
    a_started: int  # A's runs started while B's runs waited
    b_started: int

    def report(self, label: str) -> str:
        return (
            f"{label}: while B waited, {self.a_started} of A's runs and {self.b_started} of "
            f"B's started; B's median wait idle {self.idle_wait_s:.3f}s, behind 10,000 of A "
            f"{self.wait_s:.3f}s ({self.wait_s / self.idle_wait_s:.2f}x)"
        )


async def scenario(url: str, org_cap: int) -> Outcome:
    """B alone, then B behind A's backlog."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.set_policy(conn, RELEASE, org_concurrency=org_cap)
    async with running_worker(url, registry, release=RELEASE, concurrency=SLOTS):
        idle_since = await clock(url)
        await admit(url, "b-idle", 100)
        idle = await eventually(lambda: waits(url, "b-idle", idle_since), timeout=60)
        await admit_backlog(url, "a", 10_000)

        async def busy() -> bool:
            rows = await fetch(
                url, "SELECT count(*) FROM wq_runs WHERE org = 'a' AND state = 'succeeded'"
            )
            return int(rows[0][0]) >= 2 * SLOTS

        await eventually(busy, timeout=60)
        since = await clock(url)
        await admit(url, "b", 100)
        contended = await eventually(lambda: waits(url, "b", since), timeout=60)
        a_started, b_started = await starts_while_b_waits(url, since)
    return Outcome(statistics.median(idle), statistics.median(contended), a_started, b_started)


async def test_a_small_org_gets_its_share_of_the_slots_behind_a_large_one(url: str) -> None:
    outcome = await scenario(url, org_cap=SLOTS // 2)
    print(outcome.report(f"fair lane (cap {SLOTS // 2})"))
    assert outcome.b_started == 100
    # Each org may hold half the slots: B's share is half of the starts (A's backlog first
    # would start all 10,000 of A before B's last run).
    assert outcome.a_started <= 1.5 * outcome.b_started


async def test_without_a_cap_the_interleaving_still_gives_a_small_org_its_share(
    url: str,
) -> None:
    outcome = await scenario(url, org_cap=0)
    print(outcome.report("no cap"))
    assert outcome.b_started == 100
    # An equal share of the slots: about as many of A's starts as of B's.
    assert outcome.a_started <= 2 * outcome.b_started
