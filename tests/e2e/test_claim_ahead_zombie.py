"""The zombie test of claiming ahead for short plays: the hold's hand-back is fenced.

Worker A (a real ``worker start`` process, ``--claim-ahead-under 200ms``, so runs wait
ahead at most 4 s) has run two short plays, then claims two plays that hold its two slots
and four short runs ahead. It is SIGSTOPped at once, before the hold ends. While it is
stopped the test lapses its six leases at the database clock (the lane's lease is longer
than the test, so A's own watchdog, which stops its attempts after a silence as long as
the lease, never fires), a real recovery pass closes all six attempts (``lease_expired``)
and worker B runs every run as attempt 2.

Then A goes on with its heartbeat held up: the test holds the lock of A's worker row,
which each heartbeat round updates last, before it reports its renewals, so A cannot learn
that its leases are gone before its hold ends. (Otherwise, which comes first after a
pause, the heartbeat's report of the lost leases, after which the runs are dropped with
nothing written, or the hold's end, is a race of two callbacks due at once.) So the hold
hands the four back, a write for leases A no longer holds: it reaches the database and is
refused by the finish statement, a ``final`` refusal of attempt 1 for each, which the
test requires. Nothing B wrote changes, and A never starts them.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queues import admission, lanes
from tests.apps.prefetch import STARTS_DDL, registry
from tests.e2e.test_cli_scheduler import cli
from tests.workers import eventually, fetch, running_worker, worker_process

LEASE_S = 60.0  # longer than the test: only the database lapses the leases


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


def events(log: Path, event: str) -> list[dict[str, Any]]:
    """The worker's JSON log lines of ``event``."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            found.append(entry)
    return found


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
    log = tmp_path / "worker-a.log"
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
        owner = (
            await fetch(db_url, "SELECT lease_owner FROM wq_runs WHERE id = %s", (run_ids[2],))
        )[0][0]
        # Stopped before the hold ended: the four are still A's, waiting (never started).
        assert await count(db_url, "SELECT count(*) FROM test_prefetch_starts") == 2
        assert await count(db_url, "SELECT count(*) FROM wq_refusals") == 0
        assert events(log, "claimed_ahead_expired") == []

        # The six leases lapse while A is stopped (a pass at the database clock then
        # closes them), as leases A stopped renewing do.
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            await conn.execute(
                "UPDATE wq_runs SET lease_expires_at = now() - interval '1 second'"
                " WHERE id = ANY(%s) AND lease_owner = %s",
                (run_ids, owner),
            )
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

            # A's heartbeat ends each round by marking its worker row alive, and reports
            # the round only then: with that row locked here, A cannot learn that its
            # leases are gone before the hold ends.
            async with await psycopg.AsyncConnection.connect(db_url) as lock:
                await lock.execute("SELECT 1 FROM wq_workers WHERE id = %s FOR UPDATE", (owner,))
                a.send_signal(signal.SIGCONT)

                async def refused() -> bool:
                    # The hold's hand-back of attempt 1 of each of the four reached the
                    # database and was refused there.
                    return (
                        await count(
                            db_url,
                            "SELECT count(*) FROM wq_refusals WHERE run_id = ANY(%s)"
                            " AND attempt = 1 AND kind = 'final' AND worker_id = %s",
                            (run_ids[2:], owner),
                        )
                        == 4
                    )

                await eventually(refused, timeout=20)
                await lock.rollback()

            async def held_lost() -> bool:
                # Then the heartbeat reports: the two held plays stop, with no write (so
                # A's shutdown below has nothing to hand back).
                lost = {e["run_id"] for e in events(log, "lease_lost")}
                return lost >= {str(r) for r in run_ids[:2]}

            await eventually(held_lost, timeout=20)
    finally:
        a.send_signal(signal.SIGCONT)
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=30)
    assert await snapshot(db_url, run_ids) == before
    # The four refusals are the only ones: the hand-back of attempt 1 of each run A held
    # ahead, once.
    refusals = await fetch(db_url, "SELECT run_id, attempt, kind, worker_id FROM wq_refusals")
    assert sorted(refusals) == sorted((r, 1, "final", owner) for r in run_ids[2:])
    # A handed the four back at the hold's end; it dropped none unwritten before.
    assert [e["count"] for e in events(log, "claimed_ahead_expired")] == [4]
    assert [e for e in events(log, "lease_lost") if e.get("started") is False] == []
    # A never started the four; its two held plays were its only starts.
    assert (
        await count(db_url, "SELECT count(*) FROM test_prefetch_starts WHERE pid = %s", (a.pid,))
        == 2
    )
