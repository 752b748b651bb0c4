"""A model-based test of the attempt fence: random interleavings of real workers' writes.

A Hypothesis state machine (:class:`FenceModel`) drives three simulated workers, each with
its own autocommit connection to a fresh clone of the template database (one clone per
example, with the test-only audit triggers of ``tests/fence_model_audit.py``, dropped after
the example), plus an app/operator connection. Its rules are real API calls: admit a run
(at most three in flight, on two lanes; runs may share a sheet); claim (by any worker, or
again by the worker of an attempt held; maybe entering the play: admitting its page under
the run's stable intent); heartbeat (with the step-lease extensions a heartbeat makes);
claim and/or complete a step, or a page of steps (per-run or shared scope); admit a page
of sheet rows (stable intent or legacy); complete rows (under the attempt's version,
unversioned, or another version of its run); suspend (a short wake, sometimes also
waiting on an event); emit (from a play, fenced, or from the app); cancel (sometimes
forced); hand back; finish (succeeded, failed or cancelled); the recovery pass with the
model's clock moved on (often past every lease); drain, reclaim (forced) or reopen a lane.
Every example starts with two runs, both claimed.

A worker writes with *any* attempt it ever held, live or stale: that is the point. Each
write rule draws an attempt and a ``writer`` (:meth:`FenceModel.pick`): that attempt, its
worker's latest, its run's live attempt, an earlier attempt of the same run by the same
worker (a zombie), or an impostor (the latest attempt's number under a worker that never
held it).

A write the fence refuses is an expected outcome (``StaleAttempt``, ``SheetSuperseded``,
``FinishStatus.REFUSED``/``CANCEL_PENDING``), but each rule also checks that the fence
answered as the run's state says it must: the run row, read just before the write, tells
whether the attempt is live (running, at that attempt, under that worker's lease).

After every step the invariants read the database:

1. at most one live attempt per run: a running run has exactly its current attempt open
   in ``wq_attempts``, any other run none (and the audit triggers: a lease never changes
   hands while running, a claim opens attempt + 1, a closed attempt never changes);
2. no write by a closed attempt is visible: audit triggers compare every sheet-row,
   receipt and fenced-emit write, inside the writing transaction, with the run's state;
   and no terminal row was written by an attempt after its close (by the row's and the
   attempt's ``finished_at``, and by the audit order of the two writes);
3. a cancelled run never becomes anything else (also checked per update by a trigger);
4. every sheet row has at most one terminal write (pending->terminal or terminal->any);
5. no run is stuck: every non-terminal run has its live job (todo for a waiting run,
   doing for a running one, on its lane, for it), a live lease, a due wake, or is picked
   by the recovery pass (a lapsed lease, an orphan: the design's fixes), or its lane is
   reported stranded by ``recovery.find_stranded`` (``after_s=0``, the model's now).

Time is the model's: every call takes ``now=``. The clock starts an hour ahead of the
database's, so a time the database stamps (``now()``) is always earlier than one the model
stamps; the claim and recovery rules move it on. Run ids are numbered in admission order
(the test replaces admission's ``uuid4``), so statements that take several runs in id order
spawn their jobs in the same order on every replay: a replay is exact, as Hypothesis needs
to shrink. No health check is suppressed.

Reproducing a failure: Hypothesis prints the minimal failing sequence of rules as Python,
then ``@reproduce_failure(...)`` (paste it on ``test_the_fence_holds_under_random_
interleavings``), and the test adds the seed of the run to the error: ``v/bin/python -m
pytest tests/integration/test_fence_model.py --hypothesis-seed=N`` replays it. Size:
``FENCE_MODEL_EXAMPLES`` x ``FENCE_MODEL_STEPS`` (default 25 x 30: about 15 s on an idle
2-core machine; shrinking a failure takes a minute or two more).

A bug it found, fixed and pinned by the test at the end: a live attempt completed another
run's pending rows by passing that run's write version (``sheet_complete_rows`` now requires
the writer's own rows whatever version it sends).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import types
import uuid
from collections import Counter
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from unittest import mock

import hypothesis.core
import psycopg
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from queues import admission, lanes, outcomes, receipts, recovery, runs, sheets
from queues.errors import LaneDraining, LaneReclaimed, SheetSuperseded, StaleAttempt
from queues.fence import Fence
from queues.outcomes import FinishStatus
from queues.queries import q
from queues.receipts import ClaimOutcome, Scope
from tests import fence_model_audit as audit
from tests.conftest import clone_database, drop_database

Conn = psycopg.AsyncConnection[Any]
T = TypeVar("T")

ORG = "org"
PLAY = "play"
RELEASES = ("ma", "mb")
LANE = {release: lanes.lane_name(release) for release in RELEASES}
# The lanes each worker consumes: a run of ma passes between w1 and w2 (a lease lost to
# another worker); a run of mb always comes back to w3 (one worker holds an old and a new
# attempt of a run: only the attempt number tells their writes apart).
WORKERS = {"w1": (LANE["ma"],), "w2": (LANE["ma"],), "w3": (LANE["mb"],)}
SHEETS = ("s1", "s2")
ROW_KEYS = ("k0", "k1", "k2")
STEPS = ("fetch", "score")
EVENT = "ev"
MAX_UNFINISHED = 3  # runs in flight at once
MAX_RUNS = 8  # runs admitted in one example
STEP_LEASE_S = 20.0
DB_PREFIX = "wq_fence_model_"
KEYS = st.lists(st.sampled_from(ROW_KEYS), min_size=1, max_size=len(ROW_KEYS), unique=True)
WRITERS = st.sampled_from(["held", "latest", "live", "zombie", "impostor"])  # FenceModel.pick
_databases = itertools.count()
OUTCOMES: Counter[str] = Counter()  # what the rules saw, over all examples of one test


class FenceModel(RuleBasedStateMachine):
    """Workers that keep every attempt they ever held, and the fence that must stop them."""

    attempts = Bundle("attempts")

    def __init__(self, admin_url: str) -> None:
        super().__init__()
        self.admin_url = admin_url
        self.loop = asyncio.new_event_loop()
        self.dbname = f"{DB_PREFIX}{os.getpid()}_{next(_databases)}"
        self.conns: dict[str, Conn] = {}
        self.app: Conn | None = None
        self.t0 = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
        self.offset = timedelta(0)  # the model's clock is t0 + offset
        self.rng = random.Random(0)  # the recovery pass's jitter (the lanes have none)
        self.run_ids: list[uuid.UUID] = []  # in admission order
        self.sheet_of: dict[uuid.UUID, str] = {}
        self.claims: dict[Fence, runs.Claimed] = {}
        self.latest: dict[str, Fence] = {}  # the last attempt each worker claimed
        self.by_number: dict[tuple[uuid.UUID, int], Fence] = {}  # (run, attempt) -> claim
        self.legacy: dict[tuple[Fence, str], int] = {}  # (attempt, sheet) -> its version
        self.intent: dict[tuple[uuid.UUID, str], int] = {}  # (run, sheet) -> its intent
        self.last: dict[tuple[Fence, str], int] = {}  # the version an attempt last admitted
        self.page: dict[tuple[Fence, str], list[str]] = {}  # ... and the keys of that page
        # Every write version admitted on a sheet, and the run it was admitted for.
        self.versions: dict[str, dict[int, uuid.UUID]] = {sheet: {} for sheet in SHEETS}
        self.seen_cancelled: set[uuid.UUID] = set()
        self.unfinished = 0  # non-terminal runs, as the last invariant check saw them
        self.lane_ops = 0
        # Run ids in admission order: statements that take several runs in id order (an
        # emit waking sleepers, a recovery batch) then spawn their jobs in the same order
        # on every replay, which Hypothesis needs to replay and shrink a failure.
        numbers = itertools.count(1)
        ids = types.SimpleNamespace(
            UUID=uuid.UUID, uuid4=lambda: uuid.UUID(f"00000000-0000-4000-8000-{next(numbers):012x}")
        )
        self.ids = mock.patch.object(admission, "uuid", ids)
        self.ids.start()
        try:
            self.run(self._setup())
        except BaseException:
            self.teardown()
            raise
        self.saw("example")

    # ---- plumbing -------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def now(self) -> datetime:
        return self.t0 + self.offset

    def saw(self, what: str) -> None:
        OUTCOMES[what] += 1

    @property
    def db(self) -> Conn:
        assert self.app is not None
        return self.app

    async def _setup(self) -> None:
        url = await clone_database(self.admin_url, self.dbname)
        self.app = await psycopg.AsyncConnection.connect(url, autocommit=True)
        await audit.install(self.app)
        for release, budget in zip(RELEASES, (2, 3), strict=True):
            await lanes.prepare(self.app, release)
            # Few retries, due at once and without jitter: budgets run out within a short
            # sequence, a retry can be claimed right after its rescue, a replay is exact.
            await lanes.set_policy(
                self.app, release, retry_max_attempts=budget, retry_base_s=0.0, retry_jitter=0.0
            )
        for worker, served in WORKERS.items():
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
            self.conns[worker] = conn
            await runs.register_worker(
                conn, worker_id=worker, lanes=served, release="model", host="model", pid=1
            )
        await self._workers_alive()

    async def _workers_alive(self) -> None:
        # runs.worker_heartbeat stamps the database's clock and the model's runs ahead of
        # it, so the harness stamps the model's: every worker is live at the model's now.
        await self.db.execute("UPDATE wq_workers SET heartbeat_at = %s", (self.now(),))

    def teardown(self) -> None:
        try:
            self.run(self._close())
        finally:
            self.loop.close()
            self.ids.stop()

    async def _close(self) -> None:
        if self.app is not None and not self.app.closed:
            for sql in (
                "SELECT 'db: terminal row write', count(*) FROM wq_audit_terminal",
                "SELECT 'db: step completed', count(*) FROM wq_receipts WHERE status = 'completed'",
                "SELECT 'db: refused ' || kind, sum(rows) FROM wq_refusals GROUP BY kind",
                "SELECT 'db: attempt ' || outcome, count(*) FROM wq_attempts GROUP BY outcome",
            ):
                for what, count in await self._fetch(sql):
                    OUTCOMES[what] += count
        for conn in [*self.conns.values(), self.app]:
            if conn is not None:
                await conn.close()
        await drop_database(self.admin_url, self.dbname)

    async def _fetch(self, sql: Any, params: Any = None) -> list[Any]:
        cur = await self.db.execute(sql, params)
        return list(await cur.fetchall())

    def write(self, fence: Fence, coro: Coroutine[Any, Any, T]) -> T:
        """Run a write of ``fence`` on its worker's connection, naming ``fence`` to the audit
        triggers as the writer (so they can tell whose write landed on which run's row)."""

        async def write() -> T:
            async with audit.writing_as(self.conns[fence.owner], fence):
                return await coro

        return self.run(write())

    def live(self, fence: Fence) -> bool:
        """Whether ``fence`` is its run's live attempt: the oracle for the fence's answer."""
        rows = self.run(
            self._fetch(
                "SELECT state::text, attempt, lease_owner FROM wq_runs WHERE id = %s",
                (fence.run_id,),
            )
        )
        assert rows, f"run {fence.run_id} vanished"
        return bool(rows[0] == ("running", fence.attempt, fence.owner))

    def pick(self, attempt: Fence, writer: str) -> Fence:
        """Who writes, from the attempt drawn (any attempt a worker ever held):

        - ``held``: that attempt;
        - ``latest``: the last attempt its worker claimed (a worker carrying on with the
          run it works on: live, or a zombie whose lease lapsed);
        - ``live``: its run's live attempt, if it has one (most attempts held are stale:
          this keeps live writes frequent);
        - ``zombie``: an earlier attempt of its run, held by the worker that holds the run's
          latest attempt if there is one (the same process still running the attempt its
          lease lapsed under: only the attempt number tells the two apart), else the
          attempt before the latest;
        - ``impostor``: its run's latest attempt number under the next worker (w1 -> w2 ->
          w3 -> w1), which never held it (only the lease owner tells them apart).
        """
        if writer == "latest":
            return self.latest[attempt.owner]
        number, state = self.run(
            self._fetch("SELECT attempt, state::text FROM wq_runs WHERE id = %s", (attempt.run_id,))
        )[0]
        if writer == "live" and state == "running":
            return self.by_number[(attempt.run_id, number)]
        if writer == "zombie" and number > 1:
            owner = self.by_number[(attempt.run_id, number)].owner
            earlier = [self.by_number[(attempt.run_id, n)] for n in range(number - 1, 0, -1)]
            return next((f for f in earlier if f.owner == owner), earlier[0])
        if writer == "impostor":
            owner = self.by_number[(attempt.run_id, number)].owner
            names = sorted(WORKERS)
            return Fence(attempt.run_id, number, names[(names.index(owner) + 1) % len(names)])
        return attempt

    def _one(self, sql: Any, params: Any) -> Any:
        rows = self.run(self._fetch(sql, params))
        return rows[0][0] if rows else None

    # ---- admission, claims, heartbeats ----------------------------------------------------

    @initialize(target=attempts)
    def start(self) -> Any:
        """Every example starts with a run on each lane (ma on sheet s1, mb on s2), claimed
        by w1 and w3: every rule has an attempt to write with from the first step."""
        for release, sheet in zip(RELEASES, SHEETS, strict=True):
            self.admit(release, sheet)
        started = [*self.claim("w1", 0, True).values, *self.claim("w3", 0, True).values]
        assert len(started) == 2, started
        return multiple(*started)

    @precondition(lambda self: self.unfinished < MAX_UNFINISHED and len(self.run_ids) < MAX_RUNS)
    @rule(release=st.sampled_from(RELEASES), sheet=st.sampled_from(SHEETS))
    def admit(self, release: str, sheet: str) -> None:
        try:
            admitted = self.run(
                admission.submit(self.db, admission.Submission(play=PLAY, release=release, org=ORG))
            )
        except (LaneDraining, LaneReclaimed):
            self.saw("admit: lane closed")
            return  # nothing was written
        self.run_ids.append(admitted.run_id)
        self.sheet_of[admitted.run_id] = sheet
        self.unfinished += 1
        self.saw("admit")

    @rule(
        target=attempts,
        worker=st.sampled_from(sorted(WORKERS)),
        advance_s=st.sampled_from([0, 5]),
        enter_play=st.booleans(),
    )
    def claim(self, worker: str, advance_s: int, enter_play: bool = False) -> Any:
        """A worker claims its lanes' next due run, ``advance_s`` later (a wake may be due);
        with ``enter_play``, the play starts as plays do: it admits its page (every key)
        under the run's stable write intent."""
        self.offset += timedelta(seconds=advance_s)
        got = self.run(
            runs.claim(
                self.conns[worker],
                lanes=WORKERS[worker],
                worker_id=worker,
                limit=1,
                plays=[PLAY],
                now=self.now(),
            )
        )
        fences = []
        for claimed in got:
            if not claimed.claimed:
                self.saw("claim: delivery dropped")
                continue
            fence = claimed.fence(worker)
            assert self.live(fence), f"{worker} claimed {fence} but does not hold it"
            self.claims[fence] = claimed
            self.latest[worker] = fence
            self.by_number[(fence.run_id, fence.attempt)] = fence
            fences.append(fence)
            self.saw("claim: cleanup-only attempt" if claimed.cleanup else "claim")
            if enter_play:
                self._admit_page(fence, self.sheet_of[fence.run_id], list(ROW_KEYS), True)
        return multiple(*fences)

    @rule(target=attempts, attempt=attempts, enter_play=st.booleans())
    def claim_again(self, attempt: Fence, enter_play: bool) -> Any:
        """The worker that held ``attempt`` claims again: often that attempt's own run,
        after its lease lapsed or it suspended (so one worker holds an old and a new attempt
        of a run, and only the attempt number tells its writes apart)."""
        return self.claim(attempt.owner, 0, enter_play)

    @rule(attempt=attempts, writer=WRITERS)
    def heartbeat(self, attempt: Fence, writer: str) -> None:
        """The worker's heartbeat: renew the lease, then extend the attempt's step leases
        (the real one extends only renewed attempts; a zombie's may send any), in one batch
        statement and through the per-attempt call."""
        attempt = self.pick(attempt, writer)
        live = self.live(attempt)
        conn, leases = self.conns[attempt.owner], [(attempt.run_id, attempt.attempt)]
        renewed = self.run(
            runs.heartbeat(conn, worker_id=attempt.owner, leases=leases, now=self.now())
        )
        assert bool(renewed) == live, f"heartbeat of {attempt} (live={live}): {renewed}"
        self.write(
            attempt,
            receipts.extend_for_attempts(
                conn, owner=attempt.owner, leases=leases, lease_s=STEP_LEASE_S, now=self.now()
            ),
        )
        try:  # the same through the per-attempt call, which says when it is refused
            self.write(
                attempt,
                receipts.extend_leases(conn, fence=attempt, lease_s=STEP_LEASE_S, now=self.now()),
            )
        except StaleAttempt:
            assert not live, f"the live attempt {attempt} was refused its step leases"
        else:
            assert live, f"the stale attempt {attempt} extended its step leases"
        self.saw(f"heartbeat: {'renewed' if live else 'refused'}")

    # ---- steps ------------------------------------------------------------------------------

    def _scope(self, attempt: Fence, shared: bool) -> Scope:
        return Scope.named("shared") if shared else Scope.of_run(attempt.run_id)

    @rule(
        attempt=attempts,
        writer=WRITERS,
        op=st.sampled_from(["claim and complete", "claim", "complete", "page"]),
        key=st.sampled_from(STEPS),
        shared=st.booleans(),
    )
    def step(self, attempt: Fence, writer: str, op: str, key: str, shared: bool) -> None:
        """A durable step: claim it and complete it, or only claim it (its completion may
        come later, maybe stale), or only complete it (a late completion); or complete a
        ``page`` of steps (every step key) in one statement, as row-level work does."""
        attempt = self.pick(attempt, writer)
        live = self.live(attempt)
        conn = self.conns[attempt.owner]
        scope = Scope.named("shared") if shared else Scope.of_run(attempt.run_id)
        result = {"by": attempt.owner, "attempt": attempt.attempt}
        if op == "page":
            try:
                page = self.write(
                    attempt,
                    receipts.complete_many(
                        conn,
                        org=ORG,
                        play=PLAY,
                        scope=scope,
                        fence=attempt,
                        results=[(step, result) for step in STEPS],
                        now=self.now(),
                    ),
                )
            except StaleAttempt:
                assert not live, f"the live attempt {attempt} was refused a page of steps"
                self.saw("step page: refused (stale)")
                return
            assert live, f"the stale attempt {attempt} completed a page of steps: {page}"
            self.saw(f"step page: completed {len(page.completed)}")
            return
        ref = {"org": ORG, "play": PLAY, "step_key": key, "fence": attempt, "now": self.now()}
        ref["scope"] = scope
        if op != "complete":
            try:
                claim = self.write(attempt, receipts.claim(conn, **ref, lease_s=STEP_LEASE_S))
            except StaleAttempt:
                assert not live, f"the live attempt {attempt} was refused a step claim"
                self.saw("step claim: refused (stale)")
                return
            assert live, f"the stale attempt {attempt} claimed step {key}: {claim}"
            self.saw(f"step claim: {claim.outcome}")
            if op == "claim" or claim.outcome is not ClaimOutcome.EXECUTE:
                return
        try:
            self.write(attempt, receipts.complete(conn, **ref, result=result))
        except StaleAttempt:
            # Stale, or live but not holding the step: refused either way, nothing written.
            self.saw(f"step complete: refused ({'not held' if live else 'stale'})")
            return
        assert live, f"the stale attempt {attempt} completed step {key}"
        self.saw("step complete: written")

    # ---- sheets -----------------------------------------------------------------------------

    @rule(
        attempt=attempts,
        writer=WRITERS,
        keys=st.none() | KEYS,
        stable=st.booleans(),
    )
    def admit_page(self, attempt: Fence, writer: str, keys: list[str] | None, stable: bool) -> None:
        """Admit a page of the run's sheet (``keys``, None: every key), under a ``stable``
        write intent or legacy."""
        attempt = self.pick(attempt, writer)
        self._admit_page(attempt, self.sheet_of[attempt.run_id], keys or list(ROW_KEYS), stable)

    @rule(
        attempt=attempts,
        writer=WRITERS,
        keys=st.none() | KEYS,
        status=st.sampled_from(["done", "failed"]),
        version=st.sampled_from(
            ["mine", "unversioned", "run's oldest", "run's newest", "another run's"]
        ),
    )
    def complete_rows(
        self, attempt: Fence, writer: str, keys: list[str] | None, status: str, version: str
    ) -> None:
        """Complete rows (``keys``, None: the page the attempt admitted last, as a play does)
        as ``status``, under the version the attempt admitted last (``mine``; if none, its
        run's write intent: every attempt of the run shares it), none, the oldest or newest
        version any attempt of its run admitted, or the newest another run admitted."""
        attempt = self.pick(attempt, writer)
        sheet = self.sheet_of[attempt.run_id]
        if keys is None:
            keys = self.page.get((attempt, sheet), list(ROW_KEYS))
        ours = sorted(v for v, run in self.versions[sheet].items() if run == attempt.run_id)
        theirs = sorted(v for v, run in self.versions[sheet].items() if run != attempt.run_id)
        write_version = {
            "mine": self.last.get((attempt, sheet), self.intent.get((attempt.run_id, sheet))),
            "unversioned": None,
            "run's oldest": (ours or [None])[0],
            "run's newest": (ours or [None])[-1],
            "another run's": (theirs or [None])[-1],
        }[version]
        self._complete_rows(attempt, sheet, keys, sheets.RowStatus(status), write_version)

    def _admit_page(self, attempt: Fence, sheet: str, keys: list[str], stable: bool) -> None:
        # Pass back what this attempt (legacy) or any attempt of its run (stable intent)
        # was given before: a stable intent must be the same for every attempt of a run.
        known = (
            self.intent.get((attempt.run_id, sheet))
            if stable
            else self.legacy.get((attempt, sheet))
        )
        live = self.live(attempt)
        try:
            admitted = self.write(
                attempt,
                sheets.admit_page(
                    self.conns[attempt.owner],
                    org=ORG,
                    sheet=sheet,
                    fence=attempt,
                    rows=[(key, {"key": key}) for key in keys],
                    write_version=known,
                    stable_intent=stable,
                ),
            )
        except StaleAttempt:
            assert not live, f"the live attempt {attempt} was refused an admission"
            self.saw("admit page: refused (stale)")
            return
        assert live, f"the stale attempt {attempt} admitted rows: {admitted}"
        if stable:
            self.intent[(attempt.run_id, sheet)] = admitted.write_version
        else:
            self.legacy[(attempt, sheet)] = admitted.write_version
        self.versions[sheet][admitted.write_version] = attempt.run_id
        self.last[(attempt, sheet)] = admitted.write_version
        self.page[(attempt, sheet)] = keys
        for disposition in admitted.counts():
            self.saw(f"admit page: {'intent' if stable else 'legacy'} {disposition}")

    def _complete_rows(
        self,
        attempt: Fence,
        sheet: str,
        keys: list[str],
        status: sheets.RowStatus,
        write_version: int | None,
    ) -> None:
        live = self.live(attempt)
        output = {"by": attempt.owner, "attempt": attempt.attempt}
        try:
            result = self.write(
                attempt,
                sheets.complete_rows(
                    self.conns[attempt.owner],
                    org=ORG,
                    sheet=sheet,
                    fence=attempt,
                    write_version=write_version,
                    completions=[sheets.RowCompletion(key, output, status) for key in keys],
                ),
            )
        except SheetSuperseded as error:
            # The attempt fence refused it: every row is stale_attempt, and it always raises.
            assert not live and error.counts == {"stale_attempt": len(keys)}, (
                f"completion by {attempt} (live={live}) raised {error.counts}: {error}"
            )
            self.saw("complete rows: refused (stale)")
            return
        assert live, f"the stale attempt {attempt} completed rows: {result}"
        assert not result.attempt_stale, result
        self.saw(f"complete rows: committed {len(result.committed)}")
        for row in result.stale:
            self.saw(f"complete rows: stale {row.reason}")

    # ---- the attempt's end: suspend, hand back, finish ------------------------------------

    def _finish(self, attempt: Fence, final: outcomes.Finish) -> None:
        """Send ``final`` as the attempt's worker; check the answer against the model."""
        worker = attempt.owner
        live = self.live(attempt)
        cancel = self._one(
            "SELECT cancel_requested_at IS NOT NULL FROM wq_runs WHERE id = %s", (attempt.run_id,)
        )
        before = self._one(
            "SELECT outcome::text FROM wq_attempts WHERE run_id = %s AND attempt = %s",
            (attempt.run_id, attempt.attempt),
        )
        statuses = self.run(runs.finish(self.conns[worker], worker_id=worker, finishes=[final]))
        status = statuses[(attempt.run_id, attempt.attempt)]
        if live:
            pending = cancel and final.outcome is not outcomes.Outcome.CANCELLED
            expected = FinishStatus.CANCEL_PENDING if pending else FinishStatus.APPLIED
        elif before == str(final.outcome):
            expected = FinishStatus.REPLAYED  # an earlier copy of this write was applied
        else:
            expected = FinishStatus.REFUSED
        assert status is expected, (
            f"{final.outcome} of {attempt} sent by {worker} (live={live}, cancel "
            f"pending={cancel}, attempt outcome before={before}): {status}, expected {expected}"
        )
        self.saw(f"final {final.outcome}: {status}")

    @rule(
        attempt=attempts,
        writer=WRITERS,
        wake_s=st.sampled_from([1, 20, 90]),
        on_event=st.booleans(),
    )
    def suspend(self, attempt: Fence, writer: str, wake_s: int, on_event: bool) -> None:
        """Sleep until a short wake (with ``on_event``: or until the event, whichever first)."""
        attempt = self.pick(attempt, writer)
        self._finish(
            attempt,
            outcomes.suspended(
                attempt.run_id,
                attempt.attempt,
                wake_at=self.now() + timedelta(seconds=wake_s),
                wait_event=EVENT if on_event else None,
            ),
        )

    @rule(attempt=attempts, writer=WRITERS)
    def hand_back(self, attempt: Fence, writer: str) -> None:
        attempt = self.pick(attempt, writer)
        self._finish(attempt, outcomes.handed_back(attempt.run_id, attempt.attempt))

    @rule(
        attempt=attempts,
        writer=WRITERS,
        how=st.sampled_from(["succeeded", "failed", "cancelled"]),
    )
    def finish(self, attempt: Fence, writer: str, how: str) -> None:
        attempt = self.pick(attempt, writer)
        run_id, number = attempt.run_id, attempt.attempt
        if how == "succeeded":
            final = outcomes.succeeded(run_id, number, {"by": attempt.owner})
        elif how == "cancelled":
            final = outcomes.cancelled(run_id, number, "cleanup done")
        else:
            claimed = self.claims[self.by_number[(run_id, number)]]
            final = outcomes.failed(
                run_id,
                number,
                {"type": "Boom"},
                claimed.retry,
                now=self.now(),
                failure=(claimed.failures or 0) + 1,
            )
        self._finish(attempt, final)

    # ---- events and cancellation ----------------------------------------------------------

    @rule(attempt=attempts, writer=WRITERS, fenced=st.booleans())
    def emit(self, attempt: Fence, writer: str, fenced: bool) -> None:
        """Emit the event from ``attempt``'s play (fenced) or from the app (unfenced)."""
        attempt = self.pick(attempt, writer)
        fence = attempt if fenced else None
        conn = self.conns[attempt.owner] if fenced else self.db
        live = fenced and self.live(attempt)

        emit = runs.emit(conn, org=ORG, name=EVENT, payload={"n": 1}, fence=fence)
        try:
            if fence is None:
                self.run(emit)
            else:
                self.write(fence, emit)
        except StaleAttempt:
            assert fenced and not live, f"the live attempt {attempt} could not emit"
            self.saw("emit: refused (stale)")
            return
        assert not fenced or live, f"the stale attempt {attempt} emitted"
        self.saw("emit: by a live attempt" if fenced else "emit: by the app")

    @precondition(lambda self: self.unfinished > 0)
    @rule(run=st.integers(0, MAX_RUNS - 1), force=st.booleans())
    def cancel(self, run: int, force: bool) -> None:
        """Cancel a run: the ``run``-th admitted (modulo the number admitted)."""
        run_id = self.run_ids[run % len(self.run_ids)]
        result = self.run(runs.cancel(self.db, run_id, reason="model", force=force))
        if result.after == "cancelled":
            self.seen_cancelled.add(run_id)
        self.saw(f"cancel{' (force)' if force else ''}: {result.before} -> {result.after}")

    # ---- recovery and lanes -----------------------------------------------------------------

    @rule(advance_s=st.sampled_from([45, 5, 20]))
    def rescue(self, advance_s: int) -> None:
        """Move the model's clock on and run a recovery pass: 45 s is past every lease
        (30 s), 20 s past those not renewed by a heartbeat since the last move."""
        self.offset += timedelta(seconds=advance_s)
        self.run(self._workers_alive())
        report = self.run(recovery.run_once(self.db, now=self.now(), rng=self.rng))
        self.saw(f"rescue: +{advance_s} s")
        for what, count in report.counts().items():
            if count and not what.startswith("deleted"):
                OUTCOMES[f"recovery: {what}"] += count

    @precondition(lambda self: self.lane_ops < 3)  # lanes closed for good starve the rest
    @rule(release=st.sampled_from(RELEASES), op=st.sampled_from(["reopen", "drain", "reclaim"]))
    def lane(self, release: str, op: str) -> None:
        """An operator drains a lane, reclaims it (forced: its runs stay), or reopens it."""
        if op == "drain":
            self.run(lanes.drain(self.db, release))
        elif op == "reclaim":
            self.run(lanes.reclaim(self.db, release, force=True))
        else:
            self.run(lanes.reopen(self.db, release))
        self.lane_ops += 1
        self.saw(f"lane: {op}")

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def one_live_attempt_per_run(self) -> None:
        rows = self.run(
            self._fetch(
                """
                SELECT r.id, r.state::text, r.attempt, r.lease_owner,
                       array_agg(a.attempt ORDER BY a.attempt)
                           FILTER (WHERE a.outcome = 'running') AS open,
                       array_agg(a.attempt || ':' || a.outcome ORDER BY a.attempt) AS attempts
                  FROM wq_runs r
                  LEFT JOIN wq_attempts a ON a.run_id = r.id
                 GROUP BY r.id
                """
            )
        )
        for run_id, state, attempt, owner, open_, every in rows:
            expected = [attempt] if state == "running" else None
            assert open_ == expected, (
                f"invariant 1 (one live attempt per run): run {run_id} is {state} at "
                f"attempt {attempt} (lease {owner}) with open attempts {open_}, expected "
                f"{expected}; its attempts: {every}"
            )

    @invariant()
    def no_write_by_a_closed_attempt(self) -> None:
        found = self.run(audit.violations(self.db))
        assert not found, "the audit triggers recorded violations:\n" + "\n".join(
            f"  [invariant {check}] {detail}" for check, detail in found
        )
        late = self.run(audit.rows_written_after_close(self.db))
        assert not late, (
            "invariant 2 (no write by a closed attempt): terminal rows written after "
            f"their attempt closed (clock, org, sheet, key, run, attempt, row time, "
            f"attempt outcome, close time): {late}"
        )

    @invariant()
    def cancelled_stays_cancelled(self) -> None:
        rows = self.run(self._fetch("SELECT id, state::text FROM wq_runs"))
        states = dict(rows)
        for run_id in self.seen_cancelled:
            assert states.get(run_id) == "cancelled", (
                f"invariant 3 (cancel is final): run {run_id} was cancelled, "
                f"now {states.get(run_id)}"
            )
        self.seen_cancelled |= {run_id for run_id, state in rows if state == "cancelled"}
        self.unfinished = sum(state in ("queued", "running", "sleeping") for _, state in rows)

    @invariant()
    def one_terminal_write_per_row(self) -> None:
        twice = self.run(audit.rows_written_twice(self.db))
        assert not twice, (
            f"invariant 4 (one terminal write per row): (org, sheet, key, writes, changes): {twice}"
        )

    @invariant()
    def no_run_is_stuck(self) -> None:
        self.run(self._no_run_is_stuck())

    async def _no_run_is_stuck(self) -> None:
        now = self.now()
        rows = await self._fetch(
            """
            SELECT r.id, r.state::text, r.lane, r.lease_owner, r.lease_expires_at,
                   r.available_at, r.wait_event, r.cancel_requested_at IS NOT NULL,
                   j.id IS NOT NULL AND j.queue_name = r.lane AND j.task_name = 'wq.run'
                   AND j.args ->> 'run_id' = r.id::text
                   AND j.status::text = CASE WHEN r.state = 'running' THEN 'doing'
                                             ELSE 'todo' END AS live_job,
                   j.status::text
              FROM wq_runs r
              LEFT JOIN procrastinate_jobs j ON j.id = r.job_id
             WHERE r.state IN ('queued', 'running', 'sleeping')
            """
        )
        if not rows:
            return
        # What the recovery pass would take now: its own picks, in a rolled-back transaction.
        picked: set[uuid.UUID] = set()
        async with self.db.transaction(force_rollback=True):
            for name in ("recovery_expired_pick", "recovery_orphans_pick"):
                args = {"now": now, "batch": 1000, "gone_only": False}
                cur = await self.db.execute(q(name), args)
                picked |= {row[0] for row in await cur.fetchall()}
        stranded = {s.lane for s in await recovery.find_stranded(self.db, now=now, after_s=0)}
        for run_id, state, lane, owner, expires, wake, event, cancel, job, status in rows:
            live_lease = state == "running" and expires is not None and expires >= now
            due_wake = state == "sleeping" and wake is not None and wake <= now
            assert job or live_lease or due_wake or run_id in picked or lane in stranded, (
                f"invariant 5 (no run is stuck): run {run_id} is {state} on {lane} (lease "
                f"{owner} until {expires}, wake at {wake}, event {event}, cancel pending "
                f"{cancel}, its job {status}) at model time {now}: no live job, no live "
                f"lease, no due wake, nothing the recovery pass would take, not stranded"
            )


async def _leftover_databases(admin_url: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as admin:
        cur = await admin.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s",
            (f"{DB_PREFIX}{os.getpid()}_%",),
        )
        return [row[0] for row in await cur.fetchall()]


@pytest.mark.timeout(900)  # a pass takes ~15 s; a failure's shrinking may take minutes
def test_the_fence_holds_under_random_interleavings(
    pg_admin_url: str, template_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    del template_url  # the fixture builds the template that every example clones
    # Run under a known seed (pytest's --hypothesis-seed, or a fresh one) and name it on
    # failure, so any run can be replayed, not only those whose failure Hypothesis flags.
    seed = hypothesis.core.global_force_seed
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
        monkeypatch.setattr(hypothesis.core, "global_force_seed", seed)
    OUTCOMES.clear()
    try:
        run_state_machine_as_test(
            lambda: FenceModel(pg_admin_url),
            settings=settings(
                max_examples=int(os.environ.get("FENCE_MODEL_EXAMPLES", "25")),
                stateful_step_count=int(os.environ.get("FENCE_MODEL_STEPS", "30")),
                deadline=None,
                derandomize=False,
                print_blob=True,
                database=None,  # nothing is written under the work tree; replay by seed
            ),
        )
    except BaseException as failure:
        failure.add_note(
            f"Replay this run: v/bin/python -m pytest {__file__} --hypothesis-seed={seed}"
        )
        raise
    finally:
        # What the examples exercised (shown with -s): refusals of every kind should be here.
        print("\n".join(f"{count:6d}  {what}" for what, count in sorted(OUTCOMES.items())))
    assert asyncio.run(_leftover_databases(pg_admin_url)) == [], "an example's clone was left"


def test_a_run_cannot_complete_rows_of_another_run(pg_admin_url: str, template_url: str) -> None:
    """The machine's minimal sequence for a bug it found (fixed: the row must be the
    writer's run's, whatever version it sends): run 1 (w1) entered its play and admitted
    k0..k2 of sheet s1 under its write intent; run 3, admitted on s1 and claimed by w2,
    completes them under run 1's version. No write may land on rows of run 1."""
    del template_url  # the fixture builds the template the machine clones
    machine = FenceModel(pg_admin_url)
    try:
        machine.start()
        machine.admit("ma", "s1")
        (third,) = machine.claim("w2", 0, False).values
        machine.complete_rows(third, "held", None, "done", "another run's")
        machine.no_write_by_a_closed_attempt()
    finally:
        machine.teardown()
