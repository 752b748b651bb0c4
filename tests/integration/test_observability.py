"""The metrics endpoint and the traces, with a real worker in this process.

- ``/metrics`` is scraped over HTTP and parsed with prometheus_client's own parser: HELP
  and TYPE for every family, the database's counters and gauges, this process's histograms.
- One trace covers a run from its submit through its attempt to its steps (an in-memory
  span exporter), and joins the submitter's own trace when there is one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tests.workers import eventually, fetch, run_state, running_worker, submit
from worker import metrics_http
from worker.context import RunContext
from worker.plays import Registry

REPO = Path(__file__).resolve().parents[2]
registry = Registry()


@registry.play("observed")
async def observed(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    first = await ctx.step("fetch", lambda: 1)
    second = await ctx.step("score", lambda: first + 1)
    if params.get("fail"):
        raise ValueError("scoring service refused")
    return {"score": second}


async def _done(url: str, run_id: uuid.UUID) -> str | None:
    state = await run_state(url, run_id)
    return state if state in ("succeeded", "failed") else None


# ---- /metrics ----------------------------------------------------------------------------------


async def test_metrics_are_scraped_and_parsed(db_url: str) -> None:
    served = metrics_http.serve(db_url, port=0)
    try:
        async with running_worker(db_url, registry):
            ok = await submit(db_url, "observed", {"n": 1})
            assert await eventually(lambda: _done(db_url, ok)) == "succeeded"
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(served.url)
    finally:
        served.stop()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in {
        "wq_runs_admitted": "counter",
        "wq_attempts": "counter",
        "wq_rows_completed": "counter",
        "wq_refused_writes": "counter",
        "wq_lease_rescues": "counter",
        "wq_interruptions": "counter",
        "wq_queue_depth": "gauge",
        "wq_lane_oldest_due_wait_seconds": "gauge",
        "wq_lane_live_workers": "gauge",
        "wq_live_workers": "gauge",
        "wq_database_up": "gauge",
        "wq_pickup_latency_seconds": "histogram",
        "wq_attempt_duration_seconds": "histogram",
        "wq_step_duration_seconds": "histogram",
    }.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert families[name].documentation, f"{name} has no HELP"
        sample_name = name + "_total" if kind == "counter" else name
        assert f"# HELP {sample_name}" in text and f"# TYPE {sample_name} {kind}" in text

    def value(family: str, sample: str, **labels: str) -> float:
        for s in families[family].samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
        raise AssertionError(f"no {sample} {labels} in {families[family].samples}")

    assert value("wq_database_up", "wq_database_up") == 1
    assert value("wq_runs_admitted", "wq_runs_admitted_total") >= 1
    assert value("wq_attempts", "wq_attempts_total", outcome="succeeded") >= 1
    assert value("wq_live_workers", "wq_live_workers") >= 1
    assert value("wq_lane_live_workers", "wq_lane_live_workers", lane="r-t") >= 1
    assert value("wq_queue_depth", "wq_queue_depth", lane="r-t") == 0
    assert (
        value(
            "wq_attempt_duration_seconds",
            "wq_attempt_duration_seconds_count",
            lane="r-t",
            play="observed",
            outcome="succeeded",
        )
        >= 1
    )
    assert (
        value(
            "wq_step_duration_seconds",
            "wq_step_duration_seconds_count",
            play="observed",
            outcome="completed",
        )
        >= 2
    )
    assert value("wq_pickup_latency_seconds", "wq_pickup_latency_seconds_count", lane="r-t") >= 1


async def test_a_scrape_without_the_database_says_so() -> None:
    served = metrics_http.serve("postgresql://nobody@127.0.0.1:1/none", port=0)
    try:
        async with httpx.AsyncClient(timeout=20) as client:
            response = await client.get(served.url)
    finally:
        served.stop()
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert families["wq_database_up"].samples[0].value == 0
    assert "wq_runs_admitted" not in families
    assert "wq_attempt_duration_seconds" in families  # the process's own still are


# ---- traces ------------------------------------------------------------------------------------

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider, exporting to memory (set once per process)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    yield _EXPORTER


def _of_trace(spans: list[ReadableSpan], trace_id: int) -> list[ReadableSpan]:
    return [s for s in spans if s.context is not None and s.context.trace_id == trace_id]


async def test_one_trace_from_submit_through_attempt_to_steps(
    db_url: str, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    async with running_worker(db_url, registry):
        run_id = await submit(db_url, "observed", {"n": 2})
        assert await eventually(lambda: _done(db_url, run_id)) == "succeeded"
    spans = list(exporter.get_finished_spans())
    (submitted,) = [
        s
        for s in spans
        if s.name == "wq.submit" and (s.attributes or {}).get("wq.run_id") == str(run_id)
    ]
    assert submitted.context is not None
    mine = _of_trace(spans, submitted.context.trace_id)
    roots = [s for s in mine if s.parent is None]
    assert roots == [submitted]
    (attempt,) = [s for s in mine if s.name == "wq.attempt"]
    assert attempt.parent is not None and attempt.parent.span_id == submitted.context.span_id
    assert (
        dict(attempt.attributes or {}).items()
        >= {
            "wq.run_id": str(run_id),
            "wq.attempt": 1,
            "wq.play": "observed",
            "wq.lane": "r-t",
            "wq.outcome": "succeeded",
        }.items()
    )
    steps = [s for s in mine if s.name == "wq.step"]
    assert sorted((s.attributes or {})["wq.step"] for s in steps) == ["fetch", "score"]
    assert attempt.context is not None
    assert all(s.parent is not None and s.parent.span_id == attempt.context.span_id for s in steps)
    assert all((s.attributes or {})["wq.attempt"] == 1 for s in steps)
    assert {s.name for s in mine} == {"wq.submit", "wq.attempt", "wq.step"}


async def test_a_failed_attempt_is_an_error_span_in_the_submitters_trace(
    db_url: str, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    tracer = trace.get_tracer("the-app")
    async with running_worker(db_url, registry):
        with tracer.start_as_current_span("POST /webhook") as request:
            run_id = await submit(db_url, "observed", {"fail": True})
        assert await eventually(lambda: _state_is(db_url, run_id, "queued", "failed"))
    spans = list(exporter.get_finished_spans())
    mine = _of_trace(spans, request.get_span_context().trace_id)
    (root,) = [s for s in mine if s.parent is None]
    assert root.name == "POST /webhook"
    failed = [s for s in mine if s.name == "wq.attempt"]
    assert failed and failed[0].status.status_code is trace.StatusCode.ERROR
    assert "scoring service refused" in (failed[0].status.description or "")


async def _state_is(url: str, run_id: uuid.UUID, *states: str) -> str | None:
    """The run's state once it is one of ``states`` and an attempt failed."""
    found = await run_state(url, run_id)
    return found if found in states and await _attempted(url, run_id) else None


async def _attempted(url: str, run_id: uuid.UUID) -> bool:
    rows = await fetch(
        url, "SELECT count(*) FROM wq_attempts WHERE run_id = %s AND outcome = 'failed'", (run_id,)
    )
    return int(rows[0][0]) >= 1


def test_without_opentelemetry_nothing_changes() -> None:
    """With the optional extra absent, the modules import and every span is a no-op."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from queues import tracing\n"
        "import worker.attempt, worker.context, queues.admission\n"
        "assert not tracing.enabled()\n"
        "with tracing.span('wq.submit', attributes={'a': 1}) as s:\n"
        "    assert s is None\n"
        "    assert tracing.stored_context() == {} and tracing.carrier() == {}\n"
        "tracing.annotate(None, run_id='x'); tracing.failed(None, 'no')\n"
        "assert tracing.attempt_parent({'trace': {'traceparent': 'x'}}) == {'traceparent': 'x'}\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_without_a_tracer_provider_spans_are_skipped_and_context_still_flows() -> None:
    """The API installed but no provider configured (the default): a span with nothing to
    record and no context to carry is skipped; a stored submitter's context is still
    continued (a run's children carry it on); once a provider is configured, spans record."""
    code = (
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from queues import tracing\n"
        "with tracing.span('wq.attempt', attributes={'wq.run_id': 'r'}) as s:\n"
        "    assert s is None and tracing.carrier() == {}\n"
        "parent = {'traceparent': '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'}\n"
        "with tracing.span('wq.attempt', parent=parent) as s:\n"
        "    assert s is not None and not s.is_recording()\n"
        "    assert tracing.carrier()['traceparent'].split('-')[1] == "
        "'0af7651916cd43dd8448eb211c80319c'\n"
        "    with tracing.span('wq.step') as inner:\n"
        "        assert inner is not None  # a context is current: carried on\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "with tracing.span('wq.attempt', attributes={'wq.run_id': 'r'}) as s:\n"
        "    assert s is not None and s.is_recording()\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_a_tracer_provider_named_by_the_environment_records() -> None:
    """A provider the environment names (OTEL_PYTHON_TRACER_PROVIDER, as an SDK's
    configuration sets it) is loaded at the first span, which records."""
    code = (
        "from opentelemetry import trace\n"
        "from queues import tracing\n"
        "with tracing.span('wq.attempt', attributes={'wq.run_id': 'r'}) as s:\n"
        "    assert s is not None and s.is_recording()\n"
        "assert not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)\n"
        "print('ok')\n"
    )
    _prints_ok(code, env={"OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"})


def _prints_ok(code: str, env: dict[str, str] | None = None) -> None:
    """Run ``code`` in a fresh interpreter (its own tracer provider, its own imports, the
    environment with ``env`` over it); it must exit 0 having printed ``ok``."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=None if env is None else os.environ | env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
