"""Postgres fails over under load (docs/how-to/high-availability.md; docs/design.md,
section 11c): the primary's postmaster is SIGKILLed in the middle of a drain and its
streaming standby promoted, and every process rides it out on the multi-host URL
(``host=127.0.0.1,127.0.0.1 port=P1,P2 ... target_session_attrs=read-write``), with no
restart.

- **Synchronous replication** (``synchronous_standby_names``): every acknowledged submit
  exists once, every run finishes, no acknowledged step or row is missing or done twice
  (the paid side effects are counted in a database of their own, on another server), a
  ``worker result --wait`` under way reports the result, the dashboard reads again, and
  the time from the kill to the first claim on the new primary is printed.
- **Asynchronous replication**: what the guide says can be lost is lost, and nothing else.
  The standby is cut off from its primary (as a lagging standby is) while a batch of runs
  is admitted and finished: after the failover that batch is gone (its submits were
  acknowledged; their steps were paid), nothing is doubled, the batch before it is all
  there, and the system goes on: the lost submits sent again with the same keys are
  admitted again and run, and new ones too.

Every process and both servers are killed at the end, whatever happened (their process
groups; tests/replication.py), and the session's leftover check holds it to that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queues import admission
from queues.errors import DatabaseUnreachable
from tests import dashboards
from tests.apps.durable import SIDE_EFFECTS_DDL
from tests.replication import Pair, failover_pair
from tests.workers import eventually, fetch
from worker import dashboard

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")
APP = "tests.apps.durable:registry"
RELEASE = "t"
ROWS = 9  # rows per run, in chunks of CHUNK, a paid step each
CHUNK = 3
PROMOTE_AFTER_S = 2.0  # the primary is dead this long before the standby is promoted
MAX_OUTAGE = "30s"

pytestmark = pytest.mark.timeout(120)


def rows(n: int = ROWS) -> list[tuple[str, Any]]:
    return [(f"r{i}", {"i": i}) for i in range(n)]


def paid_rows(key: str, *, delay_s: float = 0.1) -> admission.Submission:
    return admission.Submission(
        play="paid-rows",
        params={"chunk": CHUNK, "chunk_delay_s": delay_s},
        release=RELEASE,
        idempotency_key=key,
    )


@dataclass
class Acked:
    key: str
    run_id: uuid.UUID
    at: float  # time.time() of the acknowledgement
    tries: int


@dataclass
class Processes:
    """The test's `worker` processes, each in its own session, killed (its group) at the
    end whatever happened."""

    tmp: Path
    env: dict[str, str]
    started: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    async def start(self, name: str, *args: str) -> asyncio.subprocess.Process:
        with (self.tmp / f"{name}.log").open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                WORKER,
                "--json-logs",
                *args,
                cwd=ROOT,
                env=self.env,
                stdout=asyncio.subprocess.PIPE if name.startswith("result") else log,
                stderr=log,
                start_new_session=True,
            )
        self.started[name] = proc
        return proc

    async def worker(self, name: str) -> asyncio.subprocess.Process:
        ready = self.tmp / f"{name}.ready"
        proc = await self.start(
            name,
            *("start", "--release", RELEASE, "--app", APP, "--concurrency", "4"),
            *("--max-outage", MAX_OUTAGE, "--grace", "1s", "--ready-file", str(ready)),
        )

        async def is_ready() -> bool:
            assert proc.returncode is None, self.log(name)
            return ready.exists()

        await eventually(is_ready, timeout=30)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-4000:]

    def alive(self, name: str) -> bool:
        return self.started[name].returncode is None

    async def close(self) -> None:
        for proc in self.started.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.started.values():
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()


@contextlib.asynccontextmanager
async def processes(pair: Pair, side_effects_url: str, tmp: Path) -> AsyncIterator[Processes]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "WORKER_HOME", "WORKER_RELEASE", "WORKER_APP", "PGAPPNAME"}
    }
    env.update(
        WORKER_DATABASE_URL=pair.url(),  # both hosts, the one that takes writes
        TEST_SIDE_EFFECTS_URL=side_effects_url,
        PYTHONPATH=str(ROOT),
        WORKER_OBSERVE_POLL_S="0.5",
    )
    procs = Processes(tmp, env)
    try:
        yield procs
    finally:
        await procs.close()


@pytest.fixture
async def side_effects(db_url: str) -> str:
    """The app's own database (the plays' paid calls), on another server than the pair."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SIDE_EFFECTS_DDL)
    return db_url


async def submit_acked(url: str, sub: admission.Submission) -> Acked:
    """Submit as an admitting app does: a connection per submit, and during an outage the
    same submit again, with the same idempotency key, until it is acknowledged."""
    assert sub.idempotency_key is not None
    tries = 0
    while True:
        tries += 1
        try:
            async with await psycopg.AsyncConnection.connect(
                url, autocommit=True, connect_timeout=3
            ) as conn:
                admitted = await admission.submit(conn, sub, inputs=rows())
            return Acked(sub.idempotency_key, admitted.run_id, time.time(), tries)
        except (psycopg.OperationalError, DatabaseUnreachable):
            await asyncio.sleep(0.2)


async def keep_submitting(url: str, stop: asyncio.Event, acked: list[Acked]) -> None:
    n = 0
    while not stop.is_set():
        acked.append(await submit_acked(url, paid_rows(f"live-{n}")))
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def all_finished(url: str) -> bool:
    rows_ = await fetch(url, "SELECT count(*) FROM wq_runs WHERE state::text <> 'succeeded'")
    return bool(rows_[0][0] == 0)


async def check_runs_once(url: str, side_effects_url: str, acked: Sequence[Acked]) -> None:
    """Every acknowledged submit exists once, as the run it was acknowledged as, and every
    run has all its rows done once, a receipt for each of its paid steps, and each step
    paid exactly once."""
    keyed = await fetch(
        url, "SELECT idempotency_key, array_agg(id) FROM wq_runs GROUP BY idempotency_key"
    )
    by_key = {key: ids for key, ids in keyed}
    for a in acked:
        assert by_key.get(a.key) == [a.run_id], (a, by_key.get(a.key))
    sheets = await fetch(
        url,
        "SELECT r.id, count(s.row_key) FILTER (WHERE s.status = 'done'), count(s.row_key) "
        "FROM wq_runs r LEFT JOIN wq_sheet_rows s ON s.sheet = 's-' || r.id::text "
        "GROUP BY r.id",
    )
    assert sheets and all(done == total == ROWS for _, done, total in sheets), sheets
    receipts = await fetch(
        url,
        "SELECT r.id, count(x.step_key) FROM wq_runs r LEFT JOIN wq_receipts x "
        "ON x.scope = 'run:' || r.id::text AND x.status = 'completed' GROUP BY r.id",
    )
    assert all(n == ROWS for _, n in receipts), receipts
    paid = await fetch(
        side_effects_url,
        "SELECT run_id, count(*), count(DISTINCT key) FROM test_side_effects GROUP BY run_id",
    )
    by_run = {run_id: (n, distinct) for run_id, n, distinct in paid}
    for run_id, _, _ in sheets:
        assert by_run.get(run_id) == (ROWS, ROWS), (run_id, by_run.get(run_id))


async def test_a_synchronous_failover_loses_nothing_and_runs_nothing_twice(
    side_effects: str, tmp_path: Path
) -> None:
    async with (
        failover_pair(synchronous=True) as pair,
        processes(pair, side_effects, tmp_path) as procs,
    ):
        url = pair.url()
        await asyncio.gather(procs.worker("w1"), procs.worker("w2"))
        await procs.start("recover", "recover", "--every", "2s", "--max-outage", MAX_OUTAGE)
        running = await dashboard.start(
            reader_url=url, worker_url=url, secret=dashboards.SECRET, port=0
        )
        stop = asyncio.Event()
        acked: list[Acked] = []
        submitting: asyncio.Task[None] | None = None
        try:
            # A long run the waiting client follows through the failover, and a backlog.
            # (Its chunks are slow: it is running when the primary dies, and after.)
            awaited = await submit_acked(url, paid_rows("awaited", delay_s=2.0))
            acked.append(awaited)
            for i in range(8):
                acked.append(await submit_acked(url, paid_rows(f"backlog-{i}")))
            submitting = asyncio.create_task(keep_submitting(url, stop, acked))
            result = await procs.start(
                "result",
                *("result", str(awaited.run_id), "--wait", "--json"),
                *("--max-outage", MAX_OUTAGE),
            )

            async def draining() -> bool:
                # Runs have finished, the awaited one runs, its waiter listens.
                found = await fetch(
                    url,
                    "SELECT (SELECT count(*) FROM wq_runs WHERE state::text = 'succeeded'), "
                    "(SELECT state::text FROM wq_runs WHERE id = %s), "
                    "(SELECT count(*) FROM pg_stat_activity WHERE application_name = 'wq-result')",
                    (awaited.run_id,),
                )
                succeeded, state, waiting = found[0]
                return bool(succeeded >= 2 and state == "running" and waiting >= 1)

            await eventually(draining, timeout=30)
            async with dashboards.logged_in(running.url) as client:
                assert (await client.get("/runs")).status_code == 200
                killed = await asyncio.to_thread(pair.kill_primary)
                await asyncio.sleep(PROMOTE_AFTER_S)  # the failover's own delay
                await asyncio.to_thread(pair.promote)
                promoted = time.time()

                # The dashboard reads again (its next live update), without a restart.
                async def live() -> bool:
                    page = await client.get("/runs", headers={"X-Live": "1"})
                    return page.status_code == 200

                await eventually(live, timeout=20)

            async def admitted_since() -> bool:
                return sum(a.at > promoted for a in acked) >= 3

            await eventually(admitted_since, timeout=30)
            stop.set()
            await submitting
            await eventually(lambda: all_finished(url), timeout=60)
            out, _ = await asyncio.wait_for(result.communicate(), 30)
        finally:
            stop.set()
            if submitting is not None and not submitting.done():
                submitting.cancel()
            await running.stop()

        # The waiting client rode the failover out (it saw the database go) and reported
        # the result, which came after the kill.
        assert result.returncode == 0, procs.log("result")
        assert "database_unavailable" in procs.log("result")
        shown = json.loads(out)
        assert shown["id"] == str(awaited.run_id) and shown["state"] == "succeeded"
        ((ended_after_kill,),) = await fetch(
            url,
            "SELECT finished_at > to_timestamp(%s) FROM wq_runs WHERE id = %s",
            (killed, awaited.run_id),
        )
        assert ended_after_kill
        # Every process rode it out: none exited.
        assert all(procs.alive(name) for name in ("w1", "w2", "recover")), [
            procs.log(name) for name in ("w1", "w2", "recover")
        ]
        # Submits met the outage and were acknowledged once sent again, as the same runs.
        assert any(a.tries > 1 for a in acked), acked
        await check_runs_once(url, side_effects, acked)
        ((first_claim,),) = await fetch(
            url,
            "SELECT extract(epoch FROM min(started_at)) FROM wq_attempts "
            "WHERE started_at > to_timestamp(%s)",
            (killed,),
        )
        assert first_claim is not None
        print(
            f"failover: primary killed, standby promoted {PROMOTE_AFTER_S:g}s later; "
            f"first claim {float(first_claim) - killed:.2f}s after the kill "
            f"({float(first_claim) - promoted:.2f}s after the promotion); "
            f"{len(acked)} submits acknowledged, "
            f"{sum(a.tries > 1 for a in acked)} of them sent again during the outage"
        )


async def test_an_asynchronous_failover_loses_only_what_the_standby_did_not_have(
    side_effects: str, tmp_path: Path
) -> None:
    async with (
        failover_pair(synchronous=False) as pair,
        processes(pair, side_effects, tmp_path) as procs,
    ):
        url = pair.url()
        await procs.worker("w1")
        kept = [await submit_acked(url, paid_rows(f"kept-{i}", delay_s=0)) for i in range(3)]
        await eventually(lambda: all_finished(url), timeout=30)
        await asyncio.to_thread(pair.caught_up)
        # The standby is cut off (it streams nothing more), as a lagging one is: what the
        # primary acknowledges from now on, it does not have.
        await asyncio.to_thread(pair.cut_off_standby)
        lost = [await submit_acked(url, paid_rows(f"lost-{i}", delay_s=0)) for i in range(3)]
        await eventually(lambda: all_finished(url), timeout=30)
        paid_before = await fetch(
            side_effects,
            "SELECT count(*) FROM test_side_effects WHERE run_id = ANY(%s)",
            ([a.run_id for a in lost],),
        )
        assert paid_before[0][0] == 3 * ROWS  # their steps ran, and were paid
        await asyncio.to_thread(pair.kill_primary)
        await asyncio.to_thread(pair.promote)

        # The acknowledged submits the standby did not have are gone; the rest is there.
        gone = await fetch(
            url,
            "SELECT count(*) FROM wq_runs WHERE id = ANY(%s)",
            ([a.run_id for a in lost],),
        )
        assert gone[0][0] == 0
        # The system goes on, on the same worker: the lost submits sent again with their
        # keys are admitted again (new runs: the old ones never reached the standby), and
        # new submits too; all of them finish.
        again = [await submit_acked(url, paid_rows(a.key, delay_s=0)) for a in lost]
        assert {a.run_id for a in again}.isdisjoint({a.run_id for a in lost})
        fresh = [await submit_acked(url, paid_rows(f"new-{i}", delay_s=0)) for i in range(2)]
        await eventually(lambda: all_finished(url), timeout=30)
        assert procs.alive("w1"), procs.log("w1")
        # Nothing is doubled: every key once, every row and receipt once per run; and each
        # run that exists paid each of its steps once (the lost runs' steps were paid on
        # the old primary: the runs sent again paid them again, as the guide says).
        await check_runs_once(url, side_effects, [*kept, *again, *fresh])
