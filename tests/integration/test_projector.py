"""The ledger's outbox delivered for real: projectors on their own connections, a real HTTP
receiver on 127.0.0.1 (``http.server`` in a thread, recording every request with its
Idempotency-Key), a real in-process worker, and the CLI as subprocesses.

Time is controlled through ``now`` wherever a lease or a retry is decided; every wait for a
state polls with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from queues import admission, lanes, ledger, runs
from queues.sheets import Disposition, RowCompletion
from tests.attempts import T0
from tests.workers import eventually, running_worker, submit
from worker import observe, projector
from worker.cli import ledger as cli_ledger
from worker.context import RunContext
from worker.plays import Registry

WORKER = str(Path(sys.executable).parent / "worker")
DEADLINE_S = 30.0
Conn = psycopg.AsyncConnection[Any]


# ---- a real HTTP receiver ------------------------------------------------------------------


@dataclass
class Receiver:
    """Records every POST; answers 500 to the first ``fail_first`` of them, then 200.

    ``applied`` is the receiver's own effect, deduped on Idempotency-Key the way a real
    consumer must: a replayed delivery is answered 200 and applied once."""

    fail_first: int = 0
    status: int = 200  # the answer once the failures are spent
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def keys(self) -> Counter[str]:
        with self.lock:
            return Counter(key for key, _ in self.requests)

    def handle(self, key: str, body: dict[str, Any]) -> int:
        with self.lock:
            self.requests.append((key, body))
            if len(self.requests) <= self.fail_first:
                return 500
            if self.status == 200:
                self.applied.setdefault(key, body)
            return self.status


@contextlib.contextmanager
def receiving(fail_first: int = 0, delay_s: float = 0.0, status: int = 200) -> Iterator[Receiver]:
    receiver = Receiver(fail_first=fail_first, status=status)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if delay_s:
                threading.Event().wait(delay_s)  # a slow consumer (keeps deliveries in flight)
            status = receiver.handle(self.headers.get("Idempotency-Key") or "", body)
            answer = b"ok" if status == 200 else b"try again later"
            self.send_response(status)
            if status in (301, 302, 303, 307, 308):
                self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/events"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        serving.join(timeout=10)


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[Conn]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        yield conn


async def all_events(conn: Conn) -> list[runs.Event]:
    cur = await conn.execute("SELECT DISTINCT run_id FROM wq_ledger")
    found: list[runs.Event] = []
    for (run_id,) in await cur.fetchall():
        found += await runs.events(conn, run_id)
    return found


async def deliveries(conn: Conn, sink: str) -> list[tuple[str, int, str | None, Any]]:
    """(status, attempts, last_error, delivered_at) of a sink's outbox rows."""
    cur = await conn.execute(
        "SELECT status::text, attempts, last_error, delivered_at FROM wq_outbox"
        " WHERE sink = %s ORDER BY id",
        (sink,),
    )
    return list(await cur.fetchall())


# ---- projectors racing ---------------------------------------------------------------------


async def test_two_projectors_racing_never_deliver_a_row_twice(db_url: str) -> None:
    with receiving(delay_s=0.01) as receiver:
        async with connect(db_url) as conn:
            await ledger.add_sink(conn, "crm", receiver.url)
            await lanes.prepare(conn, "race")
            for n in range(12):
                admitted = await admission.submit(
                    conn, admission.Submission(play="p", params={"n": n}, release="race")
                )
                for i in range(4):
                    await ledger.append(conn, admitted.run_id, "note", {"i": i})
            events = await all_events(conn)
        assert len(events) == 12 * 5

        async def project(owner: str) -> int:
            done = 0
            async with connect(db_url) as conn:
                while True:
                    report = await projector.project_once(conn, owner, limit=7)
                    done += report.delivered
                    assert report.lost == 0
                    if report.leased == 0:
                        return done

        one, two = await asyncio.wait_for(
            asyncio.gather(project("projector-1"), project("projector-2")), DEADLINE_S
        )
    # Both took part, every delivery was made by one of them, and the receiver got each
    # event exactly once, with its key.
    assert one > 0 and two > 0
    assert one + two == len(events)  # the crm delivery of each event
    keys = receiver.keys()
    assert keys == Counter({f"{e.run_id}:{e.seq}": 1 for e in events})
    for key, body in receiver.requests:
        assert key == f"{body['run_id']}:{body['seq']}"
    async with connect(db_url) as conn:
        rows = await deliveries(conn, "crm")
    assert len(rows) == len(events)
    assert {(status, attempts) for status, attempts, _, _ in rows} == {("delivered", 1)}


# ---- a failing sink ------------------------------------------------------------------------


async def test_a_failing_sink_is_retried_with_backoff_until_delivered(db_url: str) -> None:
    with receiving(fail_first=3) as receiver:
        async with connect(db_url) as conn:
            await ledger.add_sink(conn, "crm", receiver.url)
            await submit(db_url, "p", release="fail")
            now, waits = T0, []
            rng = random.Random(7)
            while receiver.keys().total() < 4:
                report = await projector.project_once(conn, "p1", now=now, rng=rng)
                [(status, attempts, error, _)] = await deliveries(conn, "crm")
                assert attempts == receiver.keys().total()
                if status == "delivered":
                    break
                assert report.failed == 1 and error == "HTTP 500: try again later"
                cur = await conn.execute("SELECT next_attempt_at FROM wq_outbox WHERE sink = 'crm'")
                ((due,),) = await cur.fetchall()
                # Not due before its retry time: a pass then leaves it alone.
                early = await projector.project_once(conn, "p1", now=due - timedelta(seconds=0.01))
                assert early.leased == 0
                waits.append((due - now).total_seconds())
                now = due
            [(status, attempts, error, delivered_at)] = await deliveries(conn, "crm")
    assert (status, attempts, error) == ("delivered", 4, None)
    assert delivered_at == now
    # Exponential: about 1 s, 2 s, 4 s (+-10% jitter), each counted from its attempt.
    assert len(waits) == 3
    for n, wait in enumerate(waits):
        assert 2**n * 0.9 <= wait <= 2**n * 1.1
    # Four requests, one event, one key; applied once by the receiver.
    assert list(receiver.keys().values()) == [4]
    assert len(receiver.applied) == 1


async def test_redirects_and_connection_errors_are_failed_deliveries(db_url: str) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    nobody = f"http://127.0.0.1:{closed.getsockname()[1]}/events"
    closed.close()  # nothing listens there now
    with receiving(status=302) as moved:
        async with connect(db_url) as conn:
            await ledger.add_sink(conn, "moved", moved.url)
            await ledger.add_sink(conn, "nobody", nobody)
            await submit(db_url, "p", release="errors")
            report = await projector.project_once(conn, "p1", now=T0)
            errors = {
                sink: error
                for sink, error in await (
                    await conn.execute("SELECT sink, last_error FROM wq_outbox")
                ).fetchall()
            }
    assert (report.leased, report.delivered, report.failed) == (2, 0, 2)
    assert errors["moved"].startswith("HTTP 302")  # never followed: POSTed once, not delivered
    assert moved.keys().total() == 1 and not moved.applied
    assert errors["nobody"].startswith("connection failed")


# ---- a replayed delivery -------------------------------------------------------------------


async def test_a_delivery_replayed_after_its_lease_lapsed_is_deduped_by_its_key(
    db_url: str,
) -> None:
    with receiving() as receiver:
        async with connect(db_url) as a_conn, connect(db_url) as b_conn:
            await ledger.add_sink(a_conn, "crm", receiver.url)
            run_id = await submit(db_url, "p", release="replay")
            # Projector A leases the delivery and sends it...
            [crm] = [
                d
                for d in await ledger.lease_deliveries(a_conn, "A", 10, 30.0, now=T0)
                if d.sink == "crm"
            ]
            body = json.dumps(crm.body()).encode()
            assert (
                await asyncio.to_thread(
                    projector.post_json, receiver.url, body, projector.headers_for(crm), 5.0
                )
                is None
            )
            # ...but its lease lapses before it can mark it (a pause, a lost connection).
            # Projector B takes the delivery over and delivers it again.
            later = crm.lease_expires_at + timedelta(seconds=1)
            report = await projector.project_once(b_conn, "B", now=later)
            assert report.delivered >= 1
            # A's late mark is refused: B's lease owns the row now, and B marked it.
            assert await ledger.mark_delivered(a_conn, "A", [crm.id], now=later) == []
            [(status, attempts, _, _)] = await deliveries(a_conn, "crm")
    assert (status, attempts) == ("delivered", 2)
    # The receiver saw the event twice under one key, and applied it once.
    key = f"{run_id}:1"
    assert receiver.keys() == Counter({key: 2})
    assert [b for k, b in receiver.requests] == [crm.body(), crm.body()]
    assert list(receiver.applied) == [key]


# ---- progress follows a real run -----------------------------------------------------------

plays = Registry()


@plays.play("paged")
async def paged(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Admit and complete its input page by page; after each page, wait for the test's
    go-ahead (the run sleeps, so the test sees a stable state between pages)."""
    sheet = ctx.sheet(f"paged-{ctx.run_id}")
    pages = 0
    async for page in ctx.input_pages():
        admitted = await sheet.admit(page, stable_intent=True)
        open_keys = admitted.keys(Disposition.ADMITTED) + admitted.keys(Disposition.READMITTED)
        if open_keys:
            await sheet.complete([RowCompletion(key, {"page": pages}) for key in open_keys])
        pages += 1
        await ctx.wait_for_event(f"page-{pages}", timeout=120)
    return {"pages": pages}


async def test_the_progress_projection_follows_a_real_run_and_observe_reads_it(
    db_url: str,
) -> None:
    rows = [(f"r{i:04d}", {"i": i}) for i in range(1500)]  # two input pages: 1000 + 500
    lines: list[str] = []
    with receiving() as receiver:
        async with connect(db_url) as conn:
            await ledger.add_sink(conn, "crm", receiver.url)
        run_id = await submit(db_url, "paged", release="prog", inputs=rows)
        following = asyncio.create_task(observe.follow(db_url, run_id, lines.append))

        async def projected(state: str, done: int) -> ledger.Progress | None:
            async with connect(db_url) as conn:
                seen = await ledger.progress(conn, run_id)
            ok = seen and (seen.state, seen.rows_done) == (state, done) and not seen.behind
            return seen if ok else None

        async def observed(text: str) -> bool:
            return any(text in line for line in lines)

        async with running_worker(db_url, plays, release="prog"):
            first = await eventually(lambda: projected("sleeping", 1000), timeout=DEADLINE_S)
            assert (first.rows_admitted, first.attempt) == (1000, 1)
            await eventually(lambda: observed("1000/1500 rows"), timeout=DEADLINE_S)
            async with connect(db_url) as conn:
                await runs.emit(conn, org="default", name="page-1")
            second = await eventually(lambda: projected("sleeping", 1500), timeout=DEADLINE_S)
            assert second.rows_admitted == 1500 and second.attempt == 2
            async with connect(db_url) as conn:
                await runs.emit(conn, org="default", name="page-2")
            final = await eventually(lambda: projected("succeeded", 1500), timeout=DEADLINE_S)
            assert final.attempt == 3
            code = await asyncio.wait_for(following, DEADLINE_S)
            async with connect(db_url) as conn:
                events = await runs.events(conn, run_id)
            # The worker's own projector delivered every event to the HTTP sink, once.
            await eventually(
                lambda: _received(receiver, len(events)), timeout=DEADLINE_S, interval=0.05
            )
    assert code == 0
    bars = [line.split(" (")[0].strip() for line in lines if " rows (" in line]
    assert bars == [
        "0/1500 rows",
        "1000/1500 rows",
        "1500/1500 rows",
    ]
    assert f"run {run_id} succeeded" in lines[-1]
    assert final.last_event_seq == events[-1].seq
    assert receiver.keys() == Counter({f"{run_id}:{e.seq}": 1 for e in events})
    kinds = [e.kind for e in events]
    assert kinds.count("rows_admitted") == 2 and kinds.count("rows_completed") == 2


async def _received(receiver: Receiver, count: int) -> bool:
    return receiver.keys().total() >= count


# ---- seq under concurrent appends ----------------------------------------------------------


async def test_seq_is_gapless_and_in_commit_order_under_concurrent_appends(db_url: str) -> None:
    """Four connections append to one run at once, in transactions of one to three events
    that stay open across awaits (so commits interleave out of id order), while a follower
    reads by seq. The seqs are exactly 1..N, and the follower, reading after the last seq it
    saw, never misses an event (a seq derived from id order would renumber under it)."""
    run_id = await submit(db_url, "p", release="seq")
    writers, per_writer = 4, 24
    done = asyncio.Event()

    async def write(n: int) -> None:
        rng = random.Random(n)
        async with connect(db_url) as conn:
            appended = 0
            while appended < per_writer:
                size = min(rng.randint(1, 3), per_writer - appended)
                async with conn.transaction():
                    for _ in range(size):
                        await ledger.append(conn, run_id, "note", {"writer": n, "i": appended})
                        appended += 1
                        await asyncio.sleep(rng.random() * 0.003)

    async def follow() -> list[runs.Event]:
        seen: list[runs.Event] = []
        async with connect(db_url) as conn:
            while True:
                finished = done.is_set()
                for event in await runs.events(conn, run_id, after=seen[-1].seq if seen else 0):
                    seen.append(event)
                if finished:
                    return seen
                await asyncio.sleep(0.001)

    follower = asyncio.create_task(follow())
    await asyncio.wait_for(asyncio.gather(*(write(n) for n in range(writers))), DEADLINE_S)
    done.set()
    followed = await asyncio.wait_for(follower, DEADLINE_S)
    async with connect(db_url) as conn:
        stored = await runs.events(conn, run_id)
    total = 1 + writers * per_writer  # run_created and the notes
    assert [e.seq for e in stored] == list(range(1, total + 1))
    assert followed == stored
    # Each writer's own events keep their order.
    for n in range(writers):
        mine = [e.data["i"] for e in stored if e.data.get("writer") == n]
        assert mine == list(range(per_writer))


async def test_seq_is_commit_order_where_id_order_would_renumber(db_url: str) -> None:
    """The interleaving that makes a seq derived from ids unstable, held on purpose: B
    draws its id, then waits for the run's seq lock that A holds; A appends again (a later
    id) and commits. Stored seqs follow the commits and never change; row_number() over the
    ids would have given A's second event a seq that later moves. The ids are those of the
    ledger readers see; run_created, which its run row may stand for (no id), comes first."""
    run_id = await submit(db_url, "p", release="order")
    by_id = (
        "SELECT e.id, row_number() OVER (ORDER BY e.id NULLS FIRST) FROM wq_ledger e"
        " WHERE e.run_id = %s"
    )
    appended, release = asyncio.Event(), asyncio.Event()

    async def b_appends(conn: Conn) -> runs.Event:
        async with conn.transaction():
            event = await ledger.append(conn, run_id, "note", {"who": "b"})
            appended.set()
            await release.wait()  # committed only when the test says so
        return event

    async with connect(db_url) as a, connect(db_url) as b, connect(db_url) as reader:
        cur = await b.execute("SELECT pg_backend_pid()")
        ((b_pid,),) = await cur.fetchall()

        async def b_waits_for_the_lock() -> bool:
            cur = await reader.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (b_pid,)
            )
            return (await cur.fetchone()) == ("Lock",)

        async with a.transaction():
            first = await ledger.append(a, run_id, "note", {"who": "a"})
            b_task = asyncio.create_task(b_appends(b))
            await eventually(b_waits_for_the_lock, timeout=DEADLINE_S)
            third = await ledger.append(a, run_id, "note", {"who": "c"})
        await asyncio.wait_for(appended.wait(), DEADLINE_S)
        # A committed both; B's event is written, not committed.
        assert [(e.seq, e.data["who"]) for e in (await runs.events(reader, run_id))[1:]] == [
            (2, "a"),
            (3, "c"),
        ]
        assert dict(await (await reader.execute(by_id, (run_id,))).fetchall())[third.id] == 3
        release.set()
        second = await asyncio.wait_for(b_task, DEADLINE_S)
        stored = await runs.events(reader, run_id)
        renumbered = dict(await (await reader.execute(by_id, (run_id,))).fetchall())
    assert first.id < second.id < third.id  # ids drawn in this order...
    assert (first.seq, third.seq, second.seq) == (2, 3, 4)  # ...committed in this one
    assert [e.seq for e in stored] == [1, 2, 3, 4]
    assert stored[2].id == third.id  # seq 3 is still A's second event
    assert renumbered[third.id] == 4  # where id order would now say 4


# ---- the CLI -------------------------------------------------------------------------------


def _env(db_url: str) -> dict[str, str]:
    return dict(os.environ, WORKER_DATABASE_URL=db_url)


async def _cli(db_url: str, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        WORKER,
        *args,
        env=_env(db_url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), DEADLINE_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_worker_events_prints_the_ledger_as_json_lines_and_follows_it(
    db_url: str,
) -> None:
    run_id = await submit(db_url, "p", release="cli")
    async with connect(db_url) as conn:
        await ledger.append(conn, run_id, "note", {"text": "hello"}, idempotency_key="k")
    code, out, _ = await _cli(db_url, "events", str(run_id), "--json")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(e["seq"], e["kind"]) for e in lines] == [(1, "run_created"), (2, "note")]
    for event in lines:
        at = datetime.fromisoformat(event["at"])  # ISO 8601, with its offset
        assert at.tzinfo is not None and at.utcoffset() is not None
        assert event["run_id"] == str(run_id)
    assert lines[1]["data"] == {"text": "hello"} and lines[1]["idempotency_key"] == "k"
    code, text, _ = await _cli(db_url, "events", str(run_id))
    assert code == 0 and "note" in text.splitlines()[1] and '{"text": "hello"}' in text

    # --follow: prints what is there, then new events, until the run ends.
    follower = await asyncio.create_subprocess_exec(
        WORKER,
        "events",
        str(run_id),
        "--follow",
        "--json",
        env=_env(db_url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert follower.stdout is not None
    seen = []
    for _ in range(2):
        seen.append(json.loads(await asyncio.wait_for(follower.stdout.readline(), DEADLINE_S)))
    async with connect(db_url) as conn:
        await ledger.append(conn, run_id, "note", {"text": "later"})
        await runs.cancel(conn, run_id, reason="done")
    rest, _ = await asyncio.wait_for(follower.communicate(), DEADLINE_S)
    seen += [json.loads(line) for line in rest.decode().splitlines()]
    assert follower.returncode == 0
    assert [e["kind"] for e in seen] == ["run_created", "note", "note", "run_cancelled"]
    assert [e["seq"] for e in seen] == [1, 2, 3, 4]

    code, _, err = await _cli(db_url, "events", str(uuid.uuid4()))
    assert code == 2 and "error[RUN_NOT_FOUND]" in err


async def test_worker_sinks_add_list_disable(db_url: str) -> None:
    code, out, _ = await _cli(db_url, "sinks", "add", "crm", "--url", "https://u:pw@example.com/h")
    assert code == 0 and "sink crm added: https://u:***@example.com/h" in out
    code, out, _ = await _cli(db_url, "sinks", "list", "--json")
    listed = {s["name"]: s for s in json.loads(out)}
    assert code == 0 and set(listed) == {"crm", "progress"}
    assert listed["crm"]["url"] == "https://u:***@example.com/h" and listed["crm"]["enabled"]
    code, out, _ = await _cli(db_url, "sinks", "disable", "crm")
    assert code == 0 and "disabled" in out
    code, out, _ = await _cli(db_url, "sinks", "list")
    assert code == 0 and any(
        line.startswith("crm") and "disabled" in line for line in out.splitlines()
    )
    code, _, err = await _cli(db_url, "sinks", "disable", "crn")
    assert code == 2 and "error[FIELD_INVALID]" in err and "did you mean 'crm'" in err
    code, _, err = await _cli(db_url, "sinks", "add", "x", "--url", "ftp://example.com")
    assert code == 2 and "--url" in err


async def test_a_projector_is_woken_by_the_outbox_it_has_to_deliver(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listening projector that polls once an hour: appends with no HTTP sink enabled do
    not wake it (it ran a pass for every append when it listened to the ledger); once a
    sink is enabled, a new event is delivered at once: only the outbox's notification
    (migration 0033) can wake it.

    That the appends sent no wake is read on a session of the test's own that listens on
    the projectors' channel: a marker notified after them arrives after anything they sent
    (notifications come in commit order), and the projector does not listen for it."""
    passes = 0
    project_once = projector.project_once

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal passes
        passes += 1
        return await project_once(*args, **kwargs)

    monkeypatch.setattr(projector, "project_once", counted)
    with receiving() as receiver:
        async with connect(db_url) as conn, connect(db_url) as listener:
            await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(projector.CHANNEL)))
            await listener.execute("LISTEN wq_test_marker")
            stop = asyncio.Event()
            projecting = asyncio.create_task(
                projector.project_forever(db_url, stop, owner="woken", poll_s=3600)
            )
            try:

                async def listening() -> bool:
                    # Its session's first statement is the LISTEN: once it has run one
                    # and waits, it listens.
                    cur = await conn.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'wq-projector woken%%'"
                        " AND state = 'idle' AND query <> ''"
                    )
                    row = await cur.fetchone()
                    return row is not None and row[0] == 1

                await eventually(listening, timeout=DEADLINE_S)
                assert passes == 1  # the first, at start
                for _ in range(5):  # five runs admitted, each its own append: no sink
                    await submit(db_url, "p", release="woken")
                await conn.execute("NOTIFY wq_test_marker")
                heard: list[str] = []
                async for note in listener.notifies(timeout=DEADLINE_S):
                    heard.append(note.channel)
                    if note.channel == "wq_test_marker":
                        break
                assert heard == ["wq_test_marker"]  # no wake for the projectors came first
                assert passes == 1
                await ledger.add_sink(conn, "woken", receiver.url)
                run_id = await submit(db_url, "p", release="woken")

                async def delivered() -> bool:
                    return receiver.keys()[f"{run_id}:1"] == 1

                await eventually(delivered, timeout=DEADLINE_S)
            finally:
                stop.set()
                await asyncio.wait_for(projecting, DEADLINE_S)


async def test_worker_recover_every_projects_the_outbox_alongside(db_url: str) -> None:
    with receiving() as receiver:
        async with connect(db_url) as conn:
            await ledger.add_sink(conn, "rec-hook", receiver.url)
        recoverer = await asyncio.create_subprocess_exec(
            WORKER,
            "recover",
            "--every",
            "60s",
            env=_env(db_url),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            run_id = await submit(db_url, "p", release="rec")

            async def delivered() -> bool:
                return receiver.keys()[f"{run_id}:1"] == 1

            await eventually(delivered, timeout=DEADLINE_S)
        finally:
            recoverer.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(recoverer.communicate(), DEADLINE_S)
    assert recoverer.returncode == 0, err.decode()[-2000:]


# ---- least privilege -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def login_as(db_url: str, role: str) -> AsyncIterator[str]:
    """A login user in a group role, as a deployment makes one; its URL."""
    name, password = f"t_{role}_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    async with connect(db_url) as admin:
        await admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(name), sql.Literal(password), sql.Identifier(role)
            )
        )
    params = {k: str(v) for k, v in conninfo_to_dict(db_url).items() if v is not None}
    try:
        yield make_conninfo(**(params | {"user": name, "password": password}))
    finally:
        async with connect(db_url) as admin:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


async def test_each_role_does_its_part_of_the_ledger_and_no_more(db_url: str) -> None:
    async with connect(db_url) as admin:
        await lanes.prepare(admin, "roles")
    async with (
        login_as(db_url, "wq_admission") as admitting,
        login_as(db_url, "wq_worker") as working,
        login_as(db_url, "wq_reader") as reading,
    ):
        # Admission appends run_created and folds it (the submit function's rights).
        async with connect(admitting) as conn:
            admitted = await admission.submit(conn, admission.Submission(play="p", release="roles"))
        run_id = admitted.run_id
        # The worker role appends (and folds), configures sinks and projects: the note's
        # delivery is leased, refused by the closed port and recorded as failed.
        async with connect(working) as conn:
            await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/never")
            await ledger.append(conn, run_id, "note", {})
            report = await projector.project_once(conn, "w", timeout_s=2.0)
            assert (report.leased, report.failed) == (1, 1)
        # The reader reads the ledger and the projection, and changes nothing.
        lines: list[str] = []
        assert (
            await cli_ledger.print_events(
                reading, run_id, follow=False, as_json=True, echo=lines.append
            )
            == 0
        )
        assert [json.loads(line)["kind"] for line in lines] == ["run_created", "note"]
        async with connect(reading) as conn:
            seen = await ledger.progress(conn, run_id)
            assert seen is not None and seen.state == "queued" and not seen.behind
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await ledger.append(conn, run_id, "note", {})
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await ledger.add_sink(conn, "mine", "http://127.0.0.1:9/x")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await ledger.lease_deliveries(conn, "reader", 10, 30.0)


async def test_racing_appends_of_one_key_store_one_event(db_url: str) -> None:
    """B appends the key A has appended but not committed: B waits, then answers A's event
    (read in a new statement, after A's commit), and the ledger holds it once."""
    run_id = await submit(db_url, "p", release="key")
    async with connect(db_url) as a, connect(db_url) as b, connect(db_url) as reader:
        cur = await b.execute("SELECT pg_backend_pid()")
        ((b_pid,),) = await cur.fetchall()

        async def b_waits() -> bool:
            cur = await reader.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (b_pid,)
            )
            return (await cur.fetchone()) == ("Lock",)

        async with a.transaction():
            first = await ledger.append(a, run_id, "paid", {"by": "a"}, idempotency_key="inv-1")
            racing = asyncio.create_task(
                ledger.append(b, run_id, "paid", {"by": "b"}, idempotency_key="inv-1")
            )
            await eventually(b_waits, timeout=DEADLINE_S)
        second = await asyncio.wait_for(racing, DEADLINE_S)
        stored = await runs.events(reader, run_id)
    assert second == first and second.data == {"by": "a"}
    assert [e.kind for e in stored] == ["run_created", "paid"]
