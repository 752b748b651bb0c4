"""Zombie workers: a real worker process SIGSTOPped at a chosen point of a run, rescued
past its lease, then continued after a newer attempt finished the run.

Each test starts worker A (``worker start`` as a subprocess, ``tests.apps.zombie``) on a
lane with a short lease, and admits one run of the ``zombie`` play, which admits rows to
a sheet under its stable write intent, records steps and completes its rows. Attempt 1
meets the test at a *rendezvous* (it writes a mark through its own connection and waits
for a release), so the test knows exactly where A is. Then:

1. SIGSTOP A (its whole process group);
2. once A's lease lapsed, run ``worker recover --once``: the pass closes attempt 1
   (``lease_expired``) and queues the run on a new job; start worker B, which claims it as
   attempt 2 and ends it;
3. snapshot the run's rows, receipts, attempts and ledger; SIGCONT A. Its heartbeat's
   renewal is refused and the watchdog stops the attempt; the rendezvous notes the stop
   (``<point>:stopped``) but goes on once released, like code that does not notice it was
   told to stop, so A's next write really reaches the database;
4. release A: its late write is refused by the attempt fence (a ``wq_refusals`` row of
   attempt 1 of the expected kind, an ``attempt_fenced`` or ``final_write=refused`` line
   in A's log), nothing in the snapshot changed, and ``worker metrics`` counts it.

What the seven points prove (A's late write, and what must hold):

- ``step`` (inside a step body): B takes over the step A had claimed and pays it again;
  A's receipt completion is refused; every receipt, row output and the result are
  attempt 2's.
- ``receipts`` (receipts recorded, rows not completed): A's receipts, written before the
  close, stay and replay in B; B completes the rows; A's row completion is refused.
- ``rows`` (rows completed, play not returned): A's rows, written before the close, stay
  terminal (B finds them ``already_terminal``); A's final ``succeeded`` write is refused;
  the result is B's.
- ``cancel`` (A stopped inside its cleanup hook after ``worker cancel``): recovery turns
  the lapsed lease with a cancel pending into a cleanup-only attempt; B runs the hook to
  its end and writes ``cancelled``; A's hook never finishes (it is interrupted); A's late
  ``cancelled`` write is refused. The hook ran to completion exactly once.
- ``spawn`` (receipts recorded, right before ``ctx.spawn``; the step key names the attempt,
  so only the fence can keep A's child out): A's spawn is refused where its step's
  receipt is claimed, in the spawn's transaction (a ``receipt`` refusal, a
  ``STALE_ATTEMPT`` naming ``child:1``), before ``child_spawn`` runs; the run has exactly
  one child, B's (spawned by attempt 2, ended), and no receipt of A's spawn step.
- ``limit`` (receipts recorded, right before ``ctx.limit``): A's permit request is refused
  (a ``limit`` refusal, a ``STALE_ATTEMPT``): no permit of attempt 1 was ever held, the
  limit's bucket did not move, B held the one permit (the concurrency cap is 1) in its
  block and released it; the limit holds none now.
- ``limit-held`` (A stopped inside its ``ctx.limit`` block, holding a permit): the rescue
  pass deletes A's dead permit, B takes the one permit under the cap; A's release is
  refused (a ``limit`` refusal; the block swallows it), then its row completion (``rows``).
  No permit of attempt 1 is left; the limit holds none now.

Worker A is the console script, ``worker start``. The processes that come after A is
stopped (the recovery pass, worker B, ``worker metrics``, and ``worker cancel`` for the
``cancel`` point) are *started ahead* (:data:`AHEAD`): an interpreter with the command's
arguments, environment and session imports the command (and hands the secrets off, as
``worker start`` and ``worker recover`` do before their command is loaded) while the test
waits for something else, A's lease to lapse; then it waits for the test's go and runs the
console script's own function, ``worker.cli.main``. Python's start-up overlaps that wait
instead of coming between the scenario's steps; what each command does, and when, is the
same.

Nothing waits on a timer for a state: every wait polls the database (through one
connection) or a log file with a deadline; the wait for A's lease to lapse first sleeps
until the expiry the database holds for that lease, then polls. No assertion is about
wall-clock time; timestamps are only compared with each other (the close of attempt 1
against the writes).
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import psycopg

from queues import costs, lanes, limits
from tests.apps.zombie import LIMIT, URL_ENV, ZOMBIE_DDL
from tests.workers import submit

T = TypeVar("T")
Conn = psycopg.AsyncConnection[Any]
REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")
APP = "tests.apps.zombie:registry"
RELEASE = "zombie"
LEASE_TTL_S = 2.0
HEARTBEAT_S = 0.25
ROWS = 5
ORG = "default"  # the org tests.workers.submit admits runs of
BUDGET = 1000  # the `budget` point's org budget, in credits: room for every step
DEADLINE_S = 30.0
TERMINAL = {"succeeded", "failed", "cancelled"}

# A `worker` command started ahead (``python -c AHEAD '[argv0, command, args]'``): what the
# console script does before it gets to the command (import the CLI; for the commands
# that hand their secrets off, that hand-off, which re-executes this same script without
# them; the command's module), then, on the go line on stdin, the console script's own
# function with the command's arguments. Any other line (stdin closed): exit, having run
# nothing.
AHEAD = """\
import importlib, json, sys
from worker import cli, config
argv0, command, args = json.loads(sys.argv[1])
if command in cli.HAND_OFF:
    config.hand_off_secrets()
importlib.import_module("worker.cli." + cli.COMMANDS[command].partition(":")[0])
if sys.stdin.readline() != "go\\n":
    sys.exit(0)
sys.argv = [argv0, *args]
sys.exit(cli.main())
"""
GO = b"go\n"


# ---- processes ---------------------------------------------------------------------------


def cli_env(db_url: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "DATABASE_URL",
            "VERCEL",
            "WORKER_ADMISSION_ONLY",
            "WORKER_RELEASE",
            "WORKER_APP",
            "WORKER_HOME",
            "PGAPPNAME",
        }
    }
    env["WORKER_DATABASE_URL"] = db_url
    env[URL_ENV] = db_url
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


async def cli(db_url: str, *args: str) -> str:
    """Run a `worker` command to its end; returns its stdout (it must exit 0)."""
    proc = await asyncio.create_subprocess_exec(
        WORKER,
        *args,
        cwd=REPO,
        env=cli_env(db_url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    return await finished(proc, args)


async def finished(
    proc: asyncio.subprocess.Process, args: Sequence[str], go: bytes | None = None
) -> str:
    """Wait for a command (sent ``go`` first, if given) to end; its stdout (it must exit
    0). Killed with its group if it is still there at the deadline."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(go), DEADLINE_S)
    finally:
        await kill(proc)
    assert proc.returncode == 0, f"worker {' '.join(args)} exited {proc.returncode}: {err!r}"
    return out.decode()


async def kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process's group unless it has ended; wait for it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def start_ahead(
    db_url: str, args: list[str], stdout: int | IO[Any], stderr: int | IO[Any]
) -> asyncio.subprocess.Process:
    """``worker ARGS`` started ahead (:data:`AHEAD`), in its own session: it runs the
    command once sent :data:`GO` on its stdin."""
    command = next(a for a in args if not a.startswith("-"))
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        AHEAD,
        json.dumps([WORKER, command, args]),
        cwd=REPO,
        env=cli_env(db_url),
        stdin=asyncio.subprocess.PIPE,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )


@dataclass
class Command:
    """A `worker` command started ahead (:func:`command_ahead`)."""

    args: tuple[str, ...]
    proc: asyncio.subprocess.Process

    async def run(self) -> str:
        """Run the command to its end; returns its stdout (it must exit 0)."""
        return await finished(self.proc, self.args, GO)


@contextlib.asynccontextmanager
async def command_ahead(db_url: str, *args: str) -> AsyncIterator[Command]:
    """``worker ARGS`` started ahead: :meth:`Command.run` runs it; killed on the way out
    if it is still there (not run, or past its deadline)."""
    proc = await start_ahead(
        db_url, list(args), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        yield Command(args, proc)
    finally:
        await kill(proc)


@dataclass
class Worker:
    name: str
    proc: asyncio.subprocess.Process
    log: Path
    worker_id: str = ""
    ready: Path | None = None  # its ready file (--ready-file)

    def signal(self, sig: signal.Signals) -> None:
        """Signal the worker's whole process group (it is a session leader)."""
        os.killpg(self.proc.pid, sig)

    def state(self) -> str:
        """The process state letter from /proc (T: stopped)."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]

    def lines(self) -> list[dict[str, Any]]:
        """The worker's JSON log lines so far."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    found.append(entry)
        return found

    def events(self, event: str, run_id: uuid.UUID, attempt: int) -> list[dict[str, Any]]:
        return [
            e
            for e in self.lines()
            if e.get("event") == event
            and e.get("run_id") == str(run_id)
            and e.get("attempt") == attempt
        ]

    async def until_ready(self) -> None:
        """Wait for its ready file; take its worker id from it."""
        assert self.ready is not None
        ready = self.ready

        async def is_ready() -> str | None:
            if self.proc.returncode is not None:
                raise AssertionError(
                    f"worker {self.name} exited {self.proc.returncode}: {self.log.read_text()}"
                )
            with contextlib.suppress(OSError, ValueError):
                return str(json.loads(ready.read_text())["worker_id"])
            return None

        self.worker_id = await eventually(is_ready, f"worker {self.name} to be ready")

    async def go(self) -> None:
        """Run the command of a worker started ahead (:func:`worker` with ``ahead``), and
        wait until it reported ready."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it exited: said next
            self.proc.stdin.write(GO)
            await self.proc.stdin.drain()
        self.proc.stdin.close()
        await self.until_ready()


@contextlib.asynccontextmanager
async def worker(
    db_url: str, tmp_path: Path, name: str, *, ahead: bool = False
) -> AsyncIterator[Worker]:
    """A `worker start` subprocess (its own session) that reported ready; with ``ahead``,
    one started ahead, which :meth:`Worker.go` runs. On the way out, whatever happened:
    SIGCONT (it may be stopped), SIGTERM, and SIGKILL at the deadline."""
    ready = tmp_path / f"{name}.ready"
    args = ["--json-logs", "start", "--release", RELEASE, "--app", APP]
    args += ["--grace", "1", "--ready-file", str(ready)]
    if not ahead:
        async with spawned(db_url, tmp_path, name, [WORKER, *args], ready) as w:
            yield w
        return
    log_path = tmp_path / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = await start_ahead(db_url, args, stdout=log_file, stderr=log_file)
    w = Worker(name, proc, log_path, ready=ready)
    try:
        yield w
    finally:
        await stop(w)


@contextlib.asynccontextmanager
async def spawned(
    db_url: str, tmp_path: Path, name: str, command: list[str], ready: Path
) -> AsyncIterator[Worker]:
    """A worker process started with ``command`` in its own session, once it wrote its
    ready file (``ready``); stopped with :func:`stop` on the way out."""
    log_path = tmp_path / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *command,
            cwd=REPO,
            env=cli_env(db_url),
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    w = Worker(name, proc, log_path, ready=ready)
    try:
        await w.until_ready()
        yield w
    finally:
        await stop(w)


async def stop(w: Worker) -> int:
    """Stop the worker's group: SIGCONT (it may be stopped), SIGTERM (a graceful stop),
    a second SIGTERM (exit at once) and SIGKILL, each only if it is still there after a
    deadline (a failed test can leave an attempt that does not stop at its rendezvous)."""
    for sig in (signal.SIGCONT, signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        if w.proc.returncode is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            w.signal(sig)
        if sig is not signal.SIGCONT:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.proc.wait(), 10)
    assert w.proc.returncode is not None
    return w.proc.returncode


# ---- the database ------------------------------------------------------------------------


async def eventually(
    check: Callable[[], Awaitable[T | None]], what: str, timeout: float = DEADLINE_S
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def fetch(db: str | Conn, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """The rows of ``sql``, through the connection ``db`` or one of its own to URL ``db``
    (a scenario polls through one connection: a connection per poll costs the database a
    backend each time)."""
    if not isinstance(db, str):
        cur = await db.execute(sql, params)
        return await cur.fetchall()
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        cur = await conn.execute(sql, params)
        return await cur.fetchall()


async def one(db: str | Conn, sql: str, params: Any = None) -> Any:
    rows = await fetch(db, sql, params)
    return rows[0][0] if rows else None


async def marks(db: str | Conn, run_id: uuid.UUID, mark: str) -> list[int]:
    """The attempts that recorded ``mark``, in order."""
    rows = await fetch(
        db,
        "SELECT attempt FROM zombie_marks WHERE run_id = %s AND mark = %s ORDER BY id",
        (run_id, mark),
    )
    return [int(a) for (a,) in rows]


async def wait_mark(db: str | Conn, run_id: uuid.UUID, mark: str, attempt: int = 1) -> None:
    async def seen() -> bool:
        return attempt in await marks(db, run_id, mark)

    await eventually(seen, f"mark {mark!r} of attempt {attempt}")


async def snapshot(db: str | Conn, run_id: uuid.UUID) -> dict[str, list[tuple[Any, ...]]]:
    """Everything of the run an attempt's writes could change."""
    queries = {
        "run": "SELECT state::text, attempt, result, error, lease_owner, lease_expires_at, "
        "job_id, finished_at, rows_admitted, rows_done, cancel_requested_at, updated_at "
        "FROM wq_runs WHERE id = %(id)s",
        "rows": "SELECT row_key, status::text, attempt, write_version, output, finished_at "
        "FROM wq_sheet_rows WHERE run_id = %(id)s ORDER BY row_key",
        "intents": "SELECT sheet, write_version FROM wq_write_intents WHERE run_id = %(id)s",
        "receipts": "SELECT step_key, status::text, owner_attempt, result, completed_at "
        "FROM wq_receipts WHERE owner_run = %(id)s ORDER BY step_key",
        "attempts": "SELECT attempt, outcome::text, worker_id, error, finished_at "
        "FROM wq_attempts WHERE run_id = %(id)s ORDER BY attempt",
        "events": "SELECT seq, attempt, kind, data FROM wq_ledger WHERE run_id = %(id)s "
        "ORDER BY seq",
        "children": "SELECT id, play, params, state::text, attempt, result, idempotency_key, "
        "finished_at FROM wq_runs WHERE parent_id = %(id)s ORDER BY created_at, id",
        "holds": "SELECT hold, key, org, attempt, owner, acquired_at "
        "FROM wq_limit_holds WHERE run_id = %(id)s ORDER BY hold",
        "charges": "SELECT attempt, step_key, outcome, unit, provider, amount "
        "FROM wq_charges WHERE run_id = %(id)s ORDER BY step_key, attempt",
        "reservations": "SELECT scope, step_key, unit, attempt, amount "
        "FROM wq_reservations WHERE run_id = %(id)s ORDER BY step_key, unit",
        # The test's database is its own: every budget is one of its scenario's.
        "budgets": "SELECT org, unit, limit_amount, spent FROM wq_budgets ORDER BY id",
        # The test's database is its own: every bucket is one of its limits.
        "buckets": "SELECT key, org, tat FROM wq_limit_buckets ORDER BY key, org",
    }
    return {name: await fetch(db, sql, {"id": run_id}) for name, sql in queries.items()}


async def refusals(db: str | Conn, run_id: uuid.UUID) -> list[tuple[int, str, int]]:
    rows = await fetch(
        db,
        "SELECT attempt, kind, rows FROM wq_refusals WHERE run_id = %s ORDER BY id",
        (run_id,),
    )
    return [(int(a), str(k), int(n)) for a, k, n in rows]


# ---- the scenario --------------------------------------------------------------------------


@dataclass
class Zombie:
    """What a scenario saw, for the per-point assertions."""

    url: str
    run_id: uuid.UUID
    a: Worker
    b: Worker
    rescue: dict[str, Any]  # the `worker recover --once --json` report that closed attempt 1
    close_at: Any  # when attempt 1 was closed (the database clock)
    before: dict[str, list[tuple[Any, ...]]]  # the run as attempt 2 left it
    after: dict[str, list[tuple[Any, ...]]]  # ... and after A went on
    refused: list[tuple[int, str, int]]
    metrics: dict[str, Any]
    exits: dict[str, int] = field(default_factory=dict)


async def lease_lapsed(db: str | Conn, run_id: uuid.UUID) -> bool:
    return bool(
        await one(
            db,
            "SELECT state = 'running' AND lease_expires_at < now() FROM wq_runs WHERE id = %s",
            (run_id,),
        )
    )


async def until_lapsed(conn: Conn, run_id: uuid.UUID) -> None:
    """Wait for the lease of the run's attempt to lapse, its worker stopped: sleep until
    the expiry the database holds (nothing renews it any more), then poll."""
    left = await one(
        conn,
        "SELECT extract(epoch FROM lease_expires_at - clock_timestamp())::float8"
        " FROM wq_runs WHERE id = %s",
        (run_id,),
    )
    if left is not None and left > 0:
        await asyncio.sleep(min(left, DEADLINE_S))

    async def lapsed() -> bool:
        return await lease_lapsed(conn, run_id)

    await eventually(lapsed, "attempt 1's lease to lapse")


async def recover(url: str) -> dict[str, Any]:
    """One real recovery pass, `worker recover --once --json`; returns its report."""
    report: dict[str, Any] = json.loads(await cli(url, "recover", "--once", "--json"))
    return report


async def diagnose(db: str | Conn, run_id: uuid.UUID, *workers: Worker) -> str:
    """The run, its attempts and jobs, and the tails of the workers' logs: for a failure."""
    state = await snapshot(db, run_id)
    parts = [f"{name}: {rows}" for name, rows in state.items() if name in ("run", "attempts")]
    jobs = await fetch(
        db,
        "SELECT j.* FROM wq_transport_jobs() j JOIN wq_runs r ON r.lane = j.lane "
        "WHERE r.id = %s ORDER BY j.id",
        (run_id,),
    )
    parts.append(f"jobs of its lane: {jobs}")
    # A session left in a transaction (a stopped worker's) holds its locks: SKIP LOCKED
    # picks pass over them.
    sessions = await fetch(
        db,
        "SELECT application_name, state, wait_event_type, now() - xact_start, left(query, 80) "
        "FROM pg_stat_activity WHERE datname = current_database() "
        "AND xact_start IS NOT NULL AND pid <> pg_backend_pid()",
    )
    parts.append(f"sessions in a transaction: {sessions}")
    for w in workers:
        tail = w.log.read_text(errors="replace").splitlines()[-40:]
        parts.append(f"worker {w.name} ({w.worker_id}) log tail:\n" + "\n".join(tail))
    return "\n".join(parts)


async def recover_until_terminal(
    url: str, run_id: uuid.UUID, *workers: Worker, conn: Conn | None = None
) -> None:
    """Wait for the run (and any child it spawned) to end, running a recovery pass whenever
    its lease lapsed (as the recovery process would: a later attempt may lose its lease
    too). On a timeout, the error carries the run's state and the workers' log tails.
    ``conn``: the connection to poll through (default: one per query)."""
    db: str | Conn = url if conn is None else conn

    async def terminal() -> str | None:
        if await lease_lapsed(db, run_id):
            await recover(url)
        state = await one(db, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,))
        unfinished = await one(
            db,
            "SELECT count(*) FROM wq_runs WHERE parent_id = %s "
            "AND state NOT IN ('succeeded', 'failed', 'cancelled')",
            (run_id,),
        )
        return state if state in TERMINAL and unfinished == 0 else None

    try:
        await eventually(terminal, "the run to end")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{await diagnose(url, run_id, *workers)}") from None


async def scenario(
    db_url: str, tmp_path: Path, point: str, *, retry_max_attempts: int = 5
) -> Zombie:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(ZOMBIE_DDL)
        await lanes.prepare(conn, RELEASE)
        await lanes.set_policy(
            conn,
            RELEASE,
            lease_ttl_s=LEASE_TTL_S,
            heartbeat_s=HEARTBEAT_S,
            retry_base_s=0.0,
            retry_jitter=0.0,
            retry_max_attempts=retry_max_attempts,
        )
        # The limit of the `limit` points: one permit at a time, and a rate (its bucket's
        # clock moves on each grant: a refused request must not move it).
        await limits.set_limit(conn, LIMIT, rate="100/s", concurrency=1)
        if point == "budget":  # the org's budget a step's estimate is reserved against
            await costs.set_budget(conn, org=ORG, limit=BUDGET)
        return await zombie_episode(db_url, tmp_path, point, conn)


async def zombie_episode(db_url: str, tmp_path: Path, point: str, conn: Conn) -> Zombie:
    """Steps 1 to 4 (the module's docstring), polling the database through ``conn``."""
    # The rendezvous where A is stopped: for a cancel, inside the cleanup hook.
    meet = "hook" if point == "cancel" else point
    async with worker(db_url, tmp_path, "a") as a:
        run_id = await submit(db_url, "zombie", {"point": point, "rows": ROWS}, release=RELEASE)
        if point == "cancel":
            cancel = ("cancel", str(run_id), "--reason", "zombie test")
            async with command_ahead(db_url, *cancel) as cancelling:
                await wait_mark(conn, run_id, "awaiting-cancel")
                await cancelling.run()
        await wait_mark(conn, run_id, meet)
        a.signal(signal.SIGSTOP)

        async def a_stopped() -> bool:
            return a.state() == "T"

        await eventually(a_stopped, "worker A to be stopped")
        assert await one(conn, "SELECT attempt FROM wq_runs WHERE id = %s", (run_id,)) == 1

        # What comes next starts ahead, while A's lease runs out.
        async with (
            command_ahead(db_url, "recover", "--once", "--json") as recovering,
            worker(db_url, tmp_path, "b", ahead=True) as b,
            command_ahead(db_url, "metrics", "--format", "json") as measuring,
        ):
            await until_lapsed(conn, run_id)
            # The rescue: no other recovery pass can run now (A is stopped, and B's command
            # has not started: its interpreter waits for the go).
            rescue: dict[str, Any] = json.loads(await recovering.run())
            await b.go()
            await recover_until_terminal(db_url, run_id, a, b, conn=conn)
            assert a.state() == "T"  # A stayed stopped while B ended the run
            close_at = await one(
                conn,
                "SELECT finished_at FROM wq_attempts WHERE run_id = %s AND attempt = 1",
                (run_id,),
            )
            before = await snapshot(conn, run_id)
            assert await refusals(conn, run_id) == []

            # A goes on: its renewal is refused, the watchdog stops the attempt (the
            # rendezvous notes it and waits on); then it is released and writes.
            a.signal(signal.SIGCONT)
            await wait_mark(conn, run_id, f"{meet}:stopped")
            await conn.execute(
                "INSERT INTO zombie_releases (run_id, point) VALUES (%s, %s)", (run_id, meet)
            )

            async def a_finished() -> list[dict[str, Any]]:
                return a.events("attempt_finished", run_id, 1)

            await eventually(a_finished, "worker A to finish its attempt")
            refused = await refusals(conn, run_id)
            after = await snapshot(conn, run_id)
            metrics = json.loads(await measuring.run())
            # Both workers stop at once: each is idle now.
            exit_b, exit_a = await asyncio.gather(stop(b), stop(a))
    return Zombie(
        url=db_url,
        run_id=run_id,
        a=a,
        b=b,
        rescue=rescue,
        close_at=close_at,
        before=before,
        after=after,
        refused=refused,
        metrics=metrics,
        exits={"a": exit_a, "b": exit_b},
    )


def check_common(z: Zombie, *, final_state: str, refused: list[tuple[int, str, int]]) -> None:
    """What every point must show."""
    # The real recovery pass closed attempt 1 and queued the run (for a cancel: its
    # cleanup-only attempt) on a new job.
    (rescued,) = [e for e in z.rescue["expired"] if e["run_id"] == str(z.run_id)]
    assert rescued["attempt"] == 1 and rescued["state"] == "queued" and rescued["job_id"]
    # A's continuation changed nothing: its late write was refused, not applied.
    assert z.after == z.before
    # ... and refused exactly as expected: attempt 1's write, of the expected kind.
    assert z.refused == refused
    # A saw it: the watchdog stopped the attempt when its renewal was refused, and the
    # attempt ended as superseded.
    assert z.a.events("lease_lost", z.run_id, 1)
    (finished,) = z.a.events("attempt_finished", z.run_id, 1)
    assert finished["outcome"] == "superseded" and finished["run_state"] is None
    # `worker metrics` counts the refused write(s), per kind.
    counted = z.metrics["attempts"]["stale_writes_refused"]
    assert counted == len(refused) > 0
    assert z.metrics["attempts"]["lease_rescues"] >= 1
    by_kind = {r["kind"]: (r["writes"], r["rows"]) for r in z.metrics["refusals"]}
    assert by_kind == {kind: (1, rows) for _, kind, rows in refused}
    # The run ended at attempt 2, which B ran; attempt 1 was closed as lease_expired.
    state, attempt = z.after["run"][0][:2]
    assert (state, attempt) == (final_state, 2)
    attempts = {a: (outcome, worker_id) for a, outcome, worker_id, _, _ in z.after["attempts"]}
    assert attempts[1] == ("lease_expired", z.a.worker_id)
    assert attempts[2][1] == z.b.worker_id
    # Nothing attempt 1 wrote after its close is there: every receipt completed and every
    # row finished after the close is attempt 2's, and a row output of attempt 1 (its
    # marker) only exists where attempt 1 wrote it before the close.
    for key, status, owner_attempt, result, completed_at in z.after["receipts"]:
        if completed_at is not None and completed_at >= z.close_at:
            # (a spawn's receipt records the child, not the attempt: its owner says it)
            assert owner_attempt == 2 and result.get("by", 2) == 2, key
        if owner_attempt == 1:
            assert status == "completed" and completed_at < z.close_at, key
    for key, status, row_attempt, _, output, finished_at in z.after["rows"]:
        if finished_at is not None and finished_at >= z.close_at:
            assert row_attempt == 2 and output["writer"] == 2, key
        if output is not None and output["writer"] == 1:
            assert finished_at < z.close_at and status == "done", key
    # Both workers shut down cleanly, A after its zombie episode too.
    assert z.exits == {"a": 0, "b": 0}


def rows_by_key(z: Zombie) -> dict[str, tuple[str, int, dict[str, Any] | None]]:
    return {
        key: (status, attempt, output) for key, status, attempt, _, output, _ in z.after["rows"]
    }


def receipts_by_key(z: Zombie) -> dict[str, tuple[str, int, Any]]:
    return {key: (status, owner, result) for key, status, owner, result, _ in z.after["receipts"]}


def run_result(z: Zombie) -> dict[str, Any]:
    result: dict[str, Any] = z.after["run"][0][2]
    return result


ROW_KEYS = [f"r{i:03d}" for i in range(ROWS)]


def check_fenced_late_write(z: Zombie, code: str, says: str | None = None) -> None:
    """A's late write was refused by the fence (``code``; its message ``says``), and A's
    attempt then made no final write of its own."""
    (fenced,) = z.a.events("attempt_fenced", z.run_id, 1)
    assert fenced["error_code"] == code
    if says is not None:
        assert says in fenced["error"]
    (finished,) = z.a.events("attempt_finished", z.run_id, 1)
    assert finished["final_write"] == "none"


# ---- the four points -----------------------------------------------------------------------


async def test_zombie_stopped_inside_a_step_body(db_url: str, tmp_path: Path) -> None:
    z = await scenario(db_url, tmp_path, "step")
    # A's late write: completing the step it was executing (one receipt).
    check_common(z, final_state="succeeded", refused=[(1, "receipt", 1)])
    check_fenced_late_write(z, "STALE_ATTEMPT", "cannot complete step 'enrich'")
    # B ran the step A was executing and paid it again; every receipt is B's.
    receipts = receipts_by_key(z)
    assert receipts["enrich"] == ("completed", 2, {"by": 2})
    assert all(
        receipts[f"row:{k}"] == ("completed", 2, {"v": f"row:{k}", "by": 2}) for k in ROW_KEYS
    )
    assert all(
        v == ("done", 2, {"score": {"v": f"row:{k}", "by": 2}, "writer": 2})
        for k, v in rows_by_key(z).items()
    )
    assert sorted(rows_by_key(z)) == ROW_KEYS
    result = run_result(z)
    assert result["attempt"] == 2 and result["enriched"] == {"by": 2}
    assert result["completed"] == ROWS and result["terminal"] == 0
    # A charged the step it was executing; its charge was refused with its receipt: every
    # charge is B's, one per step (z.after == z.before: A's late write added none).
    expected = [(2, "enrich", "completed", "credits", "zombie", 1)]
    expected += [(2, f"row:{k}", "completed", "credits", "zombie", 1) for k in ROW_KEYS]
    assert z.after["charges"] == expected


async def test_zombie_stopped_between_receipts_and_row_completion(
    db_url: str, tmp_path: Path
) -> None:
    z = await scenario(db_url, tmp_path, "receipts")
    # A's late write: completing its page of rows (refused as a whole).
    check_common(z, final_state="succeeded", refused=[(1, "rows", ROWS)])
    check_fenced_late_write(z, "RUNTIME_SHEET_ATTEMPT_SUPERSEDED")
    # The receipts A recorded before its close stand and were replayed by B (not paid
    # again); the rows were completed by B alone.
    check_rows_by_b_on_a_receipts(z)


async def test_zombie_stopped_after_rows_completed_before_return(
    db_url: str, tmp_path: Path
) -> None:
    z = await scenario(db_url, tmp_path, "rows")
    # A's late write: its final `succeeded` write.
    check_common(z, final_state="succeeded", refused=[(1, "final", 1)])
    (finished,) = z.a.events("attempt_finished", z.run_id, 1)
    assert finished["final_write"] == "refused"
    assert not z.a.events("attempt_fenced", z.run_id, 1)
    # A's rows were completed before its close: they stand, and B found them terminal.
    rows = rows_by_key(z)
    assert sorted(rows) == ROW_KEYS
    assert all(
        rows[k] == ("done", 1, {"score": {"v": f"row:{k}", "by": 1}, "writer": 1}) for k in ROW_KEYS
    )
    # The result is B's: it completed nothing and saw every row already terminal.
    result = run_result(z)
    assert result["attempt"] == 2 and result["enriched"] == {"by": 1}
    assert result["completed"] == 0 and result["terminal"] == ROWS
    attempts = {a: outcome for a, outcome, _, _, _ in z.after["attempts"]}
    assert attempts == {1: "lease_expired", 2: "succeeded"}


async def test_zombie_stopped_inside_its_cancel_hook(db_url: str, tmp_path: Path) -> None:
    z = await scenario(db_url, tmp_path, "cancel", retry_max_attempts=2)
    # A's late write: `cancelled`, after its interrupted hook reported a failure.
    check_common(z, final_state="cancelled", refused=[(1, "final", 1)])
    (finished,) = z.a.events("attempt_finished", z.run_id, 1)
    assert finished["final_write"] == "refused"
    assert not finished["cleanup"]  # attempt 1 ran the play, then the hook on the cancel
    assert z.a.events("cleanup_hook_failed", z.run_id, 1)[0]["error"].startswith(
        "RuntimeError('cleanup interrupted"
    )
    # A's hook started, was stopped (by SIGSTOP, then the watchdog), and never finished.
    assert await marks(z.url, z.run_id, "hook:interrupted") == [1]
    started = await marks(z.url, z.run_id, "hook:started")
    finished_hooks = await marks(z.url, z.run_id, "hook:finished")
    # The rows A admitted stay pending: nobody completed them, A's late writes neither.
    rows = rows_by_key(z)
    assert sorted(rows) == ROW_KEYS
    assert all(v == ("pending", 1, None) for v in rows.values())
    # Cancel is final, and its hooks run before the final write also when the lease
    # lapsed: one cleanup-only attempt (2) ran the hook to its end, then wrote `cancelled`
    # (its own heartbeats, which report the pending cancel, must not stop it).
    attempts = {a: outcome for a, outcome, _, _, _ in z.after["attempts"]}
    assert finished_hooks == [2], f"hook finished in {finished_hooks}, started in {started}"
    assert attempts == {1: "lease_expired", 2: "cancelled"}
    assert started == [1, 2]
    kinds = [(attempt, kind) for _, attempt, kind, _ in z.after["events"]]
    assert (2, "cleanup_started") in kinds
    hook_done = await one(
        z.url,
        "SELECT max(at) FROM zombie_marks WHERE run_id = %s AND mark = 'hook:finished'",
        (z.run_id,),
    )
    run_finished = z.after["run"][0][7]
    assert hook_done < run_finished


# ---- child spawn and rate-limit permits ----------------------------------------------------


def check_rows_by_b_on_a_receipts(z: Zombie) -> None:
    """A stopped after its receipts were recorded (before its close) and before its rows
    were completed: its receipts stand and replay in B, which completed every row."""
    receipts = receipts_by_key(z)
    assert receipts["enrich"] == ("completed", 1, {"by": 1})
    assert all(
        receipts[f"row:{k}"] == ("completed", 1, {"v": f"row:{k}", "by": 1}) for k in ROW_KEYS
    )
    rows = rows_by_key(z)
    assert sorted(rows) == ROW_KEYS
    assert all(
        rows[k] == ("done", 2, {"score": {"v": f"row:{k}", "by": 1}, "writer": 2}) for k in ROW_KEYS
    )
    result = run_result(z)
    assert result["attempt"] == 2 and result["enriched"] == {"by": 1}
    assert result["completed"] == ROWS and result["terminal"] == 0


async def holding(url: str) -> int:
    """The permits of :data:`LIMIT` live attempts hold now (what ``worker limits`` shows)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        (limit,) = [lim for lim in await limits.list_limits(conn) if lim.key == LIMIT]
    return limit.holding


async def test_zombie_stopped_right_before_a_spawn(db_url: str, tmp_path: Path) -> None:
    z = await scenario(db_url, tmp_path, "spawn")
    # A's late write: its spawn. The spawn's transaction claims its step's receipt first,
    # and that claim is fenced: refused there (a `receipt` refusal), no child statement ran.
    check_common(z, final_state="succeeded", refused=[(1, "receipt", 1)])
    check_fenced_late_write(z, "STALE_ATTEMPT", "cannot claim step 'child:1'")
    # Exactly one child, B's: spawned by attempt 2 under its own key, and ended.
    (child,) = z.after["children"]
    child_id, play, params, state, _, result, key, _ = child
    assert (play, params, state) == ("zombie_child", {"parent_attempt": 2}, "succeeded")
    assert result["parent_attempt"] == 2
    assert key == f"child:{z.run_id}:child:2"
    assert run_result(z)["child"] == str(child_id)
    # ... and no other run of the child's play anywhere (A admitted none, on any parent).
    assert await one(z.url, "SELECT count(*) FROM wq_runs WHERE play = 'zombie_child'") == 1
    receipts = receipts_by_key(z)
    assert receipts["child:2"] == (
        "completed",
        2,
        {"run_id": str(child_id), "play": "zombie_child"},
    )
    assert "child:1" not in receipts  # A's refused claim left no receipt
    spawned = [
        (attempt, data) for _, attempt, kind, data in z.after["events"] if kind == "child_spawned"
    ]
    assert spawned == [(2, {"child": str(child_id), "play": "zombie_child", "step": "child:2"})]
    check_rows_by_b_on_a_receipts(z)


async def test_zombie_stopped_right_before_a_permit(db_url: str, tmp_path: Path) -> None:
    z = await scenario(db_url, tmp_path, "limit")
    # A's late write: its request for a permit (refused by the fence; no bucket change).
    check_common(z, final_state="succeeded", refused=[(1, "limit", 1)])
    check_fenced_late_write(z, "STALE_ATTEMPT", f"cannot take a permit of limit {LIMIT!r}")
    # B held the one permit in its block (the cap is 1: the only hold there was), then
    # released it; A never held one; the limit holds none now, and its bucket (compared in
    # the snapshot: A's request did not move it) was made by B's grant.
    permit = run_result(z)["permit"]
    assert permit["attempt"] == 2 and permit["holds"] == [[2, f"2:1:{LIMIT}"]]
    assert z.after["holds"] == []
    assert await one(z.url, "SELECT count(*) FROM wq_limit_holds WHERE attempt = 1") == 0
    assert await holding(z.url) == 0
    ((bucket_key, _, tat),) = z.after["buckets"]
    assert bucket_key == LIMIT and tat is not None
    check_rows_by_b_on_a_receipts(z)


async def test_zombie_stopped_right_before_a_budget_reservation(
    db_url: str, tmp_path: Path
) -> None:
    z = await scenario(db_url, tmp_path, "budget")
    # A's late write: its reservation of the paid step's estimate (refused by the fence in
    # the reserving statement: no reservation row, no budget moved).
    check_common(z, final_state="succeeded", refused=[(1, "budget", 1)])
    check_fenced_late_write(z, "STALE_ATTEMPT", "cannot reserve the estimate of 1 step(s)")
    # A's steps before the stop were charged with their receipts (B replayed them); B
    # reserved, ran and settled the paid step: no reservation is left, A reserved nothing,
    # and the budget spent exactly the charges recorded.
    assert run_result(z)["paid"] == {"by": 2}
    assert z.after["reservations"] == []
    by_attempt = [(attempt, key) for attempt, key, *_ in z.after["charges"]]
    assert sorted(by_attempt) == sorted(
        [(1, "enrich"), *((1, f"row:{k}") for k in ROW_KEYS), (2, "paid")]
    )
    ((org, unit, limit, spent),) = z.after["budgets"]
    assert (org, unit, limit, spent) == (ORG, "credits", BUDGET, len(by_attempt))
    check_rows_by_b_on_a_receipts(z)


async def test_zombie_stopped_holding_a_permit(db_url: str, tmp_path: Path) -> None:
    z = await scenario(db_url, tmp_path, "limit-held")
    # A's late writes: the release of the permit it took before its close (refused; the
    # block swallows the refusal), then its row completion (refused as a whole).
    check_common(z, final_state="succeeded", refused=[(1, "limit", 1), (1, "rows", ROWS)])
    check_fenced_late_write(z, "RUNTIME_SHEET_ATTEMPT_SUPERSEDED")
    # A's permit stopped counting when its lease lapsed, and the rescue pass deleted it:
    # B got the one permit under the cap (the only hold there was in its block).
    assert z.rescue["counts"]["holds_swept"] == 1
    permit = run_result(z)["permit"]
    assert permit["attempt"] == 2 and permit["holds"] == [[2, f"2:1:{LIMIT}"]]
    assert z.after["holds"] == []
    assert await one(z.url, "SELECT count(*) FROM wq_limit_holds WHERE attempt = 1") == 0
    assert await holding(z.url) == 0
    check_rows_by_b_on_a_receipts(z)
