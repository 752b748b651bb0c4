"""The runtime operation contract: named actions, one capability each, one dispatch.

Everything a play does to run state is a named **action** (the reference runtime's wire
names: ``runtime_sheet_start``, ``runtime_sheet_start_with_intent``, ...). :data:`ACTIONS`
is the one declarative table of every action, the capability it needs and the handler
that serves it; :func:`capability_for_request` is the one policy that decides a request's
capability; :func:`dispatch` is the one receiver. The in-process run context calls it
directly with its attempt's claims; the gateway calls it with a verified token's claims.
So there is one path, and every write is fenced by the claims' attempt in its SQL.

A receiver refuses, in this order, and never guesses:

1. a request whose credential's capabilities do not allow it (the policy): 403,
   ``Unsupported runtime action capability scope.``. A credential holding
   ``run.ledger.project`` must hold nothing else, may call only the keyed outbox delivery
   actions (:data:`LEDGER_ACTIONS`), and must send a non-blank ``idempotencyKey`` and
   ``deliveryLeaseOwner``;
2. an action this receiver does not serve: 400, ``Unsupported action: NAME``, whether an
   older receiver serves a subset or nobody defined the name (the client turns that answer
   for the intent action into ``RUNTIME_SHEET_WRITE_INTENT_UNAVAILABLE``, never a legacy
   admission);
3. a payload field the action does not define (an unknown field is never ignored), or one
   of the wrong type or out of its range (:data:`FIELD_TYPES`, one table for every action);
4. a request naming another run than its credential's: 403 (the run scope).

A batch (``{"actions": [...]}``) is checked action by action before any of it runs; one
refusal refuses the batch.

The body itself is bounded before any of this: :data:`MAX_BODY_BYTES` (the largest legal
step result in its envelope; the gateway answers 413 above its limit, which defaults to
this) and :data:`MAX_BODY_DEPTH`; :func:`decode` refuses what is not JSON with a 400,
never a traceback.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from queues import children, fields, limits, policy, receipts, runs, sheets
from queues.authority import LEDGER_PROJECT, Claims
from queues.errors import (
    CapabilityScope,
    InvalidField,
    OperationRefused,
    RunScope,
    StaleAttempt,
    did_you_mean,
)
from queues.fence import refused
from queues.options import RunOptions
from queues.queries import q

AsyncConn = psycopg.AsyncConnection[Any]
Input = Mapping[str, Any]
Handler = Callable[[AsyncConn, Input, Claims], Awaitable[dict[str, Any]]]

SHEET_WRITE = "sheet.write"
RECEIPT_WRITE = "receipt.write"
EVENT_EMIT = "event.emit"
RUN_READ = "run.read"
LIMIT_ACQUIRE = "limit.acquire"
RUN_SPAWN = "run.spawn"
SCOPE_MESSAGE = "Unsupported runtime action capability scope."

# Client timeouts per action, as the reference runtime sets them: an admission page waits
# longest, a completion page longer than a plain call.
ADMISSION_TIMEOUT_S = 120.0
COMPLETION_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_S = 30.0

# ---- the body's bounds (derived from the field limits: one source) ---------------------------

# What a request adds around the largest value it carries (a step's result, at most
# fields.MAX_RESULT_BYTES of compact JSON): the action's name, its keys, its scope and the
# JSON that frames them, each bounded far below this.
ENVELOPE_BYTES = 64 * 1024
# The largest body a receiver must take: one step result of the largest legal size in its
# envelope. The gateway's body limit defaults to this; a larger batch is split by its sender.
MAX_BODY_BYTES = fields.MAX_RESULT_BYTES + ENVELOPE_BYTES
# The levels a body adds above a value it carries: in {"actions": [{"input": {"results":
# [[key, value]]}}]} a result's own top level is the seventh.
ENVELOPE_DEPTH = 6
MAX_BODY_DEPTH = fields.MAX_JSON_DEPTH + ENVELOPE_DEPTH
# A step's lease: as long as the longest lease a lane may have.
MAX_LEASE_S = policy.RULES["lease_ttl_s"].maximum
MAX_BIGINT = 2**63 - 1
MAX_INTEGER = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Action:
    name: str
    capability: str
    handler: Handler
    required: frozenset[str] = frozenset()
    optional: frozenset[str] = frozenset()
    timeout_s: float = DEFAULT_TIMEOUT_S
    # Whether the same call may be sent again after its answer was lost (a connection
    # that broke after the commit): a repeat is recognized and answered as the first
    # was, never written twice. The runtime retries only these through a blip.
    repeatable: bool = True

    @property
    def fields(self) -> frozenset[str]:
        return self.required | self.optional


# ---- handlers (each fenced by the claims' attempt in its own SQL) --------------------------


def _scope(claims: Claims, value: object) -> receipts.Scope:
    if value is None:
        return receipts.Scope.of_run(claims.run_id)
    if not isinstance(value, str):
        raise InvalidField(
            f"scope must be a name, got {value!r:.80}",
            field="input.scope",
            rule="a scope name, or absent for the run's own scope",
            fix="omit scope, or pass a short name",
        )
    return receipts.Scope.named(value)


def _ref(claims: Claims, p: Input) -> dict[str, Any]:
    return {
        "org": claims.org,
        "play": claims.play,
        "scope": _scope(claims, p.get("scope")),
        "step_key": p["stepKey"],
        "fence": claims.fence,
    }


async def _receipt_claim(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    lease_s = float(p.get("leaseSeconds") or receipts.STEP_LEASE_S)
    claim = await receipts.claim(conn, **_ref(claims, p), lease_s=lease_s)
    return {
        "outcome": claim.outcome.value,
        "stepKey": claim.step_key,
        "result": claim.result,
        "leaseExpiresAt": _iso(claim.lease_expires_at),
        "ownerRun": str(claim.owner_run) if claim.owner_run else None,
        "ownerAttempt": claim.owner_attempt,
    }


async def _receipt_complete(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    return {"result": await receipts.complete(conn, **_ref(claims, p), result=p.get("result"))}


async def _receipt_record(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    done = await receipts.record(conn, **_ref(claims, p), result=p.get("result"))
    return {"outcome": done.outcome.value, "stepKey": done.step_key, "result": done.result}


async def _receipts_settled(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    found = await receipts.settled(
        conn, org=claims.org, play=claims.play, scope=_scope(claims, p.get("scope"))
    )
    return {
        "complete": found.complete,
        "receipts": {
            key: {"status": status.value, "result": value}
            for key, (status, value) in found.receipts.items()
        },
    }


async def _receipt_fail(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    error = p.get("error")
    if not isinstance(error, Mapping):
        raise InvalidField(
            "error must be an object", field="input.error", rule="a JSON object", fix="send one"
        )
    await receipts.fail(conn, **_ref(claims, p), error=error)
    return {}


async def _receipt_skip(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    await receipts.skip(conn, **_ref(claims, p))
    return {}


async def _receipts_complete(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    pairs = [
        (_text(item, f"results[{i}][0]"), value)
        for i, (item, value) in enumerate(_pairs(p["results"], "results"))
    ]
    page = await receipts.complete_many(
        conn,
        org=claims.org,
        play=claims.play,
        scope=_scope(claims, p.get("scope")),
        fence=claims.fence,
        results=pairs,
    )
    return {"completed": page.completed, "already": page.already, "busy": page.busy}


async def _receipts_lookup(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    keys = [_text(k, f"keys[{i}]") for i, k in enumerate(_list(p["keys"], "keys"))]
    found = await receipts.lookup_many(
        conn, org=claims.org, play=claims.play, scope=_scope(claims, p.get("scope")), keys=keys
    )
    return {"results": found}


async def _sheet_start(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    return await _admit(conn, p, claims, stable_intent=False)


async def _sheet_start_with_intent(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    return await _admit(conn, p, claims, stable_intent=True)


async def _admit(
    conn: AsyncConn, p: Input, claims: Claims, *, stable_intent: bool
) -> dict[str, Any]:
    """An admission page. The action says whether it is under the run's stable intent;
    ``stableWriteIntent``, which the reference's client sends too, may only agree with it
    (its opt-in travels as the action, so an older receiver refuses it instead of ignoring
    it). ``pendingRerunAdmission`` (absent: true) re-admits pending rows of older versions."""
    asked = p.get("stableWriteIntent")
    if asked is not None and asked is not stable_intent:
        other = "runtime_sheet_start" if stable_intent else "runtime_sheet_start_with_intent"
        raise InvalidField(
            f"stableWriteIntent is {str(asked).lower()} in an admission under "
            f"{'the' if stable_intent else 'no'} stable write intent",
            field="input.stableWriteIntent",
            rule="true (or absent) with runtime_sheet_start_with_intent, false (or absent) "
            "with runtime_sheet_start",
            fix=f"send the page as {other}, or drop stableWriteIntent",
        )
    result = await sheets.admit_page(
        conn,
        org=claims.org,
        sheet=p["tableNamespace"],
        fence=claims.fence,
        rows=_rows(p["rows"]),
        write_version=_optional_int(p.get("writeVersion"), "writeVersion"),
        stable_intent=stable_intent,
        pending_rerun_admission=p.get("pendingRerunAdmission") is not False,
    )
    return result.to_wire()


async def _sheet_complete(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    completions = []
    for index, item in enumerate(_list(p["rows"], "rows")):
        where = f"rows[{index}]"
        _check_fields(_mapping(item, where), frozenset({"key", "output", "status"}), {"key"}, where)
        try:
            status = sheets.RowStatus(item.get("status", sheets.RowStatus.DONE))
        except ValueError:
            raise InvalidField(
                f"{where}.status is {item.get('status')!r}",
                field=f"{where}.status",
                rule="done or failed",
                fix="complete rows as done or failed",
            ) from None
        completions.append(sheets.RowCompletion(item["key"], item.get("output"), status))
    result = await sheets.complete_page(
        conn,
        org=claims.org,
        sheet=p["tableNamespace"],
        fence=claims.fence,
        write_version=_optional_int(p.get("writeVersion"), "writeVersion"),
        completions=completions,
    )
    return result.to_wire()


async def _input_page(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    page = _optional_int(p["page"], "page")
    rows = await runs.input_page(conn, claims.run_id, page or 0)
    return {"rows": None if rows is None else [[key, value] for key, value in rows]}


async def _event_get(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    since = await _run_created(conn, claims)
    found, payload = await runs.emitted_payload(
        conn, org=claims.org, name=_text(p["name"], "name"), since=since
    )
    return {"found": found, "payload": payload}


async def _event_emit(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    emitted = await runs.emit(
        conn,
        org=claims.org,
        name=_text(p["name"], "name"),
        payload=p.get("payload"),
        fence=claims.fence,
    )
    return {"woken": emitted.woken}


async def _limit_acquire(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    permit = await limits.acquire(
        conn,
        key=_text(p["key"], "key"),
        hold=_text(p["hold"], "hold"),
        fence=claims.fence,
    )
    return {
        "granted": permit.granted,
        "held": permit.held,
        "busy": permit.busy,
        "waitSeconds": permit.wait_s,
        "at": _iso(permit.at),
    }


async def _limit_release(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    released = await limits.release(conn, hold=_text(p["hold"], "hold"), fence=claims.fence)
    return {"released": released}


_SPAWN_OPTIONS = frozenset({"max_attempts", "retry", "timeout", "start_by", "meta"})


async def _run_spawn(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    raw = _mapping(p.get("options") or {}, "options")
    _check_fields(raw, _SPAWN_OPTIONS, (), "options")
    options = RunOptions.checked(**raw)
    spawned = await children.spawn(
        conn,
        fence=claims.fence,
        org=claims.org,
        parent_play=claims.play,
        release=claims.release,
        step_key=_text(p["stepKey"], "stepKey"),
        play=_text(p["play"], "play"),
        params=_mapping(p.get("params") or {}, "params"),
        options=options,
        priority=_optional_int(p.get("priority"), "priority") or 0,
    )
    return {"runId": str(spawned.run_id), "created": spawned.created}


async def _run_get(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    child = await children.get(conn, parent_id=claims.run_id, child_id=p["childId"])
    return {
        "runId": str(child.id),
        "play": child.play,
        "state": child.state,
        "terminal": child.terminal,
        "result": child.result,
        "error": child.error,
    }


async def _now(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    cur = await conn.execute("SELECT now()")
    row = await cur.fetchone()
    assert row is not None
    return {"now": _iso(row[0])}


async def _ledger(conn: AsyncConn, p: Input, claims: Claims, kind: str | None) -> dict[str, Any]:
    """A keyed outbox delivery to the run's ledger, fenced by the live lease: the same key
    delivered twice stores its events once."""
    key = str(p["__idempotencyKey"])
    events: list[tuple[str, Any]]
    if kind is None:
        events = []
        for index, item in enumerate(_list(p.get("events", []), "events")):
            where = f"events[{index}]"
            _check_fields(_mapping(item, where), frozenset({"kind", "data"}), {"kind"}, where)
            # Printable text, as every name is (an operator's terminal shows it).
            name = fields.text(
                item["kind"], field=f"{where}.kind", max_len=fields.MAX_EVENT_NAME, what="kind"
            )
            if not name.startswith("play."):
                raise InvalidField(
                    f"{where}.kind {name!r} is not a play event",
                    field=f"{where}.kind",
                    rule="a play's ledger events are named play.<something>",
                    fix=f"send kind 'play.{name}'",
                )
            events.append((name, item.get("data") or {}))
    else:
        events = [(kind, {})]
    cur = await conn.execute(
        q("ledger_append_delivered"),
        {
            "kinds": [k for k, _ in events],
            "datas": [Jsonb(d) for _, d in events],
            "keys": [f"{key}#{i}" for i in range(len(events))],
            "delivery_owner": p["__deliveryLeaseOwner"],
            **claims.fence.params(count=len(events)),
        },
    )
    row = await cur.fetchone()
    assert row is not None
    fenced, appended, run_attempt, run_state = row
    if not fenced:
        raise refused(
            claims.fence,
            verb="project",
            subject=f"{len(events)} ledger event(s)",
            run_attempt=run_attempt,
            run_state=run_state,
        )
    return {"appended": int(appended), "existing": len(events) - int(appended)}


async def _append_run_events(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    return await _ledger(conn, p, claims, None)


async def _project_run_events(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    return await _ledger(conn, p, claims, None)


async def _project_run_created(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    return await _ledger(conn, p, claims, "run_created_projected")


async def _start_run(conn: AsyncConn, p: Input, claims: Claims) -> dict[str, Any]:
    return await _ledger(conn, p, claims, "run_started")


# ---- the table ------------------------------------------------------------------------

_SHEET_PAGE = frozenset({"tableNamespace", "rows"})
# An admission page's options, with the reference runtime's names.
_ADMISSION = frozenset({"writeVersion", "stableWriteIntent", "pendingRerunAdmission"})
_STEP = frozenset({"stepKey"})
_RUN = frozenset({"runId"})

# The one table of runtime actions: wire name, capability, handler, fields. A receiver of
# an older release serves a subset (``served`` in :func:`dispatch`).
ACTIONS: Mapping[str, Action] = {
    a.name: a
    for a in (
        Action(
            "runtime_sheet_start",
            SHEET_WRITE,
            _sheet_start,
            _SHEET_PAGE,
            _RUN | _ADMISSION,
            ADMISSION_TIMEOUT_S,
        ),
        # A named operation of its own, so an older receiver refuses the opt-in loudly
        # instead of admitting the run under a newer version.
        Action(
            "runtime_sheet_start_with_intent",
            SHEET_WRITE,
            _sheet_start_with_intent,
            _SHEET_PAGE,
            _RUN | _ADMISSION,
            ADMISSION_TIMEOUT_S,
        ),
        Action(
            "runtime_sheet_complete_map_rows",
            SHEET_WRITE,
            _sheet_complete,
            _SHEET_PAGE,
            _RUN | {"writeVersion"},
            COMPLETION_TIMEOUT_S,
        ),
        Action(
            "runtime_receipt_claim",
            RECEIPT_WRITE,
            _receipt_claim,
            _STEP,
            _RUN | {"scope", "leaseSeconds"},
        ),
        Action(
            "runtime_receipt_complete",
            RECEIPT_WRITE,
            _receipt_complete,
            _STEP,
            _RUN | {"scope", "result"},
        ),
        # A run's own steps: which settled before this attempt (once), then claim-and-complete
        # each after it ran, one durable commit per step (worker.context explains why).
        Action(
            "runtime_receipts_settled",
            RECEIPT_WRITE,
            _receipts_settled,
            frozenset(),
            _RUN | {"scope"},
        ),
        Action(
            "runtime_receipt_record",
            RECEIPT_WRITE,
            _receipt_record,
            _STEP,
            _RUN | {"scope", "result"},
        ),
        Action(
            "runtime_receipt_fail",
            RECEIPT_WRITE,
            _receipt_fail,
            _STEP | {"error"},
            _RUN | {"scope"},
        ),
        Action("runtime_receipt_skip", RECEIPT_WRITE, _receipt_skip, _STEP, _RUN | {"scope"}),
        Action(
            "runtime_receipts_complete",
            RECEIPT_WRITE,
            _receipts_complete,
            frozenset({"results"}),
            _RUN | {"scope"},
            COMPLETION_TIMEOUT_S,
        ),
        Action(
            "runtime_receipts_lookup",
            RECEIPT_WRITE,
            _receipts_lookup,
            frozenset({"keys"}),
            _RUN | {"scope"},
        ),
        Action("runtime_input_page", RUN_READ, _input_page, frozenset({"page"}), _RUN),
        Action("runtime_event_get", RUN_READ, _event_get, frozenset({"name"}), _RUN),
        # An emit has no key to know a repeat by: sent again, it would emit twice.
        Action(
            "runtime_event_emit",
            EVENT_EMIT,
            _event_emit,
            frozenset({"name"}),
            _RUN | {"payload"},
            repeatable=False,
        ),
        Action("runtime_now", RUN_READ, _now, frozenset(), _RUN),
        # Rate limits (queues.limits) and child runs (queues.children), each write fenced.
        Action(
            "runtime_limit_acquire",
            LIMIT_ACQUIRE,
            _limit_acquire,
            frozenset({"key", "hold"}),
            _RUN,
        ),
        Action("runtime_limit_release", LIMIT_ACQUIRE, _limit_release, frozenset({"hold"}), _RUN),
        Action(
            "runtime_run_spawn",
            RUN_SPAWN,
            _run_spawn,
            frozenset({"stepKey", "play"}),
            _RUN | {"params", "options", "priority"},
        ),
        Action("runtime_run_get", RUN_READ, _run_get, frozenset({"childId"}), _RUN),
        # Keyed outbox deliveries to the run's ledger: the run-ledger token's only actions.
        Action(
            "append_run_events", LEDGER_PROJECT, _append_run_events, frozenset({"events"}), _RUN
        ),
        Action(
            "project_run_events", LEDGER_PROJECT, _project_run_events, frozenset({"events"}), _RUN
        ),
        Action("project_run_created", LEDGER_PROJECT, _project_run_created, frozenset(), _RUN),
        Action("start_run", LEDGER_PROJECT, _start_run, frozenset(), _RUN),
    )
}
LEDGER_ACTIONS = frozenset(
    {"project_run_events", "project_run_created", "append_run_events", "start_run"}
)
SERVED_ACTIONS = frozenset(ACTIONS)


def repeatable(action: str) -> bool:
    """Whether ``action`` is safe to send again after a lost answer (:attr:`Action.repeatable`)."""
    found = ACTIONS.get(action)
    return found is not None and found.repeatable


def capability_for(action: str) -> str | None:
    """The capability an action needs, or None for an action nobody defined."""
    found = ACTIONS.get(action)
    return found.capability if found else None


def capability_for_request(body: object, capabilities: Collection[str]) -> str | None:
    """The capability a request needs given its credential's capabilities, or None when
    the credential may not make it at all (the one policy, for every action of a batch).

    A credential holding ``run.ledger.project`` must hold nothing else, may call only the
    keyed outbox delivery actions, and must send a non-blank ``idempotencyKey`` and
    ``deliveryLeaseOwner``; any other credential uses the action table.
    """
    if not isinstance(body, Mapping):
        return None
    action = body.get("action")
    if not isinstance(action, str):
        return None
    if LEDGER_PROJECT in capabilities:
        if (
            len(capabilities) != 1
            or action not in LEDGER_ACTIONS
            or not _nonblank(body.get("idempotencyKey"))
            or not _nonblank(body.get("deliveryLeaseOwner"))
        ):
            return None
        return LEDGER_PROJECT
    return capability_for(action)


def _nonblank(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


@dataclass(frozen=True, slots=True)
class Request:
    action: str
    input: Input
    idempotency_key: str | None
    delivery_lease_owner: str | None


def parse(body: object) -> list[Request]:
    """The requests of a body: one action, or a batch ``{"actions": [...]}``."""
    if not isinstance(body, Mapping):
        raise InvalidField(
            "the request body must be a JSON object",
            field="body",
            rule='{"action", "input"} or {"actions": [...]}',
            fix="send a JSON object",
        )
    items: list[Any] = list(_list(body["actions"], "actions")) if "actions" in body else [body]
    if not items:
        raise InvalidField(
            "an empty batch", field="actions", rule="one action or more", fix="send actions"
        )
    requests = []
    for index, raw in enumerate(items):
        where = "body" if "actions" not in body else f"actions[{index}]"
        item = _mapping(raw, where)
        _check_fields(
            item,
            frozenset({"action", "input", "idempotencyKey", "deliveryLeaseOwner"}),
            {"action"},
            where,
        )
        key, owner = item.get("idempotencyKey"), item.get("deliveryLeaseOwner")
        requests.append(
            Request(
                action=_text(item["action"], f"{where}.action"),
                input=_mapping(item.get("input", {}), f"{where}.input"),
                idempotency_key=key if isinstance(key, str) else None,
                delivery_lease_owner=owner if isinstance(owner, str) else None,
            )
        )
    return requests


def authorize(
    requests: Iterable[Request], claims: Claims, *, served: Collection[str] | None = None
) -> None:
    """Check every request of a batch before any runs: the policy (403), the served
    actions (400), the payload's fields and the run scope (403). One refusal refuses all."""
    served_now = SERVED_ACTIONS if served is None else frozenset(served) & SERVED_ACTIONS
    for request in requests:
        body = {
            "action": request.action,
            "idempotencyKey": request.idempotency_key,
            "deliveryLeaseOwner": request.delivery_lease_owner,
        }
        needed = capability_for_request(body, claims.capabilities)
        # A name nobody defined needs no capability: it is not served (400), as the
        # contract says, unless the credential is the ledger's, which the policy confines.
        unknown = request.action not in ACTIONS and LEDGER_PROJECT not in claims.capabilities
        if not unknown and (needed is None or needed not in claims.capabilities):
            raise CapabilityScope(SCOPE_MESSAGE, field="action", rule=request.action)
        if request.action not in served_now:
            # A known action this receiver does not serve (an older release's, mid-rollout)
            # is retried after the rollout; only a name nobody defined gets a suggestion,
            # never a legacy action standing in for a newer one.
            suggestion = None if request.action in ACTIONS else did_you_mean(
                request.action, served_now
            )
            raise OperationRefused(
                f"Unsupported action: {request.action}",
                field="action",
                rule="an action this receiver serves",
                fix=f"use {suggestion!r}"
                if suggestion
                else "retry once the runtime rollout reaches this receiver",
            )
        action = ACTIONS[request.action]
        where = f"{request.action}.input"
        _check_fields(request.input, action.fields, action.required, where)
        _check_types(request.input, where)
        _check_declared(request, claims)
        run_id = request.input.get("runId")
        if run_id is not None and _uuid(run_id, f"{where}.runId") != claims.run_id:
            raise RunScope(
                f"runId {run_id!r:.80} is not the run this credential was minted for",
                field="input.runId",
                rule="a credential acts on its own run only",
                fix="send the runId of the attempt that holds this credential",
            )


def _check_declared(request: Request, claims: Claims) -> None:
    """A restricted credential (a sandboxed play's) spawns only the plays and takes only
    the rate-limit keys its play declared (``may_spawn``, ``limits``): anything else is
    refused like a capability it does not hold (403)."""
    if request.action == "runtime_run_spawn" and claims.may_spawn is not None:
        name, allowed, declared = request.input.get("play"), claims.may_spawn, "may_spawn"
    elif request.action == "runtime_limit_acquire" and claims.may_limit is not None:
        name, allowed, declared = request.input.get("key"), claims.may_limit, "limits"
    else:
        return
    if name not in allowed:
        raise CapabilityScope(
            SCOPE_MESSAGE,
            field=f"{request.action}.input",
            rule=f"{name!r:.80} is not in the play's {declared} "
            f"({', '.join(sorted(allowed)) or 'none'})",
            fix=f"declare it: @registry.play(..., {declared}=[...])",
        )


async def check_live_lease(conn: AsyncConn, claims: Claims) -> None:
    """The run is still running at the credential's attempt under its lease (the gateway
    checks this before dispatching; every handler's SQL checks it again as it writes)."""
    cur = await conn.execute(
        "SELECT state::text, attempt, lease_owner FROM wq_runs WHERE id = %(id)s",
        {"id": claims.run_id},
    )
    row = await cur.fetchone()
    if row is not None and tuple(row) == ("running", claims.attempt, claims.owner):
        return
    raise refused(
        claims.fence,
        verb="act on",
        subject="its run",
        run_attempt=None if row is None else row[1],
        run_state=None if row is None else row[0],
    )


async def dispatch(
    conn: AsyncConn,
    body: object,
    claims: Claims,
    *,
    served: Collection[str] | None = None,
    check_lease: bool = False,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Check and run one action or a batch; the result (a list for a batch)."""
    requests = parse(body)
    authorize(requests, claims, served=served)
    if check_lease:
        await check_live_lease(conn, claims)
    results = []
    for request in requests:
        handler_input = dict(request.input)
        if request.action in LEDGER_ACTIONS:
            handler_input["__idempotencyKey"] = request.idempotency_key
            handler_input["__deliveryLeaseOwner"] = request.delivery_lease_owner
        results.append(await ACTIONS[request.action].handler(conn, handler_input, claims))
    is_batch = isinstance(body, Mapping) and "actions" in body
    return results if is_batch else results[0]


# ---- payload checks ------------------------------------------------------------------------


def decode(raw: bytes) -> object:
    """A request body as JSON: refused (400, never a traceback) when it is not UTF-8 JSON,
    holds NaN, Infinity or a number out of a float's range, or nests deeper than
    :data:`MAX_BODY_DEPTH` (checked without recursion: a hostile depth cannot overflow)."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int too long
        raise InvalidField(
            f"the request body is not JSON: {str(exc)[:200]}",
            field="body",
            rule="a JSON object in UTF-8, finite numbers only",
            fix="send a JSON body",
        ) from None
    # Each level opens a bracket: a body with few brackets cannot nest too deep.
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_BODY_DEPTH and fields.depth(value, MAX_BODY_DEPTH) > MAX_BODY_DEPTH:
        raise _too_deep()
    return value


def _too_deep() -> InvalidField:
    return InvalidField(
        f"the request body nests deeper than {MAX_BODY_DEPTH} levels",
        field="body",
        rule=f"values nested at most {fields.MAX_JSON_DEPTH} levels deep in their envelope",
        fix="flatten the value",
    )


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


Check = Callable[[object, str], object]


def _text_field(value: object, where: str) -> object:
    return _text(value, where)


def _optional_text(value: object, where: str) -> object:
    return None if value is None else _text(value, where)


def _mapping_field(value: object, where: str) -> object:
    return _mapping(value, where)


def _optional_mapping(value: object, where: str) -> object:
    return None if value is None else _mapping(value, where)


def _list_field(value: object, where: str) -> object:
    return _list(value, where)


def _optional_flag(value: object, where: str) -> object:
    if value is None or isinstance(value, bool):
        return value
    raise InvalidField(
        f"{where} must be true or false, got {fields.shown(value)}",
        field=where,
        rule="a JSON boolean, or null",
        fix=f"send {where} as true or false, or omit it",
    )


def _any_json(value: object, where: str) -> object:
    return value  # any JSON value: its size and depth are checked where it is stored


def _uuid_field(value: object, where: str) -> object:
    return _uuid(value, where)


def _whole(minimum: int, maximum: int, *, optional: bool) -> Check:
    def check(value: object, where: str) -> object:
        if value is None and optional:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not (minimum <= value <= maximum)
        ):
            raise InvalidField(
                f"{where} must be a whole number from {minimum} to {maximum}, got "
                f"{fields.shown(value)}",
                field=where,
                rule=f"an integer from {minimum} to {maximum}" + (" or null" if optional else ""),
                fix=f"send {where} as a JSON integer in range",
            )
        return value

    return check


def _lease(value: object, where: str) -> object:
    if value is None:
        return None
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not math.isfinite(number) or not 0 < number <= MAX_LEASE_S:
        raise InvalidField(
            f"{where} must be a number of seconds above 0 and at most {MAX_LEASE_S:g}, got "
            f"{fields.shown(value)}",
            field=where,
            rule=f"a JSON number of seconds, 0 < n <= {MAX_LEASE_S:g}, or null",
            fix="send the lane's lease TTL in seconds, or omit it",
        )
    return value


# The type of every field an action's input may carry, by name (a name means the same in
# every action that takes it): checked for each request before any handler runs, so a
# value of the wrong type or out of range is a 400 naming the field, never a 500.
FIELD_TYPES: Mapping[str, Check] = {
    "runId": _uuid_field,
    "stepKey": _text_field,
    "scope": _optional_text,
    "leaseSeconds": _lease,
    "result": _any_json,
    "error": _mapping_field,
    "tableNamespace": _text_field,
    "rows": _list_field,
    "writeVersion": _whole(0, MAX_BIGINT, optional=True),
    "stableWriteIntent": _optional_flag,
    "pendingRerunAdmission": _optional_flag,
    "results": _list_field,
    "keys": _list_field,
    "page": _whole(0, MAX_INTEGER, optional=True),
    "name": _text_field,
    "payload": _any_json,
    "key": _text_field,
    "hold": _text_field,
    "play": _text_field,
    "params": _optional_mapping,
    "options": _optional_mapping,
    "priority": _whole(*fields.PRIORITY_RANGE, optional=True),
    "childId": _uuid_field,
    "events": _list_field,
}


def _check_types(payload: Mapping[str, Any], where: str) -> None:
    for name, value in payload.items():
        FIELD_TYPES[name](value, f"{where}.{name}")


def _check_fields(
    payload: Mapping[str, Any], allowed: frozenset[str], required: Collection[str], where: str
) -> None:
    for name in payload:
        if name not in allowed:
            suggestion = did_you_mean(str(name), allowed)
            hint = f"; did you mean {suggestion!r}?" if suggestion else ""
            raise InvalidField(
                f"{where} field {name!r} is not defined for this action{hint} "
                f"(fields: {', '.join(sorted(allowed)) or 'none'})",
                field=f"{where}.{name}",
                rule="only fields the receiver defines; an unknown field is never ignored",
                fix="remove the field, or send it to a receiver whose release defines it",
            )
    missing = sorted(set(required) - payload.keys())
    if missing:
        raise InvalidField(
            f"{where} lacks required field(s): {', '.join(missing)}",
            field=f"{where}.{missing[0]}",
            rule="required",
            fix=f"send {', '.join(missing)}",
        )


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidField(
            f"{where} must be an object, got {type(value).__name__}",
            field=where,
            rule="a JSON object",
            fix=f"send {where} as an object of named fields",
        )
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise InvalidField(
            f"{where} must be a list, got {type(value).__name__}",
            field=where,
            rule="a JSON array",
            fix=f"send {where} as an array",
        )
    return list(value)


def _pairs(value: object, where: str) -> list[tuple[Any, Any]]:
    pairs = []
    for index, item in enumerate(_list(value, where)):
        entry = _list(item, f"{where}[{index}]")
        if len(entry) != 2:
            raise InvalidField(
                f"{where}[{index}] must be a [key, value] pair",
                field=f"{where}[{index}]",
                rule="[key, value]",
                fix="send pairs",
            )
        pairs.append((entry[0], entry[1]))
    return pairs


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidField(
            f"{where} must be a non-empty string, got {value!r:.80}",
            field=where,
            rule="a non-empty string",
            fix=f"send {where}",
        )
    return value


def _rows(value: object) -> list[tuple[str, sheets.JSON]]:
    rows: list[tuple[str, sheets.JSON]] = []
    for index, item in enumerate(_list(value, "rows")):
        where = f"rows[{index}]"
        _check_fields(_mapping(item, where), frozenset({"key", "input"}), {"key"}, where)
        rows.append((item["key"], item.get("input", {})))
    return rows


def _uuid(value: object, where: str = "runId") -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return uuid.UUID(value)
    except ValueError:
        raise InvalidField(
            f"{where} must be a UUID, got {value!r:.80}",
            field=where,
            rule="a UUID",
            fix="pass the id the runtime returned",
        ) from None


def _optional_int(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(
            f"{field} must be an integer, got {value!r:.80}",
            field=field,
            rule="an integer or null",
            fix=f"pass the {field} the admission returned, or omit it",
        )
    return value


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


async def _run_created(conn: AsyncConn, claims: Claims) -> datetime:
    cur = await conn.execute(
        "SELECT created_at FROM wq_runs WHERE id = %(id)s", {"id": claims.run_id}
    )
    row = await cur.fetchone()
    if row is None:
        raise StaleAttempt(f"run {claims.run_id} does not exist", fix="stop this attempt")
    created: datetime = row[0]
    return created
