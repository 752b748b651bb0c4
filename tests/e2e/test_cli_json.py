"""One output convention: every command that prints data accepts ``--json`` and prints valid
JSON (one document, or one per line for streams) with ISO 8601 timestamps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import pytest

from tests.workers import together
from worker.cli import cli

cli.loaded()  # the commands load lazily; these tests walk all of them

WORKER = str(Path(sys.executable).parent / "worker")
# Commands that print no data: services (they log) and the demo (a story for a person).
NO_DATA = {("start",), ("gateway",), ("demo",), ("dashboard",)}
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d")


def leaves(
    group: click.Group, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from leaves(command, (*path, name))
        else:
            yield (*path, name), command


def test_every_command_with_data_has_json() -> None:
    missing = [
        " ".join(path)
        for path, command in leaves(cli)
        if path not in NO_DATA and not any("--json" in p.opts for p in command.params)
    ]
    assert missing == []


def iso_checked(value: Any, where: str = "$") -> None:
    """Every timestamp-looking string is ISO 8601 (``T``, parseable, with its offset)."""
    if isinstance(value, dict):
        for key, item in value.items():
            iso_checked(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            iso_checked(item, f"{where}[{index}]")
    elif isinstance(value, str) and TIMESTAMP.match(value):
        assert "T" in value, f"{where}: {value!r} is not ISO 8601"
        parsed = datetime.fromisoformat(value)
        assert parsed.tzinfo is not None, f"{where}: {value!r} has no offset"


def run_json(env: dict[str, str], *args: str, ok: tuple[int, ...] = (0,)) -> list[Any]:
    res = subprocess.run(
        [WORKER, *args, "--json"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode in ok, f"{args}: exit {res.returncode}\n{res.stderr}"
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert lines, f"{args}: no output"
    documents = [json.loads(line) for line in lines]
    for document in documents:
        iso_checked(document)
    return documents


@pytest.mark.slow
def test_data_commands_print_json_with_iso_timestamps(db_url: str, tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "WORKER_APP", "VERCEL", "WORKER_ENV"}
    }
    env |= {
        "WORKER_DATABASE_URL": db_url,
        "WORKER_TOKEN_SECRET": "t" * 48,
        "WORKER_HOME": str(tmp_path / "home"),
    }

    # Sequences of commands run at once, each in its order. One migrates; another reads the
    # embedded server's home meanwhile, then, once the schema is migrated, admits a run and
    # cancels it, and then the cancelled run is read while its lane is worked (lane commands
    # write the lane's row, not the run's: adopt moves no finished run). Meanwhile the first
    # emits an event nobody waits for and works the sinks, which touch neither.
    migrated = threading.Event()

    def the_lane() -> None:
        [lanes] = run_json(env, "queues", "list")
        assert [entry["lane"] for entry in lanes] == ["r-j1"]
        [drained] = run_json(env, "queues", "drain", "j1")
        assert drained["state"] == "draining"
        [reopened] = run_json(env, "queues", "reopen", "j1")
        assert reopened["state"] == "prepared"
        [adopted] = run_json(env, "queues", "adopt", "j1", "j2")
        assert adopted["moved"] == 0
        [reclaimed] = run_json(env, "queues", "reclaim", "j1")
        assert reclaimed["lane"] == "r-j1"

    def the_run() -> None:
        [status] = run_json(env, "db", "status")
        assert status["running"] is False  # the embedded server of an unused home
        [stopped] = run_json(env, "db", "stop")
        assert stopped == {"stopped": False}
        assert migrated.wait(timeout=300)
        [lane] = run_json(env, "queues", "prepare", "j1")
        assert lane["state"] == "prepared"
        [admitted] = run_json(env, "submit", "noop", "--release", "j1", "--params", '{"n": 1}')
        run_id = admitted["run_id"]
        [token] = run_json(env, "token", "mint", "--run", run_id, "--capability", "sheet.write")
        assert token["capabilities"] == ["sheet.write"]
        [cancelled] = run_json(env, "cancel", run_id)
        assert cancelled["after"] == "cancelled"
        with ThreadPoolExecutor(1) as pool:
            lane_work = pool.submit(the_lane)
            [result] = run_json(env, "result", run_id, ok=(3,))
            assert result["state"] == "cancelled"
            observed = run_json(env, "observe", run_id, ok=(3,))
            assert observed[-1]["run"]["state"] == "cancelled"
            [shown] = run_json(env, "runs", "show", run_id)
            assert shown["id"] == run_id and shown["events"]
            [listed] = run_json(env, "runs", "list")
            assert [r["id"] for r in listed] == [run_id]
            events = run_json(env, "events", run_id)
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        lane_work.result()

    def the_schema_and_the_sinks() -> None:
        try:
            [checked] = run_json(env, "migrate", "--check")
            assert checked["current"] is True
            [applied] = run_json(env, "migrate")
            assert applied["applied"] == []
        finally:
            migrated.set()
        [emitted] = run_json(env, "emit", "paid")
        assert emitted["woken"] == 0
        [sink] = run_json(env, "sinks", "add", "crm", "--url", "http://127.0.0.1:9/hook")
        assert sink["created"] is True and sink["kinds"] is None
        [billing] = run_json(
            env, "sinks", "add", "billing", "--url", "http://127.0.0.1:9/b",
            "--kind", "run_succeeded", "--kind", "run_failed",
        )  # fmt: skip
        assert billing["kinds"] == ["run_succeeded", "run_failed"]
        [sinks] = run_json(env, "sinks", "list")
        assert {s["name"] for s in sinks} >= {"crm", "billing", "progress"}
        assert {s["name"]: s["kinds"] for s in sinks}["billing"] == ["run_succeeded", "run_failed"]
        [disabled] = run_json(env, "sinks", "disable", "crm")
        assert disabled == {"sink": "crm", "enabled": False}

    together(the_run, the_schema_and_the_sinks)

    # Then, on what both left (a cancelled run on a reclaimed lane, a disabled sink):
    [recovered] = run_json(env, "recover", "--once")
    assert "counts" in recovered
    [metrics] = run_json(env, "metrics")
    assert "lanes" in metrics
