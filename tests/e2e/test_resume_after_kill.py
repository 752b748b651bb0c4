"""A worker SIGKILLed mid-run: a new attempt resumes the run with the same write intent,
finds the rows finished before the kill already terminal, and re-executes no completed
step (side effects are counted in a table).

The first attempt stops for good in the middle of a chunk, its rows paid and their
receipts completed but the rows not yet completed on the sheet (the play's ``hold_at``),
and the kill comes once it is there: what the run had done at the kill is known, not
whatever it had got to by the time the kill landed."""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg

from queues import lanes, recovery
from tests.apps.durable import SIDE_EFFECTS_DDL
from tests.workers import durable_worker, eventually, fetch, submit


async def test_sigkilled_run_resumes_with_its_intent_and_pays_no_step_twice(
    db_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SIDE_EFFECTS_DDL)
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=2.0, heartbeat_s=0.5, retry_base_s=0.0)
    rows = [(f"r{i:04d}", {"i": i}) for i in range(400)]
    chunk, hold_at = 20, 100
    run_id = await submit(
        db_url, "paid-rows", {"chunk": chunk, "hold_at": hold_at}, release="t", inputs=rows
    )

    first = durable_worker(db_url, tmp_path / "a.ready")
    try:

        async def held() -> bool:
            # The receipts of the rows before the held chunk and of the chunk itself.
            ((completed,),) = await fetch(
                db_url,
                "SELECT count(*) FROM wq_receipts"
                " WHERE scope = 'run:' || %s AND status = 'completed'",
                (str(run_id),),
            )
            return int(completed) >= hold_at + chunk

        await eventually(held, timeout=60)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    ((done_at_kill, version),) = await fetch(
        db_url,
        "SELECT r.rows_done, i.write_version FROM wq_runs r "
        "JOIN wq_write_intents i ON i.run_id = r.id WHERE r.id = %s",
        (run_id,),
    )
    assert done_at_kill == hold_at  # the chunks before the held one, and nothing since

    async def rescued() -> int:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            report = await recovery.run_once(conn)
        return len(report.expired)

    assert await eventually(rescued, timeout=20) == 1  # the lease lapsed, the run requeued

    second = durable_worker(db_url, tmp_path / "b.ready")
    try:

        async def finished() -> str | None:
            ((state,),) = await fetch(
                db_url, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,)
            )
            return state if state in {"succeeded", "failed"} else None

        assert await eventually(finished, timeout=60) == "succeeded"
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)

    ((result, attempt),) = await fetch(
        db_url, "SELECT result, attempt FROM wq_runs WHERE id = %s", (run_id,)
    )
    assert attempt == 2
    assert result["attempt"] == 2
    assert result["write_version"] == version  # the same durable intent after the crash
    assert result["terminal"] == done_at_kill  # finished rows came back already terminal
    assert result["replayed"] == chunk  # the held chunk's rows came back from receipts
    assert result["paid"] == len(rows) - hold_at - chunk
    # Every row done, under the run's intent version.
    ((done, versions),) = await fetch(
        db_url,
        "SELECT count(*) FILTER (WHERE status = 'done'), array_agg(DISTINCT write_version) "
        "FROM wq_sheet_rows WHERE run_id = %s",
        (run_id,),
    )
    assert done == 400 and versions == [version]
    # No step whose receipt was completed ran again: no row was paid twice.
    ((reexecuted,),) = await fetch(
        db_url,
        "SELECT count(*) FROM test_side_effects s JOIN wq_receipts r "
        "ON r.scope = 'run:' || s.run_id AND r.step_key = s.key "
        "WHERE s.run_id = %s AND r.status = 'completed' AND r.completed_at < s.at",
        (run_id,),
    )
    assert reexecuted == 0
    counts = await fetch(
        db_url,
        "SELECT key, count(*) FROM test_side_effects WHERE run_id = %s GROUP BY key",
        (run_id,),
    )
    assert len(counts) == 400
    assert all(n == 1 for _, n in counts), [(key, n) for key, n in counts if n > 1]
