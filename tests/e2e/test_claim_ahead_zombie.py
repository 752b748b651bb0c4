"""The zombie test of claiming ahead for short plays: the hold's hand-back is fenced.

Worker A (a real ``worker start`` process, ``--claim-ahead-under 200ms``, so runs wait
ahead at most 4 s) has run two short plays, then claims two plays that hold its two slots
and four short runs ahead. It is SIGSTOPped at once, before the hold ends, and stays
stopped past the lane's 4 s lease: a recovery pass closes all six attempts
(``lease_expired``) and worker B runs every run as attempt 2. On SIGCONT A's hold is long
over, and so are its leases: either it hands the four runs back, a write for leases it no
longer holds, which the finish statement refuses (a ``final`` refusal of attempt 1 each),
or its heartbeat's watchdog drops them first, unwritten. Either way nothing B wrote
changes, and A never starts them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queues import admission, lanes
from tests.apps.prefetch import STARTS_DDL, registry
from tests.e2e.test_cli_scheduler import cli
from tests.workers import eventually, fetch, running_worker, worker_process

LEASE_S = 4.0


def start_worker(url: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    return worker_process(
        url,
        tmp_path / "worker-a.log",
        "--app",
        "tests.apps.prefetch:registry",
        "--concurrency",
        "2",
        "--claim-ahead-under",
        "200ms",
        PREFETCH_DB_URL=url,
    )


async def admit(url: str, subs: list[tuple[str, dict[str, Any]]]) -> list[uuid.UUID]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit_many(
            conn, [admission.Submission(play=p, params=a, release="t") for p, a in subs]
        )
    return [a.run_id for a in admitted]


async def count(url: str, sql: str, params: Any = None) -> int:
    rows = await fetch(url, sql, params)
    return int(rows[0][0])


async def snapshot(url: str, run_ids: list[uuid.UUID]) -> list[Any]:
    return await fetch(
        url,
        "SELECT r.id, r.state::text, r.attempt, r.result, r.lease_owner, a.attempt,"
        " a.worker_id, a.outcome::text FROM wq_runs r JOIN wq_attempts a ON a.run_id = r.id"
        " WHERE r.id = ANY(%s) ORDER BY r.id, a.attempt",
        (run_ids,),
    )


async def recover(url: str) -> dict[str, Any]:
    """One real recovery pass, `worker recover --once --json`."""
    done = await cli(url, "recover", "--once", "--json")
    assert done.code == 0, done.err
    report: dict[str, Any] = json.loads(done.out)
    return report


async def test_a_paused_workers_late_hand_back_of_runs_claimed_ahead_is_refused(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(STARTS_DDL)
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=LEASE_S, heartbeat_s=1.0)
    a = start_worker(db_url, tmp_path)
    try:
        # Two short plays: A claims ahead from now on.
        await admit(db_url, [("counted", {"i": i}) for i in range(2)])
        done = "SELECT count(*) FROM wq_runs WHERE state = 'succeeded'"

        async def first_two() -> bool:
            return await count(db_url, done) == 2

        await eventually(first_two, timeout=30)
        subs = [("held", {"hold_s": 600.0, "i": i}) for i in range(2)]
        subs += [("counted", {"i": 10 + i}) for i in range(4)]
        run_ids = await admit(db_url, subs)

        async def all_six_by_a() -> bool:
            leased = await count(
                db_url,
                "SELECT count(*) FROM wq_runs WHERE id = ANY(%s) AND state = 'running'"
                " AND attempt = 1 AND lease_owner LIKE %s",
                (run_ids, f"%:{a.pid}:%"),
            )
            started = await count(db_url, "SELECT count(*) FROM test_prefetch_starts")
            return leased == 6 and started == 2

        await eventually(all_six_by_a, timeout=3, interval=0.02)
        a.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        owner = (
            await fetch(db_url, "SELECT lease_owner FROM wq_runs WHERE id = %s", (run_ids[2],))
        )[0][0]
        # Stopped before the hold ended: the four are still A's, waiting (never started).
        assert await count(db_url, "SELECT count(*) FROM test_prefetch_starts") == 2
        assert await count(db_url, "SELECT count(*) FROM wq_refusals") == 0

        await asyncio.sleep(max(0.0, stopped + LEASE_S + 0.5 - time.monotonic()))
        report = await recover(db_url)
        assert report["counts"]["lease_expired"] == 6
        async with running_worker(
            db_url, registry, release="t", concurrency=6, claim_ahead_under_s=0.0
        ) as b:

            async def all_done() -> bool:
                return await count(db_url, done) == 8

            await eventually(all_done, timeout=30)
            before = await snapshot(db_url, run_ids)
            assert {(row[1], row[2], row[4]) for row in before} == {("succeeded", 2, None)}
            assert {(row[5], row[6], row[7]) for row in before} == {
                (1, owner, "lease_expired"),
                (2, b.s.worker_id, "succeeded"),
            }

            assert time.monotonic() - stopped > 4.0  # past the hold (20 x 200 ms)
            a.send_signal(signal.SIGCONT)

            async def settled() -> bool:
                # Either A's hold ended first after SIGCONT (its hand-back is refused: a
                # `final` refusal of attempt 1 each) or its heartbeat's watchdog reported
                # the silence first (the four are dropped unwritten): a race of two
                # callbacks due at once. tests/integration/test_claim_ahead_short.py makes
                # the hold win, in-process.
                refusals = await count(
                    db_url,
                    "SELECT count(*) FROM wq_refusals WHERE run_id = ANY(%s)"
                    " AND attempt = 1 AND kind = 'final' AND worker_id = %s",
                    (run_ids[2:], owner),
                )
                dropped = (tmp_path / "worker-a.log").read_text().count('"started": false')
                return refusals == 4 or dropped == 4

            await eventually(settled, timeout=20)
            after = await snapshot(db_url, run_ids)
    finally:
        a.send_signal(signal.SIGCONT)
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=30)
    assert after == before
    # A never started the four; its two held plays were its only starts.
    assert (
        await count(db_url, "SELECT count(*) FROM test_prefetch_starts WHERE pid = %s", (a.pid,))
        == 2
    )
