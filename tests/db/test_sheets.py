"""Sheets and the runtime operation contract, on a real Postgres (one rolled-back transaction).

Every run is really admitted and claimed (tests/attempts.py), so each write carries the
fence of a live attempt; a "wake" is a real rescue and a second claim. Each ``admit_page``
transaction block is a savepoint that the fixture rolls back.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest

from queues import sheets
from queues.errors import (
    InvalidField,
    PayloadTooLarge,
    RunNotFound,
    SheetSuperseded,
    WriteVersionMismatch,
)
from queues.fence import Fence
from queues.sheets import (
    Disposition,
    RowCompletion,
    RowStatus,
    StaleReason,
)
from tests import attempts

Conn = psycopg.AsyncConnection[Any]
ORG = "acme"
_LIVE: dict[UUID, attempts.Attempt] = {}


async def make_run(conn: Conn, org: str = ORG) -> UUID:
    """A really admitted and claimed run (attempt 1, worker w1); its fence is ``F(run)``."""
    live = await attempts.start(conn, org=org, play="enrich", release="test")
    _LIVE[live.run_id] = live
    return live.run_id


def F(run_id: UUID) -> Fence:
    """The fence of the run's live attempt."""
    return _LIVE[run_id].fence


async def wake(conn: Conn, run_id: UUID) -> UUID:
    """The run's attempt lapses and is rescued; a second worker claims it (a new attempt
    with no local state: a wake, as far as the sheet can tell)."""
    _LIVE[run_id] = await attempts.supersede(conn, _LIVE[run_id])
    return run_id


def new_sheet() -> str:
    return f"companies-{uuid4().hex[:8]}"


def page(*keys: str) -> list[tuple[str, sheets.JSON]]:
    return [(key, {"domain": f"{key}.example"}) for key in keys]


async def row_state(conn: Conn, sheet: str, key: str) -> tuple[Any, ...] | None:
    cur = await conn.execute(
        "SELECT run_id, write_version, status::text, output, finished_at FROM wq_sheet_rows"
        " WHERE org = %(org)s AND sheet = %(sheet)s AND row_key = %(key)s",
        {"org": ORG, "sheet": sheet, "key": key},
    )
    return await cur.fetchone()


async def count(conn: Conn, sql: Any, params: dict[str, Any]) -> int:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def intents(conn: Conn, run_id: UUID, sheet: str) -> int:
    return await count(
        conn,
        "SELECT count(*) FROM wq_write_intents WHERE run_id = %(r)s AND sheet = %(s)s",
        {"r": run_id, "s": sheet},
    )


async def sheet_rows(conn: Conn, sheet: str) -> int:
    return await count(conn, "SELECT count(*) FROM wq_sheet_rows WHERE sheet = %(s)s", {"s": sheet})


def done(*keys: str, output: sheets.JSON = None) -> list[RowCompletion]:
    return [RowCompletion(key, output if output is not None else {"score": key}) for key in keys]


# ---- admission: versions and intents ---------------------------------------------------


async def test_legacy_admission_mints_once_per_attempt(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()

    first = await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a"))
    # The attempt's later pages carry its version: it never supersedes its own pages.
    second = await sheets.admit_page(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        rows=page("a", "b"),
        write_version=first.write_version,
    )
    assert second.write_version == first.write_version
    assert second.keys(Disposition.ALREADY_CURRENT) == ("a",)
    assert second.keys(Disposition.ADMITTED) == ("b",)

    # A new attempt (a wake) mints a newer version and re-stamps the run's pending rows.
    await wake(conn, run_id)
    woken = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b")
    )
    assert woken.write_version > first.write_version
    assert woken.keys(Disposition.READMITTED) == ("a", "b")
    assert (await row_state(conn, sheet, "a"))[1] == woken.write_version  # type: ignore[index]
    assert await intents(conn, run_id, sheet) == 0
    # A same-run re-stamp does not count a row twice.
    assert await sheets.progress(conn, run_id) == (2, 0)


async def test_a_legacy_admission_reuses_a_version_its_run_saved_and_refuses_others(
    conn: Conn,
) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    own = await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("y"))

    # A new attempt that carries the version an earlier attempt saved reuses it, as the
    # reference's mint does, and it becomes the attempt's for its later pages.
    await wake(conn, run_id)
    carried = await sheets.admit_page(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        rows=page("y", "z"),
        write_version=own.write_version,
    )
    assert carried.write_version == own.write_version
    assert carried.keys(Disposition.ALREADY_CURRENT) == ("y",)
    assert carried.keys(Disposition.ADMITTED) == ("z",)
    later = await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("w"))
    assert later.write_version == own.write_version

    other = await make_run(conn)
    foreign = await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(other), rows=page("x"))
    # Another run's version, or one nobody minted, is refused: nothing is written.
    for wrong in (foreign.write_version, own.write_version + 1000):
        with pytest.raises(WriteVersionMismatch, match="never admitted for run"):
            await sheets.admit_page(
                conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("x"), write_version=wrong
            )
    assert (await row_state(conn, sheet, "x"))[:2] == (other, foreign.write_version)  # type: ignore[index]
    with pytest.raises(RunNotFound):
        await sheets.admit_page(
            conn,
            org=ORG,
            sheet=sheet,
            fence=Fence(uuid4(), 1, "w1"),
            rows=page("z"),
            write_version=own.write_version,
        )


async def test_a_first_intent_stores_the_version_its_run_carries(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    legacy = await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a"))

    first = await sheets.admit_page(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        rows=page("a", "b"),
        stable_intent=True,
        write_version=legacy.write_version,
    )

    assert first.write_version == legacy.write_version and first.stable_intent
    assert first.keys(Disposition.ALREADY_CURRENT) == ("a",)
    assert await intents(conn, run_id, sheet) == 1
    await wake(conn, run_id)
    woken = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b"), stable_intent=True
    )
    assert woken.write_version == legacy.write_version
    assert woken.keys(Disposition.ALREADY_CURRENT) == ("a", "b")


async def test_without_rerun_admission_pending_rows_stay_with_their_admission(
    conn: Conn,
) -> None:
    old, sheet = await make_run(conn), new_sheet()
    v1 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(old), rows=page("a", "b"), stable_intent=True
    )
    new = await make_run(conn)

    kept = await sheets.admit_page(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(new),
        rows=page("a", "b", "c"),
        stable_intent=True,
        pending_rerun_admission=False,
    )

    assert kept.keys(Disposition.LEFT_PENDING) == ("a", "b")
    assert kept.keys(Disposition.ADMITTED) == ("c",)
    assert (await row_state(conn, sheet, "a"))[:2] == (old, v1.write_version)  # type: ignore[index]
    assert await sheets.progress(conn, new) == (1, 0)
    # A rerun admission (the default) takes them over under the newer intent.
    rerun = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(new), rows=page("a", "b"), stable_intent=True
    )
    assert rerun.keys(Disposition.READMITTED) == ("a", "b")
    assert (await row_state(conn, sheet, "a"))[:2] == (new, kept.write_version)  # type: ignore[index]


async def test_sheet_names_are_normalised_to_one_sheet_and_one_intent(conn: Conn) -> None:
    run_id, name = await make_run(conn), new_sheet()

    first = await sheets.admit_page(
        conn,
        org=ORG,
        sheet=f"  {name.upper()} ",
        fence=F(run_id),
        rows=page("a"),
        stable_intent=True,
    )
    again = await sheets.admit_page(
        conn, org=ORG, sheet=name, fence=F(run_id), rows=page("a", "b"), stable_intent=True
    )

    assert again.write_version == first.write_version
    assert again.keys(Disposition.ALREADY_CURRENT) == ("a",)
    assert await intents(conn, run_id, name) == 1 and await sheet_rows(conn, name) == 2
    written = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=name.title(),
        fence=F(run_id),
        write_version=first.write_version,
        completions=done("a", "b"),
    )
    assert written.committed == ("a", "b")
    with pytest.raises(InvalidField, match="only whitespace"):
        await sheets.admit_page(conn, org=ORG, sheet="   ", fence=F(run_id), rows=page("a"))


async def test_stable_intent_is_reused_across_pages_and_wakes(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()

    p1 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b"), stable_intent=True
    )
    p2 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("c"), stable_intent=True
    )
    # A wake: a new attempt with no local state, page 1 again, no version passed.
    await wake(conn, run_id)
    woken = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b"), stable_intent=True
    )
    # A caller that kept the version may pass it.
    kept = await sheets.admit_page(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        rows=page("c"),
        stable_intent=True,
        write_version=p1.write_version,
    )

    assert p1.write_version == p2.write_version == woken.write_version == kept.write_version
    assert p1.keys(Disposition.ADMITTED) == ("a", "b")
    assert woken.keys(Disposition.ALREADY_CURRENT) == ("a", "b")
    assert kept.keys(Disposition.ALREADY_CURRENT) == ("c",)
    assert await intents(conn, run_id, sheet) == 1
    assert await sheets.progress(conn, run_id) == (3, 0)


async def test_a_disagreeing_write_version_is_refused_and_nothing_is_written(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    first = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a"), stable_intent=True
    )
    wrong = first.write_version + 1000

    with pytest.raises(WriteVersionMismatch) as caught:
        await sheets.admit_page(
            conn,
            org=ORG,
            sheet=sheet,
            fence=F(run_id),
            rows=page("b", "c"),
            stable_intent=True,
            write_version=wrong,
        )

    message = str(caught.value)
    assert str(run_id) in message and sheet in message
    assert str(wrong) in message and str(first.write_version) in message
    assert caught.value.code == "WRITE_VERSION_MISMATCH"
    assert await row_state(conn, sheet, "b") is None
    assert await sheet_rows(conn, sheet) == 1
    assert await sheets.progress(conn, run_id) == (1, 0)


async def test_a_version_passed_to_a_first_admission_is_refused_and_leaves_no_intent(
    conn: Conn,
) -> None:
    other, sheet = await make_run(conn), new_sheet()
    foreign = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(other), rows=page("x"), stable_intent=True
    )
    run_id = await make_run(conn)

    with pytest.raises(WriteVersionMismatch, match="never admitted"):
        await sheets.admit_page(
            conn,
            org=ORG,
            sheet=sheet,
            fence=F(run_id),
            rows=page("x", "y"),
            stable_intent=True,
            write_version=foreign.write_version,
        )

    assert await intents(conn, run_id, sheet) == 0
    assert (await row_state(conn, sheet, "x"))[0] == other  # type: ignore[index]
    assert await row_state(conn, sheet, "y") is None


async def test_a_new_run_admits_a_newer_intent_and_takes_over_pending_rows(conn: Conn) -> None:
    old, sheet = await make_run(conn), new_sheet()
    v1 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(old), rows=page("a", "b", "c"), stable_intent=True
    )
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(old),
        write_version=v1.write_version,
        completions=done("a"),
    )
    new = await make_run(conn)

    v2 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(new), rows=page("a", "b", "c"), stable_intent=True
    )

    assert v2.write_version > v1.write_version
    assert v2.keys(Disposition.ALREADY_TERMINAL) == ("a",)
    assert v2.keys(Disposition.READMITTED) == ("b", "c")
    assert (await row_state(conn, sheet, "b"))[:2] == (new, v2.write_version)  # type: ignore[index]
    assert await sheets.progress(conn, new) == (2, 0)

    # The old run wakes and re-admits with its own intent: it must not steal the rows back.
    woken = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(old), rows=page("a", "b", "c"), stable_intent=True
    )
    assert woken.write_version == v1.write_version
    assert woken.keys(Disposition.SUPERSEDED) == ("b", "c")
    assert (await row_state(conn, sheet, "c"))[:2] == (new, v2.write_version)  # type: ignore[index]


async def test_admission_of_an_unknown_run_is_refused(conn: Conn) -> None:
    await make_run(conn)
    with pytest.raises(RunNotFound):
        await sheets.admit_page(
            conn,
            org=ORG,
            sheet=new_sheet(),
            fence=Fence(uuid4(), 1, "w1"),
            rows=page("a"),
            stable_intent=True,
        )
    run_id = await make_run(conn, org="other-org")
    with pytest.raises(RunNotFound, match="acme"):
        await sheets.admit_page(conn, org=ORG, sheet=new_sheet(), fence=F(run_id), rows=page("a"))


# ---- admission: input validation -------------------------------------------------------


async def test_page_validation_names_the_rule(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()

    with pytest.raises(InvalidField, match="'b' appears twice") as dup:
        await sheets.admit_page(
            conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b", "b")
        )
    assert dup.value.field == "rows[2].key"
    with pytest.raises(PayloadTooLarge, match="5,000"):
        rows = page(*(f"k{i}" for i in range(5_001)))
        await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=rows)
    with pytest.raises(InvalidField, match="non-empty"):
        await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page(""))
    with pytest.raises(InvalidField, match="512"):
        await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("k" * 513))
    with pytest.raises(InvalidField, match="positive"):
        await sheets.admit_page(
            conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a"), write_version=0
        )
    assert await sheet_rows(conn, sheet) == 0

    at_limit = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page(*(f"k{i}" for i in range(5_000)))
    )
    assert len(at_limit.keys(Disposition.ADMITTED)) == 5_000
    assert await sheets.progress(conn, run_id) == (5_000, 0)


# ---- completion: fences and stale reasons ----------------------------------------------


async def test_completion_writes_rows_of_its_version_and_counts_them(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    adm = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b"), stable_intent=True
    )

    result = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        write_version=adm.write_version,
        completions=[RowCompletion("a", {"score": 1}), RowCompletion("b", None, RowStatus.FAILED)],
    )

    assert result.committed == ("a", "b") and result.stale == () and result.replayed == ()
    assert (await row_state(conn, sheet, "a"))[2:4] == ("done", {"score": 1})  # type: ignore[index]
    assert (await row_state(conn, sheet, "b"))[2] == "failed"  # type: ignore[index]
    assert await sheets.progress(conn, run_id) == (2, 2)


async def test_newer_write_version_when_a_newer_run_readmitted_the_rows(conn: Conn) -> None:
    old, sheet = await make_run(conn), new_sheet()
    v1 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(old), rows=page("a", "b"), stable_intent=True
    )
    new = await make_run(conn)
    v2 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(new), rows=page("a", "b"), stable_intent=True
    )

    result = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(old),
        write_version=v1.write_version,
        completions=done("a"),
    )

    assert result.committed == ()
    assert [(s.key, s.reason, s.current_version) for s in result.stale] == [
        ("a", StaleReason.NEWER_WRITE_VERSION, v2.write_version)
    ]
    state = await row_state(conn, sheet, "a")
    assert state is not None and state[2] == "pending" and state[3] is None
    assert await sheets.progress(conn, old) == (2, 0)


async def test_older_write_version_when_the_version_never_admitted_the_row(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    adm = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a"), stable_intent=True
    )
    # A version minted later, for another sheet: it never admitted rows of this one.
    elsewhere = await sheets.admit_page(
        conn, org=ORG, sheet=new_sheet(), fence=F(run_id), rows=page("a"), stable_intent=True
    )
    assert elsewhere.write_version > adm.write_version

    result = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        write_version=elsewhere.write_version,
        completions=done("a", "never-admitted"),
    )

    assert [(s.key, s.reason, s.current_version) for s in result.stale] == [
        ("a", StaleReason.OLDER_WRITE_VERSION, adm.write_version),
        ("never-admitted", StaleReason.OLDER_WRITE_VERSION, None),
    ]
    assert (await row_state(conn, sheet, "a"))[2] == "pending"  # type: ignore[index]
    assert await row_state(conn, sheet, "never-admitted") is None


async def test_already_terminal_is_benign_for_an_unversioned_writer(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    adm = await sheets.admit_page(conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b"))
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        write_version=adm.write_version,
        completions=done("a", output={"v": 1}),
    )

    result = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        write_version=None,
        completions=done("a", "b", output={"v": 2}),
        raise_on_superseded=True,  # benign: must not raise
    )

    assert result.committed == ("b",)  # an unversioned writer may finish its run's pending row
    assert [(s.key, s.reason) for s in result.stale] == [("a", StaleReason.ALREADY_TERMINAL)]
    assert result.superseded == ()
    assert (await row_state(conn, sheet, "a"))[3] == {"v": 1}  # type: ignore[index]
    assert await sheets.progress(conn, run_id) == (2, 2)


async def test_a_replayed_completion_counts_as_committed_and_changes_nothing(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    adm = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(run_id), rows=page("a", "b"), stable_intent=True
    )
    version = adm.write_version
    completions = [RowCompletion("a", {"score": 7}), RowCompletion("b", {"score": 8})]
    await sheets.complete_rows(
        conn, org=ORG, sheet=sheet, fence=F(run_id), write_version=version, completions=completions
    )
    before = await row_state(conn, sheet, "a")

    replay = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        write_version=version,
        completions=completions,
        raise_on_superseded=True,
    )

    assert replay.committed == ("a", "b") and replay.replayed == ("a", "b")
    assert replay.stale == ()
    assert await row_state(conn, sheet, "a") == before  # output and finished_at unchanged
    assert await sheets.progress(conn, run_id) == (2, 2)

    # Same version, another result: nothing is overwritten, and the row is not superseded.
    other = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=F(run_id),
        write_version=version,
        completions=[RowCompletion("a", {"score": 99})],
    )
    assert [(s.key, s.reason) for s in other.stale] == [("a", StaleReason.ALREADY_TERMINAL)]
    assert await row_state(conn, sheet, "a") == before


async def test_supersession_raises_with_sheet_run_counts_and_samples(conn: Conn) -> None:
    old, sheet = await make_run(conn), new_sheet()
    keys = [f"row-{i}" for i in range(7)]
    v1 = await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(old), rows=page(*keys), stable_intent=True
    )
    new = await make_run(conn)
    await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=F(new), rows=page(*keys), stable_intent=True
    )

    with pytest.raises(SheetSuperseded) as caught:
        await sheets.complete_rows(
            conn,
            org=ORG,
            sheet=sheet,
            fence=F(old),
            write_version=v1.write_version,
            completions=done(*keys, "ghost"),
            raise_on_superseded=True,
        )

    error = caught.value
    message = str(error)
    assert error.code == "RUNTIME_SHEET_ATTEMPT_SUPERSEDED"
    assert message.startswith("RUNTIME_SHEET_ATTEMPT_SUPERSEDED: ")
    assert sheet in message and str(old) in message
    assert f"write version {v1.write_version}" in message
    assert "8 of 8" in message
    assert "newer_write_version=7, older_write_version=1" in message
    assert "must stop" in message
    sampled = [key for key in [*keys, "ghost"] if f"key={key} row_write_version=" in message]
    assert sampled == keys[:5]  # at most five in the message ...
    wire = error.as_dict()  # ... and every row in the reference's fields
    assert (wire["tableNamespace"], wire["runId"]) == (sheet, str(old))
    assert (wire["writeVersion"], wire["submittedRows"]) == (v1.write_version, 8)
    assert [row["key"] for row in wire["supersededRows"]] == [*keys, "ghost"]
    assert wire["supersededRows"][-1] == {
        "key": "ghost",
        "reason": "older_write_version",
        "rowVersionStamp": None,
    }
    assert "fenceReason" not in wire


async def test_completion_validation(conn: Conn) -> None:
    run_id, sheet = await make_run(conn), new_sheet()
    with pytest.raises(InvalidField, match="'a' appears twice"):
        await sheets.complete_rows(
            conn, org=ORG, sheet=sheet, fence=F(run_id), write_version=1, completions=done("a", "a")
        )
    with pytest.raises(InvalidField, match="done or failed"):
        await sheets.complete_rows(
            conn,
            org=ORG,
            sheet=sheet,
            fence=F(run_id),
            write_version=1,
            completions=[RowCompletion("a", {}, RowStatus.PENDING)],
        )
    with pytest.raises(PayloadTooLarge):
        await sheets.complete_rows(
            conn,
            org=ORG,
            sheet=sheet,
            fence=F(run_id),
            write_version=1,
            completions=done(*(f"k{i}" for i in range(5_001))),
        )


@pytest.mark.parametrize("value", ["a\x00b", float("nan")])
async def test_a_value_jsonb_cannot_hold_is_bad_input_and_writes_nothing(
    conn: Conn, value: object
) -> None:
    live = await attempts.start(conn)
    before = await conn.execute("SELECT count(*) FROM wq_sheet_rows")
    [(rows_before,)] = await before.fetchall()
    # Each refusal in a savepoint: the failed statement aborts its (sub)transaction.
    with pytest.raises(InvalidField, match="cannot be stored"):
        async with conn.transaction():
            await sheets.admit_page(
                conn, org=attempts.ORG, sheet="s", fence=live.fence, rows=[("a", {"v": value})]
            )
    admitted = await sheets.admit_page(
        conn,
        org=attempts.ORG,
        sheet="s",
        fence=live.fence,
        rows=[("a", {"v": 1})],
        stable_intent=True,
    )
    with pytest.raises(InvalidField, match="cannot be stored"):
        async with conn.transaction():
            await sheets.complete_rows(
                conn,
                org=attempts.ORG,
                sheet="s",
                fence=live.fence,
                write_version=admitted.write_version,
                completions=[sheets.RowCompletion("a", {"v": value})],
            )
    after = await conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE status = 'done') FROM wq_sheet_rows"
    )
    assert await after.fetchall() == [(rows_before + 1, 0)]
