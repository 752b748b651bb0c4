"""Admission: the atomic submit.

One statement on the caller's connection (``run_submit``, which calls the SECURITY DEFINER
function ``wq_submit``: the only thing the admission role may execute): the lane check
under a share lock, the launch row, the run's job on the lane (spawned through the
transport, :mod:`queues.transport`), the input pages and the ``run_created`` ledger event.
procrastinate's insert trigger NOTIFYs the lane's workers.

Idempotency is per (org, key): the same key returns the existing run (``created=False``);
the same key with another play or other params is an :class:`IdempotencyConflict`.

In admission-only mode (a serverless caller) nothing else is issued: no contract check,
no lane preparation, no inventory. Otherwise an ordinary local caller verifies the contract
and prepares the lane on its first submit (memoized per process), so an app may start
before its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, LiteralString

import psycopg
import structlog
from psycopg.types.json import Jsonb

from queues import costs, fields, lanes, migrations, tracing
from queues.authority import EXECUTOR_CAPABILITIES, Descriptor
from queues.errors import (
    InvalidField,
    UnknownPlay,
    did_you_mean,
    translate,
)
from queues.inputs import InputPages
from queues.options import RunOptions
from queues.queries import json_text, one_statement, q

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

log = structlog.get_logger("queues.admission")


@dataclass(frozen=True, slots=True)
class Submission:
    """What to run: a play by name, its JSON params, the release whose lane runs it, the
    org it runs for, and an idempotency key (the same key admits one run, however often it
    is sent; the same key with other play, params or input rows is a conflict)."""

    play: str
    params: Mapping[str, Any] = field(default_factory=dict)
    release: str = "dev"
    org: str = "default"
    idempotency_key: str | None = None
    priority: int | str = 0  # higher runs first within its lane; text of digits is taken
    # The run's own options (None: its lane's policy), by the rules of queues.options:
    max_attempts: int | str | None = None  # failed attempts allowed
    retry: fields.Retry | str | Mapping[str, Any] | None = None  # none, fixed:30s, ...
    timeout: float | timedelta | str | None = None  # seconds from its first start
    start_by: datetime | timedelta | float | str | None = None  # the claim deadline
    meta: Mapping[str, Any] | None = None  # a small JSON object stored with the run
    # The run's own budget (queues.costs): a limit in credits, or {limit, unit, period}.
    budget: float | str | Mapping[str, Any] | costs.RunBudget | None = None

    def options(self, names: Mapping[str, str] | None = None) -> RunOptions:
        """The run's own options, checked (a relative ``start_by`` counts from now);
        ``names`` renames the fields in refusals."""
        return RunOptions.checked(
            max_attempts=self.max_attempts,
            retry=self.retry,
            timeout=self.timeout,
            start_by=self.start_by,
            meta=self.meta,
            budget=self.budget,
            names=names,
        )


@dataclass(frozen=True, slots=True)
class Checked:
    """A submission every field of which passed its rule, as :func:`check` made it: the
    submits take it as it is, without checking it again (the database still checks every
    submit, as the last line).

    ``sub`` holds the checked values (its release a :class:`~queues.fields.Release`, its
    priority a number); ``options`` are the run's own, checked. Only :func:`check` makes
    one, so a submission the submits take unchecked is one that was checked."""

    sub: Submission
    options: RunOptions
    made_by: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.made_by is not _CHECK:
            raise TypeError("a Checked submission is made by queues.admission.check")


_CHECK = object()  # what check() gives each Checked it makes


@dataclass(frozen=True, slots=True)
class Admitted:
    """The admitted run: its id, whether this call created it (False: an earlier call with
    the same idempotency key did), its lane and its first job."""

    run_id: uuid.UUID
    created: bool
    lane: str
    job_id: int | None


def encode_params(params: Any) -> str:
    """Params as compact JSON text: a JSON object within the size and depth limits."""
    if not isinstance(params, Mapping):
        raise InvalidField(
            f"params must be a JSON object, got {type(params).__name__}",
            field="params",
            rule='a JSON object such as {"limit": 10}',
            fix="wrap the value in an object",
        )
    return fields.encode(params, field="params", max_bytes=fields.MAX_PARAMS_BYTES)


def check(
    sub: Submission | Checked,
    known_plays: frozenset[str] | None = None,
    *,
    names: Mapping[str, str] | None = None,
) -> Checked:
    """Every field of a submission, each by its one rule, before any write; ``names``
    renames the fields in refusals (the CLI's flags: ``{"priority": "--priority"}``).

    A submission already checked is not checked again: only its play against
    ``known_plays``, when they are given."""
    if isinstance(sub, Checked):
        if known_plays is not None:
            _known(sub.sub.play, known_plays)
        return sub
    name = dict(names or {})
    release = lanes.validate_release(sub.release, field=name.get("release", "release"))
    fields.play_name(sub.play, field=name.get("play", "play"))
    fields.org(sub.org, field=name.get("org", "org"))
    fields.idempotency_key(
        sub.idempotency_key, field=name.get("idempotency_key", "idempotency_key")
    )
    priority = fields.priority(sub.priority, field=name.get("priority", "priority"))
    options = sub.options(name)
    if known_plays is not None:
        _known(sub.play, known_plays)
    checked = replace(sub, release=release, priority=priority)
    return Checked(sub=checked, options=options, made_by=_CHECK)


def validate(sub: Submission, known_plays: frozenset[str] | None = None) -> RunOptions:
    """Every field of a submission, by the one set of field rules (before any write); the
    run's own options, checked (:func:`check`, for its options only)."""
    return check(sub, known_plays).options


def _known(play: str, known_plays: frozenset[str]) -> None:
    """Refuse a play that is not among the app's."""
    if play not in known_plays:
        hint = did_you_mean(play, known_plays)
        raise UnknownPlay(
            f"unknown play {play!r}"
            + (f"; did you mean {hint!r}?" if hint else "")
            + f" Known plays: {', '.join(sorted(known_plays)) or '(none)'}",
            field="play",
            rule="a play registered with @play",
            fix="register the play in the app module passed to --app, or fix the name",
        )


async def submit(
    conn: psycopg.AsyncConnection[Any],
    sub: Submission | Checked,
    *,
    authority: Mapping[str, Any] | None = None,
    inputs: Sequence[tuple[str, Any]] | InputPages | None = None,
) -> Admitted:
    """Admit one run atomically on ``conn``: one statement (``wq_submit``).

    On an autocommit connection outside a transaction it is one round trip (no BEGIN or
    COMMIT); inside the caller's transaction it runs in a savepoint, and the run exists
    exactly when the caller commits. ``inputs`` (rows for the play's sheet) are stored in
    pages by the same statement. The same idempotency key with another play, other params
    or other input rows is an :class:`IdempotencyConflict`. A :class:`Checked` submission
    is admitted without checking it again.
    """
    return await _admit(conn, check(sub), authority=authority, inputs=inputs)


async def _admit(
    conn: psycopg.AsyncConnection[Any],
    checked: Checked,
    *,
    authority: Mapping[str, Any] | None,
    inputs: Sequence[tuple[str, Any]] | InputPages | None,
) -> Admitted:
    """The atomic statement in a ``wq.submit`` span, whose trace context is stored with the
    run so its attempts continue the trace (:mod:`queues.tracing`)."""
    sub = checked.sub
    lane = lanes.LANE_PREFIX + sub.release
    attributes = {"wq.play": sub.play, "wq.lane": lane, "wq.org": sub.org}
    with tracing.span("wq.submit", attributes=attributes) as span:
        admitted = await _admit_statement(conn, checked, authority=authority, inputs=inputs)
        tracing.annotate(span, run_id=admitted.run_id, created=admitted.created)
    return admitted


async def _admit_statement(
    conn: psycopg.AsyncConnection[Any],
    checked: Checked,
    *,
    authority: Mapping[str, Any] | None,
    inputs: Sequence[tuple[str, Any]] | InputPages | None,
) -> Admitted:
    """The atomic statement, for a submission already checked."""
    sub, options = checked.sub, checked.options
    lane = lanes.LANE_PREFIX + sub.release
    params = encode_params(sub.params)
    pages = inputs if isinstance(inputs, InputPages) else InputPages.of(inputs or ())
    run_id = uuid.uuid4()
    args = {
        "id": run_id,
        "org": sub.org,
        "play": sub.play,
        "params": params,
        "release": sub.release,
        "lane": lane,
        "key": sub.idempotency_key,
        "priority": sub.priority,
        "authority": _authorities([sub], [run_id], authority)[0],
        "pages": list(pages.pages) or None,
        "count": pages.count,
        "digest": pages.digest,
    }
    # A run with options of its own goes through wq_submit_with_options (wq_submit, then
    # its options, in one call); one without pays nothing for them.
    statement = q("run_submit")
    if not options.empty:
        statement = q("run_submit_options")
        args["options"] = Jsonb(options.as_json())
    async with one_statement(conn):  # in a caller's transaction a refusal leaves it intact
        cur = await _execute_translated(conn, statement, args)
        row = await cur.fetchone()
    assert row is not None  # the function returns one row or raises
    run_id, created, admitted_lane, job_id = row
    return Admitted(run_id=run_id, created=created, lane=admitted_lane, job_id=job_id)


async def submit_many(
    conn: psycopg.AsyncConnection[Any],
    subs: Sequence[Submission | Checked],
    *,
    authority: Mapping[str, Any] | None = None,
) -> list[Admitted]:
    """Admit a batch of runs atomically on ``conn``: one statement (``wq_submit_many``).

    Each submission is idempotent as in :func:`submit` (its key answers with the run it
    admitted, ``created=False``; the same key twice in one batch admits one run), and the
    answer is in the batch's order. Atomic: a refusal (a lane that does not admit, a key
    reused for another request) writes nothing. No input rows: a run with rows is admitted
    by :func:`submit`. At most :data:`MAX_BATCH` submissions per call. A :class:`Checked`
    submission is not checked again.
    """
    if len(subs) > MAX_BATCH:
        raise InvalidField(
            f"{len(subs)} submissions in one batch",
            field="runs",
            rule=f"at most {MAX_BATCH} submissions per batch",
            fix="split the batch",
        )
    checked = [check(sub) for sub in subs]
    for one in checked:
        if not one.options.empty:  # never silently dropped
            raise InvalidField(
                "a batch submission carries run options (max_attempts, retry, timeout, "
                "start_by or meta)",
                field="runs",
                rule="a batch admits runs with their lane's policy",
                fix="submit runs with options of their own one by one (submit)",
            )
    if not checked:
        return []
    with tracing.span("wq.submit_many", attributes={"wq.runs": len(checked)}):
        return await _admit_many(conn, [one.sub for one in checked], authority=authority)


MAX_BATCH = 10_000  # submissions per wq_submit_many statement: bounds its locks and WAL


async def _admit_many(
    conn: psycopg.AsyncConnection[Any],
    subs: Sequence[Submission],
    *,
    authority: Mapping[str, Any] | None,
) -> list[Admitted]:
    """The batch statement, for submissions already checked."""
    ids = [uuid.uuid4() for _ in subs]
    args = {
        "ids": ids,
        "orgs": [sub.org for sub in subs],
        "plays": [sub.play for sub in subs],
        "params": [encode_params(sub.params) for sub in subs],
        "releases": [sub.release for sub in subs],
        "lanes": [lanes.LANE_PREFIX + sub.release for sub in subs],
        "keys": [sub.idempotency_key for sub in subs],
        "priorities": [sub.priority for sub in subs],
        "authorities": _authorities(subs, ids, authority),
    }
    async with one_statement(conn):  # in a caller's transaction a refusal leaves it intact
        cur = await _execute_translated(conn, q("run_submit_many"), args)
        rows = await cur.fetchall()
    return [
        Admitted(run_id=run_id, created=created, lane=lane, job_id=job_id)
        for run_id, created, lane, job_id in rows
    ]


def _authorities(
    subs: Sequence[Submission], ids: Sequence[uuid.UUID], authority: Mapping[str, Any] | None
) -> list[Jsonb]:
    """Each run's authority: its descriptor (what each attempt's tokens are minted from)
    over the submitter's metadata and trace context (which its attempts continue), as
    JSON text made once per (org, play, release) of the batch."""
    stored = check_authority(authority) | tracing.stored_context()
    texts = Descriptor.stored_texts([(s.org, s.play, s.release) for s in subs], ids, stored)
    return [json_text(text) for text in texts]


def check_authority(authority: object) -> dict[str, Any]:
    """The submitter's metadata stored in each run's authority: a JSON object of at most
    :data:`~queues.fields.MAX_AUTHORITY_BYTES` (the database refuses a stored authority that
    is not an object, or larger than its ceiling: migration 0036)."""
    if authority is None:
        return {}
    if not isinstance(authority, Mapping):
        raise InvalidField(
            f"authority must be a JSON object, got {type(authority).__name__}",
            field="authority",
            rule="a JSON object",
            fix="pass a mapping of JSON values (or none)",
        )
    fields.encode(
        authority,
        field="authority",
        max_bytes=fields.MAX_AUTHORITY_BYTES,
        fix="keep the authority's metadata small: ids, not data",
    )
    return dict(authority)


def database_rules() -> dict[str, Any]:
    """The numbers and patterns the database holds for its own checks of every submit,
    whoever calls it (``wq_field_rules()``, migration 0036): made of this module's and
    :mod:`queues.fields`'s, and equal to them (tests/integration/test_field_rules_everywhere.py
    compares the two). JSON sizes are the database's ceilings on the jsonb it stores
    (:func:`queues.fields.stored_ceiling`)."""
    low, high = fields.PRIORITY_RANGE
    return {
        "lane_prefix": lanes.LANE_PREFIX,
        "max_release": fields.MAX_RELEASE,
        "release_name": f"^{fields.RELEASE_NAME.pattern}$",
        "max_play": fields.MAX_PLAY,
        "play_name": f"^{fields.PLAY_NAME.pattern}$",
        "max_org": fields.MAX_ORG,
        "max_idempotency_key": fields.MAX_IDEMPOTENCY_KEY,
        "control": fields.sql_control_class(),
        "priority_min": low,
        "priority_max": high,
        "max_json_depth": fields.MAX_JSON_DEPTH,
        "max_json_integer_digits": fields.MAX_JSON_INTEGER_DIGITS,
        "max_params_stored_bytes": fields.stored_ceiling(fields.MAX_PARAMS_BYTES),
        "max_authority_stored_bytes": fields.stored_ceiling(fields.MAX_AUTHORITY_BYTES),
        "max_meta_stored_bytes": fields.stored_ceiling(fields.MAX_META_BYTES),
        "capabilities": list(EXECUTOR_CAPABILITIES),
        "max_batch": MAX_BATCH,
        "max_attempts": fields.MAX_ATTEMPTS,
        "min_run_timeout_s": fields.MIN_RUN_TIMEOUT_S,
        "max_run_timeout_s": fields.MAX_RUN_TIMEOUT_S,
        "retry_kinds": list(fields.RETRY_KINDS),
        "retry_bounds": {name: list(bounds) for name, bounds in fields.RETRY_BOUNDS.items()},
    }


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


@contextlib.asynccontextmanager
async def _connection(
    source: psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any],
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The caller's connection as it is, or one taken from its pool for this block only."""
    if isinstance(source, psycopg.AsyncConnection):
        yield source
    else:
        async with source.connection() as conn:
            yield conn


class Admitter:
    """Per-process admission control: a bound on concurrent submits, and one log line each.

    Each submit records the wait it spent for a permit, how many submits were waiting when
    it arrived (the process's admission queue depth), and its phase timings, in one
    ``run_submitted`` line that names the lane.

    An admitter serves one database: it remembers that the database's schema matched and
    which lanes it prepared there (lazy preparation: once per lane, never in admission-only
    mode), so keep one per database rather than one per call.
    """

    def __init__(
        self, *, max_concurrent: int = 16, admission_only: bool = False, schema: str = "public"
    ) -> None:
        self._permits = asyncio.Semaphore(max_concurrent)
        self._waiting = 0
        self.admission_only = admission_only
        self.schema = migrations.VerifiedSchema(schema=schema)
        self._prepared: set[str] = set()

    async def prepare_lane(self, conn: psycopg.AsyncConnection[Any], release: str) -> None:
        """Verify the contract and prepare the lane, once per lane for this admitter.

        Preparing creates a missing lane and never reopens a draining or reclaimed one: the
        atomic submit then refuses such a lane with its own error and fix. A failure is not
        remembered: the next submit prepares again and fails loudly again.
        """
        lane = lanes.lane_name(release)
        if lane in self._prepared:
            return
        await self.schema.verify(conn)
        async with conn.transaction():
            await lanes.prepare(conn, release)
        self._prepared.add(lane)

    async def submit_many(
        self,
        conn: psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any],
        subs: Sequence[Submission | Checked],
        *,
        known_plays: frozenset[str] | None = None,
        authority: Mapping[str, Any] | None = None,
    ) -> list[Admitted]:
        """Admit a batch in one statement (:func:`submit_many`) under one permit; lazy
        preparation of each lane first unless admission-only. One ``runs_submitted`` line.
        Each submission is checked first (a :class:`Checked` one is not checked again)."""
        checked = [check(sub, known_plays) for sub in subs]
        started = time.perf_counter()
        async with self._permits:
            waited = time.perf_counter() - started
            async with _connection(conn) as held:
                if not self.admission_only:
                    for release in sorted({one.sub.release for one in checked}):
                        await self.prepare_lane(held, release)
                admitted = await submit_many(held, checked, authority=authority)
        log.info(
            "runs_submitted",
            lanes=sorted({a.lane for a in admitted}),
            runs=len(admitted),
            created=sum(a.created for a in admitted),
            admission_only=self.admission_only,
            permit_wait_ms=round(waited * 1000, 3),
            total_ms=round((time.perf_counter() - started) * 1000, 3),
        )
        return admitted

    async def submit(
        self,
        conn: psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any],
        sub: Submission | Checked,
        *,
        known_plays: frozenset[str] | None = None,
        authority: Mapping[str, Any] | None = None,
        inputs: Sequence[tuple[str, Any]] | InputPages | None = None,
    ) -> Admitted:
        """Admit ``sub`` once a permit is free.

        ``conn`` is a connection, or a pool: from a pool the connection is taken only
        once the permit is held and returned right after the statement (in admission-only
        mode, the one ``wq_submit``), so waiting submits hold no connection, and behind
        PgBouncer in transaction mode a submit holds a server connection for its one
        statement only.

        ``sub`` is checked first, before a permit or a connection is taken (a
        :class:`Checked` one, made by :func:`check`, is not checked again).
        """
        checked = check(sub, known_plays)
        sub = checked.sub
        depth = self._waiting
        started = time.perf_counter()
        self._waiting += 1
        try:
            await self._permits.acquire()
        finally:
            self._waiting -= 1
        waited = time.perf_counter() - started
        try:
            async with _connection(conn) as held:
                prepare_s = 0.0
                if not self.admission_only:
                    t0 = time.perf_counter()
                    await self.prepare_lane(held, sub.release)
                    prepare_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                admitted = await _admit(held, checked, authority=authority, inputs=inputs)
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
