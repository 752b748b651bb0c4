"""Admission: the atomic submit.

One transaction on the caller's connection, one statement (``run_submit``): the lane check
under a share lock, the launch row, the procrastinate job on the lane and the
``run_created`` ledger event. procrastinate's insert trigger NOTIFYs the lane's workers.

Idempotency is per (org, key): the same key returns the existing run (``created=False``);
the same key with another play or other params is an :class:`IdempotencyConflict`.

In admission-only mode (a serverless caller) nothing else is issued: no contract check,
no lane preparation, no inventory. Otherwise an ordinary local caller verifies the contract
and prepares the lane on its first submit (memoized per process), so an app may start
before its worker.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, LiteralString

import psycopg
import structlog
from psycopg.types.json import Jsonb

from queues import lanes, migrations
from queues.errors import (
    IdempotencyConflict,
    InvalidField,
    LaneReclaimed,
    PayloadTooLarge,
    UnknownPlay,
    did_you_mean,
    translate,
)
from queues.queries import q

log = structlog.get_logger("queues.admission")

MAX_PARAMS_BYTES = 256 * 1024
MAX_KEY_LENGTH = 200
MAX_ORG_LENGTH = 100
TASK_NAME = "wq.run"
PAGE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class Submission:
    play: str
    params: Mapping[str, Any] = field(default_factory=dict)
    release: str = "dev"
    org: str = "default"
    idempotency_key: str | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Admitted:
    run_id: uuid.UUID
    created: bool
    lane: str
    job_id: int | None


def encode_params(params: Any) -> tuple[Mapping[str, Any], int]:
    """Validate params as a JSON object within the size limit; return it and its size."""
    if not isinstance(params, Mapping):
        raise InvalidField(
            f"params must be a JSON object, got {type(params).__name__}",
            field="params",
            rule='a JSON object such as {"limit": 10}',
            fix="wrap the value in an object",
        )
    try:
        text = json.dumps(params, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidField(
            f"params are not JSON-serialisable: {exc}",
            field="params",
            rule="JSON values only (no NaN, no custom objects)",
            fix="convert the value to plain JSON types",
        ) from exc
    size = len(text.encode("utf-8"))
    if size > MAX_PARAMS_BYTES:
        raise PayloadTooLarge(
            f"params are {size} bytes; the limit is {MAX_PARAMS_BYTES} bytes",
            field="params",
            rule=f"at most {MAX_PARAMS_BYTES} bytes of JSON",
            fix="pass large inputs as sheet rows (--input) instead of params",
        )
    return params, size


def validate(sub: Submission, known_plays: frozenset[str] | None) -> None:
    lanes.validate_release(sub.release)
    if known_plays is not None and sub.play not in known_plays:
        hint = did_you_mean(sub.play, known_plays)
        raise UnknownPlay(
            f"unknown play {sub.play!r}"
            + (f"; did you mean {hint!r}?" if hint else "")
            + f" Known plays: {', '.join(sorted(known_plays)) or '(none)'}",
            field="play",
            rule="a play registered with @play",
            fix="register the play in the app module passed to --app, or fix the name",
        )
    if not sub.org or len(sub.org) > MAX_ORG_LENGTH:
        raise InvalidField(
            "invalid org",
            field="org",
            rule=f"1 to {MAX_ORG_LENGTH} characters",
            fix="pass --org with a short identifier",
        )
    if sub.idempotency_key is not None and not (0 < len(sub.idempotency_key) <= MAX_KEY_LENGTH):
        raise InvalidField(
            "invalid idempotency key",
            field="idempotency_key",
            rule=f"1 to {MAX_KEY_LENGTH} characters",
            fix="use a delivery id or a request id",
        )
    # The params are checked (and encoded once) by submit itself, before any write.


class _PrepareMemo:
    """Lanes this process prepared, keyed by (database URL, schema, lane).

    A failure is never remembered: the next caller prepares again and fails loudly again.
    """

    def __init__(self) -> None:
        self._done: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str, str, str]) -> bool:
        return key in self._done

    def add(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            self._done.add(key)

    def evict(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            self._done.discard(key)

    def clear(self) -> None:
        with self._lock:
            self._done.clear()


prepared_lanes = _PrepareMemo()


async def ensure_lane(
    conn: psycopg.AsyncConnection[Any], *, url: str, release: str, schema: str = "public"
) -> None:
    """Verify the contract and prepare the lane once per process (lazy preparation)."""
    key = (url, schema, lanes.lane_name(release))
    if key in prepared_lanes:
        return
    try:
        await migrations.verify_contract(conn, url=url, schema=schema)
        async with conn.transaction():
            await lanes.prepare(conn, release)
    except BaseException:
        prepared_lanes.evict(key)
        raise
    prepared_lanes.add(key)


async def submit(
    conn: psycopg.AsyncConnection[Any],
    sub: Submission,
    *,
    authority: Mapping[str, Any] | None = None,
    inputs: Sequence[tuple[str, Any]] | None = None,
) -> Admitted:
    """Admit one run atomically on ``conn`` (its own transaction, or a savepoint).

    ``inputs`` (rows for the play's sheet) are stored in pages in the same transaction.
    """
    lane = lanes.lane_name(sub.release)
    params, _ = encode_params(sub.params)
    run_id = uuid.uuid4()
    async with conn.transaction():
        cur = await _execute_translated(
            conn,
            q("run_submit"),
            {
                "id": run_id,
                "org": sub.org,
                "play": sub.play,
                "params": Jsonb(params),
                "release": sub.release,
                "lane": lane,
                "key": sub.idempotency_key,
                "priority": sub.priority,
                "authority": Jsonb(
                    dict(authority or {})
                    | {"org": sub.org, "play": sub.play, "release": sub.release}
                ),
            },
        )
        row = await cur.fetchone()
        assert row is not None
        lane_state, inserted_id, job_id = row
        if lane_state != lanes.LaneState.PREPARED and sub.idempotency_key is not None:
            # A retried request (a lost response) answers with its run even after the lane
            # stopped taking new ones.
            cur = await conn.execute(q("run_by_key"), {"org": sub.org, "key": sub.idempotency_key})
            earlier = await cur.fetchone()
            if earlier is not None:
                return _existing(sub, params, earlier)
        if lane_state is None or lane_state == lanes.LaneState.DRAINING:
            raise lanes.not_prepared(sub.release, state=lane_state)
        if lane_state == lanes.LaneState.RECLAIMED:
            raise LaneReclaimed(
                f"lane {lane!r} of release {sub.release!r} was reclaimed: nothing was written",
                fix="submit with the current release, or re-prepare the lane with "
                f"`worker queues prepare {sub.release}`",
            )
        if inserted_id is not None:
            if inputs:
                chunks = [inputs[i : i + PAGE_SIZE] for i in range(0, len(inputs), PAGE_SIZE)]
                await conn.execute(
                    q("run_input_insert"),
                    {
                        "run_id": inserted_id,
                        "pages": list(range(len(chunks))),
                        "rows": [Jsonb([list(pair) for pair in chunk]) for chunk in chunks],
                        "count": len(inputs),
                    },
                )
            return Admitted(run_id=inserted_id, created=True, lane=lane, job_id=job_id)
        # The key admitted a run before (or a concurrent submit just did): same request?
        cur = await conn.execute(q("run_by_key"), {"org": sub.org, "key": sub.idempotency_key})
        existing = await cur.fetchone()
    if existing is None:  # pragma: no cover - the conflict row must exist
        raise IdempotencyConflict("idempotency key vanished during admission; retry")
    return _existing(sub, params, existing)


def _existing(sub: Submission, params: Mapping[str, Any], existing: Any) -> Admitted:
    """The run an idempotency key admitted before, or a conflict if the request differs."""
    existing_id, existing_play, existing_params, _state, existing_lane = existing
    if existing_play != sub.play or existing_params != json.loads(json.dumps(params)):
        differs = f"play {existing_play!r}" if existing_play != sub.play else "other params"
        raise IdempotencyConflict(
            f"idempotency key {sub.idempotency_key!r} of org {sub.org!r} already admitted run "
            f"{existing_id} with {differs}",
            field="idempotency_key",
            rule="one key admits one request (same play and params)",
            fix="use a new key for a different request",
        )
    return Admitted(run_id=existing_id, created=False, lane=existing_lane, job_id=None)


async def _execute_translated(
    conn: psycopg.AsyncConnection[Any], query: LiteralString, params: Mapping[str, Any]
) -> psycopg.AsyncCursor[Any]:
    """Execute, turning a database error we know (e.g. a missing schema) into ours."""
    try:
        return await conn.execute(query, params)
    except psycopg.Error as exc:
        mapped = translate(exc)
        if mapped is None:
            raise
        raise mapped from exc


class Admitter:
    """Per-process admission control: a bound on concurrent submits, and one log line each.

    Each submit records the wait it spent for a permit, how many submits were waiting when
    it arrived (the process's admission queue depth), and its phase timings, in one
    ``run_submitted`` line that names the lane.
    """

    def __init__(self, *, max_concurrent: int = 16, admission_only: bool = False) -> None:
        self._permits = asyncio.Semaphore(max_concurrent)
        self._waiting = 0
        self.admission_only = admission_only

    async def submit(
        self,
        conn: psycopg.AsyncConnection[Any],
        sub: Submission,
        *,
        url: str,
        known_plays: frozenset[str] | None = None,
        authority: Mapping[str, Any] | None = None,
        inputs: Sequence[tuple[str, Any]] | None = None,
    ) -> Admitted:
        validate(sub, known_plays)
        depth = self._waiting
        started = time.perf_counter()
        self._waiting += 1
        try:
            await self._permits.acquire()
        finally:
            self._waiting -= 1
        waited = time.perf_counter() - started
        try:
            prepare_s = 0.0
            if not self.admission_only:
                t0 = time.perf_counter()
                await ensure_lane(conn, url=url, release=sub.release)
                prepare_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            admitted = await submit(conn, sub, authority=authority, inputs=inputs)
            insert_s = time.perf_counter() - t1
        except Exception as exc:
            log.warning(
                "run_submit_failed",
                lane=lanes.LANE_PREFIX + sub.release,
                play=sub.play,
                error_code=getattr(exc, "code", type(exc).__name__),
                permit_wait_ms=round(waited * 1000, 3),
            )
            raise
        finally:
            self._permits.release()
        log.info(
            "run_submitted",
            run_id=str(admitted.run_id),
            lane=admitted.lane,
            play=sub.play,
            org=sub.org,
            created=admitted.created,
            admission_only=self.admission_only,
            permit_wait_ms=round(waited * 1000, 3),
            queue_depth=depth,
            prepare_ms=round(prepare_s * 1000, 3),
            insert_ms=round(insert_s * 1000, 3),
            total_ms=round((time.perf_counter() - started) * 1000, 3),
        )
        return admitted
