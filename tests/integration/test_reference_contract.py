"""The reference runtime's contract, exactly: its clients' own request bodies (its action
names and field names) sent to a real gateway, and the answers its client reads.

The reference's client posts an admission page as the action its opt-in picks
(``runtime_sheet_start_with_intent`` only when ``stableWriteIntent`` is true), with its
input as given plus ``pendingRerunAdmission: true``; it reads ``writeVersion`` and the
rows' dispositions back, and from a completion ``committedKeys``, ``staleRows`` (``key``,
one of four reasons, ``rowVersionStamp``) and ``supersededKeys``, its stop signal. What
this project says beyond that (the attempt fence's reason, replayed keys) is in fields of
its own, listed in docs/reference/gateway.md ("Where this gateway says more").

Each item is tried through the gateway here and through the Python API (``RunContext``
and ``Sheet`` on the gateway's transport, and a receiver that answers as the reference's).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest

from queues.errors import SheetSuperseded
from queues.sheets import CompletionResult, Disposition, RowCompletion
from tests import attempts
from tests.integration.test_gateway import Gateway, live, serve, tokens_of
from tests.workers import eventually, fetch
from worker.context import RunContext, RunInfo
from worker.contract import GatewayTransport

REASONS = {"newer_write_version", "older_write_version", "already_terminal", "unreported"}
# What the reference's client reads from a completion; anything else is this project's.
COMPLETION_FIELDS = {"committedKeys", "staleRows", "supersededKeys"}
OURS = {"writeVersion", "replayedKeys", "fenceReason"}


@pytest.fixture
async def gw(db_url: str) -> AsyncIterator[Gateway]:
    async with serve(db_url) as served:
        yield served


def admission(
    run_id: Any,
    sheet: str,
    keys: list[str],
    *,
    stable_write_intent: bool | None = None,
    write_version: int | None = None,
    pending_rerun_admission: bool = True,
) -> dict[str, Any]:
    """The body the reference's client posts for one admission page."""
    given: dict[str, Any] = {
        "runId": str(run_id),
        "tableNamespace": sheet,
        "rows": [{"key": key, "input": {"key": key}} for key in keys],
    }
    if write_version is not None:
        given["writeVersion"] = write_version
    if stable_write_intent is not None:
        given["stableWriteIntent"] = stable_write_intent
    return {
        "action": "runtime_sheet_start_with_intent"
        if stable_write_intent is True
        else "runtime_sheet_start",
        "input": {**given, "pendingRerunAdmission": pending_rerun_admission},
    }


def completion(run_id: Any, sheet: str, keys: list[str], write_version: int | None) -> dict:
    return {
        "action": "runtime_sheet_complete_map_rows",
        "input": {
            "runId": str(run_id),
            "tableNamespace": sheet,
            "writeVersion": write_version,
            "rows": [{"key": key, "output": {"done": key}} for key in keys],
        },
    }


async def ok(gw: Gateway, body: dict[str, Any], token: str) -> dict[str, Any]:
    response = await gw.post(body, token)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["result"]
    return result


def dispositions(admitted: dict[str, Any]) -> dict[str, str]:
    return {row["key"]: row["disposition"] for row in admitted["rows"]}


def reference_view(answer: dict[str, Any]) -> None:
    """A completion answer as the reference's client reads it: its reasons only."""
    assert set(answer) <= COMPLETION_FIELDS | OURS, answer
    for row in answer["staleRows"]:
        assert set(row) == {"key", "reason", "rowVersionStamp"}, row
        assert row["reason"] in REASONS and row["reason"] != "unreported", row


async def intent_rows(db_url: str, run_id: Any) -> list[tuple[Any, ...]]:
    return await fetch(
        db_url,
        "SELECT sheet, write_version FROM wq_write_intents WHERE run_id = %s ORDER BY sheet",
        (run_id,),
    )


# ---- admission: the opt-in, the mint, the names ----------------------------------------------


async def test_the_intent_is_opt_in_stable_across_attempts_and_names_are_normalised(
    gw: Gateway,
) -> None:
    async with await psycopg.AsyncConnection.connect(gw.db_url, autocommit=True) as conn:
        first = await attempts.start(conn)
        token = tokens_of(first).executor
        run_id = first.run_id

        # Without the opt-in (absent, or false as the reference sends a false flag): legacy.
        legacy = await ok(gw, admission(run_id, "plain", ["a"]), token)
        again = await ok(
            gw,
            admission(
                run_id,
                "plain",
                ["a", "b"],
                stable_write_intent=False,
                write_version=legacy["writeVersion"],
            ),
            token,
        )
        assert again["writeVersion"] == legacy["writeVersion"] and not again["stableWriteIntent"]
        assert await intent_rows(gw.db_url, run_id) == []

        # With it: one durable version for the run on the sheet, whatever the name's case.
        page1 = await ok(gw, admission(run_id, "Leads", ["a"], stable_write_intent=True), token)
        version = page1["writeVersion"]
        assert isinstance(version, int) and version > 0 and page1["stableWriteIntent"]
        page2 = await ok(
            gw,
            admission(run_id, "leads", ["b"], stable_write_intent=True, write_version=version),
            token,
        )
        assert page2["writeVersion"] == version

        # A new attempt with no local state (no writeVersion) gets the same version.
        second = await attempts.supersede(conn, first)
    woken = await ok(
        gw,
        admission(run_id, " LEADS ", ["a", "b"], stable_write_intent=True),
        tokens_of(second).executor,
    )
    assert woken["writeVersion"] == version
    assert dispositions(woken) == {"a": "already_current", "b": "already_current"}
    assert await intent_rows(gw.db_url, run_id) == [("leads", version)]

    wrong = await gw.post(
        admission(run_id, "leads", ["c"], stable_write_intent=True, write_version=version + 99),
        tokens_of(second).executor,
    )
    assert wrong.status_code == 409, wrong.text
    assert wrong.json()["error"]["code"] == "WRITE_VERSION_MISMATCH"


async def test_a_saved_write_version_is_reused_and_a_first_intent_keeps_it(gw: Gateway) -> None:
    async with await psycopg.AsyncConnection.connect(gw.db_url, autocommit=True) as conn:
        first = await attempts.start(conn)
        run_id = first.run_id
        saved = await ok(gw, admission(run_id, "s", ["a"]), tokens_of(first).executor)
        second = await attempts.supersede(conn, first)
    token = tokens_of(second).executor

    # The version an earlier attempt saved is reused, not refused, as the reference's mint.
    reused = await ok(
        gw, admission(run_id, "s", ["a", "b"], write_version=saved["writeVersion"]), token
    )
    assert reused["writeVersion"] == saved["writeVersion"]
    assert dispositions(reused) == {"a": "already_current", "b": "admitted"}
    # A first intent that carries the run's version stores it.
    intent = await ok(
        gw,
        admission(
            run_id, "s", ["a", "b"], stable_write_intent=True, write_version=saved["writeVersion"]
        ),
        token,
    )
    assert intent["writeVersion"] == saved["writeVersion"]
    assert await intent_rows(gw.db_url, run_id) == [("s", saved["writeVersion"])]
    # A version the run never had is not a version to reuse.
    foreign = await gw.post(
        admission(run_id, "t", ["a"], write_version=saved["writeVersion"] + 1000), token
    )
    assert foreign.status_code == 409, foreign.text
    assert foreign.json()["error"]["field"] == "write_version"


async def test_a_rerun_admission_takes_over_pending_rows_and_its_absence_leaves_them(
    gw: Gateway,
) -> None:
    owner, rerun, polite = [await live(gw.db_url) for _ in range(3)]
    first = await ok(
        gw,
        admission(owner.run_id, "shared", ["a", "b"], stable_write_intent=True),
        tokens_of(owner).executor,
    )
    left = await ok(
        gw,
        admission(
            polite.run_id,
            "shared",
            ["a", "b", "c"],
            stable_write_intent=True,
            pending_rerun_admission=False,
        ),
        tokens_of(polite).executor,
    )
    assert dispositions(left) == {"a": "left_pending", "b": "left_pending", "c": "admitted"}
    assert await fetch(
        gw.db_url,
        "SELECT run_id, write_version FROM wq_sheet_rows WHERE sheet = 'shared' AND row_key = 'a'",
    ) == [(owner.run_id, first["writeVersion"])]
    taken = await ok(
        gw,
        admission(rerun.run_id, "shared", ["a", "b"], stable_write_intent=True),
        tokens_of(rerun).executor,
    )
    assert dispositions(taken) == {"a": "readmitted", "b": "readmitted"}


# ---- completion: the reference's reasons, its stop signal ------------------------------------


async def test_completions_answer_with_the_reference_reasons_only(gw: Gateway) -> None:
    old, new = await live(gw.db_url), await live(gw.db_url)
    mine = await ok(
        gw,
        admission(old.run_id, "rows", ["a", "b"], stable_write_intent=True),
        tokens_of(old).executor,
    )
    theirs = await ok(
        gw,
        admission(new.run_id, "rows", ["a"], stable_write_intent=True),
        tokens_of(new).executor,
    )

    answer = await ok(
        gw,
        completion(old.run_id, "rows", ["a", "b", "ghost"], mine["writeVersion"]),
        tokens_of(old).executor,
    )
    reference_view(answer)
    assert answer["committedKeys"] == ["b"] and "supersededKeys" not in answer
    assert answer["staleRows"] == [
        {"key": "a", "reason": "newer_write_version", "rowVersionStamp": theirs["writeVersion"]},
        {"key": "ghost", "reason": "older_write_version", "rowVersionStamp": None},
    ]
    # An accepted completion sent again is committed again (a replay).
    replay = await ok(
        gw, completion(old.run_id, "rows", ["b"], mine["writeVersion"]), tokens_of(old).executor
    )
    reference_view(replay)
    assert replay["committedKeys"] == ["b"] and replay["staleRows"] == []
    # An unversioned writer meeting a finished row: the one benign reason.
    finished = await ok(gw, completion(old.run_id, "rows", ["b"], None), tokens_of(old).executor)
    reference_view(finished)
    assert [row["reason"] for row in finished["staleRows"]] == ["already_terminal"]


async def test_a_completion_the_attempt_fence_refuses_answers_the_stop_signal(
    gw: Gateway,
) -> None:
    """The gateway's lease check passes; while the completion's statement waits for the run
    row, a newer attempt takes the run: the statement's own fence refuses the page."""
    first = await live(gw.db_url)
    stale = tokens_of(first).executor
    admitted = await ok(
        gw, admission(first.run_id, "rows", ["a", "b"], stable_write_intent=True), stale
    )
    async with await psycopg.AsyncConnection.connect(gw.db_url) as holder:
        await holder.execute(
            "SELECT 1 FROM wq_runs WHERE id = %s FOR NO KEY UPDATE", (first.run_id,)
        )
        posted = asyncio.ensure_future(
            gw.post(completion(first.run_id, "rows", ["a", "b"], admitted["writeVersion"]), stale)
        )

        async def waiting() -> bool:
            rows = await fetch(
                gw.db_url,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE '%%wq_sheet_rows%%'",
            )
            return bool(rows[0][0])

        await eventually(waiting)
        await attempts.supersede(holder, first)
        await holder.commit()
        response = await posted
    assert response.status_code == 200, response.text
    answer = response.json()["result"]
    reference_view(answer)
    assert answer["committedKeys"] == []
    assert answer["supersededKeys"] == ["a", "b"]  # the reference's stop signal
    assert {row["reason"] for row in answer["staleRows"]} == {"newer_write_version"}
    assert answer["fenceReason"] == "stale_attempt"  # what the fence adds, apart

    # The Python client turns it into the reference's error, every row in its fields.
    with pytest.raises(SheetSuperseded) as raised:
        CompletionResult.from_wire(answer).raise_if_stopped(sheet="rows", run_id=first.run_id)
    wire = raised.value.as_dict()
    assert wire["code"] == "RUNTIME_SHEET_ATTEMPT_SUPERSEDED"
    assert wire["message"].startswith("RUNTIME_SHEET_ATTEMPT_SUPERSEDED: ")
    assert (wire["tableNamespace"], wire["runId"]) == ("rows", str(first.run_id))
    assert (wire["writeVersion"], wire["submittedRows"]) == (admitted["writeVersion"], 2)
    assert [row["reason"] for row in wire["supersededRows"]] == ["newer_write_version"] * 2
    assert wire["fenceReason"] == "stale_attempt"
    assert await fetch(
        gw.db_url,
        "SELECT count(*) FROM wq_sheet_rows WHERE run_id = %s AND status <> 'pending'",
        (first.run_id,),
    ) == [(0,)]


# ---- the Python API on the same wire ----------------------------------------------------------


def context_of(a: attempts.Attempt, transport: Any) -> RunContext:
    info = RunInfo(
        a.run_id,
        a.fence.attempt,
        attempts.ORG,
        attempts.PLAY,
        "r-fence",
        attempts.RELEASE,
        a.fence.owner,
        datetime.now(UTC),
    )
    return RunContext(info, {}, transport)


async def test_the_python_sheet_admits_legacy_unless_it_opts_in(gw: Gateway) -> None:
    a = await live(gw.db_url)
    tokens = tokens_of(a)
    client = GatewayTransport(
        gw.url, executor_token=tokens.executor, ledger_token=tokens.ledger, owner=a.fence.owner
    )
    try:
        ctx = context_of(a, client)
        plain = await ctx.sheet("plain").admit([("a", {})])
        assert not plain.stable_intent and await intent_rows(gw.db_url, a.run_id) == []
        leads = ctx.sheet("Leads")
        assert ctx.sheet(" LEADS") is leads and leads.name == "leads"
        opted = await leads.admit([("a", {})], stable_intent=True)
        assert opted.stable_intent
        assert await intent_rows(gw.db_url, a.run_id) == [("leads", opted.write_version)]
        kept = await leads.admit([("b", {})], stable_intent=True, pending_rerun_admission=False)
        assert kept.keys(Disposition.ADMITTED) == ("b",)
        done = await leads.complete([RowCompletion("a", 1), RowCompletion("b", 2)])
        assert done.committed == ("a", "b")
    finally:
        await client.aclose()


class ReferenceReceiver:
    """A receiver that answers a completion as the reference's does when it tells the
    writer to stop: ``supersededKeys``, and no reason of this project's."""

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        assert action == "runtime_sheet_complete_map_rows", action
        return {
            "committedKeys": ["a"],
            "staleRows": [{"key": "b", "reason": "newer_write_version", "rowVersionStamp": 12}],
            "supersededKeys": ["b"],
        }


async def test_the_python_sheet_stops_on_a_receivers_superseded_keys() -> None:
    info = RunInfo(uuid.uuid4(), 1, "org", "play", "r-t", "t", "w1", datetime.now(UTC))
    sheet = RunContext(info, {}, ReferenceReceiver()).sheet("rows")
    sheet.write_version = 7
    with pytest.raises(SheetSuperseded) as raised:
        await sheet.complete([RowCompletion("a", 1), RowCompletion("b", 2)])
    assert raised.value.superseded_rows == (("b", "newer_write_version", 12),)
    assert raised.value.submitted == 2 and raised.value.fence_reason is None
    assert "1 of 2" in raised.value.message and "key=b row_write_version=12" in raised.value.message


async def test_a_reference_body_the_gateway_does_not_define_is_still_refused(
    gw: Gateway,
) -> None:
    a = await live(gw.db_url)
    body = admission(a.run_id, "s", ["a"], stable_write_intent=True)
    body["input"]["attemptLeaseTtlMs"] = 30_000
    response: httpx.Response = await gw.post(body, tokens_of(a).executor)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["field"].endswith(".attemptLeaseTtlMs")
