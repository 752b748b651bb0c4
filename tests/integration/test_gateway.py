"""The runtime gateway over real HTTP, and sandboxed plays in a real worker.

The gateway runs on a loopback port against a fresh database; attempts are real (admitted
and claimed, tests/attempts.py) and tokens are minted from their runs' stored authority.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import jwt
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from queues import authority, operations, runs
from queues.errors import OperationRefused, WriteIntentUnavailable
from tests import attempts, ledgers
from tests.workers import eventually, fetch, run_state, running_worker, submit
from worker import gateway, sandbox
from worker.contract import GatewayTransport, gateway_origin
from worker.plays import load_registry

SECRET = b"s" * 48
Conn = psycopg.AsyncConnection[Any]


@dataclass
class Gateway:
    url: str
    db_url: str

    async def post(self, body: Any, token: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient() as client:
            return await client.post(f"{self.url}/runtime", json=body, headers=headers)


@contextlib.asynccontextmanager
async def serve(db_url: str, served: frozenset[str] | None = None) -> AsyncIterator[Gateway]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        db_url, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
    )
    await pool.open(wait=True)
    app = gateway.Served(gateway.make_app(pool, secret=SECRET, served=served))
    try:
        yield Gateway(await app.start(), db_url)
    finally:
        await app.stop()
        await pool.close()


@pytest.fixture
async def gw(db_url: str) -> AsyncIterator[Gateway]:
    async with serve(db_url) as served:
        yield served


async def live(db_url: str, **kw: Any) -> attempts.Attempt:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        return await attempts.start(conn, **kw)


def tokens_of(a: attempts.Attempt, **kw: Any) -> authority.AttemptTokens:
    return authority.mint_attempt(
        a.claimed.descriptor, attempt=a.fence.attempt, owner=a.fence.owner, secret=SECRET, **kw
    )


def start_body(rows: list[str], *, action: str = "runtime_sheet_start_with_intent") -> dict:
    return {
        "action": action,
        "input": {"tableNamespace": "s", "rows": [{"key": k, "input": {"k": k}} for k in rows]},
    }


async def sheet_rows(db_url: str) -> int:
    return int((await fetch(db_url, "SELECT count(*) FROM wq_sheet_rows"))[0][0])


async def play_events(url: str, run_id: uuid.UUID) -> list[runs.Event]:
    """The run's events a play appended (kinds ``play.*``), in seq order."""
    return [e for e in await ledgers.events(url, run_id) if e.kind.startswith("play.")]


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert "error" in body, body
    return dict(body["error"])


# ---- authentication ----------------------------------------------------------------------


async def test_missing_forged_and_expired_tokens_are_401_and_write_nothing(gw: Gateway) -> None:
    a = await live(gw.db_url)
    descriptor = a.claimed.descriptor
    forged = authority.mint(
        descriptor, attempt=1, owner="w1", capabilities=["sheet.write"], secret=b"x" * 48
    )
    expired = authority.mint(
        descriptor,
        attempt=1,
        owner="w1",
        capabilities=["sheet.write"],
        secret=SECRET,
        ttl_s=60,
        now=datetime.now(UTC) - timedelta(hours=1),
    )
    for token in (None, "not-a-jwt", forged, expired):
        response = await gw.post(start_body(["a"]), token)
        assert response.status_code == 401, (token, response.text)
        assert error_of(response)["code"] == "TOKEN_INVALID"
    assert await sheet_rows(gw.db_url) == 0
    valid = tokens_of(a).executor
    ok = await gw.post(start_body(["a"]), valid)
    assert ok.status_code == 200, ok.text
    assert await sheet_rows(gw.db_url) == 1


# ---- the policy ----------------------------------------------------------------------------


async def test_the_ledger_token_can_only_make_keyed_deliveries(gw: Gateway) -> None:
    a = await live(gw.db_url)
    ledger = tokens_of(a).ledger
    scope = "Unsupported runtime action capability scope."
    for body in (
        start_body(["a"]),
        start_body(["a"], action="runtime_sheet_start"),
        {
            "action": "runtime_sheet_complete_map_rows",
            "input": {"tableNamespace": "s", "rows": [{"key": "a", "output": 1}]},
            "idempotencyKey": "k",
            "deliveryLeaseOwner": "w1",
        },
        # A ledger action without its key or its delivery lease owner.
        {"action": "append_run_events", "input": {"events": []}, "deliveryLeaseOwner": "w1"},
        {"action": "append_run_events", "input": {"events": []}, "idempotencyKey": "k"},
        {
            "action": "append_run_events",
            "input": {"events": []},
            "idempotencyKey": "  ",
            "deliveryLeaseOwner": "w1",
        },
    ):
        response = await gw.post(body, ledger)
        assert response.status_code == 403, (body, response.text)
        assert error_of(response)["message"] == scope
    assert await sheet_rows(gw.db_url) == 0


async def test_a_keyed_ledger_delivery_stores_its_events_once_and_is_fenced(
    gw: Gateway,
) -> None:
    async with await psycopg.AsyncConnection.connect(gw.db_url, autocommit=True) as conn:
        old = await attempts.start(conn)
    run_id = old.run_id
    delivery = {
        "action": "append_run_events",
        "input": {"events": [{"kind": "play.fetched", "data": {"n": 1}}, {"kind": "play.sent"}]},
        "idempotencyKey": "delivery-1",
        "deliveryLeaseOwner": old.fence.owner,  # the worker holding the attempt's lease
    }
    ledger = tokens_of(old).ledger
    first = await gw.post(delivery, ledger)
    assert first.status_code == 200, first.text
    assert first.json()["result"] == {"appended": 2, "existing": 0}
    replay = await gw.post(delivery, ledger)  # a lost response, delivered again
    assert replay.json()["result"] == {"appended": 0, "existing": 2}
    stored = [
        (e.kind, e.data.get("n"), e.data.get("delivery_owner"), e.idempotency_key)
        for e in await play_events(gw.db_url, run_id)
    ]
    assert stored == [
        ("play.fetched", 1, "w1", "delivery-1#0"),
        ("play.sent", None, "w1", "delivery-1#1"),
    ]
    # A queue event cannot be forged through the ledger token.
    forged = dict(delivery, idempotencyKey="delivery-2")
    forged["input"] = {"events": [{"kind": "finished"}]}
    assert (await gw.post(forged, ledger)).status_code == 400
    # Once a newer attempt owns the run, the old attempt's ledger token appends nothing.
    async with await psycopg.AsyncConnection.connect(gw.db_url, autocommit=True) as conn:
        await attempts.supersede(conn, old)
    late = await gw.post(dict(delivery, idempotencyKey="delivery-3"), ledger)
    assert late.status_code == 409, late.text
    assert error_of(late)["code"] == "STALE_ATTEMPT"
    assert len(await play_events(gw.db_url, run_id)) == 2


async def test_a_ledger_delivery_naming_another_lease_owner_is_refused_and_writes_nothing(
    gw: Gateway,
) -> None:
    """The reference's delivery body, with a ``deliveryLeaseOwner`` that is not the worker
    holding the attempt's lease: refused with a stable code, alone or inside a batch, and
    nothing is written; the same body naming the live lease is delivered."""
    a = await live(gw.db_url)
    ledger = tokens_of(a).ledger

    def delivery(key: str, owner: str) -> dict[str, Any]:
        return {
            "action": "append_run_events",
            "input": {"events": [{"kind": "play.fetched", "data": {"n": 1}}]},
            "idempotencyKey": key,
            "deliveryLeaseOwner": owner,
        }

    for body in (
        delivery("d-1", "projector-9"),
        delivery("d-1", "W1"),  # compared exactly
        {"actions": [delivery("d-2", "w1"), delivery("d-3", "projector-9")]},
    ):
        response = await gw.post(body, ledger)
        assert response.status_code == 403, (body, response.text)
        error = error_of(response)
        assert error["code"] == "RUNTIME_DELIVERY_LEASE_MISMATCH", error
        assert error["field"] == "deliveryLeaseOwner"
    assert await play_events(gw.db_url, a.run_id) == []
    ok = await gw.post(delivery("d-1", "w1"), ledger)
    assert ok.status_code == 200, ok.text
    assert ok.json()["result"] == {"appended": 1, "existing": 0}


async def test_a_runs_lifecycle_actions_are_known_and_granted_to_no_play(gw: Gateway) -> None:
    """``start_run`` and ``project_run_created``, the reference's bodies, with either of an
    attempt's tokens: refused with a stable code (not ``Unsupported action``: the receiver
    knows them), nothing written; the run's lifecycle is in its ledger, from its rows."""
    a = await live(gw.db_url)
    tokens = tokens_of(a)
    before = await ledgers.events(gw.db_url, a.run_id)
    assert [e.kind for e in before][:2] == ["run_created", "attempt_started"]
    for action in ("start_run", "project_run_created"):
        body = {
            "action": action,
            "input": {"runId": str(a.run_id)},
            "idempotencyKey": f"{action}-1",
            "deliveryLeaseOwner": a.fence.owner,
        }
        for token in (tokens.ledger, tokens.executor):
            response = await gw.post(body, token)
            assert response.status_code == 403, (action, response.text)
            error = error_of(response)
            assert error["code"] == "RUNTIME_LIFECYCLE_ACTION_RESERVED", error
            assert error["message"] == operations.SCOPE_MESSAGE
        # In a batch with a delivery the play may make, the whole batch is refused.
        batch = {
            "actions": [
                {
                    "action": "append_run_events",
                    "input": {"events": [{"kind": "play.x"}]},
                    "idempotencyKey": "x-1",
                    "deliveryLeaseOwner": a.fence.owner,
                },
                body,
            ]
        }
        refused = await gw.post(batch, tokens.ledger)
        assert error_of(refused)["code"] == "RUNTIME_LIFECYCLE_ACTION_RESERVED"
    assert await ledgers.events(gw.db_url, a.run_id) == before


async def test_an_attempts_tokens_carry_the_references_origin_claims(gw: Gateway) -> None:
    """Minted for a gateway, both tokens carry ``runtimeOrigin`` and the run-ledger token
    ``runLedgerIngressPrefixOrigin`` too, each the gateway's origin; the gateway accepts
    them (it reads neither: the fence and the run scope decide)."""
    a = await live(gw.db_url)
    origin = gateway_origin(gw.url)
    assert origin.startswith("http://127.0.0.1:") and not origin.endswith("/")
    tokens = tokens_of(a, origin=origin)
    executor = jwt.decode(tokens.executor, SECRET, algorithms=["HS256"])
    ledger = jwt.decode(tokens.ledger, SECRET, algorithms=["HS256"])
    assert executor["runtimeOrigin"] == origin and "runLedgerIngressPrefixOrigin" not in executor
    assert (ledger["runtimeOrigin"], ledger["runLedgerIngressPrefixOrigin"]) == (origin, origin)
    # Without a gateway (an in-process attempt's, an operator's), they are absent.
    plain = jwt.decode(tokens_of(a).ledger, SECRET, algorithms=["HS256"])
    assert not {"runtimeOrigin", "runLedgerIngressPrefixOrigin"} & plain.keys()
    ok = await gw.post(start_body(["a"]), tokens.executor)
    assert ok.status_code == 200, ok.text
    delivered = await gw.post(
        {
            "action": "append_run_events",
            "input": {"events": [{"kind": "play.x"}]},
            "idempotencyKey": "o-1",
            "deliveryLeaseOwner": a.fence.owner,
        },
        tokens.ledger,
    )
    assert delivered.status_code == 200, delivered.text


def test_a_gateways_origin_is_its_scheme_host_and_port_or_its_socket() -> None:
    assert gateway_origin("HTTP://Gate.Example:8085/runtime") == "http://gate.example:8085"
    assert gateway_origin("https://gate.example/") == "https://gate.example"
    for url in ("unix:/run/wq/gateway.sock", "unix:///run/wq/gateway.sock"):
        assert gateway_origin(url) == "unix:/run/wq/gateway.sock"


async def test_a_token_with_the_ledger_capability_and_anything_else_is_refused(
    gw: Gateway,
) -> None:
    a = await live(gw.db_url)
    mixed = authority.mint(
        a.claimed.descriptor,
        attempt=1,
        owner="w1",
        capabilities=[authority.LEDGER_PROJECT, "sheet.write"],
        secret=SECRET,
    )
    for body in (
        start_body(["a"]),
        {
            "action": "project_run_created",
            "input": {},
            "idempotencyKey": "k",
            "deliveryLeaseOwner": "w1",
        },
    ):
        response = await gw.post(body, mixed)
        assert response.status_code == 403, response.text
    assert await sheet_rows(gw.db_url) == 0


async def test_a_batch_with_one_disallowed_action_is_refused_whole(gw: Gateway) -> None:
    a = await live(gw.db_url)
    only_sheets = authority.mint(
        a.claimed.descriptor, attempt=1, owner="w1", capabilities=["sheet.write"], secret=SECRET
    )
    batch = {
        "actions": [
            start_body(["a", "b"]),
            {"action": "runtime_receipt_claim", "input": {"stepKey": "x"}},  # receipt.write
        ]
    }
    response = await gw.post(batch, only_sheets)
    assert response.status_code == 403, response.text
    assert await sheet_rows(gw.db_url) == 0
    # The same batch with a token that may do both runs both, in order.
    both = await gw.post(batch, tokens_of(a).executor)
    assert both.status_code == 200, both.text
    results = both.json()["result"]
    assert results[0]["rows"][0]["disposition"] == "admitted"
    assert results[1]["outcome"] == "execute"


async def test_unknown_actions_and_other_runs_are_refused(gw: Gateway) -> None:
    a = await live(gw.db_url)
    token = tokens_of(a).executor
    unknown = await gw.post({"action": "runtime_sheet_strat", "input": {}}, token)
    # Not served (nobody defined it): 400 with the stable message, as the README says.
    assert unknown.status_code == 400, unknown.text
    assert error_of(unknown)["message"] == "Unsupported action: runtime_sheet_strat"
    assert error_of(unknown)["code"] == "UNSUPPORTED_ACTION"
    # The ledger token may call nothing but its four actions: the policy refuses first.
    refused = await gw.post(
        {
            "action": "runtime_sheet_strat",
            "input": {},
            "idempotencyKey": "k",
            "deliveryLeaseOwner": "w1",
        },
        tokens_of(a).ledger,
    )
    assert refused.status_code == 403, refused.text
    other = start_body(["a"])
    other["input"]["runId"] = str(uuid.uuid4())
    scoped = await gw.post(other, token)
    assert scoped.status_code == 403 and error_of(scoped)["code"] == "RUNTIME_RUN_SCOPE"
    unknown_field = start_body(["a"])
    unknown_field["input"]["attemptSeq"] = 1  # a field of the reference's this one lacks
    refused_field = await gw.post(unknown_field, token)
    assert refused_field.status_code == 400
    assert error_of(refused_field)["field"].endswith(".attemptSeq")
    assert await sheet_rows(gw.db_url) == 0


async def test_an_older_receiver_refuses_the_intent_and_the_client_never_falls_back(
    db_url: str,
) -> None:
    older = operations.SERVED_ACTIONS - {"runtime_sheet_start_with_intent"}
    async with serve(db_url, served=older) as gw:
        a = await live(db_url)
        tokens = tokens_of(a)
        raw = await gw.post(start_body(["a"]), tokens.executor)
        assert raw.status_code == 400
        assert error_of(raw)["message"] == "Unsupported action: runtime_sheet_start_with_intent"
        # Its fix is to retry after the rollout, never the legacy admission in its place.
        assert error_of(raw)["fix"] == "retry once the runtime rollout reaches this receiver"
        client = GatewayTransport(
            gw.url, executor_token=tokens.executor, ledger_token=tokens.ledger, owner="w1"
        )
        try:
            with pytest.raises(WriteIntentUnavailable) as raised:
                await client.call(
                    "runtime_sheet_start_with_intent",
                    {"tableNamespace": "s", "rows": [{"key": "a"}]},
                )
        finally:
            await client.aclose()
        assert raised.value.code == "RUNTIME_SHEET_WRITE_INTENT_UNAVAILABLE"
        assert "Retry after the runtime rollout" in raised.value.message
        assert isinstance(raised.value.__cause__, OperationRefused)
        assert await sheet_rows(db_url) == 0
        intents = await fetch(db_url, "SELECT count(*) FROM wq_write_intents")
        assert intents == [(0,)]


async def test_a_stale_attempts_token_is_refused_after_a_newer_attempt_started(
    gw: Gateway,
) -> None:
    async with await psycopg.AsyncConnection.connect(gw.db_url, autocommit=True) as conn:
        old = await attempts.start(conn)
        stale = tokens_of(old)
        new = await attempts.supersede(conn, old)
    response = await gw.post(start_body(["a"]), stale.executor)
    assert response.status_code == 409, response.text
    assert error_of(response)["code"] == "STALE_ATTEMPT"
    assert await sheet_rows(gw.db_url) == 0
    fresh = await gw.post(start_body(["a"]), tokens_of(new).executor)
    assert fresh.status_code == 200, fresh.text


# ---- sandboxed plays -----------------------------------------------------------------------


async def test_a_sandboxed_play_completes_a_sheet_run_with_no_credentials(db_url: str) -> None:
    registry = load_registry("tests.apps.sandboxed:registry")
    rows = [(f"r{i:03d}", {"n": i}) for i in range(120)]
    async with running_worker(db_url, registry, release="sbx", token_secret=SECRET):
        run_id = await submit(db_url, "sandboxed-sheet", {}, release="sbx", inputs=rows)

        async def finished() -> str | None:
            state = await run_state(db_url, run_id)
            return state if state in {"succeeded", "failed"} else None

        assert await eventually(finished, timeout=60) == "succeeded"
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    result = run.result
    assert result["rows"] == 120 and run.rows_done == 120
    assert result["pid"] != os.getpid()  # another process
    assert result["credentials_seen"] == []
    assert set(result["environment"]) <= {
        *sandbox.INHERITED,
        sandbox.SOCKET_VARIABLE,
    }
    outputs = await fetch(
        db_url,
        "SELECT count(*) FILTER (WHERE output = jsonb_build_object('n', (input->>'n')::int * 2))"
        " FROM wq_sheet_rows WHERE run_id = %s",
        (run_id,),
    )
    assert outputs == [(120,)]
