"""The transport seam: ``queues/transport.py`` and the ``wq_transport_*`` SQL functions.

Two halves, each test in one rolled-back transaction:

- nothing outside the seam names procrastinate: no statement in ``sql/queries`` and no
  module of ``queues/`` or ``worker/`` (comments included) names a procrastinate table,
  sequence, type, function or trigger (read from the migrated catalog, so whatever a
  procrastinate upgrade adds is covered), a procrastinate NOTIFY channel, our control
  channel or a task name; ``queues/migrations.py``, which installs procrastinate's schema,
  is the one exception;
- each function does what its comment in ``0013_create_transport_seam.sql`` says, against
  the real schema, and the readers are inlined by the planner (what keeps them free).

Multi-connection behaviour (NOTIFY, SKIP LOCKED) is in tests/integration/test_transport.py.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from queues import admission, fields, lanes, recovery, runs, transport
from queues.queries import q

Conn = psycopg.AsyncConnection[Any]
REPO = Path(__file__).resolve().parents[2]
SEAM = {Path("queues/transport.py"), Path("queues/migrations.py")}
# Names the seam owns that are not catalog objects: procrastinate's channels, ours, the
# task names (quoted, so ``wq.run_id`` in a span attribute is not one).
LITERALS = [
    re.compile(r"procrastinate_(any_)?queue_v1"),
    re.compile(r"\bwq_control\b"),
    re.compile(r"""['"]wq\.(run|recovery)['"]"""),
]
# procrastinate_jobs' own column names, which only a statement reading its rows would use.
SQL_ONLY = [re.compile(r"\b(queue_name|task_name)\b")]
LANE_A = "r-seam-a"
LANE_B = "r-seam-b"


async def catalog_names(conn: Conn) -> set[str]:
    """Every procrastinate object of the migrated schema, by name."""
    cur = await conn.execute(
        r"""
        SELECT c.relname FROM pg_class c
         WHERE c.relnamespace = current_schema()::regnamespace
           AND c.relname LIKE 'procrastinate\_%'
        UNION SELECT p.proname FROM pg_proc p
         WHERE p.pronamespace = current_schema()::regnamespace
           AND p.proname LIKE 'procrastinate\_%'
        UNION SELECT t.typname FROM pg_type t
         WHERE t.typnamespace = current_schema()::regnamespace
           AND t.typname LIKE 'procrastinate\_%'
        UNION SELECT g.tgname FROM pg_trigger g WHERE g.tgname LIKE 'procrastinate\_%'
        """
    )
    return {name for (name,) in await cur.fetchall()}


def scanned() -> list[Path]:
    paths = sorted((REPO / "sql" / "queries").glob("*.sql"))
    for package in ("queues", "worker"):
        paths += sorted(p for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts)
    return paths


def findings(path: Path, names: set[str]) -> list[str]:
    """Each place in one file that names something the transport owns."""
    rel = path.relative_to(REPO)
    patterns = LITERALS + (SQL_ONLY if path.suffix == ".sql" else [])
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        tokens = {t for t in re.findall(r"\bprocrastinate_\w+", line) if t in names}
        tokens |= {m.group(0) for pattern in patterns for m in pattern.finditer(line)}
        found += [f"{rel}:{number}: {token}" for token in sorted(tokens)]
    return found


async def test_nothing_outside_the_seam_names_procrastinate(conn: Conn) -> None:
    names = await catalog_names(conn)
    assert {"procrastinate_jobs", "procrastinate_job_status", "procrastinate_workers"} <= names
    files = scanned()
    assert REPO / "sql" / "queries" / "runs.sql" in files
    assert REPO / "worker" / "runtime.py" in files
    leaks = [
        hit for path in files if path.relative_to(REPO) not in SEAM for hit in findings(path, names)
    ]
    assert not leaks, (
        "these name procrastinate's tables, channels or task names outside the transport "
        "seam; go through a wq_transport_* function (sql/migrations/0013) or "
        "queues/transport.py instead:\n" + "\n".join(leaks)
    )


async def test_the_scan_finds_what_the_seam_names(conn: Conn) -> None:
    """The scanner is not blind: the seam itself names every kind of thing it looks for."""
    names = await catalog_names(conn)
    hits = " ".join(findings(REPO / "queues" / "transport.py", names))
    for expected in ("procrastinate_queue_v1", "wq_control", '"wq.run"', '"wq.recovery"'):
        assert expected in hits
    migration = REPO / "sql" / "migrations" / "0013_create_transport_seam.sql"
    hits = " ".join(findings(migration, names))
    for expected in ("procrastinate_jobs", "procrastinate_job_status", "task_name", "'wq.run'"):
        assert expected in hits


async def test_the_longest_lane_fits_its_channel(conn: Conn) -> None:
    assert len(lanes.LANE_PREFIX) + fields.MAX_RELEASE <= transport.LANE_MAX
    longest = lanes.lane_name("v" * fields.MAX_RELEASE)
    channel = transport.lane_channel(longest)
    assert len(channel.encode()) <= transport.CHANNEL_MAX_BYTES
    await conn.execute("SELECT pg_notify(%s, '')", (channel,))  # queued; rolled back
    async with conn.transaction(force_rollback=True):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="too long"):
            await conn.execute("SELECT pg_notify(%s, '')", (channel + "x",))


async def explain(conn: Conn, sql: str) -> str:
    cur = await conn.execute(f"EXPLAIN (VERBOSE, COSTS OFF) {sql}")
    return "\n".join(row[0] for row in await cur.fetchall())


async def test_the_readers_are_inlined(conn: Conn) -> None:
    """The planner sees procrastinate's table, not a function: the caller's plan is the
    plan of the table named in place (an attribute such as STRICT or SET would undo it)."""
    plan = await explain(conn, "SELECT id FROM wq_transport_jobs() j WHERE j.live AND j.id = 1")
    assert "procrastinate_jobs" in plan and "Function Scan" not in plan
    plan = await explain(conn, "SELECT wq_transport_next_id()")
    assert "nextval('procrastinate_jobs_id_seq'::regclass)" in plan
    assert "wq_transport_next_id" not in plan


# ---- the functions -------------------------------------------------------------------------


async def scalar(conn: Conn, sql: str, params: Any = None) -> Any:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def spawn(
    conn: Conn,
    lane: str,
    n: int = 1,
    *,
    at: datetime | None = None,
    priority: int | None = None,
    run_id: uuid.UUID | None = None,
) -> list[tuple[int, uuid.UUID]]:
    ids = [int(await scalar(conn, "SELECT wq_transport_next_id()")) for _ in range(n)]
    run_ids = [run_id or uuid.uuid4() for _ in range(n)]
    spawned = await scalar(
        conn,
        "SELECT wq_transport_spawn(%(ids)s, %(lanes)s, %(runs)s, %(at)s, %(prio)s)",
        {"ids": ids, "lanes": [lane] * n, "runs": run_ids, "at": [at] * n, "prio": [priority] * n},
    )
    assert spawned == n
    return list(zip(ids, run_ids, strict=True))


async def take(
    conn: Conn, lanes_: list[str], limit: int, worker: int | None = None, now: Any = None
) -> set[tuple[int, uuid.UUID | None]]:
    """What the claim statement takes (the order of the answer is not the order of taking)."""
    cur = await conn.execute(
        "SELECT job_id, run_id FROM wq_transport_take(%s, %s, %s, %s)",
        (lanes_, limit, worker, now),
    )
    return set(await cur.fetchall())


async def drop(conn: Conn, ids: list[int]) -> None:
    """Acknowledge delivered jobs, as job_drop does for deliveries no run waits for."""
    await conn.execute("SELECT wq_transport_settle(%s, %s)", (ids, [True] * len(ids)))


async def jobs(conn: Conn, ids: list[int]) -> dict[int, tuple[Any, ...]]:
    cur = await conn.execute(
        "SELECT id, lane, status, scheduled_at, waiting, live FROM wq_transport_jobs()"
        " WHERE id = ANY (%s)",
        (ids,),
    )
    return {row[0]: row[1:] for row in await cur.fetchall()}


async def statuses(conn: Conn, ids: list[int]) -> list[str]:
    found = await jobs(conn, ids)
    return [found[i][1] for i in ids]


async def test_spawn_makes_waiting_jobs_of_the_run_task(conn: Conn) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    [(now_id, now_run)] = await spawn(conn, LANE_A)
    [(later_id, later_run)] = await spawn(conn, LANE_A, at=at, priority=7)
    assert await jobs(conn, [now_id, later_id]) == {
        now_id: (LANE_A, "todo", None, True, True),
        later_id: (LANE_A, "todo", at, True, True),
    }
    cur = await conn.execute(
        "SELECT id, task_name, args, priority FROM procrastinate_jobs WHERE id = ANY (%s)"
        " ORDER BY id",
        ([now_id, later_id],),
    )
    assert await cur.fetchall() == [
        (now_id, transport.TASK_NAME, {"run_id": str(now_run)}, 0),
        (later_id, transport.TASK_NAME, {"run_id": str(later_run)}, 7),
    ]
    # array_agg over nothing: no call needed, nothing spawned.
    assert await scalar(conn, "SELECT wq_transport_spawn(NULL, NULL, NULL)") == 0


async def foreign_job(conn: Conn) -> int:
    """A job of another task on the lane's queue (not a run's)."""
    cur = await conn.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
        " VALUES (%s, 'someone.else', '{}') RETURNING id",
        (LANE_A,),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_jobs_lists_only_run_jobs(conn: Conn) -> None:
    other = await foreign_job(conn)
    [(ours, _)] = await spawn(conn, LANE_A)
    assert list(await jobs(conn, [other, ours])) == [ours]


async def test_job_waiting_probes_one_job(conn: Conn) -> None:
    ids = [job_id for job_id, _ in await spawn(conn, LANE_A, 4)]
    await take(conn, [LANE_A], 2)  # two delivered (doing), two waiting (todo)
    await drop(conn, [ids[0]])
    await conn.execute("SELECT wq_transport_stop(%s)", ([ids[3]],))
    other = await foreign_job(conn)
    probe = (
        "SELECT wq_transport_job_waiting(i) FROM unnest(%s::bigint[]) WITH ORDINALITY AS u (i, o)"
    )
    cur = await conn.execute(probe + " ORDER BY o", ([*ids, other, -1, None],))
    # succeeded, doing, todo, cancelled; another task's, missing, none: never NULL. A
    # delivered job is not waiting: a run still waiting for it lost its claimer (0022).
    assert [live for (live,) in await cur.fetchall()] == [
        False,
        False,
        True,
        False,
        False,
        False,
        False,
    ]
    plan = await explain(conn, "SELECT wq_transport_job_waiting(1)")
    assert "wq_transport_job_waiting" in plan  # called, not inlined into a join


async def test_take_takes_due_jobs_of_the_lanes_in_priority_order(conn: Conn) -> None:
    worker = await transport.register_worker(conn)
    now = datetime.now(UTC)
    first = await spawn(conn, LANE_A, 2)
    [(urgent, urgent_run)] = await spawn(conn, LANE_A, priority=5)
    [(future, _)] = await spawn(conn, LANE_A, at=now + timedelta(minutes=5))
    [(other_lane, _)] = await spawn(conn, LANE_B)
    cur = await conn.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
        " VALUES (%s, %s, %s), (%s, 'someone.else', '{}') RETURNING id",
        (LANE_A, transport.TASK_NAME, Jsonb({"run_id": "not-a-uuid"}), LANE_A),
    )
    garbage, _foreign = [row[0] for row in await cur.fetchall()]

    assert await take(conn, [LANE_A], 2, worker, now) == {(urgent, urgent_run), first[0]}
    assert await take(conn, [LANE_A], 10, worker, now) == {first[1], (garbage, None)}
    assert await take(conn, [LANE_A], 10, worker, now) == set()

    later = await take(conn, [LANE_A, LANE_B], 10, worker, now + timedelta(minutes=6))
    assert {job_id for job_id, _ in later} == {future, other_lane}
    took = [urgent, first[0][0], first[1][0], garbage, future, other_lane]
    assert await statuses(conn, took) == ["doing"] * len(took)
    assert {row[3:] for row in (await jobs(conn, took)).values()} == {(False, True)}
    cur = await conn.execute(
        "SELECT DISTINCT worker_id FROM procrastinate_jobs WHERE id = ANY (%s)", (took,)
    )
    assert await cur.fetchall() == [(worker,)]


async def test_settle_finishes_only_delivered_jobs(conn: Conn) -> None:
    spawned = await spawn(conn, LANE_A, 4)
    ids = [job_id for job_id, _ in spawned]
    await take(conn, [LANE_A], 3)
    settled = "SELECT wq_transport_settle(%(ids)s, %(ok)s)"
    params = {"ids": ids, "ok": [True, False, True, True]}
    assert await scalar(conn, settled, {"ids": ids[:2], "ok": [True, False]}) == 2
    await drop(conn, [ids[2], ids[3]])  # the last one was never delivered
    assert await statuses(conn, ids) == ["succeeded", "failed", "succeeded", "todo"]
    assert await scalar(conn, settled, params) == 0  # nothing delivered is left
    cur = await conn.execute(
        "SELECT attempts FROM procrastinate_jobs WHERE id = ANY (%s) ORDER BY id", (ids,)
    )
    assert [a for (a,) in await cur.fetchall()] == [1, 1, 1, 0]
    assert await scalar(conn, "SELECT wq_transport_settle(NULL, NULL)") == 0


async def test_release_sends_delivered_jobs_back_to_their_lane(conn: Conn) -> None:
    spawned = await spawn(conn, LANE_A, 2)
    ids = [job_id for job_id, _ in spawned]
    worker = await transport.register_worker(conn)
    await take(conn, [LANE_A], 1, worker)
    assert await scalar(conn, "SELECT wq_transport_release(%s)", (ids,)) == 1
    assert await statuses(conn, ids) == ["todo", "todo"]
    cur = await conn.execute(
        "SELECT count(*) FROM procrastinate_jobs WHERE id = ANY (%s) AND worker_id IS NULL",
        (ids,),
    )
    assert await cur.fetchone() == (2,)
    assert await take(conn, [LANE_A], 10) == set(spawned)
    assert await scalar(conn, "SELECT wq_transport_release(NULL)") == 0


async def test_a_dropped_delivery_goes_back_to_its_lane_when_its_run_waits_for_it(
    conn: Conn,
) -> None:
    """The claim takes jobs in a later snapshot than its own, so it can take a job whose
    run it cannot see yet, and drops that delivery; job_drop sends it back to its lane."""
    await lanes.prepare(conn, "seam")
    admitted = await admission.submit(conn, admission.Submission(play="p", release="seam"))
    assert admitted.job_id is not None
    # What such a claim did: it took the run's job and returned the delivery as dropped.
    assert await take(conn, [admitted.lane], 10) == {(admitted.job_id, admitted.run_id)}
    # A stray job of the same run, which the run does not wait for.
    [(stray, _)] = await spawn(conn, admitted.lane, run_id=admitted.run_id)
    await take(conn, [admitted.lane], 10)
    await conn.execute(
        q("job_drop"),
        {
            "job_ids": [admitted.job_id, stray],
            "run_ids": [admitted.run_id] * 2,
            "plays": ["p"],
            "now": None,
        },
    )
    assert await statuses(conn, [admitted.job_id, stray]) == ["todo", "succeeded"]
    claimed = await runs.claim(conn, lanes=[admitted.lane], worker_id="w1", limit=10, plays=["p"])
    assert [(c.claimed, c.run_id, c.attempt) for c in claimed] == [(True, admitted.run_id, 1)]


async def test_a_dropped_delivery_of_a_play_the_release_lacks_fails_its_run_at_once(
    conn: Conn,
) -> None:
    """A claim drops the delivery of a run whose play its release does not have (it can
    never run on this lane); job_drop fails the run with PLAY_UNKNOWN in the same statement
    that acknowledges the job, and never sends it back to the lane. Dropped that way by the
    claim's snapshot or seen first by job_drop's (a run admitted in between), the same."""
    await lanes.prepare(conn, "seam")
    admitted = await admission.submit(conn, admission.Submission(play="gone", release="seam"))
    assert admitted.job_id is not None
    assert await take(conn, [admitted.lane], 10) == {(admitted.job_id, admitted.run_id)}
    await conn.execute(
        q("job_drop"),
        {"job_ids": [admitted.job_id], "run_ids": [admitted.run_id], "plays": ["p"], "now": None},
    )
    assert await statuses(conn, [admitted.job_id]) == ["succeeded"]
    run = await runs.get(conn, admitted.run_id)
    assert run is not None and run.state == "failed" and run.attempt == 0
    assert run.error is not None and run.error["code"] == "PLAY_UNKNOWN"
    events = [e.kind for e in await runs.events(conn, admitted.run_id)]
    assert events == ["run_created", "run_failed"]
    # Settled once: a second drop of the same delivery (a retried statement) changes nothing.
    await conn.execute(
        q("job_drop"),
        {"job_ids": [admitted.job_id], "run_ids": [admitted.run_id], "plays": ["p"], "now": None},
    )
    assert [e.kind for e in await runs.events(conn, admitted.run_id)] == events
    claimed = await runs.claim(conn, lanes=[admitted.lane], worker_id="w1", limit=10, plays=["p"])
    assert claimed == []


async def test_a_late_drop_after_recovery_respawned_the_run_writes_nothing_to_it(
    conn: Conn,
) -> None:
    """A claimer that stalls between its claim and its drop (paused, or its process frozen)
    leaves the run waiting for a delivered job; recovery gives the run a new one (migration
    0022). When the stalled drop comes at last, its failure of the run is fenced by the
    run's job: the run no longer waits for that delivery, so the drop only acknowledges its
    job, and the run fails once, by the claim that takes its new job."""
    await lanes.prepare(conn, "seam")
    admitted = await admission.submit(conn, admission.Submission(play="gone", release="seam"))
    assert await take(conn, [admitted.lane], 10) == {(admitted.job_id, admitted.run_id)}
    report = await recovery.run_once(conn)
    [respawned] = report.respawned
    assert (respawned.run_id, respawned.old_job_status) == (admitted.run_id, "doing")
    await conn.execute(
        q("job_drop"),
        {"job_ids": [admitted.job_id], "run_ids": [admitted.run_id], "plays": ["p"], "now": None},
    )
    run = await runs.get(conn, admitted.run_id)
    assert (run.state, run.job_id) == ("queued", respawned.job_id)
    assert await statuses(conn, [admitted.job_id, respawned.job_id]) == ["succeeded", "todo"]
    claimed = await runs.claim(conn, lanes=[admitted.lane], worker_id="w1", limit=10, plays=["p"])
    assert [(c.claimed, c.run_id, c.job_id) for c in claimed] == [
        (False, admitted.run_id, respawned.job_id)
    ]
    run = await runs.get(conn, admitted.run_id)
    assert run.state == "failed" and run.error is not None
    assert run.error["code"] == "PLAY_UNKNOWN"
    kinds = [e.kind for e in await runs.events(conn, admitted.run_id)]
    assert kinds == ["run_created", "respawned", "run_failed"]


async def test_stop_cancels_waiting_and_aborts_delivered_jobs(conn: Conn) -> None:
    ids = [job_id for job_id, _ in await spawn(conn, LANE_A, 3)]
    await take(conn, [LANE_A], 2)
    await drop(conn, [ids[0]])
    assert await scalar(conn, "SELECT wq_transport_stop(%s)", (ids,)) == 2
    assert await statuses(conn, ids) == ["succeeded", "aborted", "cancelled"]
    assert [live for *_, live in (await jobs(conn, ids)).values()] == [False] * 3
    assert await scalar(conn, "SELECT wq_transport_stop(%s)", (ids,)) == 0


async def test_a_gone_worker_takes_only_the_jobs_it_still_runs(conn: Conn) -> None:
    """A job ended by settle or stop names no worker (migration 0029), and a worker row's
    deletion (procrastinate prunes a stalled worker's row at each start of its own
    worker) reads and changes only the jobs that still name it, through an index: not
    every job in the history, nor every job the worker ran."""
    worker = await transport.register_worker(conn)
    ids = [job_id for job_id, _ in await spawn(conn, LANE_A, 404)]
    assert len(await take(conn, [LANE_A], 404, worker)) == 404
    await drop(conn, ids[:300])
    await conn.execute("SELECT wq_transport_settle(%s, %s)", (ids[300:350], [False] * 50))
    assert await scalar(conn, "SELECT wq_transport_stop(%s)", (ids[350:400],)) == 50
    assert (
        await scalar(
            conn,
            "SELECT count(*) FROM procrastinate_jobs WHERE id = ANY (%s) AND worker_id = %s",
            (ids, worker),
        )
        == 4
    )
    await conn.execute("ANALYZE procrastinate_jobs")
    counters = (
        "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0), n_tup_upd"
        " FROM pg_stat_xact_user_tables WHERE relname = 'procrastinate_jobs'"
    )
    cur = await conn.execute(counters)
    before = await cur.fetchone()
    await conn.execute("DELETE FROM procrastinate_workers WHERE id = %s", (worker,))
    cur = await conn.execute(counters)
    after = await cur.fetchone()
    assert before is not None and after is not None
    read, updated = after[0] - before[0], after[1] - before[1]
    assert read <= 10 and updated == 4, (read, updated)
    assert (
        await scalar(
            conn,
            "SELECT count(*) FROM procrastinate_jobs WHERE id = ANY (%s) AND worker_id IS NOT NULL",
            (ids,),
        )
        == 0
    )


async def test_withdraw_cancels_only_waiting_jobs(conn: Conn) -> None:
    ids = [job_id for job_id, _ in await spawn(conn, LANE_A, 2)]
    await take(conn, [LANE_A], 1)
    assert await scalar(conn, "SELECT wq_transport_withdraw(%s)", (ids,)) == 1
    assert await statuses(conn, ids) == ["doing", "cancelled"]


async def test_prune_deletes_finished_jobs_past_their_lanes_cutoff(conn: Conn) -> None:
    a = [job_id for job_id, _ in await spawn(conn, LANE_A, 3)]
    b = [job_id for job_id, _ in await spawn(conn, LANE_B, 1)]
    await take(conn, [LANE_A, LANE_B], 4)
    await drop(conn, [a[0], a[1], b[0]])  # a[2] stays delivered
    now = await scalar(conn, "SELECT now()")  # the time of every event in this transaction
    prune = "SELECT id FROM wq_transport_prune(%(lanes)s, %(cutoffs)s, %(limit)s) AS p (id)"

    async def pruned(cutoffs: list[datetime], limit: int = 10) -> list[int]:
        params = {"lanes": [LANE_A, LANE_B], "cutoffs": cutoffs, "limit": limit}
        cur = await conn.execute(prune, params)
        return sorted(row[0] for row in await cur.fetchall())

    second = timedelta(seconds=1)
    assert await pruned([now - second, now - second]) == []  # not old enough
    assert await pruned([now + second, now - second], limit=1) == [a[0]]
    assert await pruned([now + second, now - second]) == [a[1]]  # never an unfinished one
    assert await pruned([now + second, now + second]) == [b[0]]
    assert sorted(await jobs(conn, a + b)) == [a[2]]


async def test_worker_registration_and_heartbeat(conn: Conn) -> None:
    worker = await transport.register_worker(conn)
    await conn.execute(
        "UPDATE procrastinate_workers SET last_heartbeat = now() - interval '1 hour' WHERE id = %s",
        (worker,),
    )
    await conn.execute("SELECT wq_transport_beat(%s)", (worker,))
    cur = await conn.execute(
        "SELECT last_heartbeat = now() FROM procrastinate_workers WHERE id = %s", (worker,)
    )
    assert await cur.fetchall() == [(True,)]


def test_a_cancel_request_is_read_back_and_anything_else_ignored() -> None:
    run_id = uuid.uuid4()
    assert transport.cancel_request(f'{{"cancel": "{run_id}"}}') == run_id
    for payload in ("", "not json", "[]", '{"cancel": "nope"}', '{"other": 1}'):
        assert transport.cancel_request(payload) is None
