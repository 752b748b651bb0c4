"""Child runs: a play admits a run of its own and waits for it durably.

``await ctx.spawn(play, params, ...)`` is a step of the parent: in one transaction the
step's receipt is claimed, the child is admitted (``child_spawn``, fenced by the parent's
attempt in the statement that inserts it) and the receipt is completed with the child's
id. A retried parent reaches the same step and replays the receipt: the same child, never
a second one; and the child's idempotency key (``child:<parent>:<step>``) would refuse a
second one anyway. The child runs on the parent's lane (the parent's release: it runs the
parent's code), in the parent's org, with its own options; it is admitted even while
that lane is draining or reclaimed, as part of serving the parent.

``await ctx.wait_for_run(child, timeout=...)`` reads the child (``child_get``); when it has
not ended, the parent suspends on the event ``wq.run:<child>`` of its org, which the
child's end emits (a trigger, ``sql/migrations/0019_add_child_runs.sql``). The parent
leaves the worker; the wait and the emit take the same event lock, so an end that races
the wait is never lost. The outcome is recorded as a step: a later attempt replays it.

**Cancel reaches the children.** Cancelling a run (``worker cancel``, the dashboard, the
operator API) cancels its unfinished children the same way (queued or sleeping at once,
running ones after their cleanup hooks; ``--force`` forces them too), and theirs, each in
a transaction of its own after the parent's. The recovery pass cancels any unfinished child
of a run whose cancel was asked that a cancel did not reach (an interrupted cascade). A
parent that ends otherwise (succeeded, failed, timed out) leaves its children running:
they are runs of their own.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from queues import admission, costs, fields, receipts, runs, tracing
from queues.authority import Descriptor
from queues.errors import FenceError, InvalidField
from queues.fence import Fence, refused
from queues.options import RunOptions
from queues.queries import q

EVENT_PREFIX = "wq.run:"  # the event a child's end emits in its org: wq.run:<child id>
CASCADE_MAX = 10_000  # runs one cancel reaches (children, their children, ...)


def ended_event(child_id: uuid.UUID) -> str:
    """The event a child run's end emits (what its parent waits on)."""
    return f"{EVENT_PREFIX}{child_id}"


def child_key(parent_id: uuid.UUID, step_key: str) -> str:
    """The idempotency key of the child a parent's spawn step admits."""
    return f"child:{parent_id}:{step_key}"[: fields.MAX_IDEMPOTENCY_KEY]


@dataclass(frozen=True, slots=True)
class Spawned:
    run_id: uuid.UUID
    created: bool  # False: replayed (an earlier attempt of the parent spawned it)


async def spawn(
    conn: psycopg.AsyncConnection[Any],
    *,
    fence: Fence,
    org: str,
    parent_play: str,
    release: str,
    step_key: str,
    play: str,
    params: Mapping[str, Any],
    options: RunOptions,
    priority: int = 0,
) -> Spawned:
    """Admit a child of the fenced attempt's run as the step ``step_key``, in one
    transaction with the step's receipt (see the module's docstring)."""
    fields.play_name(play)
    fields.priority(priority)
    encoded = admission.encode_params(params)
    scope = receipts.Scope.of_run(fence.run_id)
    ref = receipts.StepRef(org, parent_play, scope, step_key, fence)
    refusal: FenceError | None = None
    async with conn.transaction():
        try:
            return await _spawn(conn, ref, play, encoded, options, priority, release)
        except FenceError as exc:
            refusal = exc  # raised once the transaction committed its wq_refusals row
    assert refusal is not None
    raise refusal


def _spawned(recorded: object) -> uuid.UUID | None:
    """The child a spawn's receipt records, or None when the receipt is another step's."""
    if not isinstance(recorded, dict):
        return None
    try:
        return uuid.UUID(str(recorded["run_id"]))
    except (KeyError, ValueError):
        return None


async def _spawn(
    conn: psycopg.AsyncConnection[Any],
    ref: receipts.StepRef,
    play: str,
    encoded: str,
    options: RunOptions,
    priority: int,
    release: str,
) -> Spawned:
    fence, org, step_key = ref.fence, ref.org, ref.step_key
    claim = await receipts.claim(conn, ref, lease_s=receipts.STEP_LEASE_S)
    if claim.outcome == receipts.ClaimOutcome.REPLAY and (found := _spawned(claim.result)):
        return Spawned(run_id=found, created=False)
    if claim.outcome != receipts.ClaimOutcome.EXECUTE:  # another step's receipt, not a spawn
        raise InvalidField(
            f"step {step_key!r} was recorded as {claim.outcome}, not as a spawn",
            field="key",
            rule="a spawn's step key is used by that spawn only",
            fix="give the spawn a key of its own",
        )
    child_id = uuid.uuid4()
    key = child_key(fence.run_id, step_key)
    descriptor = Descriptor(org=org, play=play, run_id=child_id, release=release)
    args = {
        "child_id": child_id,
        "play": play,
        "params": encoded,
        "key": key,
        "priority": priority,
        "step": step_key,
        "authority": Jsonb(descriptor.as_json() | tracing.stored_context()),
        "meta": None if options.meta is None else Jsonb(options.meta),
        **options.columns(),
        **fence.params(),
    }
    cur = await conn.execute(q("child_spawn"), args)
    row = await cur.fetchone()
    assert row is not None
    fenced, created_id, _jobs, run_attempt, run_state = row
    if not fenced:
        raise refused(
            fence,
            verb="spawn",
            subject=f"a child run of play {play!r}",
            run_attempt=run_attempt,
            run_state=run_state,
        )
    if created_id is None:  # the key admitted it already
        cur = await conn.execute(
            q("child_by_key"), {"org": org, "key": key, "parent_id": fence.run_id}
        )
        existing = await cur.fetchone()
        assert existing is not None, f"child key {key!r} conflicts with another run"
        created_id = existing[0]
    if options.budget is not None and created_id == child_id:
        # The child's own budget, written with it (one transaction).
        await costs.set_budget(
            conn,
            run_id=child_id,
            limit=options.budget.limit,
            unit=options.budget.unit,
            period=options.budget.period,
            actor=f"spawn:{fence.run_id}",
        )
    await receipts.complete(conn, ref, result={"run_id": str(created_id), "play": play})
    return Spawned(run_id=created_id, created=created_id == child_id)


@dataclass(frozen=True, slots=True)
class Child:
    id: uuid.UUID
    play: str
    state: str
    result: Any
    error: Any
    finished_at: datetime | None

    @property
    def terminal(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")


async def get(
    conn: psycopg.AsyncConnection[Any], *, parent_id: uuid.UUID, child_id: object
) -> Child:
    """A child of ``parent_id`` (refused when ``child_id`` is not one of its children)."""
    try:
        cid = child_id if isinstance(child_id, uuid.UUID) else uuid.UUID(str(child_id))
    except ValueError:
        raise InvalidField(
            f"child run id {fields.shown(child_id)} is not a UUID",
            field="run_id",
            rule="the id ctx.spawn returned",
            fix="pass the id ctx.spawn returned",
        ) from None
    cur = await conn.execute(q("child_get"), {"child_id": cid, "parent_id": parent_id})
    row = await cur.fetchone()
    if row is None:
        raise InvalidField(
            f"run {cid} is not a child of run {parent_id}",
            field="run_id",
            rule="a run this run spawned (ctx.spawn)",
            fix="wait for the id ctx.spawn returned",
        )
    return Child(*row)


async def cancel_descendants(
    conn: psycopg.AsyncConnection[Any],
    run_id: uuid.UUID,
    *,
    reason: str | None = None,
    force: bool = False,
    actor: str | None = None,
) -> list[runs.CancelResult]:
    """Cancel the unfinished children of ``run_id``, and theirs, each in a transaction of its
    own (after the parent's: the lock order of migration 0019); at most
    :data:`CASCADE_MAX` runs. Idempotent: a repeated cancel reaches what an interrupted one
    did not."""
    done: list[runs.CancelResult] = []
    todo = [run_id]
    seen = {run_id}
    why = reason or parent_cancelled(run_id)
    while todo and len(done) < CASCADE_MAX:
        parent = todo.pop(0)
        cur = await conn.execute(
            q("children_unfinished"), {"parent_id": parent, "limit": CASCADE_MAX}
        )
        for (child,) in await cur.fetchall():
            if child in seen:
                continue
            seen.add(child)
            done.append(await runs.cancel(conn, child, reason=why, force=force, actor=actor))
            todo.append(child)
    return done


def parent_cancelled(parent: uuid.UUID) -> str:
    """The cancel reason a child gets when its parent's cancel reaches it (either way)."""
    return f"parent run {parent} was cancelled"


async def cancel_orphans(
    conn: psycopg.AsyncConnection[Any], *, batch: int = 100, actor: str = "recovery"
) -> list[uuid.UUID]:
    """The recovery pass's part: cancel a batch of unfinished children of runs whose cancel
    was asked, that no cancel reached; returns them."""
    cur = await conn.execute(q("children_of_cancelled"), {"batch": batch})
    cancelled = []
    for child, parent in await cur.fetchall():
        result = await runs.cancel(conn, child, reason=parent_cancelled(parent), actor=actor)
        if result.changed:
            cancelled.append(child)
    return cancelled


@dataclass(frozen=True, slots=True)
class Listed:
    id: uuid.UUID
    play: str
    state: str
    created_at: datetime
    finished_at: datetime | None


async def list_children(
    conn: psycopg.AsyncConnection[Any], parent_id: uuid.UUID, *, limit: int = 100
) -> list[Listed]:
    cur = await conn.execute(q("children_list"), {"parent_id": parent_id, "limit": limit})
    return [Listed(*row) for row in await cur.fetchall()]
