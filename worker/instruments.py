"""The process's own measurements: histograms of pickup latency, attempt and step duration.

They are observed where the work happens (:mod:`worker.attempt`, :mod:`worker.context`)
and exposed by ``/metrics`` (:mod:`worker.metrics_http`) next to the totals read from the
database. They are per process (each worker measures its own attempts), as Prometheus
histograms are: aggregate them across instances with ``sum by (le)``.

The metric objects are made without a registry; each ``/metrics`` server registers them in
a registry of its own, so a process that serves several (tests) never double-registers.
"""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Histogram

from queues import runs

# Seconds: from a few milliseconds (a claim on a busy lane) to minutes (a backlog).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
# Seconds: plays run from milliseconds to hours.
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600)

PICKUP_LATENCY = Histogram(
    "wq_pickup_latency_seconds",
    "From a run's admission to the claim of its first attempt (database clock), per lane.",
    ["lane"],
    buckets=_LATENCY_BUCKETS,
    registry=None,
)
ATTEMPT_DURATION = Histogram(
    "wq_attempt_duration_seconds",
    "Wall time of an attempt in this worker, from its claim to its end, by lane, play and outcome.",
    ["lane", "play", "outcome"],
    buckets=_DURATION_BUCKETS,
    registry=None,
)
STEP_DURATION = Histogram(
    "wq_step_duration_seconds",
    "Wall time of a step that executed (not replayed) in this worker, by play and outcome.",
    ["play", "outcome"],
    buckets=_DURATION_BUCKETS,
    registry=None,
)

ABSORBED_CALLS = Counter(
    "wq_absorbed_calls",
    "Calls of a play's attempt answered after a lost connection was absorbed (sent again), "
    "by write path (the runtime action).",
    ["action"],
    registry=None,
)
DUPLICATE_SUSPECTS = Counter(
    "wq_duplicate_suspect_steps",
    "Steps executed first by an attempt whose attempt before was cut short (interrupted, or "
    "its worker lost), by play: those it may have been in the middle of (an upper bound of "
    "the paid calls made twice).",
    ["play"],
    registry=None,
)

PROCESS_METRICS = (
    PICKUP_LATENCY,
    ATTEMPT_DURATION,
    STEP_DURATION,
    ABSORBED_CALLS,
    DUPLICATE_SUSPECTS,
)


@functools.lru_cache(maxsize=4096)
def _child(metric: Histogram | Counter, *labels: str) -> Any:
    """A metric's child for these label values, found once: ``labels()`` checks and locks
    on every call, a twentieth of a trivial attempt's Python time when called per attempt.
    Bounded: the label values are lanes, plays and outcomes."""
    return metric.labels(*labels)


def picked_up(c: runs.Claimed) -> None:
    """Observe the pickup latency of a run's first attempt (retries wait on purpose)."""
    claimed_at = c.claimed_at
    if c.attempt != 1 or c.cleanup or c.created_at is None or claimed_at is None:
        return
    latency = (claimed_at - c.created_at).total_seconds()
    _child(PICKUP_LATENCY, c.lane or "").observe(max(0.0, latency))


def attempt_finished(c: runs.Claimed, outcome: str, seconds: float) -> None:
    _child(ATTEMPT_DURATION, c.lane or "", c.play or "", outcome).observe(max(0.0, seconds))


def step_finished(play: str, outcome: str, seconds: float) -> None:
    _child(STEP_DURATION, play, outcome).observe(max(0.0, seconds))


def absorbed(action: str) -> None:
    """Count a call answered after its lost connection was absorbed (worker.contract)."""
    _child(ABSORBED_CALLS, action).inc()


def duplicate_suspects(play: str, steps: int) -> None:
    _child(DUPLICATE_SUSPECTS, play).inc(steps)


def from_sandbox(play: str, counts: object) -> None:
    """Count what a sandboxed attempt reported of its calls (its process's own counters
    end with it). Bounded: only known actions, and at most a page's worth at a time."""
    from queues import operations

    if not isinstance(counts, dict):
        return
    absorbed = counts.get("absorbed")
    if isinstance(absorbed, dict):
        for action, n in absorbed.items():
            if action in operations.ACTIONS and isinstance(n, int) and 0 < n <= 10_000:
                _child(ABSORBED_CALLS, action).inc(n)
    suspects = counts.get("duplicate_suspects")
    if isinstance(suspects, int) and 0 < suspects <= 100_000:
        duplicate_suspects(play, suspects)
