"""What a worker is started with (:class:`Settings`) and the bounds its options are held to.

The composition root (:mod:`worker.runtime`) takes a checked :class:`Settings` and builds
the services from it; the CLI's options (``worker start``) share the bounds defined here.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from queues.errors import WorkerError
from worker.config import PoolMode
from worker.plays import Registry

POLL_INTERVAL_S = 1.0
PREFETCH_MAX = 1000  # runs claimed ahead: leased while they wait, so bounded
CLAIM_AHEAD_UNDER_S = 0.05  # plays this short are claimed ahead by default (see Settings)
CLAIM_AHEAD_UNDER_MAX_S = 1.0


@dataclass
class Settings:
    url: str
    release: str
    registry: Registry
    concurrency: int | None = None  # None: the lane's policy
    adopt: tuple[str, ...] = ()  # extra releases whose lanes this worker also consumes
    ready_file: Path | None = None
    grace_s: float = 4.0  # under honcho's 5 s stop window (docs/deploy.md: per supervisor)
    max_outage_s: float = 60.0  # exit non-zero when the database is gone for this long
    install_signals: bool = True  # False when embedded in another program (tests, demo)
    token_secret: bytes | None = None  # signs sandboxed attempts' tokens (sandboxed plays)
    gateway_url: str | None = None  # the gateway sandboxes call (None: serve one in-process)
    token_ttl_s: float = 6 * 3600.0
    sandbox_hidden: tuple[Path, ...] = ()  # more paths a sandbox must not see (its --home)
    # The connection budget and the pooler (worker.connections, worker.db): a cap on this
    # process's connections (None: the pool is concurrency + 3); where it LISTENs (None:
    # on url, unless url is a transaction pooler, then it polls every poll_s).
    max_connections: int | None = None
    listen_url: str | None = None
    pool_mode: PoolMode | None = None  # None: WORKER_POOL_MODE (default session)
    poll_s: float = POLL_INTERVAL_S
    # The high-throughput mode: runs claimed ahead into a local queue beyond the free
    # slots (0: claim only for free slots). A freed slot starts the next run at once, and
    # the next claim overlaps the running attempts and their final writes. A run claimed
    # ahead is leased (and renewed) from its claim, so its timeout counts from then. In
    # every mode a slot is freed when its play returns (batched completion), not when its
    # final write is answered.
    prefetch: int = 0
    # Claiming ahead for short plays, the default mode's own (prefetch 0): while the last
    # `concurrency` plays each returned within this many seconds, the worker also claims
    # up to 4 x `concurrency` runs ahead, so a freed slot does not wait for a claim's
    # round trip. Such a run waits at most AHEAD_HOLD_FACTOR times this for a slot (1 s at
    # the default), then is handed back (no retry spent). 0: claim only for free slots.
    claim_ahead_under_s: float = CLAIM_AHEAD_UNDER_S
    worker_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    )

    def check(self) -> None:
        """Refuse options out of their bounds (a WorkerError naming the option)."""
        if not 0 <= self.prefetch <= PREFETCH_MAX:
            raise WorkerError(
                f"prefetch {self.prefetch} is out of range",
                field="prefetch",
                rule=f"from 0 (claim only for free slots) to {PREFETCH_MAX} runs claimed ahead",
                fix="pass 0 for long runs, a few times the concurrency for short ones",
            )
        if not 0 <= self.claim_ahead_under_s <= CLAIM_AHEAD_UNDER_MAX_S:
            raise WorkerError(
                f"claim_ahead_under_s {self.claim_ahead_under_s} is out of range",
                field="claim_ahead_under_s",
                rule=f"from 0 (never) to {CLAIM_AHEAD_UNDER_MAX_S:g} seconds",
                fix="plays that take longer gain nothing from a claim saved; pass 0 to turn "
                "claiming ahead for short plays off",
            )
