"""OpenTelemetry spans for submit, attempt and step; one trace from admission to the end.

OpenTelemetry is optional (``pip install 'worker[otel]'``). Without it every function here
is a no-op that imports nothing, so nothing changes. With it, this module uses only the
OpenTelemetry *API*, as a library should: the spans go wherever the application configured
a tracer provider (its own SDK setup; for the CLI, ``opentelemetry-instrument worker start
...`` from ``opentelemetry-distro`` configures one from the ``OTEL_*`` variables), and
nowhere when none is configured.

- ``wq.submit`` wraps the atomic admission. Its W3C trace context (``traceparent``, and
  ``tracestate`` when set) is stored with the run, in its authority metadata under
  ``"trace"`` (:func:`stored_context`), so a run submitted inside a request's trace joins it.
- ``wq.attempt`` continues that stored context: every attempt of the run, on any worker,
  at any later time, is a child of the submit span (:func:`attempt_parent`).
- ``wq.step`` is a child of the attempt that runs the step.

Each span carries ``wq.run_id``, ``wq.attempt``, ``wq.play`` and ``wq.lane`` where known.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

try:  # the optional extra
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
    from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
except ImportError:  # pragma: no cover - exercised by the tests' import-blocking check
    _trace = None  # type: ignore[assignment]
    _propagate = None  # type: ignore[assignment]
    OTEL_PYTHON_TRACER_PROVIDER = "OTEL_PYTHON_TRACER_PROVIDER"

# A provider named by the environment is loaded by the API's own lookup, at the first
# span; without one, the API's global (set once, by the application) is read directly.
_PROVIDER_FROM_ENVIRONMENT = OTEL_PYTHON_TRACER_PROVIDER in os.environ

TRACER_NAME = "worker"
CONTEXT_KEY = "trace"  # where the submitter's context sits in the run's authority metadata
_CARRIER_FIELDS = ("traceparent", "tracestate")


def enabled() -> bool:
    """Whether the OpenTelemetry API is installed."""
    return _trace is not None


def _idle() -> bool:
    """Whether a span made now would be a no-op: no tracer provider is configured (the
    API's proxy stands in for one) and no valid trace context is current, so the span would
    record nothing and carry no context on (a submit inside it would store none). Checked
    per span: an application may configure its provider at any time. Skipping the span
    then saves the API's no-op work, a fifth of a trivial attempt's handling."""
    assert _trace is not None
    provider = _provider()
    if provider is not None and not isinstance(
        provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider
    ):
        return False
    return not _trace.get_current_span().get_span_context().is_valid


def _provider() -> Any:
    """The configured tracer provider, or None (or the API's proxy) when there is none.

    ``get_tracer_provider()`` looks the environment up on every call while no provider is
    set (a failed ``os.environ`` lookup per span, most of the check); the API keeps the
    provider an application set in a module global, read here when the API has it and
    the environment names none."""
    assert _trace is not None
    if _PROVIDER_FROM_ENVIRONMENT or not hasattr(_trace, "_TRACER_PROVIDER"):
        return _trace.get_tracer_provider()
    return _trace._TRACER_PROVIDER  # set once, by set_tracer_provider


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Span attributes must be str, bool, int or float: everything else as text, None out."""
    out: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if value is None:
            continue
        out[key] = value if isinstance(value, str | bool | int | float) else str(value)
    return out


class _Skipped:
    """The span of a block with nothing to trace: enters as None, and costs no generator."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None


_SKIPPED = _Skipped()


def span(
    name: str,
    *,
    attributes: Mapping[str, Any] | None = None,
    parent: Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[Any]:
    """A span around the block (the current span's child, or ``parent``'s when a stored W3C
    carrier is given); enters as it, or as None without OpenTelemetry or when there is
    nothing to trace (:func:`_idle`). An exception that leaves the block is recorded on the
    span and sets its status to error."""
    if _trace is None or _propagate is None or (not parent and _idle()):
        return _SKIPPED
    return _recorded(name, attributes, parent)


@contextlib.contextmanager
def _recorded(
    name: str, attributes: Mapping[str, Any] | None, parent: Mapping[str, str] | None
) -> Iterator[Any]:
    assert _trace is not None and _propagate is not None
    context = _propagate.extract(dict(parent)) if parent else None
    tracer = _trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(name, context=context, attributes=_clean(attributes)) as s:
        yield s


def annotate(current: Any, **attributes: Any) -> None:
    """Add attributes (``wq.`` prefixed) to a span from :func:`span`; None is a no-op."""
    if current is None:
        return
    for key, value in _clean({f"wq.{k}": v for k, v in attributes.items()}).items():
        current.set_attribute(key, value)


def failed(current: Any, description: str) -> None:
    """Mark a span from :func:`span` as failed (an outcome, not an exception that left it)."""
    if current is None or _trace is None:
        return
    current.set_status(_trace.Status(_trace.StatusCode.ERROR, description[:500]))


def carrier() -> dict[str, str]:
    """The current trace context as W3C headers (empty when no span is active)."""
    if _propagate is None:
        return {}
    found: dict[str, str] = {}
    _propagate.inject(found)
    return {k: v for k, v in found.items() if k in _CARRIER_FIELDS}


def stored_context() -> dict[str, Any]:
    """What admission stores with a run: ``{"trace": {"traceparent": ...}}``, or ``{}``."""
    found = carrier()
    return {CONTEXT_KEY: found} if found.get("traceparent") else {}


def attempt_parent(authority: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The stored submitter's context of a run (from its authority metadata), or None."""
    stored = (authority or {}).get(CONTEXT_KEY)
    if not isinstance(stored, Mapping) or not isinstance(stored.get("traceparent"), str):
        return None
    return {k: str(v) for k, v in stored.items() if k in _CARRIER_FIELDS}


def run_attributes(
    *, run_id: Any, attempt: int | None, play: str | None, lane: str | None
) -> dict[str, Any]:
    """A span's run attributes, as given: :func:`span` cleans them when it records one."""
    return {"wq.run_id": run_id, "wq.attempt": attempt, "wq.play": play, "wq.lane": lane}
