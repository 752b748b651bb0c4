"""The process's logging as the CLI configures it (``worker.logs``), in a fresh interpreter
each (it is configured once per process): a structlog line and a stdlib library's line have
one shape, and a line below the level runs no processor at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SETUP = """
import logging, structlog
from worker import logs
calls = []
def spy(logger, name, event_dict):
    calls.append(event_dict["event"])
    return event_dict
logs.configure(level={level!r}, json=True)
structlog.configure(processors=[spy, *structlog.get_config()["processors"]])
structlog.contextvars.bind_contextvars(run_id="r-1", attempt=2, lane="l")
log = structlog.get_logger("worker.executor")
"""


def lines(level: str, body: str) -> list[dict[str, object]]:
    """The JSON lines ``body`` writes to stderr after ``logs.configure(level=level)``."""
    done = subprocess.run(
        [sys.executable, "-c", SETUP.format(level=level) + body],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stderr.splitlines() if line.strip()]


def test_a_structlog_line_and_a_librarys_line_have_one_shape() -> None:
    got = lines(
        "INFO",
        'log.info("attempt_finished", outcome="succeeded")\n'
        'logging.getLogger("psycopg").warning("pool %s", "lost")\n',
    )
    assert [(g["event"], g["logger"], g["level"]) for g in got] == [
        ("attempt_finished", "worker.executor", "info"),
        ("pool lost", "psycopg", "warning"),
    ]
    for line in got:  # the attempt's bound context on both, and a UTC timestamp
        assert (line["run_id"], line["attempt"], line["lane"]) == ("r-1", 2, "l")
        assert str(line["timestamp"]).endswith("Z")
    assert got[0]["outcome"] == "succeeded"


def test_a_line_below_the_level_runs_no_processor() -> None:
    got = lines(
        "WARNING",
        'log.info("attempt_finished", outcome="succeeded")\n'
        'log.warning("attempt_raised", play="p")\n'
        "assert calls == ['attempt_raised'], calls\n",
    )
    assert [g["event"] for g in got] == ["attempt_raised"]
    assert got[0]["run_id"] == "r-1"
