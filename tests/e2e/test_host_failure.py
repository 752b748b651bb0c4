"""A worker host cut off the network mid-run (its link pulled, not a clean kill).

Two worker hosts, each a network namespace linked to this one by a veth pair, reach
Postgres through PgBouncer (transaction mode, LISTEN on the session-mode alias), as
`worker start` processes. Host A's link goes down while its attempts run:

- its heartbeat cannot renew, so `queues list` shows it stale (not live) once its
  heartbeat is no longer fresh, and its watchdog stops its attempts;
- its leases lapse, the recovery pass (run here, on the database host) rescues its runs
  and host B finishes them (steps replay from receipts);
- its plays, written not to notice the stop (tests/apps/hosts.py, `late-writer`), send
  their final writes once the link is back: the fence refuses every one (`wq_refusals`),
  none is applied;
- the cut was shorter than `--max-outage`, so host A rejoins: live again, running new work.

Bounded: the lane's lease is 3 s (heartbeat 1 s); the whole test takes 15-20 s. The
namespaces, links, PgBouncer and workers are removed however it ends (also after a killed
earlier run: `bench.hosts.sweep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from bench import hosts
from queues import admission, lanes, recovery
from tests.workers import eventually, fetch

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")
RELEASE = "cut"
CONCURRENCY = 4

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"
)


def _env(url: str, listen_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("DATABASE_URL")}
    env |= {
        "WORKER_DATABASE_URL": url,
        "WORKER_LISTEN_URL": listen_url,
        "WORKER_POOL_MODE": "transaction",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    return env


async def _lane_row(url: str) -> lanes.LaneSummary:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        [row] = [s for s in await lanes.list_lanes(conn) if s.release == RELEASE]
    return row


async def _recover_forever(url: str, stop: asyncio.Event) -> None:
    """The recovery process of the database host: a pass every 0.5 s."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            await recovery.run_once(conn)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def _submit(url: str, n: int, params: dict[str, Any]) -> list[uuid.UUID]:
    tag = uuid.uuid4().hex[:8]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return [
            (
                await admission.submit(
                    conn,
                    admission.Submission(
                        play="late-writer",
                        params=params,
                        release=RELEASE,
                        idempotency_key=f"{tag}-{i}",
                    ),
                )
            ).run_id
            for i in range(n)
        ]


@pytest.mark.slow
async def test_a_host_cut_off_mid_run(db_url: str, tmp_path: Path) -> None:
    params = conninfo_to_dict(db_url)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
        await lanes.set_policy(conn, RELEASE, lease_ttl_s=3, heartbeat_s=1, retry_base_s=0.2)
    stop_recovery = asyncio.Event()
    recovering: asyncio.Task[None] | None = None
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in ("a", "b")}
    with hosts.Hosts(2) as net:
        host_a, host_b = net.hosts
        bouncer = hosts.start_pgbouncer(
            db_url,
            users={str(params["user"]): str(params["password"])},
            listen=net.addresses,
            pool_size=10,
            # A host cut off inside a transaction would keep its row locks (and its runs
            # out of the recovery pass's reach) for as long as PgBouncer keeps it: the
            # README's pooler settings close such a client after a timeout.
            settings={"idle_transaction_timeout": 5},
        )
        try:
            procs: dict[str, subprocess.Popen[bytes]] = {}
            ready: dict[str, Path] = {}
            for name, host in (("a", host_a), ("b", host_b)):
                ready[name] = tmp_path / f"ready-{name}"
                url = bouncer.url(db_url, host=host.address)
                listen = bouncer.url(db_url, host=host.address, session=True)
                procs[name] = net.spawn(
                    host,
                    [
                        WORKER,
                        "--json-logs",
                        "start",
                        "--release",
                        RELEASE,
                        "--app",
                        "tests.apps.hosts:registry",
                        "--concurrency",
                        str(CONCURRENCY),
                        "--grace",
                        "1s",
                        "--ready-file",
                        str(ready[name]),
                    ],
                    env=_env(url, listen),
                    log=logs[name],
                    cwd=ROOT,
                )

            async def both_ready() -> bool:
                for name, proc in procs.items():
                    assert proc.poll() is None, (name, _tail(tmp_path / f"{name}.log"))
                return all(path.exists() for path in ready.values())

            await eventually(both_ready, timeout=30)
            worker_a = json.loads(ready["a"].read_text())["worker_id"]
            worker_b = json.loads(ready["b"].read_text())["worker_id"]
            recovering = asyncio.create_task(_recover_forever(db_url, stop_recovery))

            # Both hosts busy: every run is running, on one host or the other.
            # A's attempts hold their final write until the link is back (the file below):
            # each then reaches the database late, whatever the timing of the cut.
            link_back = tmp_path / "link-back"
            ids = await _submit(
                db_url,
                2 * CONCURRENCY,
                {"sleep_s": 2.5, "hold_on": worker_a, "hold_until": str(link_back)},
            )

            async def owners() -> dict[str, int] | None:
                rows = await fetch(
                    db_url,
                    "SELECT lease_owner, count(*) FROM wq_runs WHERE id = ANY(%s)"
                    " AND state = 'running' GROUP BY 1",
                    (ids,),
                )
                found = {str(owner): int(n) for owner, n in rows}
                return found if found.get(worker_a) and found.get(worker_b) else None

            await eventually(owners, timeout=20)
            on_a = [
                r[0]
                for r in await fetch(
                    db_url,
                    "SELECT id FROM wq_runs WHERE id = ANY(%s) AND lease_owner = %s",
                    (ids, worker_a),
                )
            ]
            assert on_a

            # ---- the cut -------------------------------------------------------------
            cut_at = time.monotonic()
            net.cut(host_a)

            async def a_stale() -> lanes.LaneSummary | None:
                row = await _lane_row(db_url)
                return row if row.stale_workers == 1 and row.live_workers == 1 else None

            stale = await eventually(a_stale, timeout=15)
            assert stale.stale_since is not None

            async def all_succeeded() -> bool:
                rows = await fetch(
                    db_url,
                    "SELECT count(*) FROM wq_runs WHERE id = ANY(%s) AND state = 'succeeded'",
                    (ids,),
                )
                return rows[0][0] == len(ids)

            try:
                await eventually(all_succeeded, timeout=30)
            except AssertionError as exc:
                diag = await fetch(
                    db_url,
                    "SELECT state, now() - xact_start, left(query, 80) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND state <> 'idle'",
                )
                left = await fetch(
                    db_url,
                    "SELECT state::text, lease_owner, attempt, lease_expires_at < now()"
                    " FROM wq_runs WHERE id = ANY(%s) AND state <> 'succeeded'",
                    (ids,),
                )
                raise AssertionError(f"{exc}: {left}\n{diag}") from None
            # A's runs: its attempt lapsed (lease_expired), B's later attempt finished them.
            rescued = await fetch(
                db_url,
                "SELECT r.id, r.result->>'worker', a.outcome::text FROM wq_runs r"
                " JOIN wq_attempts a ON a.run_id = r.id AND a.worker_id = %s"
                " WHERE r.id = ANY(%s)",
                (worker_a, on_a),
            )
            assert {outcome for _, _, outcome in rescued} == {"lease_expired"}
            assert {finisher for _, finisher, _ in rescued} == {worker_b}
            assert procs["a"].poll() is None  # shorter than --max-outage: still up

            # ---- the link comes back ---------------------------------------------------
            net.restore(host_a)
            restored_after = time.monotonic() - cut_at
            link_back.touch()

            async def refused_late_writes() -> list[tuple[Any, ...]] | None:
                rows = await fetch(
                    db_url,
                    "SELECT run_id, kind FROM wq_refusals WHERE worker_id = %s",
                    (worker_a,),
                )
                return rows or None

            try:
                refusals = await eventually(refused_late_writes, timeout=30)
            except AssertionError as exc:
                # Say how long the cut lasted, and what A logged.
                raise AssertionError(
                    f"{exc}: the cut lasted {restored_after:.1f} s\n" + _tail(tmp_path / "a.log")
                ) from None
            # Each late write of A is refused and recorded, each for a run A had an attempt
            # of (A may have claimed one more between the snapshot of on_a and the cut).
            assert {kind for _, kind in refusals} <= {"final", "receipt"}
            attempted_by_a = {
                run_id
                for (run_id,) in await fetch(
                    db_url,
                    "SELECT DISTINCT run_id FROM wq_attempts WHERE worker_id = %s",
                    (worker_a,),
                )
            }
            assert set(on_a) <= attempted_by_a
            assert {run_id for run_id, _ in refusals} <= attempted_by_a
            results = await fetch(
                db_url,
                "SELECT DISTINCT result->>'worker' FROM wq_runs WHERE id = ANY(%s)",
                (on_a,),
            )
            assert results == [(worker_b,)]

            # A rejoins: live again (a fresh heartbeat) and running new work.
            async def rejoined() -> bool:
                row = await _lane_row(db_url)
                return row.live_workers == 2 and row.stale_workers == 0

            await eventually(rejoined, timeout=30)
            # B holds every run it takes until A has finished one: B's slots fill, so the
            # rest wait for A whatever the two hosts' timing (B alone would otherwise finish
            # them all before A's next fetch).
            b_release = tmp_path / "b-release"
            more = await _submit(
                db_url,
                2 * CONCURRENCY,
                {"sleep_s": 0.5, "hold_on": worker_b, "hold_until": str(b_release)},
            )

            async def a_worked() -> bool:
                rows = await fetch(
                    db_url,
                    "SELECT count(*) FROM wq_attempts WHERE run_id = ANY(%s)"
                    " AND worker_id = %s AND outcome = 'succeeded'",
                    (more, worker_a),
                )
                return rows[0][0] > 0

            try:
                await eventually(a_worked, timeout=30)
            except AssertionError as exc:
                states = await fetch(
                    db_url,
                    "SELECT r.state::text, r.lease_owner, r.attempt, count(*) FROM wq_runs r"
                    " WHERE r.id = ANY(%s) GROUP BY 1, 2, 3",
                    (more,),
                )
                raise AssertionError(f"{exc}: {states}\n{_tail(tmp_path / 'a.log')}") from None
            b_release.touch()
            assert procs["a"].poll() is None and procs["b"].poll() is None
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            for name, proc in procs.items():
                assert proc.wait(timeout=20) == 0, _tail(tmp_path / f"{name}.log")
            assert restored_after < 40
        finally:
            stop_recovery.set()
            if recovering is not None:
                await asyncio.gather(recovering, return_exceptions=True)
            (tmp_path / "pgbouncer.log").write_text(bouncer.log())
            bouncer.stop()
            for log in logs.values():
                log.close()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
