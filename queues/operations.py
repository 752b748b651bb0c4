"""The runtime operation contract: named actions, one capability each, one dispatch.

Everything a play does to run state is a named **action** (the reference runtime's wire
names: ``runtime_sheet_start``, ``runtime_sheet_start_with_intent``, ...). :data:`ACTIONS`
is the one declarative table of every action, the capability it needs and the codec
that turns its wire dicts into the typed call (:mod:`queues.calls`) and the call's answer
back; :func:`capability_for_request` is the one policy that decides a request's
capability. :func:`dispatch` is the wire's receiver (the gateway's, with a verified
token's claims); :func:`perform` runs a typed call in process with the attempt's claims,
under the same policy. Both run the same call, and every write is fenced by the claims'
attempt in its SQL.

A receiver refuses, in this order, and never guesses:

1. a run's lifecycle event (:data:`LIFECYCLE_ACTIONS`: ``start_run``,
   ``project_run_created``), whatever the credential: 403 with the capability scope's
   message and the code ``RUNTIME_LIFECYCLE_ACTION_RESERVED``. Known on the wire, granted
   to no play: the system writes those events from the run's state rows (the ledger view);
2. a request whose credential's capabilities do not allow it (the policy): 403,
   ``Unsupported runtime action capability scope.``. A credential holding
   ``run.ledger.project`` must hold nothing else, may call only the keyed outbox delivery
   actions (:data:`LEDGER_ACTIONS`), and must send a non-blank ``idempotencyKey`` and
   ``deliveryLeaseOwner``;
3. a keyed delivery whose ``deliveryLeaseOwner`` is not its credential's attempt's lease
   owner: 403 ``RUNTIME_DELIVERY_LEASE_MISMATCH`` (the statement that appends compares it
   with the run's live lease owner again, under the run's lock);
4. an action this receiver does not serve: 400, ``Unsupported action: NAME``, whether an
   older receiver serves a subset or nobody defined the name (the client turns that answer
   for the intent action into ``RUNTIME_SHEET_WRITE_INTENT_UNAVAILABLE``, never a legacy
   admission);
5. a payload field the action does not define (an unknown field is never ignored), or one
   of the wrong type or out of its range (:data:`FIELD_TYPES`, one table for every action);
6. a request naming another run than its credential's: 403 (the run scope).

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
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import psycopg

from queues import calls, children, costs, fields, limits, policy, receipts, runs, sheets
from queues.authority import LEDGER_PROJECT, Claims
from queues.errors import (
    CapabilityScope,
    InvalidField,
    LifecycleReserved,
    OperationRefused,
    RunScope,
    did_you_mean,
)
from queues.fence import refused
from queues.options import RunOptions

AsyncConn = psycopg.AsyncConnection[Any]
Input = Mapping[str, Any]
T = TypeVar("T")

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
    # None: a run's lifecycle event, known on the wire and granted to no play (the system
    # writes it from the run's state rows): :data:`LIFECYCLE_ACTIONS`.
    codec: Codec | None
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

    @property
    def doc(self) -> str | None:
        """What the action does: its typed call's docstring (:mod:`queues.calls`)."""
        if self.codec is None:
            return LIFECYCLE_DOC
        kind = calls.BY_ACTION.get(self.name)
        doc = kind.__doc__ if kind is not None else None
        if kind is None or doc is None or doc.startswith(f"{kind.__name__}("):
            return None  # no docstring of its own (a dataclass's generated signature)
        return doc


# ---- codecs: the wire's dicts <-> the typed calls (queues.calls) ----------------------------
#
# One codec per action. The gateway decodes a request's input into the typed call and
# encodes the call's answer back; a client of the gateway (a sandboxed play) does the
# reverse with ``wire`` and ``answer``. The in-process path never meets a dict.


@dataclass(frozen=True, slots=True)
class Codec:
    decode: Callable[[Request, Claims], calls.Call[Any]]  # a request's input -> the call
    encode: Callable[[Any], dict[str, Any]]  # the call's answer -> the wire's answer
    wire: Callable[[Any], dict[str, Any]]  # the call -> the wire's input
    answer: Callable[[Mapping[str, Any]], Any]  # the wire's answer -> the call's answer


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


def _ref(r: Request, claims: Claims) -> receipts.StepRef:
    """The step a request names, in the claims' run: their org, play and fence."""
    p = r.input
    return receipts.StepRef(
        claims.org, claims.play, _scope(claims, p.get("scope")), p["stepKey"], claims.fence
    )


def _scope_wire(scope: receipts.Scope) -> dict[str, Any]:
    """A scope on the wire: a named scope by its name; the run's own scope is absent."""
    return {} if scope.key.startswith("run:") else {"scope": scope.key}


def _ref_wire(ref: receipts.StepRef) -> dict[str, Any]:
    return {"stepKey": ref.step_key, **_scope_wire(ref.scope)}


def _none(answer: object) -> dict[str, Any]:
    return {}


def _nothing(answer: Mapping[str, Any]) -> None:
    return None


def _claim_answer(claim: receipts.Claim) -> dict[str, Any]:
    return {
        "outcome": claim.outcome.value,
        "stepKey": claim.step_key,
        "result": claim.result,
        "leaseExpiresAt": _iso(claim.lease_expires_at),
        "ownerRun": str(claim.owner_run) if claim.owner_run else None,
        "ownerAttempt": claim.owner_attempt,
    }


def _claim_of(a: Mapping[str, Any]) -> receipts.Claim:
    lease, owner = a.get("leaseExpiresAt"), a.get("ownerRun")
    return receipts.Claim(
        receipts.ClaimOutcome(a["outcome"]),
        a["stepKey"],
        result=a.get("result"),
        lease_expires_at=datetime.fromisoformat(lease) if lease else None,
        owner_run=uuid.UUID(owner) if owner else None,
        owner_attempt=a.get("ownerAttempt"),
    )


def _decode_claim(r: Request, claims: Claims) -> calls.ReceiptClaim:
    lease_s = float(r.input.get("leaseSeconds") or receipts.STEP_LEASE_S)
    return calls.ReceiptClaim(_ref(r, claims), lease_s)


def _wire_claim(c: calls.ReceiptClaim) -> dict[str, Any]:
    lease = {} if c.lease_s == receipts.STEP_LEASE_S else {"leaseSeconds": c.lease_s}
    return _ref_wire(c.ref) | lease


RECEIPT_CLAIM = Codec(_decode_claim, _claim_answer, _wire_claim, _claim_of)


def _charges(r: Request, field: str = "charges") -> list[costs.Charge]:
    """A step's charges from the wire: ``[{"amount", "unit"?, "provider"?}, ...]``."""
    found = []
    for index, item in enumerate(_list(r.input.get(field) or [], field)):
        where = f"{field}[{index}]"
        _check_fields(_mapping(item, where), _CHARGE, {"amount"}, where)
        found.append(
            costs.Charge.checked(
                item["amount"], item.get("unit", costs.DEFAULT_UNIT), item.get("provider")
            )
        )
    return found


def _charge_wire(c: costs.Charge) -> dict[str, Any]:
    wire: dict[str, Any] = {"amount": costs.number(c.amount), "unit": c.unit}
    if c.provider is not None:
        wire["provider"] = c.provider
    return wire


def _charges_wire(charges: Iterable[costs.Charge]) -> dict[str, Any]:
    """Charges on the wire; none sent when there are none (an older receiver, which
    refuses fields it does not define, serves a step that charged nothing)."""
    listed = [_charge_wire(c) for c in charges]
    return {"charges": listed} if listed else {}


RECEIPT_COMPLETE = Codec(
    lambda r, claims: calls.ReceiptComplete(
        _ref(r, claims), r.input.get("result"), charges=_charges(r)
    ),
    lambda result: {"result": result},
    lambda c: _ref_wire(c.ref) | {"result": c.result} | _charges_wire(c.charges),
    lambda a: a["result"],
)


def _record_answer(done: receipts.Claim) -> dict[str, Any]:
    return {"outcome": done.outcome.value, "stepKey": done.step_key, "result": done.result}


RECEIPT_RECORD = Codec(
    lambda r, claims: calls.ReceiptRecord(
        _ref(r, claims), r.input.get("result"), charges=_charges(r)
    ),
    _record_answer,
    lambda c: _ref_wire(c.ref) | {"result": c.result} | _charges_wire(c.charges),
    lambda a: receipts.Claim(receipts.ClaimOutcome(a["outcome"]), a["stepKey"], a.get("result")),
)


def _settled_answer(found: receipts.Settled) -> dict[str, Any]:
    return {
        "complete": found.complete,
        "receipts": {
            key: {"status": status.value, "result": value}
            for key, (status, value) in found.receipts.items()
        },
    }


def _settled_of(a: Mapping[str, Any]) -> receipts.Settled:
    return receipts.Settled(
        {
            key: (receipts.ReceiptStatus(v["status"]), v["result"])
            for key, v in a["receipts"].items()
        },
        complete=bool(a["complete"]),
    )


RECEIPTS_SETTLED = Codec(
    lambda r, claims: calls.ReceiptsSettled(_scope(claims, r.input.get("scope"))),
    _settled_answer,
    lambda c: _scope_wire(c.scope),
    _settled_of,
)


def _decode_fail(r: Request, claims: Claims) -> calls.ReceiptFail:
    error = r.input.get("error")
    if not isinstance(error, Mapping):
        raise InvalidField(
            "error must be an object", field="input.error", rule="a JSON object", fix="send one"
        )
    return calls.ReceiptFail(_ref(r, claims), error, charges=_charges(r))


RECEIPT_FAIL = Codec(
    _decode_fail,
    _none,
    lambda c: _ref_wire(c.ref) | {"error": c.error} | _charges_wire(c.charges),
    _nothing,
)
RECEIPT_SKIP = Codec(
    lambda r, claims: calls.ReceiptSkip(_ref(r, claims)),
    _none,
    lambda c: _ref_wire(c.ref),
    _nothing,
)


def _decode_page(r: Request, claims: Claims) -> calls.ReceiptsComplete:
    pairs = [
        (_text(item, f"results[{i}][0]"), value)
        for i, (item, value) in enumerate(_pairs(r.input["results"], "results"))
    ]
    by_key: dict[str, list[costs.Charge]] = {}
    for index, item in enumerate(_list(r.input.get("charges") or [], "charges")):
        where = f"charges[{index}]"
        _check_fields(_mapping(item, where), _CHARGE | {"stepKey"}, {"stepKey", "amount"}, where)
        charge = costs.Charge.checked(
            item["amount"], item.get("unit", costs.DEFAULT_UNIT), item.get("provider")
        )
        by_key.setdefault(_text(item["stepKey"], f"{where}.stepKey"), []).append(charge)
    return calls.ReceiptsComplete(_scope(claims, r.input.get("scope")), pairs, by_key)


def _wire_page(c: calls.ReceiptsComplete) -> dict[str, Any]:
    wire = {"results": [[key, value] for key, value in c.results]} | _scope_wire(c.scope)
    charges = [
        {"stepKey": key} | _charge_wire(charge)
        for key, listed in c.charges.items()
        for charge in listed
    ]
    return wire | ({"charges": charges} if charges else {})


def _page_answer(page: receipts.PageCompletion) -> dict[str, Any]:
    return {"completed": page.completed, "already": page.already, "busy": page.busy}


RECEIPTS_COMPLETE = Codec(
    _decode_page,
    _page_answer,
    _wire_page,
    lambda a: receipts.PageCompletion(
        completed=a["completed"], already=a["already"], busy=a["busy"]
    ),
)


def _decode_reserve(r: Request, claims: Claims) -> calls.BudgetReserve:
    keys = [_text(k, f"keys[{i}]") for i, k in enumerate(_list(r.input["keys"], "keys"))]
    if len(keys) > receipts.MAX_PAGE:
        raise InvalidField(
            f"a reservation of {len(keys)} keys is too large",
            field="input.keys",
            rule=f"at most {receipts.MAX_PAGE} keys (a page)",
            fix=f"reserve pages of {receipts.MAX_PAGE}",
        )
    estimate = costs.estimate_of(_mapping(r.input.get("estimate") or {}, "estimate"))
    return calls.BudgetReserve(_scope(claims, r.input.get("scope")), keys, estimate)


def _reservation_answer(got: costs.Reservation) -> dict[str, Any]:
    return {
        "granted": got.granted,
        "requested": got.requested,
        "budgets": got.budgets,
        "exhausted": got.exhausted,
        "wakeAt": _iso(got.wake_at),
        "budgetId": got.budget_id,
        "epoch": got.epoch,
    }


def _reservation_of(a: Mapping[str, Any]) -> costs.Reservation:
    wake = a.get("wakeAt")
    return costs.Reservation(
        granted=int(a["granted"]),
        requested=int(a["requested"]),
        budgets=int(a["budgets"]),
        exhausted=bool(a["exhausted"]),
        wake_at=datetime.fromisoformat(wake) if wake else None,
        budget_id=a.get("budgetId"),
        epoch=int(a["epoch"]),
    )


BUDGET_RESERVE = Codec(
    _decode_reserve,
    _reservation_answer,
    lambda c: (
        {
            "keys": list(c.keys),
            "estimate": {unit: costs.number(amount) for unit, amount in c.estimate.items()},
        }
        | _scope_wire(c.scope)
    ),
    _reservation_of,
)


def _decode_lookup(r: Request, claims: Claims) -> calls.ReceiptsLookup:
    keys = [_text(k, f"keys[{i}]") for i, k in enumerate(_list(r.input["keys"], "keys"))]
    return calls.ReceiptsLookup(_scope(claims, r.input.get("scope")), keys)


RECEIPTS_LOOKUP = Codec(
    _decode_lookup,
    lambda found: {"results": found},
    lambda c: {"keys": list(c.keys)} | _scope_wire(c.scope),
    lambda a: a["results"],
)


def _admission(stable_intent: bool) -> Callable[[Request, Claims], calls.SheetStart]:
    """An admission page. The action says whether it is under the run's stable intent;
    ``stableWriteIntent``, which the reference's client sends too, may only agree with it
    (its opt-in travels as the action, so an older receiver refuses it instead of ignoring
    it). ``pendingRerunAdmission`` (absent: true) re-admits pending rows of older versions."""

    def decode(r: Request, claims: Claims) -> calls.SheetStart:
        p = r.input
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
        kind = calls.SheetStartWithIntent if stable_intent else calls.SheetStart
        return kind(
            p["tableNamespace"],
            _rows(p["rows"]),
            write_version=_optional_int(p.get("writeVersion"), "writeVersion"),
            pending_rerun_admission=p.get("pendingRerunAdmission") is not False,
        )

    return decode


def _wire_admission(c: calls.SheetStart) -> dict[str, Any]:
    """A page as the reference's client sends it. The opt-in travels as the action's name
    and a rerun admission is the receiver's default, so neither flag is sent unless it
    changes something: a receiver of the previous release, which refuses fields it does
    not define, serves these pages."""
    wire: dict[str, Any] = {
        "tableNamespace": c.sheet,
        "rows": [{"key": key, "input": value} for key, value in c.rows],
    }
    if c.write_version is not None:
        wire["writeVersion"] = c.write_version
    if not c.pending_rerun_admission:
        wire["pendingRerunAdmission"] = False
    return wire


def _to_wire(result: sheets.AdmitResult | sheets.CompletionResult) -> dict[str, Any]:
    return result.to_wire()


SHEET_START = Codec(_admission(False), _to_wire, _wire_admission, sheets.AdmitResult.from_wire)
SHEET_START_WITH_INTENT = Codec(
    _admission(True), _to_wire, _wire_admission, sheets.AdmitResult.from_wire
)


def _decode_completion(r: Request, claims: Claims) -> calls.SheetComplete:
    completions = []
    for index, item in enumerate(_list(r.input["rows"], "rows")):
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
    return calls.SheetComplete(
        r.input["tableNamespace"],
        completions,
        write_version=_optional_int(r.input.get("writeVersion"), "writeVersion"),
    )


def _wire_completion(c: calls.SheetComplete) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "tableNamespace": c.sheet,
        "rows": [
            {"key": x.key, "output": x.output, "status": str(x.status)} for x in c.completions
        ],
    }
    if c.write_version is not None:
        wire["writeVersion"] = c.write_version
    return wire


SHEET_COMPLETE = Codec(
    _decode_completion, _to_wire, _wire_completion, sheets.CompletionResult.from_wire
)


def _rows_answer(rows: list[tuple[str, Any]] | None) -> dict[str, Any]:
    return {"rows": None if rows is None else [[key, value] for key, value in rows]}


def _rows_of(a: Mapping[str, Any]) -> list[tuple[str, Any]] | None:
    rows = a["rows"]
    return None if rows is None else [(str(key), value) for key, value in rows]


INPUT_PAGE = Codec(
    lambda r, claims: calls.InputPage(_optional_int(r.input["page"], "page") or 0),
    _rows_answer,
    lambda c: {"page": c.page},
    _rows_of,
)
EVENT_GET = Codec(
    lambda r, claims: calls.EventGet(_text(r.input["name"], "name")),
    lambda got: {"found": got.found, "payload": got.payload},
    lambda c: {"name": c.name},
    lambda a: calls.EventFound(bool(a["found"]), a.get("payload")),
)
EVENT_EMIT_CODEC = Codec(
    lambda r, claims: calls.EventEmit(_text(r.input["name"], "name"), r.input.get("payload")),
    lambda emitted: {"woken": emitted.woken},
    lambda c: {"name": c.name, "payload": c.payload},
    lambda a: runs.Emitted(woken=int(a["woken"])),
)
NOW = Codec(
    lambda r, claims: calls.Now(),
    lambda now: {"now": _iso(now)},
    lambda c: {},
    lambda a: datetime.fromisoformat(a["now"]),
)


def _permit_answer(permit: limits.Permit) -> dict[str, Any]:
    return {
        "granted": permit.granted,
        "held": permit.held,
        "busy": permit.busy,
        "waitSeconds": permit.wait_s,
        "at": _iso(permit.at),
    }


def _permit_of(a: Mapping[str, Any]) -> limits.Permit:
    wait, at = a.get("waitSeconds"), a.get("at")
    return limits.Permit(
        granted=bool(a["granted"]),
        held=bool(a["held"]),
        busy=bool(a.get("busy")),
        wait_s=None if wait is None else float(wait),
        at=datetime.fromisoformat(at) if at else None,
    )


LIMIT_ACQUIRE_CODEC = Codec(
    lambda r, claims: calls.LimitAcquire(
        _text(r.input["key"], "key"), _text(r.input["hold"], "hold")
    ),
    _permit_answer,
    lambda c: {"key": c.key, "hold": c.hold},
    _permit_of,
)
LIMIT_RELEASE = Codec(
    lambda r, claims: calls.LimitRelease(_text(r.input["hold"], "hold")),
    lambda released: {"released": released},
    lambda c: {"hold": c.hold},
    lambda a: bool(a["released"]),
)

_SPAWN_OPTIONS = frozenset({"max_attempts", "retry", "timeout", "start_by", "meta", "budget"})


def _decode_spawn(r: Request, claims: Claims) -> calls.RunSpawn:
    p = r.input
    raw = _mapping(p.get("options") or {}, "options")
    _check_fields(raw, _SPAWN_OPTIONS, (), "options")
    return calls.RunSpawn(
        step_key=_text(p["stepKey"], "stepKey"),
        play=_text(p["play"], "play"),
        params=_mapping(p.get("params") or {}, "params"),
        options=RunOptions.checked(**raw),
        priority=_optional_int(p.get("priority"), "priority") or 0,
    )


def _wire_spawn(c: calls.RunSpawn) -> dict[str, Any]:
    options = c.options
    wire = {
        "max_attempts": options.max_attempts,
        "retry": str(options.retry) if options.retry else None,
        "timeout": options.timeout_s,
        "start_by": options.start_by.isoformat() if options.start_by else None,
        "meta": options.meta,
        "budget": options.budget.as_json() if options.budget else None,
    }
    return {
        "stepKey": c.step_key,
        "play": c.play,
        "params": dict(c.params),
        "options": {k: v for k, v in wire.items() if v is not None},
        "priority": c.priority,
    }


RUN_SPAWN_CODEC = Codec(
    _decode_spawn,
    lambda spawned: {"runId": str(spawned.run_id), "created": spawned.created},
    _wire_spawn,
    lambda a: children.Spawned(run_id=uuid.UUID(a["runId"]), created=bool(a.get("created"))),
)


def _child_answer(child: children.Child) -> dict[str, Any]:
    return {
        "runId": str(child.id),
        "play": child.play,
        "state": child.state,
        "terminal": child.terminal,
        "result": child.result,
        "error": child.error,
    }


RUN_GET = Codec(
    lambda r, claims: calls.RunGet(r.input["childId"]),
    _child_answer,
    lambda c: {"childId": str(c.child_id)},
    lambda a: children.Child(
        uuid.UUID(a["runId"]), a["play"], a["state"], a["result"], a["error"], None
    ),
)


def _delivery(r: Request) -> dict[str, str]:
    return {"key": str(r.idempotency_key), "owner": str(r.delivery_lease_owner)}


def _decode_events(
    kind: type[calls.AppendRunEvents],
) -> Callable[[Request, Claims], calls.AppendRunEvents]:
    def decode(r: Request, claims: Claims) -> calls.AppendRunEvents:
        events = []
        for index, item in enumerate(_list(r.input.get("events", []), "events")):
            where = f"events[{index}]"
            _check_fields(_mapping(item, where), frozenset({"kind", "data"}), {"kind"}, where)
            events.append((item["kind"], item.get("data")))
        return kind(**_delivery(r), kinds_data=events)

    return decode


def _delivered(done: calls.Delivered) -> dict[str, Any]:
    return {"appended": done.appended, "existing": done.existing}


def _delivered_of(a: Mapping[str, Any]) -> calls.Delivered:
    return calls.Delivered(appended=int(a["appended"]), existing=int(a.get("existing") or 0))


def _wire_events(c: calls.AppendRunEvents) -> dict[str, Any]:
    return {"events": [{"kind": kind, "data": data or {}} for kind, data in c.kinds_data]}


APPEND_RUN_EVENTS = Codec(
    _decode_events(calls.AppendRunEvents), _delivered, _wire_events, _delivered_of
)
PROJECT_RUN_EVENTS = Codec(
    _decode_events(calls.ProjectRunEvents), _delivered, _wire_events, _delivered_of
)


# ---- the table ------------------------------------------------------------------------

_SHEET_PAGE = frozenset({"tableNamespace", "rows"})
# An admission page's options, with the reference runtime's names.
_ADMISSION = frozenset({"writeVersion", "stableWriteIntent", "pendingRerunAdmission"})
_STEP = frozenset({"stepKey"})
_RUN = frozenset({"runId"})
_CHARGE = frozenset({"amount", "unit", "provider"})  # one charge on the wire

# The one table of runtime actions: wire name, capability, codec, fields. A receiver of
# an older release serves a subset (``served`` in :func:`dispatch`).
ACTIONS: Mapping[str, Action] = {
    a.name: a
    for a in (
        Action(
            "runtime_sheet_start",
            SHEET_WRITE,
            SHEET_START,
            _SHEET_PAGE,
            _RUN | _ADMISSION,
            ADMISSION_TIMEOUT_S,
        ),
        # A named operation of its own, so an older receiver refuses the opt-in loudly
        # instead of admitting the run under a newer version.
        Action(
            "runtime_sheet_start_with_intent",
            SHEET_WRITE,
            SHEET_START_WITH_INTENT,
            _SHEET_PAGE,
            _RUN | _ADMISSION,
            ADMISSION_TIMEOUT_S,
        ),
        Action(
            "runtime_sheet_complete_map_rows",
            SHEET_WRITE,
            SHEET_COMPLETE,
            _SHEET_PAGE,
            _RUN | {"writeVersion"},
            COMPLETION_TIMEOUT_S,
        ),
        Action(
            "runtime_receipt_claim",
            RECEIPT_WRITE,
            RECEIPT_CLAIM,
            _STEP,
            _RUN | {"scope", "leaseSeconds"},
        ),
        Action(
            "runtime_receipt_complete",
            RECEIPT_WRITE,
            RECEIPT_COMPLETE,
            _STEP,
            _RUN | {"scope", "result", "charges"},
        ),
        # A run's own steps: which settled before this attempt (once), then claim-and-complete
        # each after it ran, one durable commit per step (worker.context explains why).
        Action(
            "runtime_receipts_settled",
            RECEIPT_WRITE,
            RECEIPTS_SETTLED,
            frozenset(),
            _RUN | {"scope"},
        ),
        Action(
            "runtime_receipt_record",
            RECEIPT_WRITE,
            RECEIPT_RECORD,
            _STEP,
            _RUN | {"scope", "result", "charges"},
        ),
        Action(
            "runtime_receipt_fail",
            RECEIPT_WRITE,
            RECEIPT_FAIL,
            _STEP | {"error"},
            _RUN | {"scope", "charges"},
        ),
        Action("runtime_receipt_skip", RECEIPT_WRITE, RECEIPT_SKIP, _STEP, _RUN | {"scope"}),
        Action(
            "runtime_receipts_complete",
            RECEIPT_WRITE,
            RECEIPTS_COMPLETE,
            frozenset({"results"}),
            _RUN | {"scope", "charges"},
            COMPLETION_TIMEOUT_S,
        ),
        # A step's estimate reserved against the run's budgets before it runs (queues.costs).
        Action(
            "runtime_budget_reserve",
            RECEIPT_WRITE,
            BUDGET_RESERVE,
            frozenset({"keys"}),
            _RUN | {"scope", "estimate"},
        ),
        Action(
            "runtime_receipts_lookup",
            RECEIPT_WRITE,
            RECEIPTS_LOOKUP,
            frozenset({"keys"}),
            _RUN | {"scope"},
        ),
        Action("runtime_input_page", RUN_READ, INPUT_PAGE, frozenset({"page"}), _RUN),
        Action("runtime_event_get", RUN_READ, EVENT_GET, frozenset({"name"}), _RUN),
        # An emit has no key to know a repeat by: sent again, it would emit twice.
        Action(
            "runtime_event_emit",
            EVENT_EMIT,
            EVENT_EMIT_CODEC,
            frozenset({"name"}),
            _RUN | {"payload"},
            repeatable=False,
        ),
        Action("runtime_now", RUN_READ, NOW, frozenset(), _RUN),
        # Rate limits (queues.limits) and child runs (queues.children), each write fenced.
        Action(
            "runtime_limit_acquire",
            LIMIT_ACQUIRE,
            LIMIT_ACQUIRE_CODEC,
            frozenset({"key", "hold"}),
            _RUN,
        ),
        Action("runtime_limit_release", LIMIT_ACQUIRE, LIMIT_RELEASE, frozenset({"hold"}), _RUN),
        Action(
            "runtime_run_spawn",
            RUN_SPAWN,
            RUN_SPAWN_CODEC,
            frozenset({"stepKey", "play"}),
            _RUN | {"params", "options", "priority"},
        ),
        Action("runtime_run_get", RUN_READ, RUN_GET, frozenset({"childId"}), _RUN),
        # Keyed outbox deliveries to the run's ledger: the run-ledger token's only actions.
        Action("append_run_events", LEDGER_PROJECT, APPEND_RUN_EVENTS, frozenset({"events"}), _RUN),
        Action(
            "project_run_events", LEDGER_PROJECT, PROJECT_RUN_EVENTS, frozenset({"events"}), _RUN
        ),
        # The reference's actions for the admitting app's projector: a run's lifecycle
        # events, which the system writes from the run's state rows (the ledger view).
        Action("project_run_created", LEDGER_PROJECT, None),
        Action("start_run", LEDGER_PROJECT, None),
    )
}
# The keyed outbox delivery actions, the only ones the run-ledger credential may name (the
# reference's policy); of them, plays may make only those with a codec.
LEDGER_ACTIONS = frozenset(
    {"project_run_events", "project_run_created", "append_run_events", "start_run"}
)
LIFECYCLE_ACTIONS = frozenset(a.name for a in ACTIONS.values() if a.codec is None)
LIFECYCLE_DOC = (
    "A run's lifecycle event: known on the wire, granted to no play (403 "
    "`RUNTIME_LIFECYCLE_ACTION_RESERVED`). The system writes it from the run's state rows."
)
# What a receiver of this release serves: every action a play may make.
SERVED_ACTIONS = frozenset(ACTIONS) - LIFECYCLE_ACTIONS


def repeatable(action: str) -> bool:
    """Whether ``action`` is safe to send again after a lost answer (:attr:`Action.repeatable`)."""
    found = ACTIONS.get(action)
    return found is not None and found.repeatable


def codec(action: str) -> Codec:
    """The codec of an action a play may make; a lifecycle action is refused
    (:func:`lifecycle_reserved`)."""
    found = ACTIONS[action].codec
    if found is None:
        raise lifecycle_reserved(action)
    return found


def lifecycle_reserved(action: str) -> LifecycleReserved:
    """The refusal of a run's lifecycle event (:data:`LIFECYCLE_ACTIONS`) to a play."""
    return LifecycleReserved(
        SCOPE_MESSAGE,
        field="action",
        rule=f"{action} is a run's lifecycle event: the system writes it from the run's state "
        "rows (the ledger view), never a play's credential",
        fix="read the run's lifecycle (run_created, attempt_started, its outcome) from its "
        "ledger; a play appends its own events with append_run_events",
    )


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
    """Check every request of a batch before any runs, in the module's order: a lifecycle
    action (403), the policy (403), a delivery's lease owner (403), the served actions
    (400), the payload's fields and the run scope (403). One refusal refuses all."""
    served_now = SERVED_ACTIONS if served is None else frozenset(served) & SERVED_ACTIONS
    for request in requests:
        if request.action in LIFECYCLE_ACTIONS:
            raise lifecycle_reserved(request.action)
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
        if request.action in LEDGER_ACTIONS:
            _check_delivery_owner(request.delivery_lease_owner, claims)
        if request.action not in served_now:
            # A known action this receiver does not serve (an older release's, mid-rollout)
            # is retried after the rollout; only a name nobody defined gets a suggestion,
            # never a legacy action standing in for a newer one.
            suggestion = (
                None if request.action in ACTIONS else did_you_mean(request.action, served_now)
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


def _check_delivery_owner(owner: str | None, claims: Claims) -> None:
    """A keyed ledger delivery names the delivery lease of its credential's attempt: the
    worker holding the run's lease (the claims' owner). Checked before any action of a
    batch runs; ``ledger_append_delivered`` compares it with the run's live lease owner
    again, under the run's lock."""
    if owner != claims.owner:
        raise calls.delivery_lease_mismatch(owner, claims)


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
        found = codec(request.action)
        answer = await found.decode(request, claims).run(conn, claims)
        results.append(found.encode(answer))
    is_batch = isinstance(body, Mapping) and "actions" in body
    return results if is_batch else results[0]


async def perform(conn: AsyncConn, call: calls.Call[T], claims: Claims) -> T:
    """Check and run one typed call in process: the policy, the declared plays and limit
    keys, and the run scope (a step's org, play and fence are the claims' own), as
    :func:`dispatch` checks a wire request; then the call, fenced in its SQL."""
    body: dict[str, Any] = {"action": call.action}
    if isinstance(call, calls.LedgerDelivery):
        body |= {"idempotencyKey": call.key, "deliveryLeaseOwner": call.owner}
    needed = capability_for_request(body, claims.capabilities)
    if needed is None or needed not in claims.capabilities:
        raise CapabilityScope(SCOPE_MESSAGE, field="action", rule=call.action)
    if isinstance(call, calls.LedgerDelivery):
        _check_delivery_owner(call.owner, claims)
    if isinstance(call, calls.RunSpawn):
        _check_declared(Request(call.action, {"play": call.play}, None, None), claims)
    elif isinstance(call, calls.LimitAcquire):
        _check_declared(Request(call.action, {"key": call.key}, None, None), claims)
    ref: receipts.StepRef | None = getattr(call, "ref", None)
    if ref is not None and (ref.org, ref.play, ref.fence) != (
        claims.org,
        claims.play,
        claims.fence,
    ):
        raise RunScope(
            f"step {ref.step_key!r} names another run's attempt than this credential's",
            field="ref",
            rule="a credential acts on its own run only",
            fix="name the step with the attempt's own org, play and fence",
        )
    scope: receipts.Scope | None = ref.scope if ref is not None else getattr(call, "scope", None)
    if (
        scope is not None
        and scope.key.startswith("run:")
        and scope != receipts.Scope.of_run(claims.run_id)
    ):
        raise RunScope(
            f"scope {scope.key!r} is another run's",
            field="scope",
            rule="a run's own scope, or a named one",
            fix="name the scope, or leave it the run's own",
        )
    return await call.run(conn, claims)


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
    "charges": _list_field,
    "estimate": _mapping_field,
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
