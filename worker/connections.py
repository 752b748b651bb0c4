"""A worker's connection budget: every connection one ``worker start`` process holds.

One worker process holds at most :attr:`Budget.total` connections, each part named in
``pg_stat_activity.application_name`` (``wq-<part> <worker id>``):

===============  =====  ==========================================================
part             count  what for
===============  =====  ==========================================================
``pool``         P      claims, final writes, and every statement of the running
                        attempts (and of the in-process runtime gateway); an attempt
                        holds a connection for one statement, never while it waits
``listen``       1 / 0  the LISTEN session (the lanes' new jobs, cancels); 0 when the
                        worker polls (a transaction pooler, no listen URL)
``heartbeat``    1      lease renewal, from a thread of its own (never starved)
``projector``    1      the ledger outbox's HTTP sinks (it polls every second: no
                        LISTEN of its own; the progress sink needs none)
``maintenance``  2      procrastinate's periodic-task worker (1) and the recovery pass
                        it runs once a minute (1)
===============  =====  ==========================================================

Without a cap the pool is ``concurrency + 3`` (every attempt a statement at once, plus
the claim, finish and suspension loops). With ``--max-connections N`` the pool is what is
left: ``min(concurrency + 3, N - fixed)``. Attempts then queue briefly for a pool
connection instead of holding one each; an IO-bound play that awaits most of its time
needs far fewer connections than its concurrency. A pool below :data:`POOL_MIN` (the
claim loop, the finish loop and one attempt statement) is refused at start with
``CONNECTION_BUDGET_TOO_SMALL``.

Through PgBouncer in transaction mode the pool, heartbeat, projector and maintenance
connections are PgBouncer clients: they hold a Postgres connection only inside a
transaction, and Postgres sees PgBouncer's ``default_pool_size``, not the workers' sum.
The listen session is always a Postgres connection of its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from queues.errors import InvalidField

POOL_EXTRA = 3  # the claim loop, the finish loop, a suspension on an event
POOL_MIN = 3  # the claim loop, the finish loop and one attempt statement
HEARTBEAT = 1
PROJECTOR = 1  # worker.projector: the HTTP sinks' deliveries
MAINTENANCE_POOL = 1  # procrastinate's pool for its periodic-task worker (no LISTEN)
MAINTENANCE = MAINTENANCE_POOL + 1  # and the recovery pass's own connection
MAX_CONNECTIONS_VARIABLE = "WORKER_MAX_CONNECTIONS"


@dataclass(frozen=True, slots=True)
class Budget:
    """The connections of one worker process, by part."""

    pool: int
    listen: int
    heartbeat: int = HEARTBEAT
    projector: int = PROJECTOR
    maintenance: int = MAINTENANCE

    @property
    def total(self) -> int:
        return self.pool + self.listen + self.heartbeat + self.projector + self.maintenance

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total": self.total}


def fixed(*, listening: bool) -> int:
    """The connections a worker holds besides its pool."""
    return int(listening) + HEARTBEAT + PROJECTOR + MAINTENANCE


def minimum(*, listening: bool) -> int:
    """The smallest ``--max-connections`` a worker can run with."""
    return fixed(listening=listening) + POOL_MIN


def check_cap(cap: int | None, *, listening: bool, field: str = "--max-connections") -> None:
    """Refuse a cap below :func:`minimum`, naming every part it must cover."""
    if cap is None:
        return
    least = minimum(listening=listening)
    if cap < least:
        parts = (
            f"{POOL_MIN} pool (claim, finish, one attempt statement)"
            + (", 1 listen" if listening else "")
            + f", {HEARTBEAT} heartbeat, {PROJECTOR} projector, {MAINTENANCE} maintenance"
        )
        raise InvalidField(
            f"a worker cannot run on {cap} connection(s): it needs at least {least}",
            field=field,
            rule=f"at least {least}: {parts}",
            fix=f"raise {field} to {least} or more (or unset {MAX_CONNECTIONS_VARIABLE})",
            code="CONNECTION_BUDGET_TOO_SMALL",
        )


def plan(concurrency: int, *, listening: bool, cap: int | None = None) -> Budget:
    """The budget of a worker running ``concurrency`` attempts, within ``cap`` if given."""
    check_cap(cap, listening=listening)
    pool = concurrency + POOL_EXTRA
    if cap is not None:
        pool = min(pool, cap - fixed(listening=listening))
    return Budget(pool=pool, listen=int(listening))
