"""Mutation check of the attempt fence: remove one fence predicate, the tests must fail.

``queues/fence.py`` lists the SQL statement that checks the attempt fence on each write
path. This script copies the project's tracked files at a commit (HEAD unless ``--ref``;
``--worktree`` copies the working tree's) into a scratch directory, never touching this
checkout. Then, one mutant at a time, it applies one exact text replacement to one
``sql/queries/*.sql`` file of the copy, runs the mutant's test files against the copy with
this project's interpreter (``pytest -p no:cacheprovider -x -q``, each test stopped after
``TEST_TIMEOUT_S``), and restores the file.
A mutant is *killed* when a test fails and fails again when run alone (so a flaky test
cannot kill it), and *survives* when every selected test passes. Before any mutant, the
unmutated copy must pass every selected test file (the baseline).

The copy is what the tests import: ``queues`` is found on ``PYTHONPATH`` (the copy first)
before the editable install's finder, and ``queues.sql`` (which setuptools maps to
``sql/``) is a symlink inside the copy, so ``importlib.resources`` reads the copy's SQL. A
small pytest plugin written into the copy checks this in the test process itself: it
fails the run unless ``queues.queries`` and ``queues.sql`` load from the copy, and, for a
mutant, unless the mutated statement's loaded text differs from the baseline's while every
other statement's text is unchanged.

Every mutation must match exactly once in its file, inside the statement it names: a
replacement that no longer matches fails the script (exit 2), so the list cannot rot.

    v/bin/python scripts/fence_mutants.py              # baseline + every mutant
    v/bin/python scripts/fence_mutants.py --list       # check and list the mutants
    v/bin/python scripts/fence_mutants.py --only 'sheet_*' --wide

Exit status: 0 when every mutant is killed; 1 when the baseline fails or a mutant is not
killed (``survived``; ``flaky``: a failure that did not repeat; ``invalid``: the mutation
broke the SQL itself; ``error``; ``timeout``); 2 when the list does not apply.
See docs/mutants.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker import embedded  # the checkout's, for the shared test server

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / "v" / "bin" / "python"
GUARD = "_fence_mutants_guard"
MUTANT_TIMEOUT_S = 300.0
# A test stuck under a mutant fails by itself (pytest-timeout), with its traceback, long
# before the whole run's bound: the run's report then names it.
TEST_TIMEOUT_S = 90

# ---- test files --------------------------------------------------------------------------

FENCE = "tests/db/test_fence.py"
# Every predicate of the fence alone, in every statement: run with every mutant.
PREDICATES = "tests/db/test_fence_predicates.py"
RECEIPTS = "tests/db/test_receipts.py"
SHEETS = "tests/db/test_sheets.py"
RECOVERY = "tests/db/test_recovery.py"
LIVENESS = "tests/db/test_liveness.py"
ADMISSION = "tests/db/test_admission.py"
RECEIPT_RACES = "tests/integration/test_receipt_races.py"
SHEET_RACES = "tests/integration/test_sheet_races.py"
SCHEDULER = "tests/integration/test_scheduler.py"
TRANSPORT_SEAM = "tests/db/test_transport_seam.py"
DROP_RACES = "tests/integration/test_drop_races.py"
# The set of waiting workers (migration 0032): not an attempt's write, the worker's own row;
# a statement that lost its worker predicate would move every worker in or out of the set.
WAKE_ONE = "tests/db/test_wake_one.py"
WAKE_ONE_RUNTIME = "tests/integration/test_wake_one_runtime.py"
LANE_RESUME = "tests/integration/test_reclaimed_lane_resume.py"
DURABLE = "tests/integration/test_durable.py"
# Child spawns and rate-limit permits (issue 14): stale attempts and each predicate alone.
FENCE_SCHEDULING = "tests/db/test_fence_scheduling.py"
ALL_FENCE_TESTS = (
    PREDICATES,
    FENCE,
    RECEIPTS,
    SHEETS,
    RECOVERY,
    ADMISSION,
    RECEIPT_RACES,
    SHEET_RACES,
    SCHEDULER,
    LANE_RESUME,
    DURABLE,
    FENCE_SCHEDULING,
)

# ---- mutants -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mutant:
    id: str
    file: str  # relative to the project root
    query: str  # the named statement the replacement must lie in
    removed: str  # what the mutation removes, for the table
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS: list[Mutant] = []


def drop(id: str, file: str, query: str, context: str, piece: str, tests: tuple[str, ...]) -> None:
    """A mutant that deletes ``piece`` from ``context`` (``context`` matches once in the
    file; ``piece`` once in ``context``)."""
    if context.count(piece) != 1:
        raise SystemExit(f"fence_mutants: {id}: {piece!r} is not exactly once in its context")
    removed = " ".join(piece.split())
    removed = re.sub(r"^(AND|OR) | (AND|OR)$", "", removed)
    MUTANTS.append(
        Mutant(id, file, query, removed, context, context.replace(piece, ""), (PREDICATES, *tests))
    )


def swap(
    id: str, file: str, query: str, removed: str, old: str, new: str, tests: tuple[str, ...]
) -> None:
    """A mutant that replaces ``old`` (matching once in the file) by ``new``."""
    MUTANTS.append(Mutant(id, file, query, removed, old, new, (PREDICATES, *tests)))


# The attempt fence (one CTE) of the receipt writes. It is the same text in three statements,
# so each context runs on to the first line that differs.
RECEIPTS_SQL = "sql/queries/receipts.sql"
RECEIPT_FENCE = """\
    WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
      AND org = %(org)s AND play = %(play)s
),
refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, 'receipt', %(count)s FROM run
    WHERE NOT EXISTS (SELECT 1 FROM fence)
),
"""
# No `state = 'running'` mutants: the database requires a lease owner exactly while a run is
# running (constraint wq_runs_lease_iff_running, migration 0011), so every fence's
# lease-owner predicate implies its state predicate, and removing the state predicate alone
# changes nothing any write can observe (an equivalent mutant). The constraint itself is
# tested (test_fence_predicates: a lease owner outside `running` is refused by the database).
RECEIPT_PIECES = {
    "attempt": "attempt = %(attempt)s AND ",
    "owner": " AND lease_owner = %(owner)s",
    "org": "org = %(org)s AND ",
    "play": " AND play = %(play)s",
}
# Every stale-attempt test of a receipt write is in test_fence or test_receipts; the races in
# test_receipt_races make attempts stale the same way (rescue, then w2), so add nothing here.
for query, tail in (
    ("receipt_claim", "settled AS (\n    SELECT status, result"),
    ("receipt_finish", "finished AS ("),
    ("receipt_complete_many", "page AS ("),
):
    for what, piece in RECEIPT_PIECES.items():
        drop(f"{query}.{what}", RECEIPTS_SQL, query, RECEIPT_FENCE + tail, piece, (FENCE, RECEIPTS))

EXTEND_FENCE = """\
    WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
),
refusal AS ("""
for what in ("attempt", "owner"):
    drop(
        f"receipt_extend_leases.{what}",
        RECEIPTS_SQL,
        "receipt_extend_leases",
        EXTEND_FENCE,
        RECEIPT_PIECES[what],
        (FENCE, RECEIPTS),
    )

EXTEND_FOR_ATTEMPTS = """\
 WHERE w.attempt = i.attempt
   AND w.state = 'running'
   AND w.lease_owner = %(owner)s
   AND r.owner_run = i.run_id"""
swap(
    "receipt_extend_for_attempts.run_fence",
    RECEIPTS_SQL,
    "receipt_extend_for_attempts",
    "run fence (w.attempt, w.state, w.lease_owner)",
    EXTEND_FOR_ATTEMPTS,
    " WHERE r.owner_run = i.run_id",
    (RECEIPTS, FENCE),
)
for what, piece in (
    ("attempt", "w.attempt = i.attempt\n   AND "),
    ("owner", "\n   AND w.lease_owner = %(owner)s"),
):
    drop(
        f"receipt_extend_for_attempts.{what}",
        RECEIPTS_SQL,
        "receipt_extend_for_attempts",
        EXTEND_FOR_ATTEMPTS,
        piece,
        (RECEIPTS, FENCE),
    )

# The attempt fence of the sheet writes: the same text in four statements again.
SHEETS_SQL = "sql/queries/sheets.sql"
SHEET_FENCE = """\
     WHERE org = %(org)s AND attempt = %(attempt)s AND state = 'running'
       AND lease_owner = %(owner)s
), refusal AS (
    INSERT INTO wq_refusals (run_id, attempt, worker_id, kind, rows)
    SELECT id, %(attempt)s, %(owner)s, '{kind}', %(count)s FROM run
     WHERE NOT EXISTS (SELECT 1 FROM fence)
), """
SHEET_PIECES = {
    "attempt": "attempt = %(attempt)s AND ",
    "owner": "\n       AND lease_owner = %(owner)s",
    "org": "org = %(org)s AND ",
}
for query, kind, tail, tests in (
    (
        "sheet_version_mint",
        "admission",
        "existing AS (\n    SELECT write_version FROM wq_attempt_versions",
        (FENCE, SHEETS),
    ),
    (
        "sheet_intent_claim",
        "admission",
        "existing AS (\n    SELECT write_version FROM wq_write_intents",
        (FENCE, SHEETS),
    ),
    ("sheet_admit_rows", "admission", "page AS (", (FENCE, SHEETS, SHEET_RACES)),
    ("sheet_complete_rows", "rows", "page AS (", (FENCE, SHEETS, SHEET_RACES)),
):
    context = SHEET_FENCE.replace("{kind}", kind) + tail
    for what, piece in SHEET_PIECES.items():
        drop(f"{query}.{what}", SHEETS_SQL, query, context, piece, tests)

swap(
    "sheet_admit_rows.cross_join_fence",
    SHEETS_SQL,
    "sheet_admit_rows",
    "CROSS JOIN fence (fence.id -> %(run_id)s)",
    """\
    SELECT %(org)s, %(sheet)s, page.row_key, fence.id, %(write_version)s, page.input,
           %(attempt)s
    FROM page CROSS JOIN fence
""",
    """\
    SELECT %(org)s, %(sheet)s, page.row_key, %(run_id)s, %(write_version)s, page.input,
           %(attempt)s
    FROM page
""",
    (FENCE, SHEETS, SHEET_RACES),
)
drop(
    "sheet_complete_rows.locked_fence",
    SHEETS_SQL,
    "sheet_complete_rows",
    """\
    ) AS r
    WHERE EXISTS (SELECT 1 FROM fence)
    ORDER BY r.row_key""",
    "\n    WHERE EXISTS (SELECT 1 FROM fence)",
    (FENCE, SHEETS, SHEET_RACES, "tests/integration/test_chaos.py"),
)
swap(
    "sheet_complete_rows.written_fence",
    SHEETS_SQL,
    "sheet_complete_rows",
    "JOIN locked in written (FROM page only)",
    "    FROM page JOIN locked USING (row_key)\n",
    "    FROM page\n",
    (FENCE, SHEETS, SHEET_RACES, "tests/integration/test_chaos.py"),
)
swap(
    "sheet_complete_rows.write_version",
    SHEETS_SQL,
    "sheet_complete_rows",
    "r.write_version = %(write_version)s",
    "OR r.write_version = %(write_version)s::bigint)",
    "OR true)",
    (SHEETS, SHEET_RACES),
)
swap(
    "sheet_complete_rows.row_run",
    SHEETS_SQL,
    "sheet_complete_rows",
    "r.run_id = %(run_id)s (any writer)",
    "          AND r.run_id = %(run_id)s  -- only the writer's own rows",
    "          AND true  -- only the writer's own rows",
    (SHEETS,),
)

RUNS_SQL = "sql/queries/runs.sql"
HEARTBEAT = """\
 WHERE r.id = i.run_id
   AND r.attempt = i.attempt
   AND r.state = 'running'
   AND r.lease_owner = %(worker)s
   AND l.name = r.lane"""
for what, piece in (
    ("attempt", "\n   AND r.attempt = i.attempt"),
    ("owner", "\n   AND r.lease_owner = %(worker)s"),
):
    drop(
        f"run_heartbeat.{what}",
        RUNS_SQL,
        "run_heartbeat",
        HEARTBEAT,
        piece,
        (FENCE, RECOVERY, SCHEDULER),
    )

# Not a fence predicate, the lock order the heartbeat shares with run_finish_batch: without
# its `locked` CTE the UPDATE locks in join order and deadlocks against a batched finish.
swap(
    "run_heartbeat.lock_order",
    RUNS_SQL,
    "run_heartbeat",
    "runs locked in id order (old deadlock)",
    "   AND l.name = r.lane\n   AND r.id IN (SELECT id FROM locked)\n",
    "   AND l.name = r.lane\n",
    ("tests/integration/test_lock_order.py",),
)

FINISH = """\
      JOIN input i ON i.run_id = r.id
     WHERE r.attempt = i.attempt
       AND r.state = 'running'
       AND r.lease_owner = %(worker)s
     ORDER BY r.id"""
for what, piece in (
    ("attempt", "r.attempt = i.attempt\n       AND "),
    ("owner", "\n       AND r.lease_owner = %(worker)s"),
):
    drop(
        f"run_finish_batch.{what}",
        RUNS_SQL,
        "run_finish_batch",
        FINISH,
        piece,
        (FENCE, SCHEDULER),
    )
swap(
    "run_finish_batch.cancel_pending",
    RUNS_SQL,
    "run_finish_batch",
    "cancel-pending rule (false AS cancel_pending)",
    "(r.cancel_requested_at IS NOT NULL AND i.outcome <> 'cancelled') AS cancel_pending",
    "false AS cancel_pending",
    (FENCE, RECOVERY, SCHEDULER),
)
swap(
    "run_cancel.repeat_sleeping",
    RUNS_SQL,
    "run_cancel",
    "repeat cancel of a sleeper: no-op (old bug)",
    "           AND (t.state = 'sleeping'\n",
    "           AND ((t.state = 'sleeping' AND t.cancel_requested_at IS NULL)\n",
    (RECOVERY, SCHEDULER),
)
drop(
    "run_claim_batch.job_id",
    RUNS_SQL,
    "run_claim_batch",
    "       AND l.name = r.lane\n       AND r.job_id = taken.id",
    "\n       AND r.job_id = taken.id",
    (SCHEDULER, RECOVERY),
)
drop(
    "run_claim_batch.waiting_worker",
    RUNS_SQL,
    "run_claim_batch",
    "     WHERE w.id = %(worker)s\n       AND (w.waiting_since IS NULL)",
    "w.id = %(worker)s\n       AND ",
    (WAKE_ONE, WAKE_ONE_RUNTIME),
)
drop(
    "worker_stop_waiting.worker",
    RUNS_SQL,
    "worker_stop_waiting",
    "WHERE id = %(id)s AND waiting_since IS NOT NULL",
    "id = %(id)s AND ",
    (WAKE_ONE, WAKE_ONE_RUNTIME),
)
drop(
    "job_drop.job_id",
    RUNS_SQL,
    "job_drop",
    "       AND r.id = d.run_id\n       AND r.job_id = d.id",
    "\n       AND r.job_id = d.id",
    (TRANSPORT_SEAM, DROP_RACES),
)

EMIT_ALLOWED = """\
    SELECT %(run_id)s::uuid IS NULL
           OR EXISTS (SELECT 1 FROM run
                       WHERE attempt = %(attempt)s AND state = 'running'
                         AND lease_owner = %(owner)s AND org = %(org)s) AS ok"""
swap(
    "event_emit.allowed",
    RUNS_SQL,
    "event_emit",
    "allowed (SELECT true AS ok)",
    EMIT_ALLOWED,
    "    SELECT true AS ok",
    (FENCE,),
)
for what, piece in (
    ("attempt", "attempt = %(attempt)s AND "),
    ("owner", "lease_owner = %(owner)s AND "),
    ("org", " AND org = %(org)s"),
):
    drop(f"event_emit.{what}", RUNS_SQL, "event_emit", EMIT_ALLOWED, piece, (FENCE,))
drop(
    "event_emit.waiting_org",
    RUNS_SQL,
    "event_emit",
    "     WHERE r.state = 'sleeping' AND r.org = e.org AND r.wait_event = e.name",
    " AND r.org = e.org",
    (DURABLE,),
)

LEDGER_FENCE = """\
     WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s
), delivery AS ("""
for what, piece in (
    ("attempt", "attempt = %(attempt)s AND "),
    ("owner", " AND lease_owner = %(owner)s"),
):
    drop(
        f"ledger_append_delivered.{what}",
        "sql/queries/authority.sql",
        "ledger_append_delivered",
        LEDGER_FENCE,
        piece,
        ("tests/integration/test_gateway.py",),
    )
# The delivery lease a request names must be the live attempt's: compared in the statement,
# not only by the receiver (a test reaches the statement past the receiver's check).
drop(
    "ledger_append_delivered.delivery_owner",
    "sql/queries/authority.sql",
    "ledger_append_delivered",
    "    SELECT id FROM fence\n     WHERE lease_owner = %(delivery_owner)s::text\n",
    "\n     WHERE lease_owner = %(delivery_owner)s::text",
    ("tests/db/test_operations.py",),
)

# The writes of issue 14: a child spawn and a permit's acquire and release each check the
# fence in their own statement (sql/queries/children.sql, limits.sql).
FENCE_PIECES = {"attempt": "attempt = %(attempt)s AND ", "owner": " AND lease_owner = %(owner)s"}
for query, file, selected in (
    ("child_spawn", "sql/queries/children.sql", "SELECT id, org, release, lane FROM run"),
    ("limit_acquire", "sql/queries/limits.sql", "SELECT id, org FROM run"),
    ("limit_release", "sql/queries/limits.sql", "SELECT id FROM run"),
):
    context = (
        f"    {selected}\n"
        "     WHERE attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s\n"
        "), refusal AS ("
    )
    for what, piece in FENCE_PIECES.items():
        drop(f"{query}.{what}", file, query, context, piece, (FENCE_SCHEDULING,))

# A step's reservation against its run's budgets (sql/queries/costs.sql), fenced in its own
# statement; the charges ride on the receipt statements' fences above.
BUDGET_RESERVE_FENCE = (
    "     WHERE checked.ok\n"
    "       AND attempt = %(attempt)s AND state = 'running' AND lease_owner = %(owner)s\n"
    "), refusal AS ("
)
for what, piece in FENCE_PIECES.items():
    drop(
        f"budget_reserve.{what}",
        "sql/queries/costs.sql",
        "budget_reserve",
        BUDGET_RESERVE_FENCE,
        piece,
        (FENCE_SCHEDULING, "tests/db/test_costs.py"),
    )

# A step's charges are written only with the receipt the statement settled, so they share
# its fence: recorded from the settled rows (`finished`, `written`), never from the
# request alone. A charge recorded apart from them would outlive a refused write.
swap(
    "receipt_finish.charges_with_receipt",
    RECEIPTS_SQL,
    "receipt_finish",
    "charges recorded only with the settled receipt (FROM finished)",
    "    FROM finished\n    CROSS JOIN unnest(%(charge_units)s::text[],",
    "    FROM (SELECT %(step_key)s::text AS step_key) AS finished\n"
    "    CROSS JOIN unnest(%(charge_units)s::text[],",
    (RECEIPTS, "tests/db/test_costs.py"),
)
swap(
    "receipt_complete_many.charges_with_receipts",
    RECEIPTS_SQL,
    "receipt_complete_many",
    "charges recorded only with the receipts the page completed (JOIN written, mine)",
    "    JOIN written w ON w.step_key = c.step_key AND w.mine\n",
    "",
    (RECEIPTS, "tests/db/test_costs.py"),
)

# The bucket a permit needs, made by the attempt's first acquire, fenced the same way.
BUCKET = (
    "   AND r.id = %(run_id)s AND r.attempt = %(attempt)s AND r.state = 'running'\n"
    "   AND r.lease_owner = %(owner)s\n"
)
for what, piece in (
    ("attempt", " AND r.attempt = %(attempt)s"),
    ("owner", "\n   AND r.lease_owner = %(owner)s"),
):
    drop(
        f"limit_bucket_ensure.{what}",
        "sql/queries/limits.sql",
        "limit_bucket_ensure",
        BUCKET,
        piece,
        (FENCE_SCHEDULING,),
    )

swap(
    "lane_prepare.reopen",
    "sql/queries/lanes.sql",
    "lane_prepare",
    "keeps the state -> reopen reclaimed (old bug)",
    "ON CONFLICT (name) DO UPDATE SET schema_version = excluded.schema_version, "
    "updated_at = now()\n WHERE %(bump)s AND coalesce(l.schema_version, 0) < "
    "excluded.schema_version\n",
    "ON CONFLICT (name) DO UPDATE SET state = 'prepared', updated_at = now()\n"
    " WHERE l.state = 'reclaimed'\n",
    (ADMISSION, RECOVERY, LANE_RESUME),
)

# The rescue's own fence: it closes an attempt only while its lease has ended (expired, or
# its owner gone: migration 0024), checked again under the row lock.
swap(
    "recovery_expired_apply.lapsed",
    "sql/queries/recovery.sql",
    "recovery_expired_apply",
    "lease ended -> any running attempt",
    "       AND wq_lease_lapsed(r.lease_owner, r.lease_expires_at,\n"
    "                           coalesce(%(now)s::timestamptz, now()))\n",
    "",
    (RECOVERY, LIVENESS),
)

# ---- the guard plugin, written into the scratch copy ---------------------------------------

GUARD_SOURCE = '''\
"""Written by scripts/fence_mutants.py: proves which code and SQL the tests load."""

import hashlib
import json
import os
import sys
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(os.environ["FENCE_MUTANTS_ROOT"]).resolve()
PROJECT = ("queues", "worker", "tests")

# The editable install maps queues, queues.sql and worker to the checkout: a module the copy
# lacks would be imported from there. Without the finder, it fails to import instead.
# (install() appends the finder class itself, so look at the object's own __module__.)
sys.meta_path[:] = [
    f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")
]


def pytest_configure(config):
    import queues.queries as queries

    loaded = {
        "queues.queries": Path(queries.__file__).resolve(),
        "queues.sql": Path(str(resources.files("queues.sql"))).resolve(),
    }
    for what, path in loaded.items():
        if not path.is_relative_to(ROOT):
            raise pytest.UsageError(f"fence_mutants: {what} loads from {path}, not from {ROOT}")
    digests = {
        name: hashlib.sha256(query.sql.encode()).hexdigest()
        for name, query in queries.QUERIES.items()
    }
    out = os.environ.get("FENCE_MUTANTS_DIGESTS_OUT")
    if out:
        Path(out).write_text(json.dumps(digests))
    changed = os.environ.get("FENCE_MUTANTS_CHANGED")
    if changed:
        baseline = json.loads(Path(os.environ["FENCE_MUTANTS_BASELINE"]).read_text())
        if digests.get(changed) == baseline.get(changed):
            raise pytest.UsageError(f"fence_mutants: {changed} was loaded unmutated")
        others = sorted(n for n in set(digests) | set(baseline)
                        if n != changed and digests.get(n) != baseline.get(n))
        if others:
            raise pytest.UsageError(f"fence_mutants: other statements changed too: {others}")


def pytest_sessionfinish(session, exitstatus):
    outside = sorted(
        name
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in PROJECT
        and getattr(module, "__file__", None)
        and not Path(module.__file__).resolve().is_relative_to(ROOT)
    )
    if outside:
        print(f"fence_mutants: modules loaded from outside the copy: {outside}")
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
'''

# ---- applying mutants ---------------------------------------------------------------------

_HEADER = re.compile(r"^-- name: (?P<name>[a-z][a-z0-9_]*) :", re.MULTILINE)
_INVALID = re.compile(
    r"psycopg\.errors\.(SyntaxError|Undefined\w+|Ambiguous\w+|GroupingError|"
    r"DatatypeMismatch|InvalidColumnReference|IndeterminateDatatype)"
)


class Rotted(Exception):
    """The mutant list no longer applies to the SQL (exit status 2)."""


def statement_of(text: str, offset: int) -> str | None:
    """The name of the statement whose section holds ``offset``."""
    name = None
    for match in _HEADER.finditer(text):
        if match.start() > offset:
            break
        name = match["name"]
    return name


def mutate(text: str, mutant: Mutant) -> str:
    """The file's text with the mutation applied; fails unless it matches exactly once,
    inside the statement it names, and changes something."""
    count = text.count(mutant.old)
    if count != 1:
        raise Rotted(
            f"{mutant.id}: the text to replace occurs {count} times in "
            f"{mutant.file} (must be exactly once); update the mutant list:\n{mutant.old}"
        )
    at = text.index(mutant.old)
    inside = {statement_of(text, at), statement_of(text, at + len(mutant.old) - 1)}
    if inside != {mutant.query}:
        raise Rotted(
            f"{mutant.id}: the replacement lies in {sorted(map(str, inside))}, "
            f"not in {mutant.query}"
        )
    if mutant.old == mutant.new:
        raise Rotted(f"{mutant.id}: the mutation changes nothing")
    return text.replace(mutant.old, mutant.new)


def check_all(mutants: list[Mutant], tree: Path) -> None:
    """Every mutation applies to the copy ``tree`` (exactly once, in its statement)."""
    ids = [m.id for m in mutants]
    if len(ids) != len(set(ids)):
        raise Rotted("duplicate mutant ids")
    for mutant in mutants:
        mutate((tree / mutant.file).read_text(encoding="utf-8"), mutant)
        for test in mutant.tests:
            if not (tree / test).is_file():
                raise Rotted(f"{mutant.id}: no test file {test}")


def make_copy(ref: str | None) -> Path:
    """A scratch copy of the tracked files: of commit ``ref``, or (``ref`` None) of the
    working tree, uncommitted edits and new files (untracked, not ignored) included: a new
    migration or test file belongs to the working tree being checked."""
    scratch = Path(tempfile.mkdtemp(prefix="fence-mutants-"))
    if ref is None:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        for name in filter(None, listed.decode().split("\0")):
            source = ROOT / name
            if not source.is_file():  # deleted in the working tree
                continue
            target = scratch / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    else:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", ref], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
    # setuptools maps the package queues.sql to sql/: make the copy's queues/ hold it too,
    # so the copy's SQL is found before the editable install's mapping to this checkout.
    (scratch / "queues" / "sql").symlink_to(Path("..") / "sql", target_is_directory=True)
    (scratch / f"{GUARD}.py").write_text(GUARD_SOURCE, encoding="utf-8")
    return scratch


@dataclass
class Outcome:
    result: str  # passed | failed | invalid | error | timeout
    seconds: float
    detail: str  # the first failing test, or why the run errored
    output: str


def run_tests(scratch: Path, tests: tuple[str, ...], env_extra: dict[str, str]) -> Outcome:
    python = PYTHON if PYTHON.exists() else Path(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCE_MUTANTS_")}
    env.update(PYTHONPATH=str(scratch), FENCE_MUTANTS_ROOT=str(scratch), **env_extra)
    command = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", GUARD, "-x", "-q"]
    command += ["-o", f"timeout={TEST_TIMEOUT_S}"]
    started = time.monotonic()
    with subprocess.Popen(
        [*command, *tests],
        cwd=scratch,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so a timeout can stop all of it
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=MUTANT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            output, _ = proc.communicate()
            return Outcome("timeout", time.monotonic() - started, "", output)
    seconds = time.monotonic() - started
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    detail = failed[0] if failed else ""
    if proc.returncode == 0:
        return Outcome("passed", seconds, "", output)
    if proc.returncode == 1 and failed:
        result = "invalid" if _INVALID.search(output) else "failed"
        return Outcome(result, seconds, detail, output)
    tail = output.strip().splitlines()[-1:] or [""]
    return Outcome("error", seconds, f"pytest exit {proc.returncode}: {tail[0]}", output)


def judge(scratch: Path, tests: tuple[str, ...], env: dict[str, str]) -> tuple[str, Outcome]:
    """Run a mutant's tests: ``killed`` only when the failing test fails again when run
    alone (a test that fails once under load and then passes is no kill: the mutant's tests
    run again, once). Otherwise ``survived``, ``flaky``, ``invalid``, ``error`` or
    ``timeout``. The outcome's seconds add up every run."""
    seconds = 0.0
    flaky: list[str] = []
    for _ in range(2):
        got = run_tests(scratch, tests, env)
        seconds += got.seconds
        if got.result != "failed":
            break
        again = run_tests(scratch, (got.detail,), env)
        seconds += again.seconds
        if again.result == "failed":
            got.seconds = seconds
            return "killed", got
        flaky.append(got.detail.removeprefix("tests/"))
    got.seconds = seconds
    result = {"passed": "survived", "failed": "flaky"}.get(got.result, got.result)
    if flaky:
        got.detail = f"{got.detail} (failed once, then passed alone: {', '.join(flaky)})".strip()
    return result, got


def _commit(ref: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def short(test: str) -> str:
    return test.removeprefix("tests/").removesuffix(".py")


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


# ---- CI: a rotating share, the whole set when a fenced statement changed -----------------

DOC = ROOT / "docs" / "mutants.md"
DOC_BEGIN = "<!-- fence-mutants:results -->"
DOC_END = "<!-- /fence-mutants:results -->"
CI_SHARES = 8
_DIGEST_LINE = re.compile(r"fenced\s+statements'\s+digest:\s+`(?P<digest>[0-9a-f]{64})`")


def statement_text(text: str, name: str) -> str:
    """The section of a query file holding statement ``name`` (its header to the next)."""
    starts = [(m.start(), m["name"]) for m in _HEADER.finditer(text)]
    for i, (start, found) in enumerate(starts):
        if found == name:
            end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
            return text[start:end]
    raise Rotted(f"no statement {name!r}")


def fenced_digest(tree: Path, mutants: list[Mutant]) -> str:
    """A digest of the text of every statement a mutant names, and of each mutant's
    replacement: it changes when a fenced statement or a mutation does, and only then (a
    mutant's list of tests may grow without it)."""
    sha = hashlib.sha256()
    for file, query in sorted({(m.file, m.query) for m in mutants}):
        sha.update(f"{file}:{query}\n".encode())
        sha.update(statement_text((tree / file).read_text(encoding="utf-8"), query).encode())
    for m in mutants:
        sha.update(repr((m.id, m.file, m.query, m.old, m.new)).encode())
    return sha.hexdigest()


def recorded_digest() -> str | None:
    """The digest docs/mutants.md recorded with its last full run."""
    with contextlib.suppress(OSError):
        found = _DIGEST_LINE.search(DOC.read_text(encoding="utf-8"))
        return found["digest"] if found else None
    return None


def ci_share(commit: str) -> int:
    """This commit's share of the mutants: the number of commits up to it, modulo the
    shares, so consecutive commits check consecutive shares and every mutant is run at
    least once in any CI_SHARES consecutive commits."""
    count = subprocess.run(
        ["git", "rev-list", "--count", commit], cwd=ROOT, check=True, capture_output=True
    ).stdout
    return int(count) % CI_SHARES


def write_doc(commit: str, digest: str, summary: str, results: str) -> None:
    """Replace the results section of docs/mutants.md with this full run's."""
    text = DOC.read_text(encoding="utf-8")
    if DOC_BEGIN not in text or DOC_END not in text:
        raise SystemExit(f"fence_mutants: {DOC} has no {DOC_BEGIN} ... {DOC_END} section")
    day = datetime.datetime.now(datetime.UTC).date().isoformat()
    prose = textwrap.fill(
        f"Written by `scripts/fence_mutants.py --write-doc` at {commit[:12]} on {day}: "
        f"{summary}. The fenced statements' digest: `{digest}` (CI runs every mutant when "
        "the statements or the mutations no longer match it).",
        width=90,
        break_long_words=False,
        break_on_hyphens=False,
    )
    block = f"{DOC_BEGIN}\n{prose}\n\n{results}\n{DOC_END}"
    before, rest = text.split(DOC_BEGIN, 1)
    after = rest.split(DOC_END, 1)[1]
    DOC.write_text(before + block + after, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="GLOB",
        help="run only the mutants whose id matches (repeatable)",
    )
    parser.add_argument(
        "--wide", action="store_true", help="run every mutant against all ten fence test files"
    )
    parser.add_argument(
        "--tests",
        action="append",
        default=[],
        metavar="FILE",
        help="run every mutant against these test files instead (repeatable)",
    )
    parser.add_argument(
        "--list", action="store_true", help="check and list the mutants, run nothing"
    )
    parser.add_argument(
        "--ref",
        default="HEAD",
        help="the commit to copy (default HEAD: the checkout is shared, and "
        "others' uncommitted edits must not decide the result)",
    )
    parser.add_argument(
        "--worktree",
        action="store_true",
        help="copy the working tree's tracked files instead (uncommitted edits)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    parser.add_argument(
        "--ci",
        action="store_true",
        help="CI: every mutant when a fenced statement or the mutant list changed since "
        "docs/mutants.md's run, else this commit's rotating share (one of "
        f"{CI_SHARES})",
    )
    parser.add_argument(
        "--write-doc",
        action="store_true",
        help="after a full run, write its table into docs/mutants.md",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the pytest output of survivors and errors",
    )
    args = parser.parse_args(argv)

    mutants = [
        m for m in MUTANTS if not args.only or any(fnmatch.fnmatch(m.id, g) for g in args.only)
    ]
    if not mutants:
        raise SystemExit(f"fence_mutants: no mutant matches {args.only}")

    started = time.monotonic()
    ref = None if args.worktree else _commit(args.ref)  # one commit, even if HEAD moves
    scratch = make_copy(ref)
    try:
        try:
            check_all(MUTANTS, scratch)  # the whole list, whatever --only selects
        except Rotted as rotted:
            sys.stderr.write(f"fence_mutants: the mutant list does not apply: {rotted}\n")
            return 2
        digest = fenced_digest(scratch, MUTANTS)
        if args.ci and not args.only:
            if recorded_digest() == digest:
                share = ci_share(ref or "HEAD")
                mutants = [m for i, m in enumerate(MUTANTS) if i % CI_SHARES == share]
                say(
                    f"fenced statements unchanged since docs/mutants.md's full run: "
                    f"share {share} of {CI_SHARES}, {len(mutants)} mutants"
                )
            else:
                say("fenced statements or mutants changed since docs/mutants.md's run: all")
        if args.list:
            say(
                table(
                    [(m.id, m.file, m.removed, ", ".join(map(short, m.tests))) for m in mutants],
                    ("mutant", "file", "removed", "tests"),
                )
            )
            return 0
        source = "the working tree" if ref is None else f"{args.ref} ({ref[:12]})"
        say(f"scratch copy of {source}: {scratch}")
        # One server for every run (each run still migrates its own template from the
        # copy): a test session need not start a server of its own each time.
        server_home = scratch / ".server"
        server_home.mkdir(mode=0o755)
        scratch.chmod(0o755)
        os.environ["WORKER_TEST_DATABASE_URL"] = embedded.ensure_running(server_home).url(
            "postgres"
        )
        chosen = tuple(args.tests) or (ALL_FENCE_TESTS if args.wide else ())
        selected = {m.id: chosen or m.tests for m in mutants}
        union = tuple(dict.fromkeys(t for s in selected.values() for t in s))
        digests = scratch / ".fence_mutants_baseline.json"
        base = run_tests(scratch, union, {"FENCE_MUTANTS_DIGESTS_OUT": str(digests)})
        say(f"baseline (unmutated copy, {len(union)} files): {base.result} in {base.seconds:.1f}s")
        if base.result != "passed" or not digests.exists():
            say(base.output)
            say("fence_mutants: the baseline must pass before mutants mean anything")
            return 1

        rows: list[tuple[str, ...]] = []
        bad: list[tuple[Mutant, str, Outcome]] = []
        for n, mutant in enumerate(mutants, 1):
            path = scratch / mutant.file
            original = path.read_text(encoding="utf-8")
            path.write_text(mutate(original, mutant), encoding="utf-8")
            tests = selected[mutant.id]
            env = {"FENCE_MUTANTS_CHANGED": mutant.query, "FENCE_MUTANTS_BASELINE": str(digests)}
            try:
                result, got = judge(scratch, tests, env)
            finally:
                path.write_text(original, encoding="utf-8")
            if result != "killed":
                bad.append((mutant, result, got))
            killer = got.detail.removeprefix("tests/")
            rows.append(
                (
                    mutant.id,
                    mutant.file.removeprefix("sql/queries/"),
                    mutant.removed,
                    ", ".join(map(short, tests)),
                    result,
                    f"{got.seconds:.1f}s",
                    killer,
                )
            )
            say(f"[{n}/{len(mutants)}] {mutant.id}: {result} in {got.seconds:.1f}s {killer}")
    finally:
        with contextlib.suppress(Exception):  # none started when the list did not apply
            embedded.stop(scratch / ".server", mode="immediate")
        if args.keep:
            say(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    total = time.monotonic() - started
    say("")
    results = table(rows, ("mutant", "file", "removed", "tests run", "result", "time", "killed by"))
    say(results)
    killed = sum(1 for r in rows if r[4] == "killed")
    say(f"\n{killed}/{len(rows)} killed; total {total:.0f}s (baseline {base.seconds:.0f}s)")
    for mutant, result, got in bad:
        say(
            f"\n{result.upper()}: {mutant.id} ({mutant.file}, statement {mutant.query}): "
            f"removed {mutant.removed}; ran {', '.join(selected[mutant.id])} {got.detail}"
        )
        if args.verbose:
            say(got.output)
        elif result in ("timeout", "error"):  # its last lines say where it stopped
            say("\n".join(got.output.strip().splitlines()[-40:]))
    if args.write_doc:
        if len(rows) != len(MUTANTS) or ref is None:
            say("fence_mutants: --write-doc records a full run of a commit only; not written")
            return 1
        summary = f"**{killed} of {len(rows)} killed** in {total:.0f} s"
        write_doc(ref, digest, summary, results)
        say(f"wrote {DOC.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
