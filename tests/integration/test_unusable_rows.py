"""A worker never dies on a row it cannot use.

Admission refuses such values (migration 0036), but a row can still be written around it:
by the owner, or admitted before the database checked. A real worker process that claims
one fails that run (``RUN_ROW_INVALID``, through its fenced final write, never retried)
and goes on serving the next run. Before, a claimed run whose params were not a JSON
object killed the worker (a TypeError in its claim loop), recovery handed the run to the
next worker, and that one died too.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from psycopg import sql

from queues import lanes
from tests.workers import connect, eventually, fetch, submit, worker_process

DEEP = "[" * 5000 + "]" * 5000  # jsonb takes it; Python cannot read it back
POISON = [
    ("params", "[1, 2]"),
    ("params", '"limit=10"'),
    ("params", '{"a": ' + DEEP + "}"),
    ("params", '{"n": 1' + "0" * 5000 + "}"),  # an integer longer than Python reads
    ("authority", "[1]"),
    ("authority", '{"org": "someone-else"}'),
    ("authority", '{"capabilities": "run.spawn"}'),
    ("meta", '{"a": ' + DEEP + "}"),
]


async def failed_as_unusable(url: str, run_ids: list[uuid.UUID]) -> bool:
    rows = await fetch(
        url,
        "SELECT count(*) FROM wq_runs"
        " WHERE id = ANY (%s) AND state = 'failed' AND error ->> 'code' = 'RUN_ROW_INVALID'",
        (run_ids,),
    )
    return rows[0][0] == len(run_ids)


async def succeeded(url: str, run_id: uuid.UUID) -> bool:
    rows = await fetch(url, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,))
    return rows == [("succeeded",)]


async def test_a_worker_fails_a_run_it_cannot_use_and_serves_the_next(
    db_url: str, tmp_path: Path
) -> None:
    poisoned: list[uuid.UUID] = []
    async with connect(db_url) as owner:
        await lanes.prepare(owner, "t")
        for column, value in POISON:
            run_id = await submit(db_url, "echo", {"poison": column})
            # Written as the owner, around the submit function's checks.
            await owner.execute(
                sql.SQL("UPDATE wq_runs SET {} = %s::jsonb WHERE id = %s").format(
                    sql.Identifier(column)
                ),
                (value, run_id),
            )
            poisoned.append(run_id)
    proc = worker_process(db_url, tmp_path / "worker.log", "--app", "tests.apps.plays:registry")
    try:
        await eventually(lambda: failed_as_unusable(db_url, poisoned), timeout=30)
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        after = await submit(db_url, "echo", {"after": "poison"})
        await eventually(lambda: succeeded(db_url, after), timeout=15)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text()[-3000:]
    attempts = await fetch(
        db_url,
        "SELECT count(*), count(DISTINCT run_id) FROM wq_attempts WHERE run_id = ANY (%s)",
        (poisoned,),
    )
    assert attempts == [(len(poisoned), len(poisoned))]  # each tried once: never retried
