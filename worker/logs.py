"""Logging, configured once at the CLI entry point (never at import).

JSON lines when stderr is not a terminal, the console renderer when it is. procrastinate's
and psycopg's stdlib loggers go through the same processor chain, so every line of a
process has one shape.

A line costs only when it is written: one below the level is dropped before any processor
runs (an attempt's line at ``--log-level warning`` costs a level check), and a record
leaves out what no line renders (the caller's frame, the thread and process names: the
logging HOWTO's optimizations), which is most of an attempt's line at INFO.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(*, level: str = "INFO", json: bool | None = None) -> None:
    global _configured  # noqa: PLW0603 - configure-once guard for the process
    if _configured:
        return
    _configured = True
    use_json = (not sys.stderr.isatty()) if json is None else json
    root = logging.getLogger()
    root.setLevel(level.upper())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=colors())
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        # A line below the level is a no-op call: no processor, no record.
        wrapper_class=structlog.make_filtering_bound_logger(root.level),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if use_json else _identity,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root.handlers[:] = [handler]
    # What no line renders, left out of every record (the logging HOWTO, "Optimization"):
    # the caller's frame (a walk of the stack per line), the thread and process names.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # Libraries are chatty at INFO; their warnings still come through the same pipeline.
    for name in ("procrastinate", "psycopg", "psycopg.pool", "httpx", "httpcore", "uvicorn"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


def colors() -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


def _identity(
    _logger: object, _name: str, event_dict: structlog.types.EventDict
) -> structlog.types.EventDict:
    return event_dict
