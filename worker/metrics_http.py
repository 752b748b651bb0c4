"""``/metrics`` for Prometheus: ``worker start --metrics-port N``, ``worker recover
--metrics-port N``.

Served by ``prometheus_client``'s own HTTP server (a thread; the worker's event loop never
waits for a scrape), from a registry of its own holding:

- **counters** read as monotonic totals from the database on each scrape
  (:mod:`queues.totals`): ``wq_runs_admitted_total``, ``wq_attempts_total{outcome}``,
  ``wq_rows_completed_total``, ``wq_refused_writes_total{kind}`` (and
  ``wq_refused_rows_total{kind}``), ``wq_lease_rescues_total``, ``wq_interruptions_total``.
  They are cluster-wide (every process serves the same numbers): query one instance, or
  ``max`` across instances, never ``sum``;
- **gauges** read on each scrape (:mod:`queues.metrics`): per lane ``wq_queue_depth``
  (queued runs), ``wq_lane_running``, ``wq_lane_sleeping``, ``wq_lane_due_jobs``,
  ``wq_lane_oldest_due_wait_seconds``, ``wq_lane_live_workers``, ``wq_lane_state``; and
  ``wq_live_workers``, ``wq_stranded_runs{lane}``, ``wq_database_up``;
- **histograms** this process measured (:mod:`worker.instruments`): pickup latency,
  attempt duration, step duration.

A scrape while the database is away answers with ``wq_database_up 0`` and the histograms,
never an error page.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

import psycopg
import structlog
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from queues import metrics, totals
from queues.errors import DatabaseUnreachable
from worker import db, instruments

log = structlog.get_logger("worker.metrics")

SCRAPE_TIMEOUT_S = 10.0


class DatabaseCollector(Collector):
    """Counters and gauges read from the database at each scrape (a fresh connection)."""

    def __init__(self, url: str, *, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def describe(self) -> Iterable[Metric]:
        return []  # no read at registration: the database is only asked when scraped

    async def _read(self) -> tuple[totals.Totals, metrics.Metrics]:
        async with asyncio.timeout(self.timeout_s):
            async with db.session(self.url) as conn:
                found_totals = await totals.read(conn)
                found = await metrics.collect(conn)
        return found_totals, found

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("wq_database_up", "Whether the last scrape could read the database.")
        try:
            # The scrape runs in the server's own thread: a loop of its own for the read.
            found_totals, found = asyncio.run(self._read())
        except (psycopg.Error, DatabaseUnreachable, OSError, TimeoutError) as exc:
            log.warning("metrics_database_unavailable", error=str(exc).strip()[:300])
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _counters(found_totals)
        yield from _gauges(found, found_totals)


def _counters(t: totals.Totals) -> Iterator[Metric]:
    admitted = CounterMetricFamily("wq_runs_admitted", "Runs admitted (cluster-wide total).")
    admitted.add_metric([], t.runs_admitted)
    yield admitted
    attempts = CounterMetricFamily(
        "wq_attempts", "Finished attempts by outcome (cluster-wide total).", labels=["outcome"]
    )
    for outcome, value in sorted(t.attempts.items()):
        attempts.add_metric([outcome], value)
    yield attempts
    rows = CounterMetricFamily("wq_rows_completed", "Sheet rows completed (cluster-wide total).")
    rows.add_metric([], t.rows_completed)
    yield rows
    refused = CounterMetricFamily(
        "wq_refused_writes",
        "Writes of stale attempts the fence refused, by kind (cluster-wide total).",
        labels=["kind"],
    )
    for kind, value in sorted(t.refusals.items()):
        refused.add_metric([kind], value)
    yield refused
    refused_rows = CounterMetricFamily(
        "wq_refused_rows",
        "Rows or keys carried by refused writes, by kind (cluster-wide total).",
        labels=["kind"],
    )
    for kind, value in sorted(t.refused_rows.items()):
        refused_rows.add_metric([kind], value)
    yield refused_rows
    rescues = CounterMetricFamily(
        "wq_lease_rescues", "Lapsed leases rescued by recovery (cluster-wide total)."
    )
    rescues.add_metric([], t.lease_rescues)
    yield rescues
    interruptions = CounterMetricFamily(
        "wq_interruptions",
        "Attempts cut short, by cause (cluster-wide total): database, an outage longer than "
        "the worker's max outage (a shorter one is absorbed: wq_absorbed_calls); worker, "
        "its worker died or hung (its lease lapsed).",
        labels=["cause"],
    )
    interruptions.add_metric(["database"], t.interruptions)
    interruptions.add_metric(["worker"], t.lease_rescues)
    yield interruptions
    charged = CounterMetricFamily(
        "wq_charged",
        "What paid steps cost, recorded once with their receipts, by org, play, provider "
        "(empty: none named) and unit (cluster-wide total).",
        labels=["org", "play", "provider", "unit"],
    )
    for labels, spent in sorted(t.charged.items()):
        charged.add_metric(list(labels), float(spent))
    yield charged


def _gauges(found: metrics.Metrics, t: totals.Totals) -> Iterator[Metric]:
    per_lane: list[tuple[str, str, Callable[[metrics.LaneMetrics], float]]] = [
        (
            "wq_queue_depth",
            "Queued runs (waiting for a worker or their retry time).",
            lambda m: m.queued,
        ),
        ("wq_lane_running", "Running runs.", lambda m: m.running),
        ("wq_lane_sleeping", "Sleeping runs (a sleep or an event wait).", lambda m: m.sleeping),
        (
            "wq_lane_budget_paused",
            "Sleeping runs paused with BUDGET_EXHAUSTED (a budget had no room for a step).",
            lambda m: m.budget_paused,
        ),
        ("wq_lane_due_jobs", "Jobs due now and not yet claimed.", lambda m: m.due_jobs),
        (
            "wq_lane_oldest_due_wait_seconds",
            "How long the oldest due queued run has waited.",
            lambda m: m.oldest_due_wait_s,
        ),
        ("wq_lane_live_workers", "Live workers consuming the lane.", lambda m: m.live_workers),
    ]
    for name, help_text, value_of in per_lane:
        family = GaugeMetricFamily(name, help_text, labels=["lane"])
        for lane in found.lanes:
            family.add_metric([lane.lane], value_of(lane))
        yield family
    state = GaugeMetricFamily(
        "wq_lane_state",
        "1 for the lane's state (prepared, draining, reclaimed).",
        labels=["lane", "state"],
    )
    for lane in found.lanes:
        state.add_metric([lane.lane, lane.lane_state], 1)
    yield state
    workers = GaugeMetricFamily("wq_live_workers", "Live worker processes.")
    workers.add_metric([], t.live_workers)
    yield workers
    stranded = GaugeMetricFamily(
        "wq_stranded_runs", "Unfinished runs on a lane no live worker serves.", labels=["lane"]
    )
    for s in found.stranded:
        stranded.add_metric([s.lane], s.runs)
    yield stranded


class _Read(Collector):
    """Families already read (``worker metrics --format prometheus``: one read, printed)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposition(found_totals: totals.Totals, found: metrics.Metrics) -> str:
    """The database's counters and gauges as Prometheus text: what ``/metrics`` serves
    from the database, printed once (the process histograms belong to a running process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Read([*_counters(found_totals), *_gauges(found, found_totals)]))
    return generate_latest(registry).decode()


def registry_for(url: str) -> CollectorRegistry:
    """A registry with this process's histograms and the database's counters and gauges."""
    registry = CollectorRegistry(auto_describe=False)
    for metric in instruments.PROCESS_METRICS:
        registry.register(metric)
    registry.register(DatabaseCollector(url))
    return registry


class MetricsServer:
    """``/metrics`` served from a thread until :meth:`stop`."""

    def __init__(self, server: WSGIServer, host: str) -> None:
        self.server = server
        self.host = host

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve(url: str, *, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Start serving ``/metrics`` (port 0: any free port; see :attr:`MetricsServer.port`)."""
    server, _thread = start_http_server(port, addr=host, registry=registry_for(url))
    served = MetricsServer(server, host)
    log.info("metrics_serving", url=served.url)
    return served


@contextlib.contextmanager
def serving(url: str, port: int | None, host: str = "127.0.0.1") -> Iterator[MetricsServer | None]:
    """Serve ``/metrics`` for the block when a port is given; nothing otherwise."""
    if port is None:
        yield None
        return
    served = serve(url, port=port, host=host)
    try:
        yield served
    finally:
        started = time.monotonic()
        served.stop()
        log.debug("metrics_stopped", seconds=round(time.monotonic() - started, 3))
